"""Routing strategies, by name. Each picks one node among the candidates (up, serving the model).

- ``random``: a random node, weighted by its speed.
- ``min_expected_latency``: the fewest requests in flight per unit of speed, counting the new one
  ((in_flight + 1) / speed).
- ``min_observed_latency``: the lowest recent first-byte latency times (in_flight + 1). A node with no
  observation yet gets an optimistic prior (the best latency seen on any node, 0 when none), so a new
  node is tried at once instead of never.
- ``prefix``: the node most likely to hold the request's prefix in its KV cache (cache-aware routing, as
  SGLang's router does), bounded by load. The proxy keeps, per node, an approximate view of the prefixes it sent
  there: the request's leading text (chat messages, prompt or input) cut into chunks of CHUNK_CHARS characters,
  each chunk's key a hash chained over the chunks before it, in a bounded LRU set per node. A request goes to the
  node holding the longest run of its leading keys when that run covers at least MIN_MATCH of them and that node
  is not overloaded (at most MAX_EXTRA_IN_FLIGHT requests in flight more than the least busy node); otherwise to the
  least loaded node (as ``min_expected_latency``) and, among equally loaded ones, the one holding the fewest keys
  (SGLang's rule: a new prefix goes where cache is freest, so tenants spread instead of sharing one node's cache).
  Requests without text go as ``min_expected_latency`` does. The chosen node's view then holds the request's keys.

Ties are broken at random, so equal nodes share the load.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from typing import Any, Callable

from lmkit.serve.proxy.registry import Node


def _lowest(nodes: list, score: Callable[[Any], float]) -> list:
    """The nodes of the lowest ``score`` (equal within rounding)."""
    scores = [score(n) for n in nodes]
    best = min(scores)
    return [n for n, s in zip(nodes, scores) if s <= best * (1 + 1e-9)]


def _pick_min(nodes: list, score: Callable[[Any], float], rng) -> Any:
    return rng.choice(_lowest(nodes, score))


def _expected_latency(n: Node) -> float:
    """min_expected_latency's score: requests in flight per unit of speed, counting the new one."""
    return (n.num_in_flight + 1) / n.speed


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
        return _pick_min(nodes, _expected_latency, self.rng)


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

        # ties (no observations yet): the fewest in flight
        return _pick_min(_lowest(nodes, expected), lambda n: n.num_in_flight, self.rng)


CHUNK_CHARS = 256
"""Characters per prefix key: a system prompt of 2,000 tokens (~8,000 characters) is ~30 keys."""
MIN_MATCH = 0.5
"""Share of a request's keys a node must hold for the request to follow them (SGLang's cache_threshold)."""
MAX_EXTRA_IN_FLIGHT = 8
"""A node holding the prefix takes the request only while it has at most this many requests in flight more than
the least busy node: one hot prefix cannot pin every request on one node."""
MAX_KEYS = 512
"""Keys per request at most (the first 128 K characters decide): the work on the event loop stays under a
millisecond however large the body."""
VIEW_KEYS = 1 << 18
"""Keys remembered per node (LRU): 2^18 chunks of 256 characters, ~64 M characters of distinct prefixes."""


def request_text(payload: Any) -> str:
    """The leading text of an OpenAI request that decides which KV blocks it can reuse: the chat messages (role
    and content, in order), else the completion prompt, else the input; "" when it has none."""
    if not isinstance(payload, dict):
        return ""
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts, size = [], 0
        for m in messages:
            if size >= MAX_KEYS * CHUNK_CHARS:
                break
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
                parts.append(f"\x1e{m.get('role')}\x1f{text}")
                size += len(parts[-1])
        return "".join(parts)
    for field in ("prompt", "input"):
        value = payload.get(field)
        if isinstance(value, str):
            return value
        if value is not None:
            return json.dumps(value)
    return ""


def prefix_keys(text: str, chunk: int = CHUNK_CHARS) -> list[bytes]:
    """One key per whole chunk of ``text`` (a trailing partial chunk has none), each a hash of the previous key
    and the chunk: equal keys at position i mean equal text up to (i + 1) * chunk characters."""
    keys, previous = [], b""
    for start in range(0, min(len(text), MAX_KEYS * chunk) - chunk + 1, chunk):
        previous = hashlib.blake2b(previous + text[start:start + chunk].encode("utf-8", "surrogatepass"),
                                   digest_size=12).digest()
        keys.append(previous)
    return keys


class PrefixView:
    """The prefix keys sent to one node, most recent last, at most ``capacity``."""

    def __init__(self, capacity: int = VIEW_KEYS):
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, this node was sent."""
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def add(self, keys: list[bytes]) -> None:
        for k in keys:
            self.keys[k] = None
            self.keys.move_to_end(k)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


def follow_prefix(candidates: list, keys: list[bytes], view_of: Callable[[Any], PrefixView | None],
                  in_flight: Callable[[Any], int], cost: Callable[[Any], float], rng) -> Any:
    """The prefix rule (module docstring) among ``candidates`` (proxy nodes, Ray replicas) for a request with
    prefix ``keys``: of the candidates whose ``view_of`` holds the longest run of the keys (at least MIN_MATCH of
    them) and whose ``in_flight`` is within MAX_EXTRA_IN_FLIGHT of the least, the lowest ``cost``; else, of the
    lowest ``cost``, the one holding the fewest keys. Ties at random (``rng.choice``)."""
    if keys:
        matched = [view.match(keys) if (view := view_of(c)) is not None else 0 for c in candidates]
        best = max(matched)
        least_busy = min(in_flight(c) for c in candidates)
        holders = [c for c, m in zip(candidates, matched)
                   if m == best and in_flight(c) <= least_busy + MAX_EXTRA_IN_FLIGHT]
        if best >= MIN_MATCH * len(keys) and holders:
            return _pick_min(holders, cost, rng)
    return _pick_min(_lowest(candidates, cost), lambda c: len(v.keys) if (v := view_of(c)) is not None else 0, rng)


class PrefixAffinity:
    name = "prefix"
    uses_request = True

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()
        self.fallback = MinExpectedLatency(self.rng)
        self.views: dict[str, PrefixView] = {}

    def choose(self, nodes: list[Node], payload: Any = None) -> Node:
        keys = prefix_keys(request_text(payload))
        if not keys:
            return self.fallback.choose(nodes)
        node = follow_prefix(nodes, keys, lambda n: self.views.get(n.url), lambda n: n.num_in_flight,
                             _expected_latency, self.rng)
        self.views.setdefault(node.url, PrefixView()).add(keys)
        return node

    def forget(self, url: str) -> None:
        """A node that went down lost its cache (a restart): its view goes too."""
        self.views.pop(url, None)


STRATEGIES = {cls.name: cls for cls in (RandomStrategy, MinExpectedLatency, MinObservedLatency, PrefixAffinity)}


def make_strategy(name: str, rng: random.Random | None = None):
    """The strategy called ``name``; an unknown name lists the known ones."""
    try:
        return STRATEGIES[name](rng)
    except KeyError:
        raise ValueError(f"unknown routing strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}") from None
