"""Property tests: arbitrary JSON in adapter_config.json fields, arbitrary and
mutated safetensors headers and regex patterns. Only metrale.errors.MetraleError
subclasses (or success) may come out, and valid regexes match as `re` does (PEFT's
engine). Bigger runs: bench/fuzz_parsers.py."""

from __future__ import annotations

import json
import re
import struct
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale import errors
from metrale.adapters import patterns
from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.plan import plan_adapter, resolve_targets
from metrale.adapters.safetensors_file import read_header
from metrale.adapters.weights_check import check_weights
from metrale.config import ModelConfig, PoolConfig
from tests.helpers.tiny_models import hf_config, write_lora

MODEL = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
POOL = PoolConfig(max_loras=2, max_lora_rank=16)
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
BASE_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
               "bias": "none", "use_dora": False, "use_rslora": False}
FIELDS = ["r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
          "layers_to_transform", "layers_pattern", "exclude_modules", "modules_to_save", "use_dora",
          "bias", "fan_in_fan_out", "peft_type", "lora_bias", "use_qalora", "target_parameters",
          "trainable_token_indices", "layer_replication", "alora_invocation_tokens", "use_bdlora",
          "init_lora_weights", "task_type"]
NAMES = ["q_proj", "v_proj", "k_proj", "down_proj", "model.layers.1.self_attn.q_proj", "layers",
         "lm_head", "embed_tokens", ".*", "(", "[", "(a+)+$", r".*\.(q|v)_proj", "a{3}", "", "\\"]

scalars = (st.none() | st.booleans()
           | st.integers(-(2 ** 70), 2 ** 70) | st.sampled_from([0, 1, 4, 8, 16, -1, 10 ** 400])
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from(NAMES) | st.text(max_size=12))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(autouse=True, scope="module")
def small_budget():
    with pytest.MonkeyPatch.context() as mp:  # a pathological draw costs 50 ms, not 1 s
        mp.setattr(patterns, "MATCH_BUDGET_S", 0.05)
        yield


def _only_typed(call) -> None:
    try:
        call()
    except errors.MetraleError as e:
        assert str(e)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values,
                               min_size=1, max_size=3))
def test_config_dict_fields(changes):
    cfg = {**BASE_CONFIG, **changes}

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # re's FutureWarnings on odd sets
            resolve_targets(PeftAdapterConfig.from_dict(cfg), MODEL, POOL)

    _only_typed(run)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return write_lora(tmp_path_factory.mktemp("fuzz") / "a")


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=2),
       edits=st.lists(st.tuples(st.integers(0, 10 ** 6), st.binary(max_size=3)), max_size=3))
def test_config_file_bytes(adapter_dir, changes, edits):
    raw = bytearray(json.dumps({**BASE_CONFIG, **changes}).encode())
    for pos, data in edits:  # overwrite bytes: broken JSON, UTF-8, brackets
        pos %= max(len(raw), 1)
        raw[pos:pos + len(data)] = data
    (adapter_dir / "adapter_config.json").write_bytes(bytes(raw))
    _only_typed(lambda: plan_adapter(adapter_dir, "x", MODEL, POOL))


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    d = write_lora(tmp_path_factory.mktemp("fuzz") / "h", r=2, target_modules=["q_proj"])
    raw = (d / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return d, json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(d, header: bytes, data: bytes, length: int | None = None) -> None:
    n = len(header) if length is None else length
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", n) + header + data)


@FUZZ
@given(blob=st.binary(max_size=300))
def test_header_arbitrary_bytes(good_file, blob):
    d, _, _ = good_file
    (d / "adapter_model.safetensors").write_bytes(blob)
    _only_typed(lambda: read_header(d / "adapter_model.safetensors"))


@FUZZ
@given(which=st.integers(0, 100), key=st.sampled_from(["dtype", "shape", "data_offsets", "extra"]),
       value=json_values, top=st.none() | st.tuples(st.sampled_from(["__metadata__", "x"]), json_values),
       length_delta=st.sampled_from([0, 0, 0, 1, -1, 2 ** 40, -(10 ** 6)]),
       data_cut=st.integers(0, 64))
def test_header_mutated_fields(good_file, which, key, value, top, length_delta, data_cut):
    d, header, data = good_file
    header = json.loads(json.dumps(header))
    names = sorted(header)
    header[names[which % len(names)]][key] = value
    if top is not None:
        header[top[0]] = top[1]
    text = json.dumps(header).encode()
    length = max(0, min(len(text) + length_delta, 2 ** 64 - 1))
    _write(d, text, data[:len(data) - data_cut], length)
    (d / "adapter_config.json").write_text(json.dumps({**BASE_CONFIG, "r": 2, "target_modules": ["q_proj"]}))
    _only_typed(lambda: plan_adapter(d, "x", MODEL, POOL))


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 10 ** 6), st.binary(min_size=1, max_size=4)),
                      min_size=1, max_size=4))
def test_header_byte_mutations(good_file, edits):
    d, header, data = good_file
    raw = bytearray(struct.pack("<Q", len(json.dumps(header))) + json.dumps(header).encode() + data)
    for pos, blob in edits:
        pos %= len(raw)
        raw[pos:pos + len(blob)] = blob
    (d / "adapter_model.safetensors").write_bytes(bytes(raw))
    (d / "adapter_config.json").write_text(json.dumps({**BASE_CONFIG, "r": 2, "target_modules": ["q_proj"]}))
    _only_typed(lambda: plan_adapter(d, "x", MODEL, POOL))


# --- regex semantics: the bounded matcher answers exactly what re answers ---------------

TOKENS = ["a", "q", "_", "0", "1", ".", "\\.", "\\", "(", ")", "(?:", "(?P<n>", "(?P=n)", "(?=",
          "(?!", "(?<=", "(?<!", "(?#", "(?i)", "(?i:", "[", "]", "[^", "^", "-", "{", "}", ",",
          "2", "e<=1", ":alpha:", "*", "+", "?", "|", "$", "\\d", "\\w", "\\b", "\\B", "\\1", "&&",
          "--", " ", "#", "*?", "++", "{2}", "{1,2}", "{,}", "(?>", "[]", "[^]", "\\[", "\\{", "K",
          "\\N{LATIN SMALL LETTER Q}", "\\x71", "[[:alpha:]]", "proj", "layers"]
# short subjects: re itself has no timeout, and 2^14 backtracking steps stay fast
SUBJECTS = ["a", "q_proj", "a.1.b", "x.layers.2.y", "m.l.0.q_proj", "l.12.q", "[a]{2}", "a-b_c:d"]
TEMPLATES = {
    "fullmatch": (patterns.fullmatch_pattern, "{}", "fullmatch"),
    "suffix": (patterns.suffix_pattern, r"(.*\.)?({})$", "match"),
    "layers": (patterns.layers_pattern, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.", "match"),
}


def _re_answer(kind, compiled, subject):
    m = getattr(compiled, TEMPLATES[kind][2])(subject)
    if kind != "layers":
        return m is not None
    idx = None if m is None else m.groupdict().get("idx")
    return m is not None, None if idx is None else int(idx)


def _our_answer(kind, pattern, subject):
    budget = patterns.MatchBudget()
    if kind == "fullmatch":
        return pattern.fullmatch(subject, budget)
    if kind == "suffix":
        return pattern.suffix_match(subject, budget)
    return pattern.layer_match(subject, budget)


@settings(max_examples=1000, deadline=None, database=None)
@given(tokens=st.lists(st.sampled_from(TOKENS), max_size=8), kind=st.sampled_from(sorted(TEMPLATES)))
def test_regex_matches_like_re(tokens, kind):
    source = "".join(tokens)
    make, template, _ = TEMPLATES[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            expected = re.compile(template.replace("{}", source))
        except re.error:
            expected = None
        try:
            ours = make("f", source)
        except errors.AdapterConfigError as e:
            # refused: invalid for re too, or one of the documented bounds
            assert expected is None or any(w in str(e) for w in ("verbose", "repeats too much")), e
            return
    assert expected is not None, f"accepted {source!r}, which re refuses"
    for subject in SUBJECTS:
        assert _our_answer(kind, ours, subject) == _re_answer(kind, expected, subject), (source, subject)


# --- PEFT parity: targeting, ranks and alphas equal PEFT's own functions ------------------

SAFE_REGEXES = [r".*\.(q|v)_proj", r".*q_proj", r"model\.layers\.[01]\..*", r".*(?<!k)_proj",
                r"(?i).*DOWN_PROJ", r"[^.]*\.layers\.\d+\.mlp\..*", r"q_proj", r".*\.[[:alpha:]]_proj"]
SHORT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "self_attn.q_proj",
         "mlp.down_proj", "1.mlp.up_proj", "model.layers.2.self_attn.v_proj"]
PATTERN_KEYS = SHORT + [r"layers\.1\.self_attn\.q_proj", r"(q|k)_proj", r".*proj", "proj", "layers.0.mlp.*"]


@settings(max_examples=300, deadline=None, database=None)
@given(
    targets=st.sampled_from(SAFE_REGEXES) | st.lists(st.sampled_from(SHORT), min_size=1, max_size=4),
    exclude=st.none() | st.sampled_from(SAFE_REGEXES) | st.lists(st.sampled_from(SHORT), max_size=3),
    layers=st.none() | st.integers(0, 3) | st.lists(st.integers(0, 3), max_size=3),
    layers_pattern=st.none() | st.sampled_from(["layers", "model.layers", "l.yers", "nope", ""])
    | st.lists(st.sampled_from(["layers", "x", "layers|mlp"]), max_size=2),
    rank_pattern=st.dictionaries(st.sampled_from(PATTERN_KEYS), st.integers(1, 16), max_size=3),
    alpha_pattern=st.dictionaries(st.sampled_from(PATTERN_KEYS), st.integers(1, 64), max_size=3),
)
def test_targets_match_peft(targets, exclude, layers, layers_pattern, rank_pattern, alpha_pattern):
    from types import SimpleNamespace

    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    if isinstance(targets, str):
        layers = layers_pattern = None  # PEFT refuses them with a regex
    elif layers is None:
        layers_pattern = None  # ...and layers_pattern alone
    cfg = PeftAdapterConfig.from_dict({
        **BASE_CONFIG, "target_modules": targets, "exclude_modules": exclude,
        "layers_to_transform": layers, "layers_pattern": layers_pattern,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
    })
    peft_cfg = SimpleNamespace(
        target_modules=targets if isinstance(targets, str) else set(targets),
        exclude_modules=exclude if exclude is None or isinstance(exclude, str) else set(exclude),
        layers_to_transform=layers, layers_pattern=layers_pattern, modules_to_save=None,
        target_parameters=None)
    for layer in range(MODEL.num_layers):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            key = MODEL.module_path(layer, module)
            assert cfg.targets(key) == bool(check_target_module_exists(peft_cfg, key)), key
            r = rank_pattern.get(get_pattern_key(list(rank_pattern), key), BASE_CONFIG["r"])
            a = alpha_pattern.get(get_pattern_key(list(alpha_pattern), key), BASE_CONFIG["lora_alpha"])
            assert (cfg.rank_for(key), cfg.alpha_for(key)) == (r, a), key


# --- DoRA magnitudes and embedding / lm_head tensors: any corruption is a typed refusal ---

EXTRA_POOL = PoolConfig(max_loras=2, max_lora_rank=16, extra_targets=("embed_tokens", "lm_head"))
DORA_TARGETS = ["q_proj", "down_proj", "embed_tokens", "lm_head"]


@pytest.fixture(scope="module")
def dora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "dora"


def _mutate(tensors, which, how, value):
    import torch

    name = sorted(tensors)[which % len(tensors)]
    t = tensors[name]
    if how == "drop":
        del tensors[name]
    elif how == "reshape":
        tensors[name] = torch.zeros(*[d + value % 3 for d in t.shape[:1]], *t.shape[1:])
    elif how == "flatten":
        tensors[name] = t.reshape(-1)
    elif how == "unsqueeze":
        tensors[name] = t.unsqueeze(0)
    elif how == "value":
        t = t.clone()
        t.view(-1)[value % t.numel()] = [float("nan"), float("inf"), -float("inf"), 1e30][value % 4]
        tensors[name] = t
    elif how == "rename":
        del tensors[name]
        new = [name.replace("lora_embedding_", "lora_").replace(".weight", ""),
               name.replace("lora_A.weight", "lora_embedding_A"),
               name.replace("lora_magnitude_vector", "lora_magnitude_vector.weight"),
               name.replace("layers.0", "layers.7"),
               name + ".extra"][value % 5]
        tensors[new] = t
    elif how == "base-copy":
        tensors["base_model.model.lm_head.base_layer.weight"] = torch.zeros(
            MODEL.vocab_size + value % 2, MODEL.hidden_size)


@FUZZ
@given(use_dora=st.booleans(), mutations=st.lists(st.tuples(
    st.integers(0, 100), st.sampled_from(["drop", "reshape", "flatten", "unsqueeze", "value",
                                          "rename", "base-copy"]), st.integers(0, 100)),
    max_size=2), bf16=st.booleans())
def test_dora_and_embedding_tensors(dora_dir, use_dora, mutations, bf16):
    """plan_adapter + check_weights (what registration runs) on a DoRA / embed_tokens /
    lm_head adapter with arbitrary tensor damage: success or a MetraleError, never
    another exception."""
    import torch
    from safetensors.torch import load_file, save_file

    write_lora(dora_dir, r=4, target_modules=DORA_TARGETS, use_dora=use_dora)
    path = dora_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    for which, how, value in mutations:
        if tensors:
            _mutate(tensors, which, how, value)
    save_file(tensors, path)

    def run():
        plan = plan_adapter(dora_dir, "x", MODEL, EXTRA_POOL)
        check_weights(plan, torch.bfloat16 if bf16 else torch.float32)

    _only_typed(run)
