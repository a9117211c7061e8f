"""The chat page the api_server and the proxy serve at GET /: one static file (index.html, its CSS and script
inline, nothing fetched from elsewhere) that talks to the OpenAI API of the server it came from.

The page is open without an API key (gate.PAGE_PATHS); it asks the user for a key when the API answers 401 and
keeps it in the tab's sessionStorage. Its Content-Security-Policy allows only its own inline script and style,
by hash, and requests to its own origin: text a model writes cannot load or run anything.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import Response

PAGE_FILE = "index.html"


@lru_cache(maxsize=1)
def page() -> tuple[bytes, dict[str, str]]:
    """(the page's bytes, the headers it is served with), read from the package once."""
    html = files("lmkit.serve.web").joinpath(PAGE_FILE).read_bytes()
    return html, {"Content-Security-Policy": content_security_policy(html), "Cache-Control": "no-cache",
                  "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def content_security_policy(html: bytes) -> str:
    """A policy that allows the inline <script> and <style> blocks of ``html`` by their SHA-256 and nothing
    else to run or style: no remote or injected scripts, no inline handlers or style attributes, requests to
    the page's own origin only, and no framing."""

    def hashes(tag: str) -> str:
        blocks = re.findall(rb"<%s>(.*?)</%s>" % (tag.encode(), tag.encode()), html, re.DOTALL)
        if not blocks:
            raise RuntimeError(f"{PAGE_FILE} has no inline <{tag}> block")
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in blocks)

    return (f"default-src 'self'; script-src {hashes('script')}; style-src {hashes('style')}; img-src 'self' data:; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def add_web_ui(app: FastAPI) -> None:
    """Adds GET / (the chat page) to ``app``; it is left out of the OpenAPI schema."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        html, headers = page()
        return Response(html, media_type="text/html; charset=utf-8", headers=headers)
