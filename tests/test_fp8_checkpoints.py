"""FP8 checkpoints in the formats users have (block-wise `fp8` with weight_scale_inv,
compressed-tensors float-quantized per tensor and per channel) load through the
dequantizing reference path: with weight-only activations, greedy tokens equal transformers
+ PEFT on the dequantized weights, for the base and for mixed adapters in one batch; with
dynamic FP8 activations (the default), they equal transformers + PEFT whose base linears see
each token's input rounded to e4m3 (fake_quantized, written here from the format), and the
dequantized reference's wherever its top-2 gap exceeds twice the logit error that rounding
causes. Other quantization configs are refused at start, naming the field.

The checkpoints are made here from a tiny random Llama: its linear weights quantized to
float8_e4m3fn with scales chosen per block / tensor / channel; the reference weights are
dequantized here, independently of metrale's loader."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from metrale import LLM, SamplingParams
from metrale.config import ConfigError
from tests.helpers.reference import assert_mixed_batch_matches, hf_greedy
from tests.helpers.tiny_models import make_adapter, make_model, save_model

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0
PROMPTS = [[5, 17, 99, 3, 42, 8], [61, 2, 9, 13, 200, 7, 1]]
GEN = 6


def quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_checkpoint(base, path, fmt: str):
    """Write base as an FP8 checkpoint of format fmt; returns the dequantized state dict."""
    save_model(base, path)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    tensors, dequantized = {}, {}
    for name, w in state.items():
        if not any(f".{m}." in name for m in LINEAR):
            tensors[name] = w.contiguous()
            dequantized[name] = w
            continue
        if fmt == "block":
            bo, bi = 16, 32  # blocks that do not divide every dimension (96 rows)
            rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
            scale = torch.empty(rows, cols)
            for i in range(rows):
                for j in range(cols):
                    scale[i, j] = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].abs().max() / FP8_MAX
            full = scale.repeat_interleave(bo, 0)[:w.shape[0]].repeat_interleave(bi, 1)[:, :w.shape[1]]
            tensors[name.replace("weight", "weight_scale_inv")] = scale
        elif fmt == "channel":
            full = w.abs().amax(1, keepdim=True) / FP8_MAX  # [out, 1]
            tensors[name.replace("weight", "weight_scale")] = full.clone()
            tensors[name.replace("weight", "input_scale")] = torch.tensor([0.5])  # ignored
        else:
            full = w.abs().max().reshape(1) / FP8_MAX
            tensors[name.replace("weight", "weight_scale")] = full.clone()
        q = quantize(w, full)
        tensors[name] = q
        dequantized[name] = q.to(torch.float32) * full
    (path / "model.safetensors").unlink()
    save_file(tensors, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    if fmt == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [16, 32]}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "tensor" if fmt == "tensor" else fmt,
                "symmetric": True, "dynamic": False}}}, "ignore": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.mark.parametrize("fmt", ["block", "tensor", "channel"])
def test_fp8_checkpoint_equals_transformers_peft_on_its_dequantized_weights(tmp_path, fmt):
    base = make_model("llama", seed=11)
    dequantized = fp8_checkpoint(base, tmp_path / "fp8", fmt)
    ref = copy.deepcopy(base)
    ref.load_state_dict(dequantized)
    assert not torch.equal(ref.model.layers[0].self_attn.q_proj.weight,
                           base.model.layers[0].self_attn.q_proj.weight)  # quantization shows
    adapters = {name: (make_adapter(ref, tmp_path / name, seed=seed, r=4, lora_alpha=8,
                                    target_modules="all-linear"), tmp_path / name)
                for name, seed in (("x", 3), ("y", 4))}
    assert_mixed_batch_matches(tmp_path / "fp8", ref, adapters, PROMPTS, GEN,
                               fp8_activations="weight-only")


X_BLOCK = 512  # columns per activation scale (metrale's documented block)


def fake_quantized(model):
    """A copy of model (plain or PEFT) whose base linears see each token's input, in blocks
    of X_BLOCK columns, divided by the block's max |x| / 448, cast to float8_e4m3fn and
    scaled back: FP8 dynamic activations. LoRA's own layers and lm_head see x as it is."""
    model = copy.deepcopy(model)

    def rounded(_, args):
        x = args[0]
        k = x.shape[-1]
        blocks = -(-k // X_BLOCK)
        xb = torch.nn.functional.pad(x, (0, blocks * X_BLOCK - k)).unflatten(-1, (blocks, X_BLOCK))
        s = (xb.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        xb = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s
        return (xb.flatten(-2)[..., :k],)

    for name, m in model.named_modules():
        parts = name.split(".")
        base = parts[-1] in LINEAR or (parts[-1] == "base_layer" and parts[-2] in LINEAR)
        if isinstance(m, torch.nn.Linear) and base and "lora_" not in name:
            m.register_forward_pre_hook(rounded)
    return model


def step_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the log-probs model gives each of tokens after the ones before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("fmt", ["tensor", "channel"])
def test_dynamic_fp8_activations_equal_peft_with_rounded_inputs(tmp_path, fmt):
    """The default mode. Tokens equal the fake-quantized reference's (ties under 1e-4 aside:
    the two differ in float32 summation order alone). Against the exact dequantized
    reference, every step of the engine's own sequence (teacher-forced, so one near-tie does
    not end the comparison): the engine's token is the reference's top-1 wherever its top-2
    log-prob gap exceeds 2x the activation error at that step, the largest log-prob change
    the rounding causes there (measured by transformers with and without it), since each of
    the two top log-probs moves by at most that much; half the steps at least are outside it
    (62-66% here: a tiny random model's top two log-probs lie close)."""
    ref, adapters = _fp8_with_plain_and_dora(tmp_path, fmt)
    rounded = {n: (fake_quantized(m), p) for n, (m, p) in adapters.items()}
    llm = assert_mixed_batch_matches(tmp_path / "fp8", fake_quantized(ref), rounded, PROMPTS, GEN,
                                     tie_gap=1e-4)
    proj = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert proj.fp8_dynamic and proj.weight.dtype == torch.float8_e4m3fn
    models = {None: ref, **{n: m for n, (m, _) in adapters.items()}}
    requests = [(p, a) for p in PROMPTS for a in models]
    outs = llm.generate([p for p, _ in requests],
                        SamplingParams(max_tokens=3 * GEN, temperature=0, ignore_eos=True),
                        [a for _, a in requests])
    compared = 0
    for (prompt, name), out in zip(requests, outs):
        tokens = list(out.token_ids)
        exact = step_logprobs(models[name], prompt, tokens)  # [3 GEN, V]
        error = (exact - step_logprobs(fake_quantized(models[name]), prompt, tokens)).abs()
        top2 = exact.topk(2, -1)
        outside = top2.values[:, 0] - top2.values[:, 1] > 2 * error.amax(-1)  # [3 GEN]
        assert error.amax() > 0  # the rounding reaches the log-probs
        assert top2.indices[outside, 0].tolist() == torch.tensor(tokens)[outside].tolist()
        compared += int(outside.sum())
    print(f"{compared} of {3 * GEN * len(requests)} steps outside the bound")
    assert compared >= 0.5 * 3 * GEN * len(requests)  # a tiny random model's top two lie close


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq'"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "load_in_8bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "bits 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor"}}}},
     "weights.num_bits 4"),
])
def test_other_quantization_configs_are_refused_naming_the_field(tmp_path, qc, field):
    base = make_model("llama", seed=11)
    save_model(base, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        LLM(tmp_path / "m", max_loras=1, max_lora_rank=4, max_model_len=64, block_size=4,
            num_kv_blocks=16)


def test_a_float8_weight_without_its_scale_is_refused(tmp_path):
    base = make_model("llama", seed=11)
    fp8_checkpoint(base, tmp_path / "m", "tensor")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="float8"):
        LLM(tmp_path / "m", max_loras=1, max_lora_rank=4, max_model_len=64, block_size=4,
            num_kv_blocks=16)


def test_quantization_fp8_rounds_a_dense_checkpoint_per_output_channel(tmp_path):
    """vLLM's --quantization fp8 on a bf16/fp32 checkpoint: each linear weight rounded to
    float8_e4m3fn with one scale per output row (computed here, not by metrale)."""
    base = make_model("llama", seed=12)
    save_model(base, tmp_path / "dense")
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for name, w in ref.named_parameters():
            if any(f".{m}." in name for m in LINEAR):
                scale = w.abs().amax(1, keepdim=True) / FP8_MAX
                w.copy_((w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale)
    adapter = make_adapter(ref, tmp_path / "x", seed=5, r=4, lora_alpha=8,
                           target_modules="all-linear")
    llm = LLM(tmp_path / "dense", max_loras=1, max_lora_rank=4, max_model_len=64, block_size=4,
              num_kv_blocks=64, quantization="fp8", fp8_activations="weight-only")
    llm.register_adapter("x", tmp_path / "x")
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        for model, name in ((ref, None), (adapter, "x")):
            want, _ = hf_greedy(model, prompt, GEN)
            assert list(llm.generate([prompt], params, name)[0].token_ids) == want
    for proj in (llm.engine.runner.model.layers[0].self_attn.qkv_proj,
                 llm.engine.runner.model.layers[1].mlp.down_proj):  # held in 8 bits
        assert proj.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(ConfigError, match="quantization 'int4'"):
        LLM(tmp_path / "dense", max_loras=0, quantization="int4")
    with pytest.raises(ConfigError, match="fp8_activations 'static'"):
        LLM(tmp_path / "dense", max_loras=0, quantization="fp8", fp8_activations="static")


def _fp8_with_plain_and_dora(tmp_path, fmt: str):
    """An FP8 checkpoint of format fmt at tmp_path/fp8, its dequantized reference model,
    and a plain and a DoRA adapter trained on that reference."""
    base = make_model("llama", seed=11)
    ref = copy.deepcopy(base)
    ref.load_state_dict(fp8_checkpoint(base, tmp_path / "fp8", fmt))
    adapters = {"plain": (make_adapter(ref, tmp_path / "plain", seed=3, r=4, lora_alpha=8,
                                       target_modules="all-linear"), tmp_path / "plain"),
                "dora": (make_adapter(ref, tmp_path / "dora", seed=4, r=4, lora_alpha=8,
                                      use_dora=True, target_modules="all-linear"),
                         tmp_path / "dora")}
    return ref, adapters


def _references(tmp_path, fmt: str, activations: str):
    """_fp8_with_plain_and_dora's models, fake-quantized where the engine rounds the
    activations (dynamic, per-row scales; block-scaled weights run weight-only: see
    metrale.ops.fp8_linear.runs_dynamic), and the tie gap to compare them with."""
    ref, adapters = _fp8_with_plain_and_dora(tmp_path, fmt)
    if activations != "dynamic" or fmt == "block":
        return ref, adapters, 0.0
    return (fake_quantized(ref), {n: (fake_quantized(m), p) for n, (m, p) in adapters.items()},
            1e-4)


@pytest.mark.parametrize("activations", ["weight-only", "dynamic"])
@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_fp8_gemm_kernel_in_the_engine_with_dora_and_plain_adapters(tmp_path, fmt, activations,
                                                                    monkeypatch):
    """The same checkpoints through the Triton FP8 GEMM (Triton's interpreter on CPU) and
    the LoRA kernels, a DoRA adapter (its norms read the dequantized FP8 weight) beside a
    plain one and the base in one batch; dynamic against the fake-quantized references
    (block-scaled weights: weight-only in either mode, against the exact ones)."""
    from metrale.ops import lora as lora_ops
    from tests.helpers.kernels import KERNELS
    if not KERNELS or torch.cuda.is_available():  # with CUDA: the gpu test runs them compiled
        pytest.skip("needs Triton's interpreter (a CPU-only box)")
    monkeypatch.setattr(lora_ops, "TRITON_ON_CPU", True)
    ref, adapters, tie = _references(tmp_path, fmt, activations)
    llm = assert_mixed_batch_matches(tmp_path / "fp8", ref, adapters, PROMPTS[:1], 4,
                                     tie_gap=tie, fp8_activations=activations)
    proj = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    assert proj.weight.dtype == torch.float8_e4m3fn
    assert proj.fp8_dynamic == (activations == "dynamic" and fmt != "block")


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["weight-only", "dynamic"])
@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_gpu_fp8_checkpoint_through_graphs_equals_peft(tmp_path, fmt, activations):
    """fp32 on CUDA (exact-fp32 dots): the compiled FP8 GEMM under captured graphs, plain
    and DoRA adapters beside the base, against transformers + PEFT on the CPU (dynamic:
    the fake-quantized references, ties under 1e-4 aside)."""
    ref, adapters, tie = _references(tmp_path, fmt, activations)
    llm = assert_mixed_batch_matches(tmp_path / "fp8", ref, adapters, PROMPTS, GEN, tie_gap=tie,
                                     device="cuda", dtype="float32", fp8_activations=activations)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
