"""Shared benchmark helpers: random-weight models built on the device (no checkpoint),
the matching transformers model from the same state dict, PEFT adapters, device
ceilings and the results file.

    build_pair("llama3-8b", "cuda")  -> Pair(model_dir, ours, hf)

The HF model is initialised randomly (transformers' own init, std 0.02) on the device,
and our model is filled from its state dict through the same fusing the checkpoint
loader does, so the two compute the same function.
"""

from __future__ import annotations

import datetime
import functools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.results_json import merge_results  # noqa: F401  (re-exported: the benches import it here)
from metrale.config import MOE_MODULES, MOE_PARAMS, ModelConfig
from metrale.model.layers import LoraProjection
from metrale.model.llama import LlamaForCausalLM
from metrale.model.loader import build_computed, copy_weight, param_name
from metrale.ops import int4_linear
from metrale.ops.fp8_linear import DEFAULT_ACTIVATIONS, FP8_DTYPE, quantize_rows

CONFIGS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                      tie_word_embeddings=False),
    # built only quantized (llama3-70b-fp8, -awq): 141 GB in bf16 does not fit one H200
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                       tie_word_embeddings=False),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=8192, tie_word_embeddings=True),
    # built only (random weights, no transformers twin): 61 GB in bf16; experts read as routed
    "qwen3-30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=8192, tie_word_embeddings=False),
    "gemma2-9b": dict(arch="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                      num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      max_position_embeddings=8192, tie_word_embeddings=True),
    # CPU smoke runs of the benchmark code itself
    "tiny-moe": dict(arch="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 tie_word_embeddings=False),
}
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear")
BUILT_ONLY = ("llama3-70b", "qwen3-30b-a3b", "tiny-moe")  # no transformers twin


def hf_config(name: str):
    """The transformers config of a CONFIGS entry (Llama unless it names its arch)."""
    import transformers

    kw = dict(CONFIGS[name])
    arch = kw.pop("arch", "llama")
    cls = {"llama": transformers.LlamaConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "gemma2": transformers.Gemma2Config}[arch]
    return cls(**kw)


@dataclass
class Pair:
    name: str
    model_dir: Path
    config: ModelConfig
    ours: LlamaForCausalLM
    hf: object | None  # transformers LlamaForCausalLM; None for a base built only as FP8


INT4 = {  # bench name suffix -> how the random 4-bit projections are held
    "awq": int4_linear.Int4Layout(128, torch.float16, zero=True, codebook=False, act_order=False),
    "gptq": int4_linear.Int4Layout(128, torch.float16, zero=True, codebook=False, act_order=True),
    "nf4": int4_linear.Int4Layout(64, torch.float32, zero=False, codebook=True, act_order=False),
}
NF4_CODES = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                          0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])


def build_any(name: str, device: str, workdir: Path,
              fp8_activations: str = DEFAULT_ACTIVATIONS) -> Pair:
    """build_pair(name); "<name>-fp8": its projections rounded to FP8 per output row after
    (--quantization fp8's rounding), or, for a shape that does not fit in bf16, built FP8
    with random weights and no transformers twin (build_random_quant); "<name>-awq",
    "-gptq" (act order), "-nf4": 4-bit projections with random codes (build_random_quant).
    fp8_activations: the FP8 GEMMs' mode (metrale.ops.fp8_linear.ACTIVATIONS)."""
    if name in BUILT_ONLY:
        return build_random_quant(name, None, device, workdir)
    base, _, quant = name.rpartition("-")
    if quant in INT4 or (quant == "fp8" and base in BUILT_ONLY):
        return build_random_quant(base, quant, device, workdir, fp8_activations=fp8_activations)
    if quant != "fp8":
        return build_pair(name, device, workdir)
    pair = build_pair(base, device, workdir)
    for m in pair.ours.modules():
        if isinstance(m, LoraProjection):
            q, scale = quantize_rows(m.weight)
            m.use_fp8((1, q.shape[1]), fp8_activations)
            with torch.no_grad():
                m.weight.copy_(q)
                m.weight_scale.copy_(scale)
    return Pair(name, pair.model_dir, pair.config, pair.ours, pair.hf)


def build_random_quant(name: str, quant: str | None, device: str, workdir: Path,
                       max_positions: int = 16384,
                       fp8_activations: str = DEFAULT_ACTIVATIONS) -> Pair:
    """Our model alone, projections quantized from the start when quant is given (never a
    bf16 copy in memory), weights about N(0, 0.02) (transformers' init std): FP8 codes of
    N(0, 1) scaled by 0.02 per row; 4-bit: uniform codes, zero points 8 and scales 0.005,
    or NF4 codes under an absmax of 0.05; GPTQ act order a random column permutation.
    Embeddings and the rest N(0, 0.02), norms 1."""
    model_dir = workdir / (f"{name}-{quant}" if quant else name)
    hf_config(name).save_pretrained(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        ours = LlamaForCausalLM(cfg, max_positions)
    for m in ours.modules():
        if isinstance(m, LoraProjection) and quant is not None:
            if quant == "fp8":
                m.use_fp8((1, m.in_features), fp8_activations)
            else:
                m.use_int4(INT4[quant])
    ours = ours.to_empty(device=device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # make_engine's
    torch.manual_seed(0)
    with torch.no_grad():
        for pname, p in ours.named_parameters():
            if p.dtype == FP8_DTYPE:
                for rows in p.split(4096):  # bounded scratch
                    rows.copy_(torch.randn(rows.shape, device=device).to(FP8_DTYPE))
            elif p.dtype == torch.int32:  # 8 uniform 4-bit codes a word
                for rows in p.split(4096):
                    rows.copy_(torch.randint(-2**31, 2**31 - 1, rows.shape, device=device,
                                             dtype=torch.int32))
            elif pname.endswith("norm.weight"):
                p.data = torch.ones_like(p, dtype=dtype)
            else:
                p.data = (torch.randn_like(p) * 0.02).to(dtype)
        for m in ours.modules():
            if isinstance(m, LoraProjection) and quant is not None:
                m.weight_scale.fill_(0.02 if quant == "fp8" else 0.05 if quant == "nf4" else 0.005)
                if m.weight_zero is not None:
                    m.weight_zero.fill_(8)
                if m.codebook is not None:
                    m.codebook.copy_(NF4_CODES)
                if m.input_perm is not None:
                    m.input_perm.copy_(torch.randperm(m.in_features, device=device))
    ours.eval()
    build_computed(ours)
    return Pair(model_dir.name, model_dir, cfg, ours, None)


def write_random_adapters(pair: Pair, n: int, out_dir: Path, dtype=torch.bfloat16) -> None:
    """LORA-shaped adapters in PEFT's file layout without a transformers model (a base built
    only quantized): a0 random, a1..a{n-1} links to it (speed depends on the slots read, not
    on their values)."""
    from safetensors.torch import save_file

    cfg, r = pair.config, LORA["r"]
    torch.manual_seed(1)
    tensors, modules, parameters = {}, set(), set()
    for layer in range(cfg.num_layers):
        for module in cfg.layer_modules(layer):  # a MoE layer: attention, experts, router
            d_in, d_out = cfg.linear_shape(module)
            rows = r * cfg.module_rows(module)
            path = cfg.module_path(layer, module)
            if module in MOE_MODULES:  # PEFT nests gate_up's wrapper inside down's
                parameters.add(f"mlp.{'gate' if module == 'router' else 'experts'}."
                               f"{MOE_PARAMS[module]}")
                path += ".base_layer" if module == "experts_gate_up" else ""
            else:
                modules.add(module)
            key = f"base_model.model.{path}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rows, d_in) / d_in ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, rows) * 0.01).to(dtype)
    a0 = adapter_dir(out_dir, 0)
    a0.mkdir(parents=True)
    save_file(tensors, a0 / "adapter_model.safetensors")
    (a0 / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": LORA["lora_alpha"],
        "target_modules": sorted(modules), "target_parameters": sorted(parameters)}))
    for i in range(1, n):
        adapter_dir(out_dir, i).symlink_to(a0, target_is_directory=True)


def build_pair(name: str, device: str, workdir: Path, dtype=None,
               max_positions: int = 16384) -> Pair:
    import transformers

    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    hf_cfg = hf_config(name)
    model_dir = workdir / name
    hf_cfg.save_pretrained(model_dir)  # config.json: what the engine reads
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        ours = LlamaForCausalLM(cfg, max_positions)
    ours = ours.to_empty(device=device)
    params = dict(ours.named_parameters())
    for key, tensor in hf.state_dict().items():
        target, shard = param_name(key)
        if target is None or (target == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        copy_weight(params[target], tensor, target, shard, cfg)
    ours.to(dtype).eval()
    ours.rotary.build()  # float32 tables
    return Pair(name, model_dir, cfg, ours, hf)


def make_peft(pair: Pair, n: int, out_dir: Path, dtype=None):
    """Wrap pair.hf with n random r=16 all-linear adapters a0..a{n-1} (in pool dtype, so
    PEFT's baseline does its LoRA math in bf16 too) and save them: out_dir/a{i}/.
    Also saves a0 as PEFT writes it by default (fp32) to out_dir/fp32/a0."""
    from peft import LoraConfig, get_peft_model

    dtype = dtype or next(pair.ours.parameters()).dtype
    cfg = LoraConfig(init_lora_weights=False, **LORA)
    torch.manual_seed(1)
    peft = get_peft_model(pair.hf, cfg, adapter_name="a0")
    for i in range(1, n):
        peft.add_adapter(f"a{i}", cfg)
    peft.save_pretrained(out_dir / "fp32", selected_adapters=["a0"])
    with torch.no_grad():
        for pname, p in peft.named_parameters():
            if "lora_" in pname:
                p.data = p.data.to(dtype)
    peft.save_pretrained(out_dir, selected_adapters=[f"a{i}" for i in range(n)])
    peft.eval()
    return peft


def adapter_dir(out_dir: Path, i: int) -> Path:
    """Where PEFT saved adapter a{i} (its non-default adapters go into subfolders)."""
    return out_dir / f"a{i}"


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int = 5, warmup: int = 1) -> list[float]:
    """Wall-clock ms of fn() with the device synchronized around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(xs) -> float:
    return float(statistics.median(xs))


def pct(xs, p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return float(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))])


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    if not device.startswith("cuda"):
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    ms = median(timed(lambda: b.copy_(a), device, reps=10, warmup=2))
    return nbytes / (ms / 1e3)


def graph_us(fn, reps: int = 20) -> float:
    """GPU time of fn per call: `reps` calls captured in one CUDA graph (as the engine runs
    them), so Python launch overhead is out of the figure; the median of Triton's
    do_bench over replays."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and cache descriptors before capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / reps


def sweep_configs(gemm, configs) -> dict:
    """Time gemm(config=c) (common.graph_us) for each config c the device can hold;
    {best_us, best_config} of the fastest, the top few printed."""
    import dataclasses

    import triton

    timed = []
    for c in configs:
        try:
            timed.append((graph_us(functools.partial(gemm, config=c)), dataclasses.astuple(c)))
        except triton.runtime.errors.OutOfResources:
            continue
    timed.sort()
    print("  top:", [(round(us, 1), c) for us, c in timed[:5]], flush=True)
    return {"best_us": timed[0][0], "best_config": str(timed[0][1])}


def h2d_ms(nbytes: int, device: str) -> float:
    """Pinned host -> device copy of nbytes (median ms)."""
    if not device.startswith("cuda"):
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return median(timed(lambda: dev.copy_(host, non_blocking=True), device, reps=10, warmup=2))


def gpu_tag(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "_").lower()


def results_path(device: str, root: Path | None = None) -> Path:
    root = root or Path(__file__).resolve().parent / "results"
    return root / f"{datetime.date.today():%Y%m%d}-{gpu_tag(device)}.json"


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
