"""Decode throughput: our engine (CUDA graphs) with no adapter, one adapter, 32 distinct
adapters, against transformers + PEFT mixed-adapter `generate`, and the HBM roofline.

    PYTHONPATH=. python bench/decode.py [--model llama3-8b] [--batch 32 64]

JSON `decode[<model>]`: per batch size base_tok_s, lora1_tok_s, lora32_tok_s,
peft_mixed32_tok_s (batch 32 only), hbm_roofline_tok_s, and the inputs of the roofline.
tok/s = generated tokens / wall time of the decode steps (prefill excluded), engine
overhead (scheduling, sampling, the per-step host sync) included.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    adapter_dir,
    build_pair,
    copy_bandwidth,
    make_peft,
    merge_results,
    results_path,
    sync,
    table,
)
from metrale.config import EngineConfig, PoolConfig, SchedulerConfig
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.sampling_params import SamplingParams

PROMPT, GEN = 128, 64


def make_engine(pair, device: str, max_loras: int, max_num_seqs: int = 64, max_model_len: int = 512,
                host_tier_bytes: int = 0, enforce_eager: bool = False,
                scheduler: SchedulerConfig | None = None,
                max_num_batched_tokens: int | None = None) -> LLMEngine:
    blocks = max_num_seqs * max_model_len // 16
    cfg = EngineConfig(
        pool=PoolConfig(max_loras, 16, host_tier_bytes=host_tier_bytes), device=device,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        max_model_len=max_model_len, block_size=16, num_kv_blocks=blocks,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens or max_num_seqs * PROMPT,
        enable_prefix_caching=False, enforce_eager=enforce_eager,
        scheduler=scheduler or SchedulerConfig(),
    )
    return LLMEngine(pair.model_dir, cfg, model=pair.ours)


def prompts(n: int, vocab: int, seed: int = 0, length: int = PROMPT) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def engine_tok_s(engine: LLMEngine, names: list[str | None], device: str, gen: int = GEN) -> float:
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    for p, name in zip(prompts(len(names), engine.model_config.vocab_size), names):
        engine.add_request(p, params, adapter=name)
    while any(not s.output_ids for s in engine.requests.values()):
        engine.step()  # prefill (and any promotion) outside the timed region
    sync(device)
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    sync(device)
    return tokens / (time.perf_counter() - t0)


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


def roofline_tok_s(pair, batch: int, ctx: float, bw: float) -> tuple[float, float]:
    """(tok/s, bytes per step): every weight read once per step (the embedding table only
    where it doubles as lm_head) plus each sequence's K/V at mean context ctx."""
    cfg, m = pair.config, pair.ours
    weights = sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                  if cfg.tie_word_embeddings or not n.startswith("embed_tokens"))
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
    for b in batches:
        row = {
            "base_tok_s": engine_tok_s(engine, [None] * b, device, gen),
            "lora1_tok_s": engine_tok_s(engine, ["a0"] * b, device, gen),
            f"lora{n_adapters}_tok_s": engine_tok_s(
                engine, [f"a{i % n_adapters}" for i in range(b)], device, gen),
        }
        tok_s, step_bytes = roofline_tok_s(pair, b, PROMPT + gen / 2, bw)
        row.update(hbm_roofline_tok_s=tok_s, step_bytes=step_bytes)
        if peft is not None and b == 32:
            row[f"peft_mixed{n_adapters}_tok_s"] = peft_mixed_tok_s(peft, b, n_adapters, vocab,
                                                                    device)
        out[f"batch{b}"] = row
    if engine.runner.graphs is not None:
        out["graph_replays"] = engine.runner.graphs.num_replays
        out["graph_captures"] = engine.runner.graphs.num_captures
    return out


def report(name: str, res: dict) -> str:
    rows = []
    for key, row in res.items():
        if key.startswith("batch"):
            r = {"model": name, "batch": key[5:], **{k: v for k, v in row.items() if k != "step_bytes"}}
            base, roof = row["base_tok_s"], row["hbm_roofline_tok_s"]
            r["lora32/base"] = row.get("lora32_tok_s", float("nan")) / base
            r["base/roof"] = base / roof
            if "peft_mixed32_tok_s" in row:
                r["lora32/peft"] = row["lora32_tok_s"] / row["peft_mixed32_tok_s"]
            rows.append(r)
    cols = ["model", "batch", "base_tok_s", "lora1_tok_s", "lora32_tok_s", "peft_mixed32_tok_s",
            "hbm_roofline_tok_s", "lora32/base", "base/roof", "lora32/peft"]
    return table(rows, cols)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-peft", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_pair(args.model, args.device, Path(tmp))
        peft = make_peft(pair, 32, Path(tmp) / "adapters")
        res = run(pair, Path(tmp) / "adapters", None if args.no_peft else peft, args.device,
                  tuple(args.batch))
    merge_results(results_path(args.device), "decode", args.model, res)
    print(report(args.model, res))


if __name__ == "__main__":
    main()
