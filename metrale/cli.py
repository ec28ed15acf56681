"""metrale's command line."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from metrale.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from metrale.errors import MetraleError
from metrale.model.default_model import default_model_dir
from metrale.server.client import add_adapters_parser
from metrale.server.listen import check_can_listen, require_ray
from metrale.server.serve import (
    add_engine_arguments,
    add_serve_arguments,
    parse_adapter_args,
    progress,
    serve,
)

# Imports inside the commands below pull in torch (seconds) or the server extra; kept there
# so that `metrale --help` and the `metrale adapters` HTTP client start at once.


def _model_config(args: argparse.Namespace):
    from metrale.config import ModelConfig

    return ModelConfig.from_dir(args.model or default_model_dir(progress=progress))


def _inspect(args: argparse.Namespace) -> int:
    from metrale.adapters.plan import plan_adapter
    from metrale.config import EXTRA_TARGETS, PoolConfig

    model = _model_config(args)
    plan = plan_adapter(args.adapter, "inspect", model,
                        PoolConfig(1, args.max_lora_rank, extra_targets=EXTRA_TARGETS))
    cfg = plan.config
    print(f"adapter   {args.adapter}")
    print(f"base      {model.model_type}, {model.num_layers} layers, hidden {model.hidden_size}")
    print(f"peft      r={cfg.r} alpha={cfg.lora_alpha} rslora={cfg.use_rslora} dora={cfg.use_dora} "
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


def _generate(args: argparse.Namespace) -> int:
    from metrale import LLM, SamplingParams

    adapters = parse_adapter_args(args.adapter)
    use = args.use or [None]
    if args.model is None:
        for name in use:
            if name in DEMO_ADAPTERS and name not in adapters:
                adapters[name] = str(demo_adapter_dir(name, progress=progress))
    llm = LLM(args.model, max_loras=max(len(adapters), 1), max_lora_rank=max(args.max_lora_rank, 16),
              device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              quantization=args.quantization, fp8_activations=args.fp8_activations)
    for name, path in adapters.items():
        llm.register_adapter(name, path)
    prompt = llm.chat_prompt(args.prompt) if args.chat else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    names = [None if n in (None, "base") else n for n in use]
    outputs = llm.generate([prompt] * len(names), [params] * len(names), names)
    for name, out in zip(names, outputs):
        if len(names) > 1:
            print(f"--- {name or 'base'} ---")
        print(out.text.strip())
    return 0


def _serve(args: argparse.Namespace) -> int:
    # the default model comes with the demo adapters (trained on first use), served on demand
    pinned = parse_adapter_args(args.adapter)
    demos = {n: demo_adapter_dir(n, progress=progress) for n in DEMO_ADAPTERS
             if n not in pinned} if args.model is None else {}
    if args.replicas is not None or args.ray_address is not None:
        if args.tensor_parallel_size != 1:
            raise MetraleError("--tensor-parallel-size runs one engine; it is not combined with "
                               "--replicas / --ray-address yet")
        require_ray()
        from metrale.cluster.launch import serve_cluster  # the `cluster` extra (Ray)

        if args.replicas is None:
            args.replicas = 1
        return serve_cluster(args, demos)
    return serve(args, demos)


# --- cluster (Ray Serve): `metrale serve --replicas N [--ray-address ADDR]` ------------------


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (Ray Serve; the `cluster` extra)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas on Ray Serve behind one ingress at --host/--port "
                        "(one GPU each with --device cuda; default: one engine, no Ray)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="attach to a running Ray cluster (e.g. 'auto' or ray://head:10001) "
                        "instead of starting a local one")
    g.add_argument("--ray-num-cpus", type=int, default=None, metavar="N",
                   help="CPUs of the local Ray started without --ray-address (default: all)")
    g.add_argument("--replica-threads", type=int, default=1, metavar="N",
                   help="torch threads (and Ray CPUs) per CPU replica (default: %(default)s)")
    g.add_argument("--router-epsilon", type=float, default=0.5,
                   help="adapter affinity may load a replica up to (1+epsilon) x the mean "
                        "(default: %(default)s)")
    g.add_argument("--router-spread-queue", type=int, default=8, metavar="N",
                   help="spread an adapter to another replica once each holder has N of its "
                        "requests in flight; 0 = never (default: %(default)s)")


def _peer_serve(args: argparse.Namespace) -> int:
    from metrale.dtypes import parse_dtype
    from metrale.peer.allow import LOOPBACK
    from metrale.peer.store import serve_store

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve_store(args.adapters, _model_config(args), device=args.device, dtype=parse_dtype(args.dtype),
                max_lora_rank=args.max_lora_rank, host=args.host, port=args.port,
                transport=args.transport, client_allow=args.allow_client or LOOPBACK,
                announce=lambda line: print(line, flush=True))
    return 0


def _peer_list(args: argparse.Namespace) -> int:
    from metrale.peer.listing import print_ids

    return print_ids(args.url)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="metrale", description="multi-LoRA inference engine")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="check a PEFT adapter against a base model")
    ins.add_argument("adapter", help="PEFT adapter directory")
    ins.add_argument("--model", help="Hugging Face model dir (default: embedded SmolLM2)")
    ins.add_argument("--max-lora-rank", type=int, default=64,
                     help="refuse adapters above this rank (default: %(default)s)")
    ins.set_defaults(func=_inspect)

    gen = sub.add_parser("generate", help="generate text, with or without adapters")
    gen.add_argument("--prompt", required=True, help="the prompt text (required)")
    gen.add_argument("--model", help="Hugging Face model dir (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                     help="register a PEFT adapter (repeatable)")
    gen.add_argument("--use", action="append", metavar="NAME",
                     help="run the prompt through this adapter ('base' = none); repeatable. "
                          "On the default model the demo adapters 'shout' and 'pirate' need no --adapter")
    gen.add_argument("--max-tokens", type=int, default=64,
                     help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature in [0, 2]; 0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus sampling mass in (0, 1] (default: %(default)s)")
    gen.add_argument("--seed", type=int, help="sampling seed, for reproducible output "
                                               "(default: none)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-lora-rank", type=int, default=16,
                     help="largest LoRA rank a slot holds (default: %(default)s)")
    add_engine_arguments(gen)
    gen.set_defaults(func=_generate)

    peer = sub.add_parser("peer", help="adapter peers: serve a directory of adapters to engines")
    peer_sub = peer.add_subparsers(dest="peer_command", required=True)
    ps = peer_sub.add_parser("serve", help="export every PEFT adapter of a directory over NIXL/HTTP")
    ps.add_argument("--adapters", required=True, metavar="DIR",
                    help="directory whose subdirs are PEFT adapters (adapter id = subdir name)")
    ps.add_argument("--model", help="Hugging Face model dir; only config.json is read "
                                    "(default: embedded SmolLM2)")
    ps.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="hold adapters in host memory (pinned when CUDA exists) or on the GPU "
                         "(default: %(default)s)")
    ps.add_argument("--dtype", default="float32",
                    help="storage dtype: float32, bfloat16 or float16; must equal the engines' "
                         "pool dtype for NIXL (HTTP converts) (default: %(default)s)")
    ps.add_argument("--max-lora-rank", type=int, default=None,
                    help="refuse adapters above this rank (default: the largest rank found)")
    ps.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    ps.add_argument("--port", type=int, default=7460,
                    help="port to listen on; 0 picks a free port (default: %(default)s)")
    ps.add_argument("--transport", default="auto", choices=["auto", "nixl", "http"],
                    help="data planes to offer: nixl, http, or auto = NIXL when installed, "
                         "plus HTTP (default: %(default)s)")
    ps.add_argument("--allow-client", action="append", metavar="NET",
                    help="address, network or host allowed to lease (repeatable; default loopback)")
    ps.set_defaults(func=_peer_serve)
    pl = peer_sub.add_parser("list", help="list the adapter ids a peer serves, with their peer:// source")
    pl.add_argument("--url", default="http://127.0.0.1:7460",
                    help="the peer's address, as printed by `metrale peer serve` (default: %(default)s)")
    pl.set_defaults(func=_peer_list)

    srv = sub.add_parser("serve", help="OpenAI-compatible server with runtime adapter management")
    add_serve_arguments(srv)
    add_cluster_arguments(srv)
    srv.set_defaults(func=_serve)
    add_adapters_parser(sub)  # `metrale adapters ...`: a client of a running server
    return p


# Commands that run torch here; the others are HTTP clients and must not import it.
_TORCH_COMMANDS = ("inspect", "generate", "serve")


# a Python spelling of a setting in an engine message: max_loras, max_lora_rank ...
_SNAKE = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every --flag of the parser and of its subcommands."""
    flags = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
    return flags


def cli_spelling(message: str, flags: set[str]) -> str:
    """The engine names its settings as Python does (they are LLM()'s arguments); a CLI
    user set them as flags: say those that are flags as flags."""
    def flag(m: re.Match) -> str:
        dashed = "--" + m[0].replace("_", "-")
        return dashed if dashed in flags else m[0]

    return _SNAKE.sub(flag, message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":  # a taken port: one line now, not after the model loaded
            check_can_listen(args.host, args.port)  # or Ray started
        if args.command in _TORCH_COMMANDS or getattr(args, "peer_command", None) == "serve":
            from metrale.threads import apply_threads

            progress(f"metrale: torch threads: {apply_threads().reason}")
        return args.func(args)
    except MetraleError as e:
        print(f"metrale: error: {cli_spelling(str(e), _flags(parser))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `metrale adapters list | head`: the reader left, which is no error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
