"""metrale's command line."""

from __future__ import annotations

import argparse
import sys

from metrale.errors import MetraleError


def _inspect(args: argparse.Namespace) -> int:
    from metrale.adapters.plan import plan_adapter
    from metrale.config import ModelConfig, PoolConfig

    if args.model:
        model = ModelConfig.from_dir(args.model)
    else:
        from metrale.model.default_model import default_model_dir

        model = ModelConfig.from_dir(default_model_dir(progress=lambda m: print(m, file=sys.stderr)))
    plan = plan_adapter(args.adapter, "inspect", model, PoolConfig(1, args.max_lora_rank))
    cfg = plan.config
    print(f"adapter   {args.adapter}")
    print(f"base      {model.model_type}, {model.num_layers} layers, hidden {model.hidden_size}")
    print(f"peft      r={cfg.r} alpha={cfg.lora_alpha} rslora={cfg.use_rslora} "
          f"targets={cfg.target_modules!r}")
    print(f"bytes     {plan.data_bytes:,} in {len(plan.landings)} tensors")
    by_module: dict[str, list] = {}
    for t in plan.targets:
        by_module.setdefault(t.module, []).append(t)
    print(f"{'module':<10} {'layers':>6} {'ranks':>10} {'scales':>16}")
    for module, ts in by_module.items():
        ranks = sorted({t.rank for t in ts})
        scales = sorted({round(t.scale, 4) for t in ts})
        print(f"{module:<10} {len(ts):>6} {','.join(map(str, ranks)):>10} "
              f"{','.join(map(str, scales)):>16}")
    print("OK: this adapter can be served by this model")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="metrale", description="multi-LoRA inference engine")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="check a PEFT adapter against a base model")
    ins.add_argument("adapter", help="PEFT adapter directory")
    ins.add_argument("--model", help="Hugging Face model dir (default: embedded SmolLM2)")
    ins.add_argument("--max-lora-rank", type=int, default=64)
    ins.set_defaults(func=_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MetraleError as e:
        print(f"metrale: error: {e}", file=sys.stderr)
        return 2
