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
