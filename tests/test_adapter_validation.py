"""One test per class of bad adapter input: each corrupts a tiny valid adapter on
disk (or a peer's config dict) and asserts the exact AdapterError subclass; nothing
else (TypeError, RecursionError, re.error, OverflowError...) may come out."""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch

from metrale import errors
from metrale.adapters import patterns
from metrale.adapters.input_limits import MAX_JSON_DEPTH
from metrale.adapters.peft_config import MAX_CONFIG_BYTES, MAX_SCALE, PeftAdapterConfig
from metrale.adapters.plan import plan_adapter, resolve_targets
from metrale.adapters.safetensors_file import MAX_HEADER_BYTES, read_header
from metrale.adapters.weights_check import (
    WeightsOverflowError,
    all_finite,
    check_tensor,
    check_weights,
)
from metrale.config import ModelConfig, PoolConfig
from tests.helpers.tiny_models import hf_config, write_lora

MODEL = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
POOL = PoolConfig(max_loras=2, max_lora_rank=16)
CFG = errors.AdapterConfigError
FILE = errors.AdapterFileError
UNSUPPORTED = errors.UnsupportedAdapterError
MISMATCH = errors.AdapterMismatchError


@pytest.fixture
def good(tmp_path):
    return write_lora(tmp_path / "good")


def plan(d):
    return plan_adapter(d, "x", MODEL, POOL)


def refused(d, error):
    with pytest.raises(errors.AdapterError) as info:
        plan(d)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert str(info.value)
    return info.value


def edit_config(d, **changes):
    path = d / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def raw_field(d, name, literal: str):
    """Set a config field to a raw JSON literal json.dumps cannot write (1e999, 10**5000)."""
    edit_config(d, **{name: "@@RAW@@"})
    path = d / "adapter_config.json"
    path.write_text(path.read_text().replace('"@@RAW@@"', literal))


def header_of(d):
    raw = (d / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(d, header_bytes: bytes, data: bytes, length: int | None = None):
    n = len(header_bytes) if length is None else length
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", n) + header_bytes + data)


def edit_header(d, fn):
    header, data = header_of(d)
    fn(header)
    write_header(d, json.dumps(header).encode(), data)


def tensors(header):
    return sorted(k for k in header if k != "__metadata__")


def first_tensor(header):
    return tensors(header)[0]


def test_good_adapter_plans(good):
    p = plan(good)
    assert len(p.targets) == 2 * MODEL.num_layers
    assert all(t.rank == 4 and t.scale == 2.0 for t in p.targets)


def test_dora_and_embedding_adapter_plans(tmp_path):
    """A DoRA adapter on q_proj, embed_tokens and lm_head: every module's A, B and
    magnitude land, embed_tokens' A is [r, vocab], and the plan says DoRA."""
    from metrale.config import EXTRA_TARGETS

    d = write_lora(tmp_path / "d", r=4, target_modules=["q_proj", "embed_tokens", "lm_head"],
                   use_dora=True)
    p = plan_adapter(d, "d", MODEL, PoolConfig(1, 8, extra_targets=EXTRA_TARGETS))
    assert p.dora and len(p.targets) == MODEL.num_layers + 2
    kinds = sorted((t.target.module, t.kind, t.entry.shape) for t in p.landings
                   if t.target.layer == 0)
    assert kinds == [
        ("embed_tokens", "A", (4, MODEL.vocab_size)),
        ("embed_tokens", "B", (MODEL.hidden_size, 4)),
        ("embed_tokens", "M", (MODEL.hidden_size,)),
        ("lm_head", "A", (4, MODEL.hidden_size)),
        ("lm_head", "B", (MODEL.vocab_size, 4)),
        ("lm_head", "M", (MODEL.vocab_size,)),
        ("q_proj", "A", (4, MODEL.hidden_size)),
        ("q_proj", "B", (MODEL.q_size, 4)),
        ("q_proj", "M", (MODEL.q_size,)),
    ]


def test_dora_magnitude_overflowing_the_pool_dtype_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    d = write_lora(tmp_path / "d", use_dora=True)
    tensors = load_file(d / "adapter_model.safetensors")
    key = sorted(k for k in tensors if "magnitude" in k)[0]
    tensors[key][0] = 1e6  # finite in F32, Inf in fp16 (max 65504)
    save_file(tensors, d / "adapter_model.safetensors")
    p = plan_adapter(d, "d", MODEL, PoolConfig(1, 8))
    check_weights(p, torch.float32)
    with pytest.raises(WeightsOverflowError, match="magnitude"):
        check_weights(p, torch.float16)


@pytest.mark.parametrize("target, error", [
    ("embed_tokens", errors.ExtraTargetsRequiredError),
    ("lm_head", errors.ExtraTargetsRequiredError),
])
def test_extra_target_without_pool_memory_names_the_flag(tmp_path, target, error):
    d = write_lora(tmp_path / "d", target_modules=["q_proj", target])
    with pytest.raises(error, match="--lora-extra-targets"):
        plan_adapter(d, "d", MODEL, PoolConfig(1, 8))
    plan_adapter(d, "d", MODEL, PoolConfig(1, 8, extra_targets=(target,)))  # with it: fine


# --- regex fields ------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("target_modules", "("), ("target_modules", ".*[q"), ("target_modules", "*q_proj"),
    ("exclude_modules", "(?P<x"), ("rank_pattern", {"q_proj(": 2}),
    ("alpha_pattern", {"[": 2}), ("rank_pattern", {"(?i)q_proj": 2}),  # flags mid-pattern
    ("layers_pattern", "(?P<idx>layers)"),  # redefines PEFT's group
])
def test_invalid_regex_is_typed(good, field, value):
    changes = {field: value}
    if field == "layers_pattern":
        changes["layers_to_transform"] = [0]
    edit_config(good, **changes)
    err = refused(good, CFG)
    assert field.split("_")[0] in str(err)


def _regex_changes(field: str, pattern: str) -> dict:
    if field in ("rank_pattern", "alpha_pattern"):
        return {field: {pattern: 2}}
    if field == "layers_pattern":
        return {field: pattern, "layers_to_transform": [0]}
    return {field: pattern}


# (.*){1,32}[A-Z] defeats regex's own guards: billions of splits of a module name
@pytest.mark.parametrize("field", ["target_modules", "exclude_modules", "rank_pattern",
                                   "alpha_pattern", "layers_pattern"])
def test_catastrophic_backtracking_is_bounded(good, field, monkeypatch):
    monkeypatch.setattr(patterns, "MATCH_BUDGET_S", 0.2)
    edit_config(good, **_regex_changes(field, r"(.*){1,32}[A-Z]"))
    start = time.perf_counter()
    err = refused(good, CFG)
    assert time.perf_counter() - start < 10
    assert "too long" in str(err) and field.split("_")[0] in str(err)


@pytest.mark.parametrize("field", ["target_modules", "exclude_modules", "rank_pattern"])
def test_backtracking_re_would_hang_on_is_answered(good, field):
    # re needs ~2^31 steps here; regex's guards answer at once, with re's answer
    edit_config(good, **_regex_changes(field, r"([a-z._0-9]+)+X"))
    start = time.perf_counter()
    try:
        plan(good)
    except errors.AdapterError as e:
        assert type(e) is MISMATCH  # target_modules matching nothing
    assert time.perf_counter() - start < 10


def test_match_budget_is_shared_across_modules(monkeypatch):
    # each match alone stays under the budget; together they must not run unbounded
    monkeypatch.setattr(patterns, "MATCH_BUDGET_S", 0.2)
    slowish = r"([a-z._0-9]+)+\.(q|v)_proj"
    cfg = PeftAdapterConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                       "rank_pattern": {slowish: 2}})
    start = time.perf_counter()
    try:
        resolve_targets(cfg, MODEL, POOL)
    except CFG:
        pass
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("pattern", ["(?:(?:a{255}){255}){255}", "a{100000}", "(?x) q_proj # c"])
def test_unbounded_compile_or_verbose_refused(good, pattern):
    edit_config(good, target_modules=pattern)
    refused(good, CFG)


def test_long_pattern_refused(good):
    edit_config(good, target_modules="q" * (patterns.MAX_PATTERN_CHARS + 1))
    refused(good, CFG)


@pytest.mark.parametrize("pattern", [
    r".*\.(q|v)_proj", r"model\.layers\.\d+\.self_attn\.[qv]_proj", r".*(?<!k)_proj",
    r"[^k]*q_proj", r"(?i).*Q_PROJ", r"model\.layers\.[02]\..*", r".*\.[[:alpha:]]_proj",
])
def test_valid_regex_keeps_peft_semantics(tmp_path, pattern):
    import re

    d = write_lora(tmp_path / "a")
    edit_config(d, target_modules=pattern)
    cfg = PeftAdapterConfig.from_dir(d)
    for i in range(MODEL.num_layers):
        for m in ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"):
            path = MODEL.module_path(i, m)
            assert cfg.targets(path) == bool(re.fullmatch(pattern, path)), path


# --- wrong JSON types ---------------------------------------------------------------


WRONG_TYPES = [
    ("rank_pattern", ["q_proj", 2]), ("rank_pattern", "q_proj"), ("rank_pattern", {"q_proj": "2"}),
    ("rank_pattern", {"q_proj": 2.5}), ("rank_pattern", {"q_proj": True}),
    ("rank_pattern", {"q_proj": {"r": 2}}), ("rank_pattern", {"q_proj": None}),
    ("alpha_pattern", "v_proj"), ("alpha_pattern", {"v_proj": "3"}), ("alpha_pattern", {"v_proj": [3]}),
    ("alpha_pattern", [1, 2]),
    ("layers_to_transform", "0,1"), ("layers_to_transform", [0, "1"]), ("layers_to_transform", [True]),
    ("layers_to_transform", -1), ("layers_to_transform", [0.0]), ("layers_to_transform", {"0": 1}),
    ("layers_to_transform", [[0]]),
    ("r", True), ("r", "8"), ("r", [8]), ("r", None), ("r", {"value": 8}),
    ("lora_alpha", "16"), ("lora_alpha", False), ("lora_alpha", None), ("lora_alpha", [16]),
    ("target_modules", 5), ("target_modules", 1.5), ("target_modules", True),
    ("target_modules", {"q_proj": 1}), ("target_modules", ["q_proj", 5]),
    ("target_modules", ["q_proj", ["v_proj"]]), ("target_modules", [None]),
    ("exclude_modules", 3), ("exclude_modules", {"a": 1}), ("exclude_modules", [1]),
    ("layers_pattern", 5), ("layers_pattern", [["layers"]]),
    ("use_rslora", "true"), ("use_rslora", 1), ("use_dora", "false"), ("fan_in_fan_out", []),
    ("lora_bias", "no"), ("bias", 0), ("bias", "everything"), ("peft_type", 1),
    ("peft_type", ["LORA"]), ("modules_to_save", "lm_head"), ("modules_to_save", 1),
    ("target_parameters", "experts"), ("trainable_token_indices", 3),
]


@pytest.mark.parametrize("field, value", WRONG_TYPES, ids=lambda v: repr(v)[:30])
def test_wrong_json_type_on_disk(good, field, value):
    edit_config(good, **{field: value})
    err = refused(good, CFG)
    assert field in str(err)


@pytest.mark.parametrize("field, value", WRONG_TYPES, ids=lambda v: repr(v)[:30])
def test_wrong_json_type_in_peer_dict(field, value):
    d = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], field: value}
    with pytest.raises(CFG):
        PeftAdapterConfig.from_dict(d)


@pytest.mark.parametrize("doc", [None, [], "LORA", 5, [{"r": 4}]])
def test_config_not_an_object(good, doc):
    (good / "adapter_config.json").write_text(json.dumps(doc))
    refused(good, CFG)
    with pytest.raises(CFG):
        PeftAdapterConfig.from_dict(doc)


def test_peer_dict_with_python_values():
    for bad in ({"r": 4, "target_modules": ["q_proj"], "rank_pattern": {1: 2}},
                {"r": 4, "target_modules": [b"q_proj"]},
                {"r": 4, "target_modules": ["q_proj"], "lora_alpha": 10 ** 400},
                {"r": 4, "target_modules": ["q_proj"], "lora_alpha": complex(1, 1)}):
        with pytest.raises(CFG):
            PeftAdapterConfig.from_dict(bad)


@pytest.mark.parametrize("field, value", [
    ("alora_invocation_tokens", [1, 2]), ("use_bdlora", {}), ("arrow_config", {"top_k": 2}),
    ("velora_config", {}), ("kasa_config", {}), ("monteclora_config", {}), ("use_qalora", True),
    ("layer_replication", [[0, 2]]), ("trainable_token_indices", [5]),
])
def test_unserved_variants_refused(good, field, value):
    edit_config(good, **{field: value})
    refused(good, UNSUPPORTED)


@pytest.mark.parametrize("changes", [
    {"target_modules": ".*q_proj", "layers_to_transform": [0]},
    {"target_modules": ".*q_proj", "layers_pattern": "layers"},
    {"layers_pattern": "layers"},  # without layers_to_transform
])
def test_combinations_peft_refuses(good, changes):
    edit_config(good, **changes)
    refused(good, CFG)


# --- numbers ------------------------------------------------------------------------


@pytest.mark.parametrize("field, literal", [
    ("r", "1e999"), ("r", "Infinity"), ("r", "NaN"), ("r", "4.9"), ("r", "8.0"), ("r", "0"),
    ("r", "-4"), ("r", "1000000"), ("r", "1" * 400), ("r", "1" * 5000), ("r", "-Infinity"),
    ("lora_alpha", "NaN"), ("lora_alpha", "Infinity"), ("lora_alpha", "-Infinity"),
    ("lora_alpha", "1e308"), ("lora_alpha", "1e999"), ("lora_alpha", "1" * 400),
    ("lora_alpha", "1e-300"), ("lora_alpha", "1e5"),
    ("alpha_pattern", '{"v_proj": NaN}'), ("alpha_pattern", '{"v_proj": 1e999}'),
    ("alpha_pattern", '{"v_proj": 1e300}'), ("rank_pattern", '{"v_proj": 1e999}'),
    ("rank_pattern", '{"v_proj": 2.0}'), ("rank_pattern", '{"v_proj": 0}'),
])
def test_bad_numbers(good, field, literal):
    raw_field(good, field, literal)
    err = refused(good, CFG)
    if len(literal) < 1000:  # past Python's int digit limit json itself refuses it
        assert field in str(err)


@pytest.mark.parametrize("alpha, rslora, scale", [
    (8.0, False, 2.0), (0, False, 0.0), (-8, False, -2.0), (16, True, 8.0), (1e-3, False, 2.5e-4),
])
def test_good_numbers(good, alpha, rslora, scale):
    edit_config(good, lora_alpha=alpha, use_rslora=rslora)
    assert {t.scale for t in plan(good).targets} == {scale}


def test_scale_bound_counts_rslora(good):
    edit_config(good, lora_alpha=3 * MAX_SCALE, r=4)  # 3e4 / 4
    assert {t.scale for t in plan(good).targets} == {0.75 * MAX_SCALE}
    edit_config(good, use_rslora=True)  # 3e4 / sqrt(4)
    refused(good, CFG)


# --- safetensors header -------------------------------------------------------------


def _set_entry(key, value):
    def fn(header):
        header[first_tensor(header)][key] = value
    return fn


@pytest.mark.parametrize("case, fn", [
    ("shape-negative", _set_entry("shape", [-4, 64])),
    ("shape-float", _set_entry("shape", [4.0, 64])),
    ("shape-bool", _set_entry("shape", [True, 64])),
    ("shape-string", _set_entry("shape", "4x64")),
    ("shape-huge", _set_entry("shape", [2 ** 70, 64])),
    ("shape-9-dims", _set_entry("shape", [1] * 9)),
    ("shape-nested", _set_entry("shape", [[4], 64])),
    ("offsets-float", _set_entry("data_offsets", [0.0, 1024.0])),
    ("offsets-string", _set_entry("data_offsets", ["0", "1024"])),
    ("offsets-three", _set_entry("data_offsets", [0, 512, 1024])),
    ("offsets-negative", _set_entry("data_offsets", [-1024, 0])),
    ("offsets-reversed", _set_entry("data_offsets", [1024, 0])),
    ("offsets-past-end", _set_entry("data_offsets", [0, 2 ** 40])),
    ("offsets-huge", _set_entry("data_offsets", [0, 2 ** 80])),
    ("offsets-missing", lambda h: h[first_tensor(h)].pop("data_offsets")),
    ("entry-not-object", lambda h: h.__setitem__(first_tensor(h), [1, 2])),
    ("dtype-unknown", _set_entry("dtype", "F33")),
    ("dtype-number", _set_entry("dtype", 32)),
    ("metadata-list", lambda h: h.__setitem__("__metadata__", ["format", "pt"])),
    ("metadata-int-value", lambda h: h.__setitem__("__metadata__", {"format": 1})),
    ("overlap", lambda h: h[tensors(h)[1]].__setitem__("data_offsets", h[tensors(h)[0]]["data_offsets"])),
])
def test_bad_header_fields(good, case, fn):
    edit_header(good, fn)
    refused(good, FILE)


def test_header_raw_literals(good):
    header, data = header_of(good)
    key = first_tensor(header)
    text = json.dumps(header)
    for literal in ("1e999", "NaN", "-0.5", "9" * 5000):
        entry = json.dumps(header[key]).replace(json.dumps(header[key]["shape"]), f"[{literal}, 64]")
        write_header(good, text.replace(json.dumps(header[key]), entry).encode(), data)
        refused(good, FILE)


@pytest.mark.parametrize("header_bytes", [
    b"[]", b'"x"', b"5", b"null", b"{nope", b"\xff\xfe{}", b"\xef\xbb\xbf{}",
    b'{"a": 1, "a": 2}', b"[" * 200_000 + b"]" * 200_000, b'{"a":' * 100_000,
])
def test_header_not_a_json_object(good, header_bytes):
    _, data = header_of(good)
    write_header(good, header_bytes, data)
    refused(good, FILE)


@pytest.mark.parametrize("length", [2 ** 64 - 1, 2 ** 63, MAX_HEADER_BYTES + 1, 10 ** 12])
def test_header_length_field_absurd(good, length):
    header, data = header_of(good)
    write_header(good, json.dumps(header).encode(), data, length=length)
    refused(good, FILE)


def test_file_shorter_than_length_field(good):
    (good / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 100) + b"{}")
    refused(good, FILE)


def test_int_dtype_is_a_mismatch(good):
    edit_header(good, _set_entry("dtype", "I32"))
    refused(good, MISMATCH)


def test_read_header_alone_is_typed(tmp_path):
    for content in (b"", b"\x00" * 7, b"\xff" * 8, struct.pack("<Q", 2) + b"{}",
                    struct.pack("<Q", 2) + b"[]"):
        (tmp_path / "f").write_bytes(content)
        try:
            read_header(tmp_path / "f")
        except errors.MetraleError:
            pass


# --- size and depth bounds ----------------------------------------------------------


def test_config_over_size_limit(good):
    cfg = json.loads((good / "adapter_config.json").read_text())
    text = json.dumps(cfg)
    (good / "adapter_config.json").write_text(text[:-1] + " " * MAX_CONFIG_BYTES + "}")
    refused(good, CFG)


def test_huge_sparse_config_is_not_read_whole(good):
    import tracemalloc

    path = good / "adapter_config.json"
    with open(path, "r+b") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB of NULs that cost no disk
    tracemalloc.start()
    try:
        refused(good, CFG)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MAX_CONFIG_BYTES


def test_huge_sparse_safetensors_is_refused_fast(good):
    path = good / "adapter_model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 2 << 30))
        f.truncate((2 << 30) + 100)
    start = time.perf_counter()
    refused(good, FILE)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("text", [
    "[" * 200_000 + "]" * 200_000,
    '{"r": 4, "x": ' + "[" * 200_000 + "]" * 200_000 + "}",
    '{"r": 4, "x": ' + '{"a":' * 100_000 + "1" + "}" * 100_000 + "}",
    '{"r": 4, "x": "' + "[" * 200_000 + '"}',  # brackets inside a string are fine...
])
def test_deep_nesting_is_typed(good, text):
    (good / "adapter_config.json").write_text(text)
    refused(good, CFG)  # ...this one is refused for missing target_modules


def test_depth_limit_is_exact(good):
    ok = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    nested: object = 1
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = [nested]
    (good / "adapter_config.json").write_text(json.dumps({**ok, "x": nested}))
    plan(good)
    (good / "adapter_config.json").write_text(json.dumps({**ok, "x": [nested]}))
    refused(good, CFG)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_does_not_block(good, tmp_path):
    (good / "adapter_config.json").unlink()
    os.mkfifo(good / "adapter_config.json")
    refused(good, CFG)
    other = write_lora(tmp_path / "other")
    (other / "adapter_model.safetensors").unlink()
    os.mkfifo(other / "adapter_model.safetensors")
    refused(other, FILE)


def test_config_not_utf8(good):
    (good / "adapter_config.json").write_bytes(b'{"r": 4, "target_modules": ["q\xff"]}')
    refused(good, CFG)


def test_duplicate_config_keys(good):
    (good / "adapter_config.json").write_text('{"r": 4, "r": 8, "target_modules": ["q_proj"]}')
    refused(good, CFG)


# --- weights -------------------------------------------------------------------------


def _poke(d, value, dtype=torch.float32):
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(dtype) for k, v in load_file(d / "adapter_model.safetensors").items()}
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][1, 2] = value
    save_file(tensors, d / "adapter_model.safetensors")


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_weights_accepts_good(good, pool_dtype):
    check_weights(plan(good), pool_dtype)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_check_weights_refuses_non_finite(good, value):
    _poke(good, value)
    with pytest.raises(errors.NonFiniteWeightsError) as info:
        check_weights(plan(good), torch.float32)
    assert type(info.value) is errors.NonFiniteWeightsError
    assert "lora_B" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite_agrees_with_isfinite(dtype):
    """The landing and registration check (aminmax on the CPU) against torch's isfinite:
    NaN (either sign), +-Inf at the start, middle and end of tensors of many sizes (and
    past one thread's share), the dtype's extremes and subnormals, empty tensors."""
    g = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    edge = torch.tensor([info.max, info.min, info.tiny, info.tiny / 4, -0.0], dtype=dtype)
    cases = [torch.empty(0, dtype=dtype), edge]
    for n in (1, 2, 15, 16, 17, 255, 4099, 300_007):
        for bad in (float("nan"), -float("nan"), float("inf"), float("-inf")):
            for at in sorted({0, n // 2, n - 1}):
                x = torch.randn(n, generator=g).to(dtype)
                x[at] = bad
                cases.append(x)
        cases.append(torch.randn(n, generator=g).to(dtype))
    cases.append(torch.randn(64, 33, generator=g).to(dtype).t())  # non-contiguous
    for x in cases:
        assert all_finite(x) == bool(x.isfinite().all()), (x.shape, x.flatten()[:4])


@pytest.mark.parametrize("value, file_dtype, pool_dtype", [
    (1e30, torch.float32, torch.float16), (1e39, torch.float64, torch.bfloat16),
    (1e39, torch.float64, torch.float32), (-7e4, torch.float32, torch.float16),
    (1e38, torch.bfloat16, torch.float16),
])
def test_check_weights_refuses_overflow(good, value, file_dtype, pool_dtype):
    _poke(good, value, file_dtype)
    with pytest.raises(WeightsOverflowError) as info:
        check_weights(plan(good), pool_dtype)
    assert isinstance(info.value, errors.NonFiniteWeightsError)
    assert str(pool_dtype) in str(info.value)


def test_check_weights_keeps_what_fits(good):
    _poke(good, 1e30)
    check_weights(plan(good), torch.float32)
    check_weights(plan(good), torch.bfloat16)  # bf16 reaches 3.4e38
    # float16's max itself fits as a value (as a lora_B entry its LoRA would overflow:
    # test_hostile_edges' gain-bound tests)
    check_tensor("x", "w", torch.tensor([65504.0]), torch.float16)


def test_check_weights_in_small_chunks(good, monkeypatch):
    from metrale.adapters import weights_check

    monkeypatch.setattr(weights_check, "CHUNK_BYTES", 44)  # not a multiple of 8 (F64)
    _poke(good, float("nan"), torch.float64)
    with pytest.raises(errors.NonFiniteWeightsError):
        check_weights(plan(good), torch.float32)


def test_check_weights_file_shrank(good):
    p = plan(good)
    path = good / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(FILE):
        check_weights(p, torch.float32)


@pytest.mark.parametrize("path", ["bad\x00dir", 5, None, "/nonexistent/adapter"])
def test_odd_adapter_paths_are_typed(path):
    with pytest.raises(CFG):
        plan(path)


def test_directory_in_place_of_a_file(good):
    (good / "adapter_model.safetensors").unlink()
    (good / "adapter_model.safetensors").mkdir()
    refused(good, FILE)
    (good / "adapter_config.json").unlink()
    (good / "adapter_config.json").mkdir()
    refused(good, CFG)


def test_frozen_embedding_copies_are_skipped_not_staged(tmp_path):
    """PEFT saves the frozen embed_tokens / lm_head weights beside their LoRA
    (save_embedding_layers): at the base shape they are planned around (only the landed
    tensors' bytes are read), and what lands is exactly the LoRA tensors."""
    from safetensors.torch import load_file, save_file

    from metrale.config import EXTRA_TARGETS
    from metrale.pool.swap import LoraSlots
    from tests.helpers.pool import land_disk

    d = write_lora(tmp_path / "d", r=4, target_modules=["q_proj", "embed_tokens", "lm_head"])
    tensors = load_file(d / "adapter_model.safetensors")
    full = torch.randn(MODEL.vocab_size, MODEL.hidden_size)
    tensors["base_model.model.model.embed_tokens.base_layer.weight"] = full
    tensors["base_model.model.lm_head.base_layer.weight"] = full.clone()
    save_file(tensors, d / "adapter_model.safetensors")
    pool = PoolConfig(1, 8, extra_targets=EXTRA_TARGETS)
    p = plan_adapter(d, "d", MODEL, pool)
    lora_bytes = sum(t.entry.nbytes for t in p.landings)
    assert p.spans and p.staged_bytes == lora_bytes < p.data_bytes - 2 * full.numel() * 4 + 1
    slots = LoraSlots(MODEL, pool, "cpu", torch.float32)
    land_disk(slots, d, 0)
    a = tensors["base_model.model.model.embed_tokens.lora_embedding_A"]  # [r, vocab]
    b = tensors["base_model.model.lm_head.lora_B.weight"]  # [vocab, r]
    assert torch.equal(slots.pool.lora_a(0, "embed_tokens")[0, :4], a)
    assert torch.equal(slots.pool.lora_bt(0, "lm_head")[0, :4], b.T)
    q = tensors["base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"]
    assert torch.equal(slots.pool.lora_a(2, "q_proj")[0, :4], q)
