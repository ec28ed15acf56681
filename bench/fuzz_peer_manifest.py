"""Fuzz the peer manifest reader: N mutated manifests go through parse_manifest
and plan building, which is all an engine does with a peer's lease reply before
any byte moves. Each outcome is counted:

  accepted    the manifest was read and planned
  refused     a deliberate check raised a MetraleError
  wrapped     a plain exception inside a parser (TypeError, re.error...) that the
              safety net turned into PeerManifestError: typed, but a check is missing
  unexpected  anything else escaped: a bug (exit status 1)

    python bench/fuzz_peer_manifest.py --examples 100000 [--seed 0]

Seeds are manifests an exporter would send for a small Llama-shaped model (no
weights are needed: only the model's shapes and module paths matter here).
"""

from __future__ import annotations

import argparse
import base64
import collections
import copy
import math
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from metrale.config import LINEAR_MODULES, ModelConfig, PoolConfig  # noqa: E402
from metrale.errors import MetraleError  # noqa: E402
from metrale.peer.errors import PeerManifestError  # noqa: E402
from metrale.peer.exporter import peft_from_tables  # noqa: E402
from metrale.peer.manifest import manifest_plan, parse_manifest, read_reply  # noqa: E402
from metrale.peer.wire import WIRE_VERSION, Unrepresentable, encode_doc  # noqa: E402
from metrale.pool.layout import SlotLayout  # noqa: E402

SOURCE = "peer 10.0.0.1:7460 adapter 'a'"
LEASE = "fuzzlease0001"
MODEL = ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=16)
POOL = PoolConfig(max_loras=2, max_lora_rank=8)
LAYOUT = SlotLayout(MODEL, POOL, torch.float32)

FIELDS = ["version", "adapter_id", "name", "uid", "generation", "peft", "dtype", "tensors",
          "data_bytes", "transports", "layer", "module", "kind", "shape", "nbytes", "http", "nixl",
          "data_path", "ranges", "agent_metadata", "mem_type", "descs", "r", "lora_alpha",
          "target_modules", "rank_pattern", "alpha_pattern", "use_rslora", "layers_to_transform",
          "layers_pattern", "exclude_modules", "modules_to_save", "use_dora", "bias", "peft_type",
          "lora_bias"]
ATOMS = [0, 1, -1, 2, 3, 4, 8, 9, 64, 96, 2**31, 2**62, 2**63, 2**64, -2**63, 10**30, True, False,
         None, 0.5, 4.0, 1e308, -0.0, float("inf"), float("-inf"), float("nan"), "", "(", ")", "[",
         "*", "\\", "(.*)*x", "(a|a)*y", ".*.*.*.*.*x", ".*", ".*\\.(q_proj|v_proj)", "all-linear",
         "ALL-LINEAR", "q_proj", "down_proj", "lm_head", "embed_tokens", "A", "B", "F32", "F16",
         "BF16", "I32", "DRAM", "VRAM", "LORA", "none", "all", "a", "%%%", "x" * 300, "\x00",
         "\udc80", "model.layers.0.self_attn.q_proj", "layers", f"/peer/v1/leases/{LEASE}/data",
         "http://10.9.9.9/peer/v1/leases/fuzzlease0001/data", [], {}, [1], [4, 64], [[1, 2, 3]]]
REGEX_BITS = ["(", ")", "[", "]", "*", "+", "?", "{2,}", "|", ".", "\\", "^", "$", "(?:", "(?P<x>",
              "\\d", "q_proj", "layers", "\\.", "a"]


# --- seeds -------------------------------------------------------------------------------


def tensors_for(targets: dict[tuple[int, str], int]) -> list[dict]:
    out = []
    for layer, module in sorted(targets, key=lambda k: (k[0], LINEAR_MODULES.index(k[1]))):
        r = targets[(layer, module)]
        d_in, d_out = MODEL.linear_shape(module)
        for kind, cols in (("A", d_in), ("B", d_out)):
            out.append({"layer": layer, "module": module, "kind": kind, "shape": [r, cols],
                        "nbytes": r * cols * 4})
    return out


def manifest(peft: dict, targets: dict[tuple[int, str], int], nixl: bool) -> dict:
    tensors = tensors_for(targets)
    transports: dict = {"http": {"data_path": f"/peer/v1/leases/{LEASE}/data"}}
    if nixl:
        transports["nixl"] = {
            "agent_metadata": base64.b64encode(b"agent-metadata" * 8).decode(), "mem_type": "DRAM",
            "descs": [[(i + 1) << 20, t["nbytes"], 0] for i, t in enumerate(tensors)],
        }
    return {"version": WIRE_VERSION, "adapter_id": "a", "name": "a", "uid": 7, "generation": 3,
            "peft": peft,
            "dtype": "F32", "tensors": tensors, "data_bytes": sum(t["nbytes"] for t in tensors),
            "transports": transports}


def seeds() -> list[dict]:
    layers = range(MODEL.num_layers)
    names = {(layer, m): 4 for layer in (1, 2) for m in ("q_proj", "v_proj", "down_proj")}
    ranks = torch.zeros(MODEL.num_layers, len(LINEAR_MODULES), dtype=torch.int32)
    scales = torch.zeros(MODEL.num_layers, len(LINEAR_MODULES))
    for layer in layers:
        for m in range(len(LINEAR_MODULES)):
            ranks[layer, m], scales[layer, m] = 1 + (layer + m) % 8, 0.25 * (1 + m)
    tables = {(layer, mod): int(ranks[layer, m]) for layer in layers
              for m, mod in enumerate(LINEAR_MODULES)}
    regex = {(layer, m): (2 if m == "k_proj" else 4) for layer in layers for m in ("q_proj", "k_proj")}
    return [
        manifest({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                  "target_modules": ["q_proj", "v_proj", "down_proj"], "layers_to_transform": [1, 2],
                  "layers_pattern": "layers", "bias": "none"}, names, False),
        manifest(peft_from_tables(LAYOUT, ranks, scales), tables, True),
        manifest({"r": 4, "lora_alpha": 16, "use_rslora": True,
                  "target_modules": ".*\\.(q_proj|k_proj)", "rank_pattern": {"k_proj": 2},
                  "alpha_pattern": {"q_proj": 3.0}}, regex, True),
    ]


# --- mutations ---------------------------------------------------------------------------


def random_json(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if roll < 0.35:
        return copy.deepcopy(rng.choice(ATOMS))
    if roll < 0.5:
        return rng.choice([rng.randint(-10, 100), rng.randint(-2**70, 2**70), 1 << rng.randint(0, 80)])
    if roll < 0.6:
        return rng.choice([rng.uniform(-1e3, 1e3), rng.random() * 10.0 ** rng.randint(-300, 308)])
    if roll < 0.75:
        return random_regex(rng)
    if roll < 0.8 and depth == 0:
        return nest(rng.choice([5, 15, 16, 17, 100, 3000]))
    if depth >= 3:
        return None
    if roll < 0.9:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS + ["x", ""]): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def random_regex(rng: random.Random) -> str:
    return "".join(rng.choice(REGEX_BITS) for _ in range(rng.randint(1, 8)))


def nest(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def tweak(rng: random.Random, value: object) -> object:
    """A near miss of `value`: the mutations a sloppy or hostile exporter makes."""
    if type(value) is int:
        return rng.choice([value + 1, value - 1, value * 2, -value, 0, bool(value), float(value),
                           str(value), value + 2**63, [value]])
    if type(value) is float:
        near_int = int(value) if math.isfinite(value) else 0
        return rng.choice([value * 2, -value, float("nan"), float("inf"), near_int, str(value)])
    if type(value) is str:
        return rng.choice(["", value * 2, value + "(", "(" + value + ")*", value.upper(),
                           value + random_regex(rng), [value], value[: len(value) // 2]])
    if type(value) is list:
        out = list(value)
        if out:
            i = rng.randrange(len(out))
            rng.choice([lambda: out.pop(i), lambda: out.append(out[i]),
                        lambda: rng.shuffle(out), lambda: out.insert(i, random_json(rng))])()
        return out
    if type(value) is dict:
        out = dict(value)
        if out and rng.random() < 0.5:
            out.pop(rng.choice(list(out)))
        else:
            out[rng.choice(FIELDS)] = random_json(rng)
        return out
    return random_json(rng)


def spots(doc: object) -> list[tuple[object, object]]:
    """Every (container, key) of a JSON document."""
    out, stack = [], [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            out.append((node, key))
            stack.append(value)
    return out


def mutate(rng: random.Random, seed: dict) -> dict:
    doc = copy.deepcopy(seed)
    for _ in range(rng.randint(1, 4)):
        places = spots(doc)
        if not places:
            break
        container, key = rng.choice(places)
        op = rng.random()
        if op < 0.45:
            container[key] = tweak(rng, container[key])
        elif op < 0.8:
            container[key] = random_json(rng)
        elif op < 0.9:
            del container[key]
        elif isinstance(container, dict):
            container[rng.choice(FIELDS)] = random_json(rng)
        else:
            container.insert(key, random_json(rng))
    return doc


# --- the target --------------------------------------------------------------------------


def read(doc: object) -> None:
    """The document on the wire (protocol v3), read back, checked and planned. A tensor
    field the packed table cannot hold is refused as the engine never sees it."""
    try:
        raw = encode_doc({"lease": {"id": "fakelease0001", "expires_in_s": 30},
                          "manifest": doc if isinstance(doc, dict) else {}})
    except (Unrepresentable, TypeError, ValueError, RecursionError) as e:
        raise PeerManifestError(f"{SOURCE}: not representable on the wire: {e}") from None
    manifest = parse_manifest(read_reply(raw, SOURCE), LAYOUT, SOURCE)
    plan = manifest_plan(manifest, "a", manifest.peft_config(LAYOUT, SOURCE), MODEL, POOL, SOURCE)
    # An accepted plan must be one the pool can take as it is.
    for t in plan.targets:
        if not (0 < t.rank <= POOL.max_lora_rank and math.isfinite(t.scale)):
            raise AssertionError(f"accepted a bad target: {t}")
    if plan.data_bytes != manifest.data_bytes or len(plan.landings) != len(manifest.table):
        raise AssertionError("accepted a plan that does not cover the manifest's bytes")


def origin(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} at {Path(frame.filename).name}:{frame.lineno} {frame.name}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    bases = seeds()
    for base in bases:
        read(copy.deepcopy(base))  # every seed must be accepted, or the fuzz starts off-target
    counts: collections.Counter = collections.Counter()
    refused: collections.Counter = collections.Counter()
    wrapped: collections.Counter = collections.Counter()
    unexpected: collections.Counter = collections.Counter()
    slowest = (0.0, None)
    start = time.perf_counter()
    for i in range(args.examples):
        doc = mutate(rng, rng.choice(bases))
        t0 = time.perf_counter()
        try:
            read(doc)
            counts["accepted"] += 1
        except MetraleError as e:
            cause = e.__cause__
            if type(e) is PeerManifestError and cause is not None and not isinstance(cause, MetraleError):
                counts["wrapped"] += 1
                wrapped[origin(cause)] += 1
            else:
                counts["refused"] += 1
                refused[type(e).__name__] += 1
        except Exception as e:  # noqa: BLE001 - counting these is the point
            counts["unexpected"] += 1
            unexpected[origin(e)] += 1
        took = time.perf_counter() - t0
        if took > slowest[0]:
            slowest = (took, i)
        if (i + 1) % 20_000 == 0:
            print(f"  ... {i + 1} examples, {dict(counts)}", flush=True)
    elapsed = time.perf_counter() - start
    n = max(1, args.examples)
    print(f"fuzz_peer_manifest: {args.examples} examples (seed {args.seed}) in {elapsed:.1f}s, "
          f"{elapsed / n * 1e3:.2f} ms each, slowest {slowest[0] * 1e3:.1f} ms (example {slowest[1]})")
    for key in ("accepted", "refused", "wrapped", "unexpected"):
        print(f"  {key:<11}{counts[key]:>8}")
    for title, table in (("refused, by class", refused),
                         ("wrapped (typed only by the safety net), by origin", wrapped),
                         ("unexpected, by origin", unexpected)):
        if table:
            print(title + ":")
            for where, k in table.most_common(15):
                print(f"  {k:>8}  {where}")
    return 1 if counts["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
