from lmkit.cli.main import main

main()
