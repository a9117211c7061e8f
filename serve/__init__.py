"""lmkit.serve: the OpenAI-compatible api_server and the proxy. Work in progress: see the project's issues."""
