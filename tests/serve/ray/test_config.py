"""ReplicaConfig without a cluster: the autoscaling options Ray Serve gets, and impossible settings refused."""

from __future__ import annotations

import pytest

from lmkit import EngineConfig
from lmkit.serve.ray.config import ReplicaConfig


def test_autoscaled_replicas_pass_every_autoscaling_setting_to_ray():
    replicas = ReplicaConfig(min_replicas=1, max_replicas=3, target_ongoing_requests=2, upscale_delay_s=1,
                             downscale_delay_s=4, look_back_period_s=6)
    options = replicas.deployment_options(EngineConfig(max_batch_size=8), drain_timeout_s=30)
    assert options["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 3, "initial_replicas": 1, "target_ongoing_requests": 2,
        "upscale_delay_s": 1, "downscale_delay_s": 4, "look_back_period_s": 6}
    assert options["max_ongoing_requests"] == 16 and "num_replicas" not in options
    fixed = ReplicaConfig(min_replicas=2, max_replicas=2).deployment_options(EngineConfig(), drain_timeout_s=30)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed


@pytest.mark.parametrize("field, value, says", [
    ("look_back_period_s", 0, "look_back_period_s must be > 0, got 0"),
    ("look_back_period_s", float("nan"), "look_back_period_s must be > 0, got nan"),
    ("upscale_delay_s", -1, "upscale_delay_s must be >= 0, got -1"),
    ("target_ongoing_requests", 0, "target_ongoing_requests must be > 0, got 0"),
    ("max_replicas", 0, "max_replicas must be an integer >= max(1, min_replicas=1), got 0"),
])
def test_impossible_settings_are_refused_naming_the_field(field, value, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        ReplicaConfig(**{field: value})


def test_prefix_routing_names_lmkits_router_and_other_names_are_refused():
    options = ReplicaConfig(request_router="prefix").deployment_options(EngineConfig(), drain_timeout_s=30)
    assert options["request_router_config"] == {"request_router_class": "lmkit.serve.ray.routing:PrefixRequestRouter"}
    assert "request_router_config" not in ReplicaConfig().deployment_options(EngineConfig(), drain_timeout_s=30)
    with pytest.raises(ValueError, match="request_router must be one of power_of_two, prefix, got 'sticky'"):
        ReplicaConfig(request_router="sticky")


def test_prefix_ranking_follows_the_prefix_within_the_load_bound():
    """The Ray router's policy without a cluster: a tenant's request ranks the replica that was sent its prefix
    first; past MAX_EXTRA_IN_FLIGHT more requests than the least busy replica it does not; a new prefix goes to
    the least busy replica caching the fewest keys; a request without keys to the least busy."""
    pytest.importorskip("ray.serve")
    from types import SimpleNamespace

    from lmkit.serve.proxy.strategies import MAX_EXTRA_IN_FLIGHT, PrefixView, prefix_keys
    from lmkit.serve.ray.routing import rank

    a, b, c = (SimpleNamespace(replica_id=name) for name in "abc")
    tenant = tuple(prefix_keys("system prompt of tenant one. " * 40))
    other = tuple(prefix_keys("another tenant's instructions! " * 40))
    views = {"b": PrefixView(), "c": PrefixView()}
    views["b"].add(list(tenant))
    views["c"].add(list(other) + list(tenant[:2]))
    idle = {"a": 0, "b": 0, "c": 0}
    assert rank([a, b, c], tenant, views, lambda r: idle[r.replica_id]) == [[b], [a, c]]
    busy = {"a": 0, "b": MAX_EXTRA_IN_FLIGHT + 1, "c": 0}
    assert rank([a, b, c], tenant, views, lambda r: busy[r.replica_id]) == [[a], [b, c]]  # a holds no keys
    new = tuple(prefix_keys("a prompt nobody has sent " * 40))
    assert rank([a, b, c], new, views, lambda r: idle[r.replica_id]) == [[a], [b, c]]
    views["a"] = PrefixView()
    views["a"].add(list(other) * 2 + list(tenant))  # a now caches the most keys: the new prefix goes to b
    assert rank([a, b, c], new, views, lambda r: idle[r.replica_id]) == [[b], [a, c]]
    loads = {"a": 3, "b": 1, "c": 2}
    assert rank([a, b, c], (), views, lambda r: loads[r.replica_id]) == [[b], [a, c]]
    assert rank([], tenant, views, lambda r: 0) == []


def test_prefix_router_takes_back_a_choice_ray_did_not_take():
    """PrefixRequestRouter records its choice at once; Ray asking again for the request, or placing it on another
    replica (the chosen one was full), takes the keys that choice added back, so later requests of the prefix
    follow where it went."""
    pytest.importorskip("ray.serve")
    import asyncio
    from types import SimpleNamespace

    from lmkit.serve.proxy.strategies import prefix_keys
    from lmkit.serve.ray.routing import PrefixRequestRouter

    router = object.__new__(PrefixRequestRouter)  # the policy's state without a Ray deployment around it
    router.initialize_state()
    router._replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: 0)
    a, b = SimpleNamespace(replica_id="a"), SimpleNamespace(replica_id="b")
    keys = tuple(prefix_keys("the tenant's long instructions. " * 40))

    def pending(i: int):
        return SimpleNamespace(args=[SimpleNamespace(prefix_keys=keys)], kwargs={},
                               metadata=SimpleNamespace(internal_request_id=f"r{i}"))

    def holders() -> list[str]:
        return sorted(r for r, view in router.views.items() if view.match(list(keys)) == len(keys))

    asyncio.run(router.choose_replicas([a, b], pending(1)))
    assert len(holders()) == 1
    first = asyncio.run(router.choose_replicas([a, b], pending(1)))[0][0]  # asked again: decided anew, held once
    assert holders() == [first.replica_id]
    other = b if first is a else a
    router.on_request_routed(pending(1), other.replica_id, None)  # Ray placed it on the other replica
    assert router.views[first.replica_id].match(list(keys)) == 0
    assert router.views[other.replica_id].match(list(keys)) == len(keys) and not router.tentative
    assert asyncio.run(router.choose_replicas([a, b], pending(2)))[0] == [other]
    router.on_request_routed(pending(2), other.replica_id, None)
    assert router.views[other.replica_id].match(list(keys)) == len(keys) and not router.tentative
