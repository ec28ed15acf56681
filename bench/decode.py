"""Decode throughput: our engine (CUDA graphs) with no adapter, one adapter, 32 distinct
adapters, against transformers + PEFT mixed-adapter `generate`, and the HBM roofline.

    PYTHONPATH=. python bench/decode.py [--model llama3-8b] [--batch 32 64] [--mixed]

--model NAME-fp8 (llama3-8b-fp8, llama3-70b-fp8): the base's projections in FP8 with a
scale per output row (metrale.ops.fp8_linear, activations per --fp8-activations: dynamic
per-token FP8 by default; the 70B shape is built FP8 from the start with random weights and
random adapters, no PEFT baseline); its roofline counts the FP8 bytes and the scales.
--model NAME-awq / -gptq / -nf4 (llama3-8b, llama3-70b): 4-bit projections with random
codes built that way (metrale.ops.int4_linear:
AWQ group 128 with zero points, GPTQ the same plus act order, NF4 blocks of 64 with float32
absmax); the roofline counts the packed codes, scales and zero points. --model
qwen3-30b-a3b (tiny-moe on the CPU): a MoE shape built with random weights, adapters on
attention, experts and routers (target_parameters), engines with --lora-experts; its
roofline counts of each MoE layer's experts the mean number the base run's last decode
step routed to (base_experts_routed_per_layer; lora1_ and lora32_ the same for those runs),
and the adapter bytes of an expert module only the (slot, expert) slices routed.

JSON `decode[<model>]`: per batch size base_tok_s, lora1_tok_s, lora32_tok_s,
peft_mixed32_tok_s (batch 32 only), hbm_roofline_tok_s, and the inputs of the roofline;
per mode (base, lora1, lora32) the median step wall time (*_step_ms) and on CUDA the
step's graph replayed alone (*_graph_ms; batches over 64 run eagerly: nan), so
base_host_share is the host's part of a step and base_graph_over_roofline the GPU's own
distance from the HBM floor; for lora1/lora32 the adapter bytes a step reads
(*_lora_bytes_per_step: every slot the batch touches, an expert module's routed
slices), the ratio to the byte bound base_tok_s * step_bytes / (step_bytes + lora bytes)
(*_over_byte_bound) and the share of a step that is LoRA (*_lora_share). --kernels adds
kernel_table: bench/lora_kernels.py's rows for this model's groups at 1, 32, 64 and 256
tokens.

--mixed adds JSON `decode_mixed[<model>]`: adapter kinds mixed per token in one batch of 32
distinct adapters, on one engine started with --lora-extra-targets embed_tokens,lm_head:
plain32_tok_s (all plain LoRA), dora8_tok_s (24 plain + 8 DoRA: a quarter DoRA),
kinds_tok_s (16 plain + 8 DoRA + 8 embed_tokens/lm_head LoRA), the ratios
dora8_over_plain32 and kinds_over_plain32 (target: >= 0.9), and plain32_noextra_tok_s
(all plain on an engine without extra-target memory: what the opt-in costs plain batches).
tok/s = generated tokens / wall time of the decode steps (prefill excluded), engine
overhead (scheduling, sampling, the per-step host sync) included.

--structured adds JSON `decode_structured[<model>]` (run_structured): a batch
of --structured-batch (32) requests over 16 adapters, half of them constrained by a JSON
schema, against the same batch unconstrained: structured_tok_s, plain_tok_s, their
ratio structured_over_plain (target: >= 0.9) and the median step times. The model gets
a synthetic tokenizer of its vocabulary size (bench/synthetic_tokenizer.py).
"""

from __future__ import annotations

import argparse
import importlib
import math
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.adapter_kinds import dora_variant, embedding_variant
from bench.common import (
    adapter_dir,
    build_any,
    copy_bandwidth,
    make_peft,
    median,
    merge_results,
    results_path,
    sync,
    table,
    write_random_adapters,
)
from bench.synthetic_tokenizer import save_synthetic_tokenizer
from metrale.config import EXPERT_MODULES, EngineConfig, PoolConfig, SchedulerConfig
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.structured import StructuredOutput
from metrale.model.moe import MoeMLP
from metrale.ops import lora_launch
from metrale.ops.fp8_linear import ACTIVATIONS, DEFAULT_ACTIVATIONS

PROMPT, GEN = 128, 64


def make_engine(pair, device: str, max_loras: int, max_num_seqs: int = 64, max_model_len: int = 512,
                host_tier_bytes: int = 0, enforce_eager: bool = False,
                scheduler: SchedulerConfig | None = None,
                max_num_batched_tokens: int | None = None,
                lora_extra_targets: tuple[str, ...] = (), tokenizer=None) -> LLMEngine:
    blocks = max_num_seqs * max_model_len // 16
    cfg = EngineConfig(
        lora_extra_targets=lora_extra_targets, lora_experts=pair.config.moe is not None,
        pool=PoolConfig(max_loras, 16, host_tier_bytes=host_tier_bytes), device=device,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        max_model_len=max_model_len, block_size=16, num_kv_blocks=blocks,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens or max_num_seqs * PROMPT,
        enable_prefix_caching=False, enforce_eager=enforce_eager,
        scheduler=scheduler or SchedulerConfig(),
    )
    return LLMEngine(pair.model_dir, cfg, tokenizer=tokenizer, model=pair.ours)


def prompts(n: int, vocab: int, seed: int = 0, length: int = PROMPT) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def decode_run(engine: LLMEngine, names: list[str | None], device: str,
               gen: int = GEN) -> tuple[float, float]:
    """(tok/s, median step wall ms) of decoding `names` (one request each) to gen tokens."""
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    for p, name in zip(prompts(len(names), engine.model_config.vocab_size), names):
        engine.add_request(p, params, adapter=name)
    while any(not s.output_ids for s in engine.requests.values()):
        engine.step()  # prefill (and any promotion) outside the timed region
    sync(device)
    t0, tokens, steps = time.perf_counter(), 0, []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        tokens += len(engine.step())  # the step returns after its host sync
        steps.append((time.perf_counter() - t) * 1e3)
    sync(device)
    return tokens / (time.perf_counter() - t0), median(steps)


def engine_tok_s(engine: LLMEngine, names: list[str | None], device: str, gen: int = GEN) -> float:
    return decode_run(engine, names, device, gen)[0]


def graph_replay_ms(engine: LLMEngine, replays_before: int, reps: int = 50) -> float:
    """GPU time of the latest decode step's CUDA graph replayed alone (its static inputs
    hold that step's batch): the step's wall time minus this is the host's share.
    replays_before: the graphs' replay count before the run (none since: it ran eagerly)."""
    graphs = engine.runner.graphs
    if graphs is None or graphs.num_replays == replays_before or graphs.last_key[0] == "mixed":
        return float("nan")  # enforce_eager, or the batch ran eagerly (past the largest graph)
    graph, _ = graphs.graphs[graphs.last_key]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps



def peft_mixed_tok_s(peft, batch: int, n_adapters: int, vocab: int, device: str,
                     new_tokens: int = 4) -> float:
    """Decode rate of PEFT generate with a different adapter per row: the difference of a
    1-token and a (1+new_tokens)-token generate (same prompts) removes the prefill."""
    ids = torch.tensor(prompts(batch, vocab), device=device)
    names = [f"a{i % n_adapters}" for i in range(batch)]

    def gen(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    gen(1)  # warm-up
    t1, tn = gen(1), gen(1 + new_tokens)
    return batch * new_tokens / max(tn - t1, 1e-9)


def routed_experts(model) -> float:
    """The mean number of experts a MoE layer read in the model's last forward (each
    MoeMLP counts its routed pairs per expert, inside CUDA graphs too): read right after a
    decode run, the last decode step's."""
    layers = [m for m in model.modules() if isinstance(m, MoeMLP)]
    return sum(int((m.expert_counts > 0).sum()) for m in layers) / len(layers)


def lora_step_bytes(layout, used_slots: int, expert_slices: float) -> float:
    """Adapter bytes a decode step reads: every used slot's regions, except that of a
    stacked expert module only the (slot, expert) slices the step routes to count
    (expert_slices per MoE layer)."""
    total = 0.0
    for (_, module, _), region in layout.regions.items():
        nbytes = region.rows * region.cols * layout.dtype.itemsize
        if module in EXPERT_MODULES:
            total += nbytes / layout.model.moe.num_experts * expert_slices
        else:
            total += nbytes * used_slots
    return total


def roofline_tok_s(pair, batch: int, ctx: float, bw: float,
                   routed: float | None = None) -> tuple[float, float]:
    """(tok/s, bytes per step): every weight read once per step (the embedding table only
    where it doubles as lm_head; of a MoE layer's experts the `routed` a step reads, on
    average) plus each sequence's K/V at mean context ctx."""
    cfg, m = pair.config, pair.ours
    weights = sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                  if (cfg.tie_word_embeddings or not n.startswith("embed_tokens"))
                  and ".experts_" not in n)
    if cfg.moe is not None:
        per_expert = sum(p[0].numel() * p.element_size() for n, p in m.named_parameters()
                         if ".experts_" in n) // len(cfg.moe.layers)
        weights += (cfg.moe.num_experts if routed is None else routed) * per_expert * len(cfg.moe.layers)
    weights += sum(b.numel() * b.element_size() for n, b in m.named_buffers()
                   if n.endswith(("weight_scale", "weight_zero")))  # a quantized base's scales
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * ctx * batch
    step = weights + kv
    return batch / (step / bw), step


def run(pair, adapters_root: Path, peft, device: str, batches=(32, 64), n_adapters: int = 32,
        gen: int = GEN, engine: LLMEngine | None = None) -> dict:
    engine = engine or make_engine(pair, device, n_adapters + 1, max(batches))
    for i in range(n_adapters):
        engine.swap_lora_slot_from_disk(adapter_dir(adapters_root, i), f"a{i}", i)
    bw = copy_bandwidth(device)
    vocab = pair.config.vocab_size
    engine_tok_s(engine, [None] * 2, device, gen=4)  # warm-up: prefill kernels compile
    out = {"copy_bw_GBs": bw / 1e9, "prompt": PROMPT, "gen": gen,
           "graphs": engine.runner.graphs is not None}
    layout = engine.runner.pool.layout
    for b in batches:
        row = {}
        for key, names in (("base", [None] * b), ("lora1", ["a0"] * b),
                           (f"lora{n_adapters}", [f"a{i % n_adapters}" for i in range(b)])):
            graphs = engine.runner.graphs
            before = graphs.num_replays if graphs is not None else 0
            row[f"{key}_tok_s"], row[f"{key}_step_ms"] = decode_run(engine, names, device, gen)
            if pair.config.moe is not None:
                row[f"{key}_experts_routed_per_layer"] = routed_experts(pair.ours)
            if device.startswith("cuda"):
                row[f"{key}_graph_ms"] = graph_replay_ms(engine, before)
                row[f"{key}_graph"] = str(graphs.last_key if graphs is not None else None)
            if engine.async_scheduling and key != "lora1":  # A/B: the same engine, steps synchronous
                engine.async_scheduling = False
                row[f"{key}_sync_tok_s"], row[f"{key}_sync_step_ms"] = decode_run(
                    engine, names, device, gen)
                engine.async_scheduling = True
        tok_s, step_bytes = roofline_tok_s(pair, b, PROMPT + gen / 2, bw,
                                           row.get("base_experts_routed_per_layer"))
        row.update(hbm_roofline_tok_s=tok_s, step_bytes=step_bytes)
        # the byte bound of a LoRA batch: base speed scaled by the step's bytes over the
        # step's bytes plus the adapters' (every slot a batch touches is read once a step;
        # of an expert module, the (slot, expert) slices routed: with one adapter the
        # experts the run routed to, with a distinct adapter per row each row's top_k)
        top_k = pair.config.moe.top_k if pair.config.moe is not None else 0
        for key, used in (("lora1", 1), (f"lora{n_adapters}", min(b, n_adapters))):
            slices = (row.get("lora1_experts_routed_per_layer", 0.0) if used == 1
                      else b * top_k if b <= n_adapters else math.nan)
            lora_bytes = lora_step_bytes(layout, used, slices)
            bound = row["base_tok_s"] * step_bytes / (step_bytes + lora_bytes)
            row[f"{key}_lora_bytes_per_step"] = lora_bytes
            row[f"{key}_over_byte_bound"] = row[f"{key}_tok_s"] / bound
            # the share of a LoRA step that is not the base step: (1/lora - 1/base) / (1/lora)
            row[f"{key}_lora_share"] = 1 - row[f"{key}_tok_s"] / row["base_tok_s"]
        if device.startswith("cuda"):
            row["base_host_share"] = 1 - row["base_graph_ms"] / row["base_step_ms"]
            row["base_graph_over_roofline"] = (step_bytes / bw * 1e3) / row["base_graph_ms"]
        if peft is not None and b == 32:
            row[f"peft_mixed{n_adapters}_tok_s"] = peft_mixed_tok_s(peft, b, n_adapters, vocab,
                                                                    device)
        out[f"batch{b}"] = row
    if engine.runner.graphs is not None:
        out["graph_replays"] = engine.runner.graphs.num_replays
        out["graph_captures"] = engine.runner.graphs.num_captures
    return out


def run_mixed(pair, adapters_root: Path, device: str, batch: int = 32, gen: int = GEN) -> dict:
    """Plain LoRA only against batches mixing in DoRA and embed_tokens/lm_head adapters
    (a{i}: plain; d{i}: DoRA variants of a{i}; e{i}: embedding/lm_head variants)."""
    kinds = adapters_root / "kinds"
    base_weights = pair.ours.lora_base_weights()
    for i in range(8):
        dora_variant(adapter_dir(adapters_root, 16 + i), kinds / f"d{i}", base_weights, seed=i)
        embedding_variant(adapter_dir(adapters_root, 24 + i), kinds / f"e{i}", pair.config, seed=i)
    extra = ("embed_tokens", "lm_head")
    engine = make_engine(pair, device, 49, batch, lora_extra_targets=extra)
    slot = 0
    for i in range(32):
        engine.swap_lora_slot_from_disk(adapter_dir(adapters_root, i), f"a{i}", slot)
        slot += 1
    for kind in "de":
        for i in range(8):
            engine.swap_lora_slot_from_disk(kinds / f"{kind}{i}", f"{kind}{i}", slot)
            slot += 1
    engine_tok_s(engine, [None] * 2, device, gen=4)  # warm-up
    plain = [f"a{i}" for i in range(32)]
    dora8 = plain[:24] + [f"d{i}" for i in range(8)]
    kinds_mix = plain[:16] + [f"d{i}" for i in range(8)] + [f"e{i}" for i in range(8)]
    pick = lambda names: [names[i % len(names)] for i in range(batch)]  # noqa: E731
    out = {"batch": batch, "gen": gen}
    mixes = (("plain32_tok_s", plain), ("dora8_tok_s", dora8), ("kinds_tok_s", kinds_mix))
    for _, names in mixes:  # warm-up: Triton compiles the DoRA / embedding paths on first use
        engine_tok_s(engine, pick(names), device, gen=4)
    for key, names in mixes:
        out[key] = engine_tok_s(engine, pick(names), device, gen)
    out["dora8_over_plain32"] = out["dora8_tok_s"] / out["plain32_tok_s"]
    out["kinds_over_plain32"] = out["kinds_tok_s"] / out["plain32_tok_s"]
    del engine
    plain_engine = make_engine(pair, device, 33, batch)
    for i in range(32):
        plain_engine.swap_lora_slot_from_disk(adapter_dir(adapters_root, i), f"a{i}", i)
    engine_tok_s(plain_engine, [None] * 2, device, gen=4)
    out["plain32_noextra_tok_s"] = engine_tok_s(plain_engine, pick(plain), device, gen)
    return out


# A schema no answer can complete within the bench's tokens (the summary's 1000
# characters need more than GEN tokens of at most 8): every constrained row decodes to
# the end, so both runs decode the same number of tokens a step.
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "summary": {"type": "string", "minLength": 1000},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}, "required": ["summary", "tags"]}


def mixed_decode_run(engine: LLMEngine, rows: list[tuple[str | None, SamplingParams]],
                     device: str) -> tuple[float, float, int]:
    """decode_run with a SamplingParams per request: (tok/s, median step wall ms, tokens
    decoded in the timed steps)."""
    for p, (name, params) in zip(prompts(len(rows), engine.model_config.vocab_size), rows):
        engine.add_request(p, params, adapter=name)
    while any(not s.output_ids for s in engine.requests.values()):
        engine.step()
    sync(device)
    t0, tokens, steps = time.perf_counter(), 0, []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
        steps.append((time.perf_counter() - t) * 1e3)
    sync(device)
    return tokens / (time.perf_counter() - t0), median(steps), tokens


def run_structured(pair, adapters_root: Path, tokenizer_dir: Path, device: str, batch: int = 32,
                   n_adapters: int = 16, gen: int = GEN) -> dict:
    """A batch over n_adapters adapters, every other request constrained by
    STRUCTURED_SCHEMA, against the same batch unconstrained, on one engine (CUDA graphs
    on a GPU; the sampler applies the masks after the graph's replay)."""
    tokenizer = save_synthetic_tokenizer(tokenizer_dir, pair.config.vocab_size)
    engine = make_engine(pair, device, n_adapters + 1, batch, tokenizer=tokenizer)
    for i in range(n_adapters):
        engine.swap_lora_slot_from_disk(adapter_dir(adapters_root, i), f"a{i}", i)
    plain = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    schema = replace(plain, structured=StructuredOutput.json_schema(STRUCTURED_SCHEMA))
    names = [f"a{i % n_adapters}" for i in range(batch)]
    mixed = [(name, schema if i % 2 else plain) for i, name in enumerate(names)]
    unconstrained = [(name, plain) for name in names]
    mixed_decode_run(engine, mixed[:4], device)  # warm-up: compiles, the grammar's tables
    mixed_decode_run(engine, unconstrained[:4], device)
    out = {"batch": batch, "adapters": n_adapters, "gen": gen, "constrained": batch // 2,
           "graphs": engine.runner.graphs is not None, "async": engine.async_scheduling}
    before = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
    for key, rows in (("plain", unconstrained), ("structured", mixed)):
        out[f"{key}_tok_s"], out[f"{key}_step_ms"], out[f"{key}_tokens"] = \
            mixed_decode_run(engine, rows, device)
    out["structured_over_plain"] = out["structured_tok_s"] / out["plain_tok_s"]
    if engine.runner.graphs is not None:
        out["graph_replays"] = engine.runner.graphs.num_replays - before
    return out


KERNEL_TOKENS = (1, 32, 64, 256)


def kernel_table(pair, n_slots: int = 32, rank: int = 16) -> list[dict]:
    """bench/lora_kernels.py's rows for this model's four groups (r=16, n_slots slots) at
    KERNEL_TOKENS: us per group (alone and beside its base GEMM) against the byte floor."""
    from bench import lora_kernels

    cfg = pair.config

    def group(*modules: str) -> tuple[int, list[int]]:
        shapes = [cfg.linear_shape(m) for m in modules]  # (in, out) each
        return shapes[0][0], [out for _, out in shapes]

    shapes = {"qkv": group("q_proj", "k_proj", "v_proj"), "o": group("o_proj"),
              "gate_up": group("gate_proj", "up_proj"), "down": group("down_proj")}
    return lora_kernels.run(n_slots, rank, torch.bfloat16, tuple(shapes), KERNEL_TOKENS,
                            shapes=shapes)


def report(name: str, res: dict) -> str:
    rows, many = [], "lora32"
    for key, row in res.items():
        if key.startswith("batch"):
            many = next((k[:-len("_tok_s")] for k in row if k.startswith("lora") and k.endswith("_tok_s")
                         and k not in ("lora1_tok_s",) and "sync" not in k), many)
            r = {"model": name, "batch": key[5:], **{k: v for k, v in row.items() if k != "step_bytes"}}
            base, roof = row["base_tok_s"], row["hbm_roofline_tok_s"]
            r[f"{many}/base"] = row.get(f"{many}_tok_s", float("nan")) / base
            r["lora1/base"] = row["lora1_tok_s"] / base
            r[f"{many}/bound"] = row.get(f"{many}_over_byte_bound", float("nan"))
            r["base/roof"] = base / roof
            r["host share"] = row.get("base_host_share", float("nan"))
            r["base async/sync"] = base / row.get("base_sync_tok_s", float("nan"))
            if "peft_mixed32_tok_s" in row:
                r["lora32/peft"] = row["lora32_tok_s"] / row["peft_mixed32_tok_s"]
            rows.append(r)
    cols = ["model", "batch", "base_tok_s", "lora1_tok_s", f"{many}_tok_s", "peft_mixed32_tok_s",
            "hbm_roofline_tok_s", f"{many}/base", "lora1/base", f"{many}/bound", "base/roof",
            "host share", "base async/sync", "lora32/peft"]
    return table(rows, cols)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64, 256])
    ap.add_argument("--kernels", action="store_true",
                    help="also the LoRA kernel table (decode[model].kernel_table)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-peft", action="store_true",
                    help="no PEFT baseline: the adapters are random files written directly")
    ap.add_argument("--adapters", type=int, default=32,
                    help="distinct adapters of the lora<N> runs (keys lora<N>_*)")
    ap.add_argument("--mixed", action="store_true",
                    help="also: plain LoRA vs DoRA and embed/lm_head LoRA mixed in one batch")
    ap.add_argument("--only-mixed", action="store_true", help="only the --mixed runs")
    ap.add_argument("--structured", action="store_true",
                    help="also: half a batch constrained by a JSON schema vs the batch unconstrained")
    ap.add_argument("--only-structured", action="store_true", help="only the --structured run")
    ap.add_argument("--structured-batch", type=int, default=32)
    ap.add_argument("--gen", type=int, default=GEN, help="tokens decoded per request (--structured)")
    ap.add_argument("--override", metavar="MODULE.NAME=INT", action="append", default=[],
                    help="A/B a tuning constant or switch, e.g. metrale.ops.lora_triton.DECODE_MAX_T=16, "
                         "metrale.ops.lora_triton.OVERLAP=0 (the LoRA shrink on the GEMM's stream), "
                         "metrale.ops.fused_triton.ENABLED=0 (torch norms, rotary, SiLU-mul): "
                         "results go to decode_ab[model][override]")
    ap.add_argument("--fp8-activations", choices=ACTIVATIONS, default=DEFAULT_ACTIVATIONS,
                    help="an -fp8 model's GEMM inputs; other than the default: results go to "
                         "decode_ab")
    ap.add_argument("--lora-path", choices=lora_launch.PATHS, default=None,
                    help="run every LoRA group on this path instead of lora_launch.PATH_TABLE's "
                         "choice per shape (an A/B of the table): results go to decode_ab")
    args = ap.parse_args()
    for o in args.override:
        target, value = o.split("=")
        module, name = target.rsplit(".", 1)
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"{module} has no {name}")
        setattr(mod, name, int(value))
    if args.lora_path:
        lora_launch.PATH_TABLE = (lora_launch.PathRule(args.lora_path),)
        args.override.append(f"lora-path={args.lora_path}")
    if args.fp8_activations != DEFAULT_ACTIVATIONS:
        args.override.append(f"fp8-activations={args.fp8_activations}")
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_any(args.model, args.device, Path(tmp), args.fp8_activations)
        n = max(args.adapters, 32)  # the --mixed runs use 32
        if pair.hf is not None and not args.no_peft:
            peft = make_peft(pair, n, Path(tmp) / "adapters")
        else:  # no PEFT baseline (or a base built only quantized): adapters written directly
            peft = None
            write_random_adapters(pair, n, Path(tmp) / "adapters")
        if args.structured or args.only_structured:
            res = run_structured(pair, Path(tmp) / "adapters", Path(tmp) / "tokenizer", args.device,
                                 batch=args.structured_batch, gen=args.gen)
            merge_results(results_path(args.device), "decode_structured", args.model, res)
            print(table([{"model": args.model, **res}], ["model", *res]))
            if args.only_structured:
                return
        if not args.only_mixed:
            res = run(pair, Path(tmp) / "adapters", peft, args.device, tuple(args.batch),
                      n_adapters=args.adapters)
            if args.kernels:
                res["kernel_table"] = kernel_table(pair)
            if args.override:
                merge_results(results_path(args.device), "decode_ab",
                              f"{args.model} {' '.join(args.override)}", res)
            else:
                merge_results(results_path(args.device), "decode", args.model, res, keep=True)
            print(report(args.model, res))
        if args.mixed or args.only_mixed:
            mixed = run_mixed(pair, Path(tmp) / "adapters", args.device)
            merge_results(results_path(args.device), "decode_mixed", args.model, mixed)
            print(table([{"model": args.model, **mixed}], ["model", *mixed]))


if __name__ == "__main__":
    main()
