"""Tool calling: the families' call formats parsed as they stream (parsers), and the grammars that enforce a
required or named call (grammar)."""
