"""The chat page at GET / of the api_server and the proxy (page.py, index.html)."""

from lmkit.serve.web.page import add_web_ui, content_security_policy

__all__ = ["add_web_ui", "content_security_policy"]
