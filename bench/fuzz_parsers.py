"""Fuzz the adapter parsers with seeded random inputs and count the outcomes.

    PYTHONPATH=. python bench/fuzz_parsers.py [--examples 100000] [--seed 0] [--targets a,b]

Every target makes one input from a random.Random and parses it. An outcome is
`accepted` (parsed), `refused` (a metrale.errors.MetraleError subclass: the typed
refusal the server maps to a 4xx) or `unexpected` (anything else: a bug, which the
server would turn into a 500). Prints the counts per target and the first
unexpected tracebacks; exits 1 if any input was unexpected.

--examples is per target. To fuzz another parser, append a FuzzTarget(name, make,
parse) to TARGETS: `make(rng)` returns an input, `parse(input)` parses it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from metrale.adapters import patterns
from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.plan import plan_from_tensors, resolve_targets
from metrale.adapters.safetensors_file import read_header
from metrale.config import ModelConfig, PoolConfig
from metrale.errors import MetraleError

MODEL = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
POOL = PoolConfig(max_loras=2, max_lora_rank=16)
BASE_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
               "bias": "none", "use_dora": False, "use_rslora": False}
FIELDS = ["r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
          "layers_to_transform", "layers_pattern", "exclude_modules", "modules_to_save", "use_dora",
          "bias", "fan_in_fan_out", "peft_type", "lora_bias", "use_qalora", "target_parameters",
          "trainable_token_indices", "layer_replication", "alora_invocation_tokens", "use_bdlora",
          "arrow_config", "init_lora_weights", "task_type", "unknown_field"]
STRINGS = ["q_proj", "v_proj", "down_proj", "model.layers.1.self_attn.q_proj", "layers", "all-linear",
           "lm_head", "embed_tokens", "none", "all", "LORA", "IA3", ".*", "(", ")", "[", "]", "{", "\\",
           "(a+)+$", r".*\.(q|v)_proj", "a{99999}", "(?x) q", "(?i)Q_PROJ", "[^\\d\\D]", "(?P<idx>x)",
           "\x00", "\ud800", "é", "q" * 2000, ""]
NUMBERS = [0, 1, -1, 4, 8, 8.0, 4.9, 16, 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30, 10 ** 400, -(10 ** 400),
           1e308, 1e-308, 5e-324, math.inf, -math.inf, math.nan, -0.0, 0.5, True, False]


def rand_json(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.55:
        kind = rng.randrange(5)
        if kind == 0:
            return rng.choice(NUMBERS)
        if kind == 1:
            return rng.choice(STRINGS)
        if kind == 2:
            return None
        if kind == 3:
            return rng.uniform(-1e6, 1e6) if rng.random() < 0.5 else rng.randint(-100, 100)
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(8)))
    if roll < 0.8:
        return [rand_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(STRINGS + FIELDS): rand_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def mutated_config(rng: random.Random) -> dict:
    cfg = dict(BASE_CONFIG)
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS)
        if rng.random() < 0.1:
            cfg.pop(field, None)
        else:
            cfg[field] = rand_json(rng)
    return cfg


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    out = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op, pos = rng.randrange(6), rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(pos, len(out) - 1)] = rng.randrange(256)
        elif op == 1:
            out[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif op == 2:
            del out[pos:pos + rng.randint(1, 8)]
        elif op == 3:
            out[pos:pos] = rng.choice([b"[", b"{", b"]", b"}", b'"', b"\\", b",", b":", b"NaN",
                                       b"1e999", b"-", b"\xff", b"\xc3"])
        elif op == 4:
            depth = rng.choice([10, 70, 5000, 200_000])
            out[pos:pos] = b"[" * depth + b"]" * depth * rng.randint(0, 1)
        else:
            del out[pos:]
    return bytes(out)


# --- targets ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzTarget:
    name: str
    make: Callable[[random.Random], Any]
    parse: Callable[[Any], Any]


class Files:
    """A scratch dir holding one valid adapter; targets overwrite its files."""

    def __init__(self) -> None:
        shm = Path("/dev/shm")
        self._tmp = tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None)
        self.dir = Path(self._tmp.name)
        self.config = self.dir / "adapter_config.json"
        self.weights = self.dir / "adapter_model.safetensors"
        gen = torch.Generator().manual_seed(0)
        tensors = {}
        for layer in range(MODEL.num_layers):
            for module in ("q_proj", "v_proj"):
                d_in, d_out = MODEL.linear_shape(module)
                prefix = f"base_model.model.{MODEL.module_path(layer, module)}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, d_in, generator=gen)
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, 4, generator=gen)
        save_file(tensors, self.weights, metadata={"format": "pt"})
        raw = self.weights.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        self.file = raw
        self.header = json.loads(raw[8:8 + n])
        self.data = raw[8 + n:]


FILES: Files | None = None


def files() -> Files:
    global FILES
    if FILES is None:
        FILES = Files()
    return FILES


def parse_config_dict(cfg: dict) -> Any:
    return resolve_targets(PeftAdapterConfig.from_dict(cfg), MODEL, POOL)


def make_config_bytes(rng: random.Random) -> bytes:
    raw = json.dumps(mutated_config(rng) if rng.random() < 0.5 else BASE_CONFIG).encode()
    return mutate_bytes(rng, raw) if rng.random() < 0.8 else raw


def parse_config_bytes(raw: bytes) -> Any:
    f = files()
    f.config.write_bytes(raw)
    return resolve_targets(PeftAdapterConfig.from_dir(f.dir), MODEL, POOL)


def make_header(rng: random.Random) -> bytes:
    f = files()
    header = json.loads(json.dumps(f.header))
    names = sorted(header)
    for _ in range(rng.randint(1, 3)):
        op, name = rng.randrange(5), rng.choice(names)
        if op == 0:
            key = rng.choice(["dtype", "shape", "data_offsets", "extra"])
            if isinstance(header.get(name), dict):
                header[name][key] = rand_json(rng)
        elif op == 1:
            header[name] = rand_json(rng)
        elif op == 2:
            header.pop(name, None)
        elif op == 3:
            header[rng.choice(STRINGS + ["__metadata__"])] = rand_json(rng)
        elif isinstance(header.get(name), dict):  # plausible but lying numbers
            header[name]["data_offsets"] = [rng.randrange(-2, 9000), rng.randrange(-2, 9000)]
    text = json.dumps(header).encode() if rng.random() < 0.9 else json.dumps(rand_json(rng)).encode()
    length = len(text)
    if rng.random() < 0.2:
        length = rng.choice([0, length - 1, length + 1, 2 ** 64 - 1, 2 ** 40, 100 * 2 ** 20 + 1])
    data = f.data[:len(f.data) - rng.choice([0, 0, 0, 1, 64])]
    return struct.pack("<Q", max(0, min(length, 2 ** 64 - 1))) + text + data


def parse_safetensors(raw: bytes) -> Any:
    f = files()
    f.weights.write_bytes(raw)
    header = read_header(f.weights)
    cfg = PeftAdapterConfig.from_dict(BASE_CONFIG)
    return plan_from_tensors("x", cfg, str(f.weights), header.tensors.values(), header.data_bytes,
                             MODEL, POOL, header.data_start)


def make_safetensors_bytes(rng: random.Random) -> bytes:
    if rng.random() < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    return mutate_bytes(rng, files().file)


TARGETS: list[FuzzTarget] = [
    FuzzTarget("peft_config.from_dict", mutated_config, parse_config_dict),
    FuzzTarget("adapter_config.json", make_config_bytes, parse_config_bytes),
    FuzzTarget("safetensors header", make_header, parse_safetensors),
    FuzzTarget("safetensors bytes", make_safetensors_bytes, parse_safetensors),
]


# --- runner -------------------------------------------------------------------------------


def run_target(target: FuzzTarget, examples: int, seed: int, show: int) -> Counter:
    rng = random.Random(f"{seed}:{target.name}")
    counts: Counter = Counter()
    shown = 0
    for _ in range(examples):
        value = target.make(rng)
        try:
            target.parse(value)
            counts["accepted"] += 1
        except MetraleError:
            counts["refused"] += 1
        except BaseException as e:  # noqa: BLE001 - the point is to catch everything
            if isinstance(e, KeyboardInterrupt):
                raise
            counts["unexpected"] += 1
            counts[f"unexpected:{type(e).__name__}"] += 1
            if shown < show:
                shown += 1
                print(f"--- {target.name}: unexpected {type(e).__name__} on {repr(value)[:300]}")
                traceback.print_exc()
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=100_000, help="inputs per target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default="", help="comma-separated target names (default: all)")
    ap.add_argument("--match-budget", type=float, default=0.05,
                    help="seconds of regex matching per input (the engine's default is "
                         f"{patterns.MATCH_BUDGET_S}); keeps a pathological draw cheap")
    ap.add_argument("--show", type=int, default=3, help="unexpected tracebacks to print per target")
    args = ap.parse_args()
    patterns.MATCH_BUDGET_S = args.match_budget
    wanted = {t for t in args.targets.split(",") if t}
    unknown = wanted - {t.name for t in TARGETS}
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)}; known: {[t.name for t in TARGETS]}")
    warnings.simplefilter("ignore")  # re's FutureWarnings on odd sets, once per pattern
    total: Counter = Counter()
    for target in TARGETS:
        if wanted and target.name not in wanted:
            continue
        start = time.perf_counter()
        counts = run_target(target, args.examples, args.seed, args.show)
        total.update(counts)
        print(f"{target.name:24s} accepted={counts['accepted']:7d} refused={counts['refused']:7d} "
              f"unexpected={counts['unexpected']:5d}  ({time.perf_counter() - start:.1f} s)"
              + "".join(f" {k}={v}" for k, v in sorted(counts.items()) if k.startswith("unexpected:")),
              flush=True)
    print(f"{'total':24s} accepted={total['accepted']:7d} refused={total['refused']:7d} "
          f"unexpected={total['unexpected']:5d}")
    return 1 if total["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
