"""Whatever a peer puts in a lease reply, reading it (read_reply, parse_manifest, then
the plan built from it) ends in a MetraleError or a plan: never a TypeError, a crash or
a regex that backtracks for minutes. Hypothesis mutates a genuine exporter manifest
(its logical form, then put on the wire) with arbitrary JSON values, and the packed body
with arbitrary bytes; named cases pin the ones seen in the wild."""

from __future__ import annotations

import copy
import json
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from metrale.errors import MetraleError
from metrale.peer.client import strict_json
from metrale.peer.errors import PeerManifestError
from metrale.peer.manifest import (
    MAX_JSON_DEPTH,
    check_json_bounds,
    manifest_plan,
    parse_manifest,
    read_reply,
)
from metrale.peer.wire import Unrepresentable, encode_doc
from tests.helpers.peers import LEASE, new_slots

SOURCE = "peer 127.0.0.1:1 adapter 'a'"
PEFT_KEYS = ["r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_rslora",
             "layers_to_transform", "layers_pattern", "exclude_modules", "modules_to_save",
             "use_dora", "bias", "peft_type", "fan_in_fan_out", "lora_bias"]
MANIFEST_KEYS = ["version", "adapter_id", "name", "uid", "generation", "peft", "dtype", "tensors",
                 "data_bytes", "transports", "layer", "module", "kind", "shape", "nbytes", "http",
                 "nixl", "data_path", "ranges", "agent_metadata", "mem_type", "descs", *PEFT_KEYS]
ATOMS = st.sampled_from([
    0, 1, -1, 2, 4, 8, 64, 2**31, 2**62, 2**63, 2**64, -2**63, 10**30, True, False, None,
    0.5, 1e308, -0.0, float("inf"), float("-inf"), float("nan"),
    "", "(", ")", "[", "*", "(.*)*x", "(a|a)*y", ".*", "all-linear", "q_proj", "down_proj",
    "A", "B", "F32", "F16", "I32", "DRAM", "VRAM", "LORA", "none", "a", "%%%", "x" * 300,
    "model.layers.0.self_attn.q_proj", "/peer/v1/leases/fakelease0001/data", "\u0000", "\udc80",
])
JSON = st.recursive(
    ATOMS | st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(MANIFEST_KEYS) | st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def target():
    slots = new_slots()
    return slots.pool.layout, slots.model_config, slots.pool_config


def read(doc, target) -> None:
    """What landing does with a manifest before any byte moves: the document goes on the
    wire (metrale.peer.wire; a tensor field the packed table cannot hold raises
    Unrepresentable), then is read back, checked and planned."""
    read_body(encode_doc({"lease": {"id": LEASE, "expires_in_s": 30}, "manifest": doc}), target)


def read_body(raw: bytes, target) -> None:
    layout, model, pool = target
    manifest = parse_manifest(read_reply(raw, SOURCE), layout, SOURCE)
    manifest_plan(manifest, "a", manifest.peft_config(layout, SOURCE), model, pool, SOURCE)


def _paths(doc, prefix=()):
    """Every (container, key) of a JSON document, outermost first."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield doc, key
        yield from _paths(value, prefix + (key,))


@st.composite
def mutated(draw, base):
    """`base` with one to three values replaced, deleted or inserted anywhere in it."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        spots = list(_paths(doc))
        if not spots:
            break
        container, key = draw(st.sampled_from(spots))
        op = draw(st.sampled_from(["replace", "replace", "delete", "insert"]))
        if op == "replace":
            container[key] = draw(JSON)
        elif op == "delete":
            del container[key]
        elif isinstance(container, dict):
            container[draw(st.sampled_from(MANIFEST_KEYS))] = draw(JSON)
        else:
            container.insert(key, draw(JSON))
    return doc


def test_the_genuine_manifest_is_read(genuine, target):  # noqa: F811
    read(copy.deepcopy(genuine[0]["manifest"]), target)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_mutation_ends_in_a_metrale_error_or_a_plan(data, genuine, target):  # noqa: F811
    doc = data.draw(mutated(genuine[0]["manifest"]))
    try:
        raw = encode_doc({"lease": {"id": LEASE, "expires_in_s": 30}, "manifest": doc})
    except Unrepresentable:
        assume(False)  # a tensor field of another type: the packed table cannot say it
    start = time.monotonic()
    try:
        read_body(raw, target)
    except MetraleError as e:
        assert str(e)
    assert time.monotonic() - start < 1.0  # no pattern may backtrack for long


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_byte_flip_ends_in_a_metrale_error_or_a_plan(data, genuine, target):  # noqa: F811
    """The packed body itself: overwrite one to four bytes anywhere (prefix, header,
    PEFT config, table) or cut it short."""
    raw = bytearray(encode_doc({"lease": {"id": LEASE, "expires_in_s": 30},
                                "manifest": genuine[0]["manifest"]}))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    try:
        read_body(bytes(raw), target)
    except MetraleError as e:
        assert str(e)


def _peft(**fields):
    return lambda m: m["peft"].update(fields)


def _tensor0(**fields):
    return lambda m: m["tensors"][0].update(fields)


def _nest(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


# name -> an edit the readers must refuse with a MetraleError
NAMED = {
    "rank-pattern-list": _peft(rank_pattern=[1]),
    "target-modules-bad-regex": _peft(target_modules="("),
    "r-infinity": _peft(r=float("inf")),
    "r-nan": _peft(r=float("nan")),
    "alpha-nan": _peft(lora_alpha=float("nan")),
    "r-huge": _peft(r=10**30),
    "rank-pattern-value-dict": _peft(rank_pattern={"q_proj": {}}),
    "target-modules-number": _peft(target_modules=7),
    "layers-to-transform-string": _peft(target_modules=["q_proj"], layers_to_transform="0"),
    "redos-target": _peft(target_modules="(.*)*x"),
    "redos-alternation": _peft(target_modules=r"(\w|\w|.)*z"),
    "redos-rank-pattern": _peft(rank_pattern={"(.*.*)*y": 2}),
    "polynomial-pattern": _peft(target_modules=".*.*.*.*.*.*.*x"),
    "pattern-flood": _peft(rank_pattern={f"p{i}": 2 for i in range(5000)}),
    "version-true": lambda m: m.update(version=True),
    "version-float": lambda m: m.update(version=2.0),
    "version-1-peer": lambda m: m.update(version=1),
    "version-2-peer": lambda m: m.update(version=2),
    "uid-float": lambda m: m.update(uid=1.5),
    "generation-huge": lambda m: m.update(generation=2**70),
    "module-list": _tensor0(module=["q_proj"]),
    "kind-dict": _tensor0(kind={"A": 1}),
    # DoRA magnitudes and model-level modules (manifest version 2)
    "magnitude-two-rows": lambda m: m["tensors"].append(
        {**m["tensors"][1], "kind": "M", "shape": [2, m["tensors"][1]["shape"][1]]}),
    "magnitude-wrong-width": lambda m: m["tensors"].append(
        {**m["tensors"][1], "kind": "M", "shape": [1, 3], "nbytes": 12}),
    "magnitude-without-dora": lambda m: m["tensors"].append(
        {**m["tensors"][1], "kind": "M", "shape": [1, m["tensors"][1]["shape"][1]],
         "nbytes": 4 * m["tensors"][1]["shape"][1]}),
    "dora-without-magnitude": _peft(use_dora=True),
    "dora-not-bool": _peft(use_dora="yes"),
    "kind-unknown": _tensor0(kind="C"),
    "lm-head-not-in-pool": _tensor0(module="lm_head"),
    "embed-layer-1": _tensor0(module="embed_tokens", layer=1),
    "transports-list": lambda m: m.update(transports=[]),
    "http-string": lambda m: m["transports"].update(http="/peer/v1/leases/x/data"),
    "nixl-string": lambda m: m["transports"].update(nixl="x"),
    "nixl-no-device": lambda m: m["transports"].update(nixl={
        "agent_metadata": "", "mem_type": "DRAM"}),
    "nixl-device-huge": lambda m: m["transports"].update(nixl={
        "agent_metadata": "", "mem_type": "DRAM", "device": 2**40}),
    "deep-nesting": _peft(extra=_nest(MAX_JSON_DEPTH + 2)),
    "tuple-value": _peft(target_modules=("q_proj",)),
    "too-large": lambda m: m.update(padding="x" * (9 << 20)),
}


@pytest.mark.parametrize("case", sorted(NAMED))
def test_named_malformed_manifests_are_refused(case, genuine, target):  # noqa: F811
    doc = copy.deepcopy(genuine[0]["manifest"])
    NAMED[case](doc)
    start = time.monotonic()
    with pytest.raises(MetraleError) as info:
        read(doc, target)
    assert time.monotonic() - start < 1.0
    assert SOURCE in str(info.value) and len(str(info.value)) < 1000


@pytest.mark.parametrize("where,error", [
    ("from_dict", KeyError("r")), ("from_dict", RecursionError()),
    ("plan", TypeError("'int' object is not iterable")), ("plan", OverflowError()),
])
def test_plain_python_errors_become_refusals_naming_the_peer(where, error, genuine, target,  # noqa: F811
                                                             monkeypatch):
    """The safety net: whatever the config parser or the planner raises on a peer's
    document is a PeerManifestError naming the peer, the original kept as its cause."""
    from metrale.adapters.peft_config import PeftAdapterConfig
    from metrale.peer import manifest

    def fail(*args, **kwargs):
        raise error

    if where == "from_dict":
        monkeypatch.setattr(PeftAdapterConfig, "from_dict", classmethod(fail))
    else:
        monkeypatch.setattr(manifest, "plan_from_tensors", fail)
    with pytest.raises(PeerManifestError) as info:
        read(copy.deepcopy(genuine[0]["manifest"]), target)
    assert SOURCE in str(info.value) and info.value.__cause__ is error


@pytest.mark.parametrize("raw", [
    b"NaN", b"[Infinity]", b'{"r": -Infinity}', b"1e400", b"9" * 30, b"[" * 100_000,
    b"\xff\xfe", b'{"a": 1',
])
def test_reply_json_is_strict(raw):
    with pytest.raises(ValueError):
        strict_json(raw)


@pytest.mark.parametrize("section", ["header", "peft"])
def test_nesting_past_the_decoder_is_refused(section, genuine, target):  # noqa: F811
    """JSON nested deeper than Python's recursion limit, in either JSON section."""
    from metrale.peer import wire

    good = wire.decode(encode_doc({"lease": {"id": LEASE, "expires_in_s": 30},
                                   "manifest": genuine[0]["manifest"]}), SOURCE)
    deep = b"[" * 100_000 + b"]" * 100_000
    raw = wire.encode(deep if section == "header" else good.header,
                      deep if section == "peft" else good.peft, good.table)
    with pytest.raises(PeerManifestError):
        read_body(raw, target)


def test_json_bounds_allow_the_manifest_shape():
    check_json_bounds(_nest(MAX_JSON_DEPTH - 1), SOURCE)
    with pytest.raises(PeerManifestError):
        check_json_bounds(_nest(MAX_JSON_DEPTH), SOURCE)
    assert strict_json(json.dumps({"a": [1, 2.5, None, True, "x"]})) == {"a": [1, 2.5, None, True, "x"]}
