"""Cache-aware routing on Ray Serve: the policy of the proxy's ``prefix`` strategy (serve/proxy/strategies.py) as a
Ray Serve request router of a model's replicas.

The application's Router reads each request's leading text and passes its prefix keys (chained hashes of
256-character chunks, ``strategies.prefix_keys``) with the forwarded request. ``PrefixRequestRouter`` keeps, per
replica, a bounded LRU view of the keys it routed there, and ranks the replicas for Ray: the replica holding the
longest run of the request's keys first, when that run covers at least half of them and the replica has at most
MAX_EXTRA_IN_FLIGHT requests more than the least busy one (one hot prefix cannot pin every request on one
replica); else the least busy replica caching the fewest keys (a new prefix goes where cache is freest, so tenants
spread); the others after it. Ray sends the request to the first replica with room (queue lengths from its
cache, probed when missing). The chosen replica's view takes the request's keys at once, so that a burst of one
new prefix follows its first request; when Ray asks again for the request or places it elsewhere (that replica was
full), the keys that choice added are taken back. A replica that dies loses its view.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any, Callable

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lmkit.serve.proxy.strategies import PrefixView, follow_prefix

def request_keys(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    """The prefix keys the application's Router attached to a forwarded request (none for other calls)."""
    if pending_request is None:
        return ()
    for arg in pending_request.args:
        keys = getattr(arg, "prefix_keys", None)
        if keys is not None:
            return tuple(keys)
    return ()


def rank(candidates: list, keys: tuple[bytes, ...], views: dict, load: Callable[[Any], int],
         rng: random.Random | None = None) -> list[list]:
    """The candidates (objects with a replica_id) in ranks of preference for a request with prefix ``keys``, given
    each replica's ``views`` (replica_id -> PrefixView) and ``load`` (requests it has in flight): the proxy's
    prefix rule's choice first (strategies.follow_prefix, the load both its bound and its cost), then the rest."""
    if not candidates:
        return []
    first = follow_prefix(candidates, list(keys), lambda r: views.get(r.replica_id), load, load, rng or random)
    rest = [r for r in candidates if r is not first]
    return [[first], rest] if rest else [[first]]


MAX_TENTATIVE = 10_000
"""Choices remembered until Ray reports where their requests went (a request Ray never reports is dropped oldest
first)."""


def _request_id(pending_request: PendingRequest | None) -> str | None:
    return getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)


class PrefixRequestRouter(RequestRouter):
    """Ranks a model's replicas by the prefixes routed to them (see the module docstring). Ray's base class gives
    the replica it picks to the request it was ranked for (FIFOMixin would hand it to the oldest waiting one)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.views: dict[ReplicaID, PrefixView] = {}
        self.tentative: OrderedDict[str, tuple[ReplicaID, list[bytes]]] = OrderedDict()
        """request id -> (the replica its keys were recorded on at once, the keys that were new there)."""

    def _record(self, replica_id: ReplicaID, keys: tuple[bytes, ...]) -> list[bytes]:
        """Adds ``keys`` to the replica's view; the ones it did not hold."""
        view = self.views.setdefault(replica_id, PrefixView())
        new = [k for k in keys if k not in view.keys]
        view.add(list(keys))
        return new

    def _undo(self, request_id: str | None) -> None:
        """A choice that did not take its request (Ray asks again, or placed it elsewhere): the keys it added go."""
        replica_id, added = self.tentative.pop(request_id, (None, []))
        view = self.views.get(replica_id)
        for k in added if view is not None else ():
            view.keys.pop(k, None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        keys, request_id = request_keys(pending_request), _request_id(pending_request)
        self._undo(request_id)  # asked again: the last choice is not where it went
        ranks = rank(candidate_replicas, keys, self.views,
                     lambda r: self.replica_queue_len_cache.get(r.replica_id) or 0)
        if keys and ranks:
            # recorded where it is meant to go at once, as the proxy does: the next request of a burst with this
            # prefix follows it instead of spreading before the first is accepted
            added = self._record(ranks[0][0].replica_id, keys)
            if request_id is not None:
                self.tentative[request_id] = (ranks[0][0].replica_id, added)
                while len(self.tentative) > MAX_TENTATIVE:
                    self.tentative.popitem(last=False)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = _request_id(pending_request)
        if self.tentative.get(request_id, (replica_id,))[0] != replica_id:
            self._undo(request_id)
        self.tentative.pop(request_id, None)
        keys = request_keys(pending_request)
        if keys:
            self._record(replica_id, keys)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.views.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self.views if rid not in live]:  # a replica Ray removed: its cache went too
            del self.views[gone]
