"""CPU time of the CPU LoRA reference (lora_apply_fused_ref) at the default model's decode
shapes (SmolLM2-135M, r=16), this tree against another commit's copy of the file, 1 thread;
and the largest difference of their outputs (0.0: bit-identical).

    git show REV:metrale/ops/lora_ref.py > /tmp/lora_ref_old.py
    PYTHONPATH=. python bench/lora_ref_micro.py /tmp/lora_ref_old.py
"""

from __future__ import annotations

import importlib.util
import sys
import time

import torch

from metrale.ops import lora_ref as new

S, R, REPS = 2, 16, 2000
# (name, output widths of the modules sharing x, input width)
MODULES = (("qkv", [576, 192, 192], 576), ("gate_up", [1536, 1536], 576),
           ("down", [576], 1536), ("o", [576], 576))
BATCHES = (("b8 one", [0] * 8), ("b8 two", [0, 1] * 4), ("b1", [0]))


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("lora_ref_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(old, outs: list[int], width: int, ids: list[int]) -> tuple[dict[str, float], float]:
    As = [torch.randn(S, R, width) for _ in outs]
    Bts = [torch.randn(S, R, o) for o in outs]
    slices, start = [], 0
    for o in outs:
        slices.append(slice(start, start + o))
        start += o
    scales = [torch.full((S,), 2.0) for _ in outs]
    ranks = [torch.full((S,), R, dtype=torch.int64) for _ in outs]
    x, y = torch.randn(len(ids), width), torch.zeros(len(ids), start)
    groups, slot_ids = new.token_groups(ids), torch.tensor(ids)

    def call(module, y):
        module.lora_apply_fused_ref(y, x, As, Bts, slices, slot_ids, scales, ranks, groups=groups)

    us = {}
    for name, module in (("old", old), ("new", new)):
        scratch = y.clone()
        for _ in range(50):
            call(module, scratch)
        t0 = time.process_time()
        for _ in range(REPS):
            call(module, scratch)
        us[name] = (time.process_time() - t0) / REPS * 1e6
    y_old, y_new = y.clone(), y.clone()
    call(old, y_old)
    call(new, y_new)
    return us, float((y_old - y_new).abs().max())


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    old = load_old(sys.argv[1])
    for label, outs, width in MODULES:
        for batch, ids in BATCHES:
            us, diff = case(old, outs, width, ids)
            print(f"{label:8} {batch:7} old {us['old']:7.1f} us  new {us['new']:7.1f} us  "
                  f"x{us['old'] / us['new']:.2f}  max diff {diff:.1e}")


if __name__ == "__main__":
    main()
