"""AdapterRegistry's memory of a landing's refusal (sources only landings check): it holds
for its version until its time passes, a reload installs a new version, or an unload."""

from __future__ import annotations

from pathlib import Path

from metrale.engine.registry import AdapterRegistry, AdapterSource
from metrale.errors import NonFiniteWeightsError

SOURCE = AdapterSource(path=Path("/adapters/a"), verify_on_landing=True)


def test_a_refusal_lasts_until_its_time():
    registry = AdapterRegistry()
    version = registry.register("a", SOURCE)
    error = NonFiniteWeightsError("tensor 'x' holds NaN")
    assert registry.refusal(version, now=0.0) is None
    registry.refuse(version, error, until=10.0)
    assert registry.refusal(version, now=9.9) is error
    assert registry.refusal(version, now=10.0) is None


def test_a_reload_or_an_unload_ends_it():
    registry = AdapterRegistry()
    old = registry.register("a", SOURCE)
    registry.refuse(old, NonFiniteWeightsError("bad"), until=10.0)
    new = registry.register("a", SOURCE, reload=True)
    assert registry.refusal(new, now=0.0) is None and registry.refusal(old, now=0.0) is None
    registry.refuse(new, NonFiniteWeightsError("bad"), until=10.0)
    registry.unload("a", None)
    again = registry.register("a", SOURCE)
    assert registry.refusal(again, now=0.0) is None


def test_a_stale_versions_refusal_is_not_kept():
    registry = AdapterRegistry()
    old = registry.register("a", SOURCE)
    new = registry.register("a", SOURCE, reload=True)
    registry.refuse(old, NonFiniteWeightsError("bad"), until=10.0)  # its landing ended late
    assert registry.refusal(new, now=0.0) is None
