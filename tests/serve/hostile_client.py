"""The hostile clients of test_hostile.py, importable without lmkit so that they run in processes of their own:
in the server's process their threads would compete for its GIL and measure themselves, not the server."""

from __future__ import annotations

import json

import httpx


def send(url: str, path: str, body: dict, headers: dict | None) -> tuple[int, str]:
    """(status, text) of POST /v1/{path}; bodies are encoded here, so a lone surrogate goes as its JSON escape."""
    raw = json.dumps({"model": "tiny", **body}).encode()
    r = httpx.post(f"{url}/v1/{path}", content=raw,
                   headers=headers if headers is not None else {"Content-Type": "application/json"}, timeout=120)
    return r.status_code, r.text
