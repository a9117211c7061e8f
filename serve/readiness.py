"""Readiness: whether an api_server can take a request and start on it in reasonable time (GET /ready), as
against liveness (GET /health: the process and its engine answer). A proxy routes only to ready nodes and
Kubernetes keeps only ready pods behind a Service; a server that is alive but not ready is left alone to catch up,
not restarted.

Not ready, with the reason in the 503's message, when:
- the preparation pool is saturated: more requests wait for tokenization and template rendering than
  ``max_preparing`` (four per preparation thread by default), so a new one would queue behind them;
- the engine is stalled: it holds requests but has not stepped for ``stall_s`` seconds;
- the engine does not answer its metrics within the health timeout (as /health), or the server is draining
  (the gate answers 503 to every request then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Readiness:
    """The api_server's /ready verdict from its preparation queue and the engine's step counter."""

    max_preparing: int
    """Requests waiting for or in preparation at most while ready."""
    stall_s: float = 30.0
    """An engine with requests and no step for this long is stalled."""
    _steps: int = -1
    _stepped_at: float = field(default_factory=time.monotonic)

    def reason_not_ready(self, num_preparing: int, num_steps: int, num_requests: int) -> str | None:
        """Why the server is not ready (None: ready), given the requests in the preparation pool, the engine's
        step count and the requests it holds (running and waiting)."""
        now = time.monotonic()
        if num_steps != self._steps or num_requests == 0:
            self._steps, self._stepped_at = num_steps, now
        if num_preparing > self.max_preparing:
            return (f"the preparation queue is saturated: {num_preparing} requests wait for tokenization, more than "
                    f"{self.max_preparing}")
        if now - self._stepped_at > self.stall_s:
            return (f"the engine is stalled: it holds {num_requests} requests and has not stepped for "
                    f"{now - self._stepped_at:.0f} s")
        return None
