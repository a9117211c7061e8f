"""Routing strategies, by name. Each picks one node among the candidates (up, serving the model).

- ``random``: a random node, weighted by its speed.
- ``min_expected_latency``: the fewest requests in flight per unit of speed, counting the new one
  ((in_flight + 1) / speed).
- ``min_observed_latency``: the lowest recent first-byte latency times (in_flight + 1). A node with no
  observation yet gets an optimistic prior (the best latency seen on any node, 0 when none), so a new
  node is tried at once instead of never.

Ties are broken at random, so equal nodes share the load.
"""

from __future__ import annotations

import random
from typing import Callable

from lmkit.serve.proxy.registry import Node


def _pick_min(nodes: list[Node], score: Callable[[Node], float], rng: random.Random) -> Node:
    scores = [score(n) for n in nodes]
    best = min(scores)
    return rng.choice([n for n, s in zip(nodes, scores) if s <= best * (1 + 1e-9)])


class RandomStrategy:
    name = "random"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, nodes: list[Node]) -> Node:
        return self.rng.choices(nodes, weights=[n.speed for n in nodes])[0]


class MinExpectedLatency:
    name = "min_expected_latency"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, nodes: list[Node]) -> Node:
        return _pick_min(nodes, lambda n: (n.num_in_flight + 1) / n.speed, self.rng)


class MinObservedLatency:
    name = "min_observed_latency"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, nodes: list[Node]) -> Node:
        seen = [n.observed_latency_s for n in nodes if n.observed_latency_s is not None]
        prior = min(seen) if seen else 0.0

        def expected(n: Node) -> float:
            latency = n.observed_latency_s if n.observed_latency_s is not None else prior
            return latency * (n.num_in_flight + 1)

        scores = [expected(n) for n in nodes]
        best = min(scores)
        tied = [n for n, s in zip(nodes, scores) if s <= best * (1 + 1e-9)]
        return _pick_min(tied, lambda n: n.num_in_flight, self.rng)  # no observations yet: fewest in flight


STRATEGIES = {cls.name: cls for cls in (RandomStrategy, MinExpectedLatency, MinObservedLatency)}


def make_strategy(name: str, rng: random.Random | None = None):
    """The strategy called ``name``; an unknown name lists the known ones."""
    try:
        return STRATEGIES[name](rng)
    except KeyError:
        raise ValueError(f"unknown routing strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}") from None
