"""Admission of generation requests by the sequences they run.

A request costs (number of prompts) x n sequences: 64 prompts with n=16 run 1,024 completions, not one.
The api_server admits sequences up to ``max_num_seqs``, by default the engine's batch (max_batch_size
running) plus as many again waiting: the batch stays full (a finished sequence's slot goes to one already
waiting, without a network round trip), and an admitted request waits about one request's time at most
instead of behind an unbounded queue. Beyond the limit a request gets 429 at once (a proxy tries another
node; a client retries after Retry-After); a request that could never fit gets 400.

State: ``num_seqs`` admitted, ``0 <= num_seqs <= max_num_seqs``; every ``admit`` is paired with exactly one
``Reservation.release`` (idempotent), however the request ends.
"""

from __future__ import annotations

from lmkit.serve.errors import APIError

RETRY_AFTER_S = 1
"""What a refused client is told to wait (Retry-After): sequences finish every engine step."""


class Reservation:
    """The sequences of one admitted request; ``release()`` gives them back (again: no effect)."""

    def __init__(self, admission: "Admission", num_seqs: int):
        self.admission = admission
        self.num_seqs = num_seqs
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.admission.num_seqs -= self.num_seqs  # admitted -> released

    def __repr__(self) -> str:
        return f"Reservation({self.num_seqs} seqs{', released' if self.is_released else ''})"


class Admission:
    """Counts the sequences of the requests in progress against a limit. Event-loop only (no locks)."""

    def __init__(self, max_batch_size: int, max_waiting_seqs: int):
        assert max_batch_size >= 1 and max_waiting_seqs >= 0, (
            f"need max_batch_size >= 1 and max_waiting_seqs >= 0, got {max_batch_size} and {max_waiting_seqs}")
        self.max_batch_size = max_batch_size
        self.max_waiting_seqs = max_waiting_seqs
        self.num_seqs = 0

    @property
    def max_num_seqs(self) -> int:
        return self.max_batch_size + self.max_waiting_seqs

    def _limit(self) -> str:
        return (f"{self.max_num_seqs} sequences at once (max_batch_size {self.max_batch_size} + max_waiting_seqs "
                f"{self.max_waiting_seqs})")

    def admit(self, num_prompts: int, n: int, param: str = "prompt") -> Reservation:
        """Reserves ``num_prompts * n`` sequences. Raises APIError 400 (naming ``n``, or ``param``, the prompts'
        field, when n is 1) for a request larger than the limit, 429 with Retry-After when the limit is reached
        now. The caller releases the returned Reservation when the request ends."""
        num_seqs = num_prompts * n
        if num_seqs > self.max_num_seqs:
            raise APIError(400, f"This request runs {num_seqs} sequences ({num_prompts} prompts x n={n}), more than "
                                f"this server admits: {self._limit()}. Lower n or send fewer prompts per request.",
                           "n" if n > 1 else param, "invalid_value")
        if self.num_seqs + num_seqs > self.max_num_seqs:
            raise APIError(429, f"The server is busy: {self.num_seqs} sequences in progress, this request adds "
                                f"{num_seqs} (prompts x n), the limit is {self._limit()}. Retry after "
                                f"{RETRY_AFTER_S} s.", None, "rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_seqs += num_seqs  # free -> admitted
        return Reservation(self, num_seqs)

    def __repr__(self) -> str:
        return f"Admission({self.num_seqs}/{self.max_num_seqs} seqs)"
