"""The cluster's frozen settings refuse what an engine would refuse, at construction: a
replica spec that could never start is an error in the launcher, not in every replica."""

from __future__ import annotations

import pytest

from metrale.cluster.config import ReplicaSpec
from metrale.config import EVICTION_POLICIES, FP8_ACTIVATIONS, PoolConfig

BASE = dict(model="m", registry_name="r", registry_namespace="n", internal_key="k")


def test_a_spec_carries_the_engines_adapter_cache_settings():
    spec = ReplicaSpec(**BASE, host_tier_bytes=8 << 30, adapter_eviction="lru")
    assert (spec.host_tier_bytes, spec.adapter_eviction) == (8 << 30, "lru")
    default = ReplicaSpec(**BASE)
    assert default.adapter_eviction == PoolConfig(1, 16).eviction  # replicas as one engine


@pytest.mark.parametrize("bad", [
    {"adapter_eviction": "fifo"}, {"adapter_eviction": ""}, {"host_tier_bytes": -1},
    {"fp8_activations": "static"}, {"max_loras": 0}, {"torch_threads": 0},
])
def test_a_spec_no_replica_could_start_with_is_refused(bad):
    with pytest.raises(ValueError):
        ReplicaSpec(**BASE, **bad)


def test_every_engine_choice_is_a_valid_spec():
    for policy in EVICTION_POLICIES:
        ReplicaSpec(**BASE, adapter_eviction=policy)
    for mode in FP8_ACTIVATIONS:
        ReplicaSpec(**BASE, fp8_activations=mode)
