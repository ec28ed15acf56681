"""The one engine interface of the HTTP layer (server/engine_api.py) and the one read
model of adapter state (engine/residency.py): the single engine and the cluster ingress
both implement EngineAPI with its exact signatures, the routes use nothing else, and the
residency rows follow registration, landing, pinning, reload, unload and promotion."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import json
import threading
from pathlib import Path

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.residency import Residence, ResidencyRow
from metrale.server.async_engine import AsyncEngine
from metrale.server.engine_api import EngineAPI
from tests.helpers.engine import run_until_done, step_until, step_until_running
from tests.helpers.tiny_models import make_adapter, make_model, save_model

ROOT = Path(__file__).resolve().parents[1] / "metrale"
LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
METHODS = sorted(n for n, v in vars(EngineAPI).items() if inspect.isfunction(v) and n[0] != "_")
FIELDS = sorted(EngineAPI.__annotations__)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_api")
    base = make_model("llama", seed=5)
    save_model(base, root / "model")
    for i, name in enumerate(("a", "b", "c")):
        make_adapter(base, root / name, seed=40 + i, r=4, lora_alpha=8, target_modules="all-linear")
    return root


def _llm(root) -> LLM:
    return LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
               num_kv_blocks=128)


# --- the protocol ----------------------------------------------------------------------------


def _kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async generator"
    return "coroutine" if inspect.iscoroutinefunction(fn) else "plain"


def _shape(fn) -> list[tuple]:
    """Parameters as a caller sees them: name, kind and default (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _check_implements(cls, instance) -> None:
    for name in METHODS:
        declared, impl = getattr(EngineAPI, name), getattr(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {name}"
        assert _shape(impl) == _shape(declared), f"{cls.__name__}.{name}{inspect.signature(impl)}"
        # generate is declared as returning an async iterator: both implement it as a generator
        expected = "async generator" if name == "generate" else _kind(declared)
        assert _kind(impl) == expected, f"{cls.__name__}.{name} is {_kind(impl)}"
    missing = [f for f in FIELDS if not hasattr(instance, f)]
    assert not missing, f"{cls.__name__} instances lack {missing}"
    assert isinstance(instance, EngineAPI)


def test_async_engine_implements_the_protocol(root):
    engine = AsyncEngine(_llm(root).engine)
    _check_implements(AsyncEngine, engine)
    config = json.loads((root / "model" / "config.json").read_text())
    assert engine.limits.vocab_size == config["vocab_size"]


def test_cluster_ingress_implements_the_protocol():
    pytest.importorskip("ray")
    from metrale.cluster.config import ClusterConfig, ReplicaSpec
    from metrale.cluster.ingress import ClusterEngine

    spec = ReplicaSpec(model="m", registry_name="r", registry_namespace="n", internal_key="k")
    _check_implements(ClusterEngine, ClusterEngine(None, None, spec, ClusterConfig(replicas=1)))


def test_a_signature_drift_is_caught():
    class Drifted(AsyncEngine):
        async def unload(self, name: str, force: bool = False) -> str: ...

    class Blocking(AsyncEngine):
        def is_known(self, name: str) -> bool: ...

    with pytest.raises(AssertionError, match="unload"):
        _check_implements(Drifted, object())
    with pytest.raises(AssertionError, match="is_known is plain"):
        _check_implements(Blocking, object())


def _engine_attributes(path: Path) -> set[str]:
    """Attributes read off `engine` (a name, or `...state.engine`) in one module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "engine") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "engine"):
                out.add(node.attr)
    return out


def test_routes_use_only_the_protocol():
    for module in ("app.py", "openai_api.py", "admin_api.py"):
        used = _engine_attributes(ROOT / "server" / module)
        assert used and used <= set(METHODS) | set(FIELDS), (module, used - set(METHODS) - set(FIELDS))
    for package in ("server", "cluster"):
        for path in (ROOT / package).glob("*.py"):
            assert "engine.engine." not in path.read_text(), path


# --- residency rows -----------------------------------------------------------------------------


def _row(rows: list[ResidencyRow], name: str) -> ResidencyRow:
    (row,) = [r for r in rows if r.name == name]
    return row


def _check_cover(rows: list[ResidencyRow], registered: set[str], slots: int) -> None:
    """Every registered name once; every slot once."""
    assert sorted(r.name for r in rows if r.registered) == sorted(registered)
    assert sorted(r.slot for r in rows if r.slot is not None) == list(range(slots))


def test_rows_follow_register_land_pin_reload_unload(root):
    engine = _llm(root).engine
    va = engine.register_adapter("a", root / "a")
    vb = engine.register_adapter("b", root / "b")
    rows = engine.residency()
    _check_cover(rows, {"a", "b"}, 2)
    assert _row(rows, "a") == ResidencyRow("a", va.version, None, Residence.COLD, 0, False, True,
                                           va.source)
    assert [(r.slot, r.state, r.name) for r in rows if not r.registered] == \
        [(0, Residence.EMPTY, None), (1, Residence.EMPTY, None)]

    slot_a, _ = engine.promote(va)
    engine.pin_adapter("a", True)
    rows = engine.residency()
    _check_cover(rows, {"a", "b"}, 2)
    a = _row(rows, "a")
    assert (a.slot, a.state, a.version, a.refs, a.pinned) == (slot_a, Residence.READY, va.version,
                                                              0, True)
    assert a.uid is not None and a.generation == 1

    rid = engine.add_request([5, 6, 7], LONG, "a")
    step_until_running(engine, rid)
    assert _row(engine.residency(), "a").refs == 1
    engine.pin_adapter("a", False)
    va2 = engine.register_adapter("a", root / "c", reload=True)  # a new version: in no slot yet
    rows = engine.residency()
    _check_cover(rows, {"a", "b"}, 2)
    assert _row(rows, "a") == ResidencyRow("a", va2.version, None, Residence.COLD, 0, False, True,
                                           va2.source)
    (old,) = [r for r in rows if r.slot == slot_a]
    assert (old.name, old.version, old.state, old.refs, old.pinned, old.uid) == \
        (None, va.version, Residence.READY, 1, False, a.uid)  # detached: serves its request, admits none

    slot_b, evicted = engine.promote(vb)
    assert (slot_b, evicted) == (1 - slot_a, None)
    rid_b = engine.add_request([8, 9], LONG, "b")
    step_until_running(engine, rid_b)
    assert engine.unload_adapter("b") == "draining"
    rows = engine.residency()
    _check_cover(rows, {"a"}, 2)
    b = _row(rows, "b")
    assert (b.registered, b.slot, b.state, b.refs, b.version) == \
        (False, slot_b, Residence.READY, 1, vb.version)

    run_until_done(engine)
    step_until(engine, lambda: not [r for r in engine.residency() if r.name == "b"])
    rows = engine.residency()
    _check_cover(rows, {"a"}, 2)
    assert [(r.slot, r.state, r.refs) for r in rows if not r.registered] == \
        sorted([(slot_a, Residence.READY, 0), (slot_b, Residence.EMPTY, 0)])


def test_a_promotion_in_flight_is_loading(root, monkeypatch):
    engine = _llm(root).engine
    va = engine.register_adapter("a", root / "a")
    written = threading.Event()
    original = engine.lora.prepare_disk

    def gated(*args, **kwargs):
        prepared = original(*args, **kwargs)

        def write(landing):
            assert written.wait(30), "the test never let the write go on"
            prepared.write(landing)

        return dataclasses.replace(prepared, write=write)

    monkeypatch.setattr(engine.lora, "prepare_disk", gated)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0), "a")
    step_until(engine, lambda: _row(engine.residency(), "a").state is not Residence.COLD)
    rows = engine.residency()
    _check_cover(rows, {"a"}, 2)
    a = _row(rows, "a")
    assert (a.state, a.version, a.refs) == (Residence.LOADING, va.version, 0)
    written.set()
    assert run_until_done(engine)[rid].error is None
    a = _row(engine.residency(), "a")
    assert (a.state, a.slot) == (Residence.READY, _row(rows, "a").slot)


def test_async_engine_serves_the_listing_from_rows(root):
    llm = _llm(root)
    va = llm.engine.register_adapter("a", root / "a")
    slot, _ = llm.engine.promote(va)
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        listing = asyncio.run(engine.residency())
    finally:
        asyncio.run(engine.shutdown(drain_timeout_s=0))
    (view,) = listing.adapters
    assert (view.name, view.slot, view.state, view.version, view.unloading) == \
        ("a", slot, "READY", va.version, False)
    assert [(s["slot"], s["name"], s["state"]) for s in listing.slots] == \
        sorted([(slot, "a", "READY"), (1 - slot, None, "EMPTY")])
