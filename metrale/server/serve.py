"""`metrale serve`: build the engine from command-line arguments and run uvicorn.

With no arguments it serves the embedded default model on 127.0.0.1:8000, with the adapters
its caller registers unpinned (`metrale serve`: the demo adapters; promoted on first use).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from metrale.adapters.fetch_deadline import FetchLimits
from metrale.config import (
    EVICTION_POLICIES,
    FP8_ACTIVATIONS,
    ConfigError,
    SchedulerConfig,
    check_extra_targets,
)
from metrale.model.default_model import cache_root, default_model_dir
from metrale.server.settings import ServerSettings, is_loopback
from metrale.server.tool_formats import FAMILIES as TOOL_FAMILIES

# The engine, fastapi and uvicorn are imported where they are used:
# they cost seconds (torch) or are the optional `server` extra, and the CLI imports this
# module for its argument parser.


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_adapter_args(values: list[str]) -> dict[str, str]:
    out = {}
    for item in values:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"metrale: --adapter expects NAME=DIR, got {item!r}")
        out[name] = path
    return out


def default_adapter_root() -> Path:
    """Where the default run (no --model, no --adapter-root) lets clients load adapters by
    path from: <metrale cache>/adapter-root, created if missing."""
    root = cache_root() / "adapter-root"
    root.mkdir(parents=True, exist_ok=True)
    return root


def model_and_adapter_roots(args: argparse.Namespace) -> tuple[Path, list[Path]]:
    """The model dir (--model, else the embedded default) and the checked --adapter-root
    dirs; the default model alone gets default_adapter_root()."""
    model_dir = Path(default_model_dir(progress=progress) if args.model is None else args.model)
    adapter_roots = [Path(r) for r in args.adapter_root]
    if args.model is None and not adapter_roots:  # `make run`: loading by path works out of the box
        adapter_roots = [default_adapter_root()]
        print(f"metrale: adapters can be loaded by path from {adapter_roots[0]} "
              "(--adapter-root DIR to choose)", flush=True)
    for root in adapter_roots:
        if not root.is_dir():
            raise SystemExit(f"metrale: --adapter-root {str(root)!r} is not a directory")
    return model_dir, adapter_roots


def curl_example(base_url: str, model: str, api_key: str | None = None,
                 key_from_env: bool = False) -> str:
    """A chat request to paste into a shell. api_key: the key the server was started with,
    written as $METRALE_API_KEY when it came from there (the shell that started the server
    has it), else as itself (it was typed on this command line already)."""
    body = {"model": model,
            "messages": [{"role": "user", "content": "Tell me about the moon."}],
            "max_tokens": 48, "temperature": 0}
    auth = ""
    if api_key is not None:
        auth = (' -H "Authorization: Bearer $METRALE_API_KEY"' if key_from_env
                else f" -H {shlex.quote(f'Authorization: Bearer {api_key}')}")
    return (f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(json.dumps(body))}")


def build_app(args: argparse.Namespace, on_demand: dict[str, Path] | None = None):
    """(app, settings, adapter names) for the parsed `serve` arguments; no socket yet.
    on_demand: adapters registered unpinned at start-up (a --adapter of the same name wins)."""
    from metrale.engine.llm import LLM
    from metrale.server.app import create_app
    from metrale.server.async_engine import AsyncEngine

    pinned = parse_adapter_args(args.adapter)
    unpinned = {n: p for n, p in (on_demand or {}).items() if n not in pinned}
    model_dir, adapter_roots = model_and_adapter_roots(args)
    # Runtime swaps are switched off only after the start-up adapters have landed:
    # --no-runtime-swaps freezes the pool as configured, it must not forbid configuring it.
    llm = LLM(model_dir, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
              host_tier_bytes=args.host_tier_bytes, adapter_eviction=args.adapter_eviction,
              device=args.device, dtype=args.dtype, allow_runtime_swaps=True,
              max_model_len=args.max_model_len, promotion_timeout_s=args.promotion_timeout,
              quantization=args.quantization, fp8_activations=args.fp8_activations,
              peer_allow=tuple(args.peer_allow), peer_transport=args.peer_transport,
              peer_timeout_s=args.peer_timeout, lora_extra_targets=args.lora_extra_targets,
              lora_experts=args.lora_experts, tensor_parallel_size=args.tensor_parallel_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              scheduler=SchedulerConfig(
                  max_prefill_chunk=args.max_prefill_chunk,
                  max_prefill_attention=args.max_prefill_attention,
                  max_tokens_beside_decodes=args.max_tokens_beside_decodes or None,
                  step_time_ratio=args.step_time_ratio or None,
                  prompt_drain_s=args.prompt_drain,
                  max_admission_wait_s=args.max_admission_wait,
                  max_promotions_in_flight=args.max_promotions_in_flight),
              **({"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}))
    engine = llm.engine
    for name, path in unpinned.items():
        # without runtime swaps an unpinned adapter could never become resident
        engine.register_adapter(name, path, pinned=args.no_runtime_swaps)
    for name, path in pinned.items():
        engine.register_adapter(name, path, pinned=True)
    if args.no_runtime_swaps:
        engine.lora.disable_runtime_swaps()

    settings = ServerSettings(**settings_fields(args, model_dir.name, adapter_roots))
    async_engine = AsyncEngine(engine, on_fatal=_exit_on_engine_failure)
    if args.peer_export_port is not None:
        server = async_engine.export(args.host, args.peer_export_port, tuple(args.peer_allow),
                                     args.peer_transport)
        print(f"metrale: exporting resident adapters to peers at {server.url}", flush=True)
    return create_app(async_engine, settings), settings, list(pinned) + list(unpinned)


def settings_fields(args: argparse.Namespace, model_id: str, adapter_roots) -> dict:
    """ServerSettings' fields from `serve`'s arguments (the keys may come from the environment)."""
    return dict(model_id=model_id, host=args.host,
                api_key=args.api_key or os.environ.get("METRALE_API_KEY") or None,
                admin_key=args.admin_key or os.environ.get("METRALE_ADMIN_KEY") or None,
                adapter_roots=tuple(adapter_roots), max_tokens_limit=args.max_tokens_limit,
                adapter_sources=tuple(args.adapter_source),
                adapter_cache_dir=str(args.adapter_cache_dir or cache_root() / "adapter-cache"),
                adapter_cache_bytes=args.adapter_cache_bytes,
                adapter_fetch=FetchLimits(args.adapter_fetch_timeout, args.adapter_fetch_min_rate,
                                          args.adapter_fetch_workers),
                public_metrics=args.public_metrics, public_docs=args.public_docs,
                tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser)


def _exit_on_engine_failure(error: BaseException) -> None:
    """The engine loop itself failed (a bug or a device error, never one request's fault):
    exit non-zero so a supervisor restarts the server, instead of answering 503 forever."""
    print(f"metrale: the engine loop failed ({error!r}); exiting with status 70", file=sys.stderr,
          flush=True)
    os._exit(70)


def serve(args: argparse.Namespace, on_demand: dict[str, Path] | None = None) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app, settings, names = build_app(args, on_demand)
    host = f"[{args.host}]" if ":" in args.host else args.host
    base_url = f"http://{host}:{args.port}"
    example = "shout" if "shout" in names else (names[0] if names else settings.model_id)
    print(f"metrale: serving {settings.model_id} with adapters {names or 'none'} at {base_url}/v1",
          flush=True)
    curl = curl_example(base_url, example, settings.api_key, key_from_env=not args.api_key)
    print(f"metrale: try\n  {curl}", flush=True)
    if settings.admin_open_to_network:
        print("metrale: WARNING: listening beyond loopback without --admin-key: adapter "
              "management endpoints are disabled", flush=True)
    if not is_loopback(args.host) and settings.api_key is None:
        print("metrale: WARNING: listening beyond loopback without --api-key: anyone who can "
              "reach this port can generate", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=10)
    return 0


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--max-model-len, --device, --dtype and --quantization, shared by `serve` and `generate`."""
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="most tokens per sequence, prompt plus output (default: %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="torch device to run on: cpu, cuda or cuda:N (default: %(default)s)")
    # no argparse choices: parse_dtype also takes the aliases fp32, bf16, fp16 and half
    p.add_argument("--dtype", default=None,
                   help="weights and KV-cache dtype: float32, bfloat16 or float16 (default: "
                        "bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: round a dense checkpoint's linear weights to FP8 per output "
                        "channel as they load (an FP8 checkpoint is read as it is either way)")
    p.add_argument("--fp8-activations", choices=FP8_ACTIVATIONS, default=FP8_ACTIVATIONS[0],
                   help="an FP8 base's GEMM inputs: dynamic rounds the activations to FP8, a "
                        "scale per 512 columns of a token (fast on Hopper); weight-only keeps "
                        "them in --dtype, exactly the dequantized base (default: %(default)s)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the base and the adapters over N ranks, one process each (one "
                        "GPU each with --device cuda; gloo between CPU processes) "
                        "(default: %(default)s)")
    p.add_argument("--model", help="Hugging Face model dir (default: embedded SmolLM2-135M-Instruct "
                                   "with the demo adapters 'shout' and 'pirate')")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="serve a PEFT adapter, pinned in a slot from start-up (repeatable); "
                        "DIR may be peer://HOST:PORT/ADAPTER_ID")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="allow loading adapters by path at run time, only inside DIR (repeatable; "
                        "default: none, or <metrale cache>/adapter-root when serving the "
                        "embedded default model)")
    p.add_argument("--adapter-source", action="append", default=[],
                   metavar="DIR|s3://BUCKET/PREFIX|hf://ORG",
                   help="look up an adapter a request names before anyone registered it as the "
                        "PEFT directory DIR/NAME (NAME may be org/adapter), the objects "
                        "PREFIX/NAME/adapter_config.json and adapter_model.safetensors of an "
                        "S3-compatible bucket (boto3: AWS_* settings, profiles, roles), or the "
                        "Hugging Face Hub repo ORG/ADAPTER[@REVISION] (HF_* settings), and "
                        "register it (repeatable, searched in order; names found nowhere are "
                        "remembered as missing for 30 s; default: off)")
    p.add_argument("--adapter-cache-dir", default=None, metavar="DIR",
                   help="where adapters fetched from object storage are kept (default: "
                        "<metrale cache>/adapter-cache)")
    p.add_argument("--adapter-cache-bytes", type=int, default=20 << 30, metavar="N",
                   help="most bytes of fetched adapters kept on disk, least recently used "
                        "dropped first (default: %(default)s)")
    p.add_argument("--adapter-fetch-timeout", type=float, default=FetchLimits.timeout_s,
                   metavar="S",
                   help="seconds an adapter fetch from a bucket or the Hub may take to connect "
                        "and receive headers, and the least its whole fetch may take "
                        "(default: %(default)s)")
    p.add_argument("--adapter-fetch-min-rate", type=float, default=FetchLimits.min_rate,
                   metavar="BYTES_PER_S",
                   help="a fetch's deadline grows by its announced bytes at this rate; a "
                        "store slower than that is cut off (default: %(default)s)")
    p.add_argument("--adapter-fetch-workers", type=int, default=FetchLimits.workers, metavar="N",
                   help="fetches in flight per bucket or Hub source; more wait for one, at most "
                        "a fetch timeout (then 503) (default: %(default)s)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapter slots on the device; more adapters than slots are promoted "
                        "on demand (default: 10%% of the memory left after the weights, with "
                        "the KV cache, at least 4 and at most --max-num-seqs; the split is "
                        "logged at start-up)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest LoRA rank a slot holds; adapters above it are refused "
                        "(default: %(default)s)")
    p.add_argument("--host-tier-bytes", type=int, default=0, metavar="N",
                   help="host memory (pinned on cuda) for images of recently landed adapters, one "
                        "slot's bytes each: landing one again is one host-to-device copy instead "
                        "of a file read (default: %(default)s, no host tier)")
    p.add_argument("--adapter-eviction", choices=list(EVICTION_POLICIES), default="cost",
                   help="which adapters the host tier and the slots keep: 'cost' weighs each "
                        "adapter's uses by what a miss costs, recent uses more, and slots give "
                        "up first adapters the host tier holds; 'lru' keeps the most recently "
                        "used (default: %(default)s)")
    p.add_argument("--lora-extra-targets", type=_extra_targets, default=(), metavar="LIST",
                   help="comma-separated model-level LoRA targets to reserve slot memory for: "
                        "embed_tokens, lm_head (lm_head costs max-lora-rank x vocab per slot); "
                        "adapters with LoRA on them are refused without it (default: none)")
    p.add_argument("--lora-experts", action="store_true",
                   help="a MoE base: reserve slot memory for LoRA on its experts and "
                        "routers (PEFT's target_parameters on mlp.experts.gate_up_proj / "
                        "down_proj and mlp.gate.weight, or per-expert modules "
                        "mlp.experts.E.gate_proj; each slot then holds a rank-r factor per "
                        "expert and layer); adapters with such LoRA are refused without it")
    add_engine_arguments(p)
    p.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV-cache blocks of 16 tokens to allocate (default: room for "
                        "--max-num-seqs sequences of --max-model-len tokens within what the "
                        "adapter slots leave of the memory budget: on cuda 80%% of the device "
                        "memory free after the weights, on cpu half the available memory and at "
                        "most half the model's weight bytes (at least 64 MiB); never less than "
                        "one --max-model-len sequence)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; beyond loopback, set --api-key and --admin-key "
                        "(default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--api-key", help="required as 'Authorization: Bearer' on inference "
                                     "endpoints (or set METRALE_API_KEY)")
    p.add_argument("--admin-key", help="required on every adapter-management endpoint "
                                       "(or set METRALE_ADMIN_KEY)")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key (e.g. to a Prometheus scraper); "
                        "by default it needs the key whenever --api-key is set")
    p.add_argument("--public-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json without the API key; by "
                        "default they need the key whenever --api-key is set")
    sched = p.add_argument_group("scheduling")
    sched.add_argument("--max-num-seqs", type=int, default=32,
                       help="sequences running at once (default: %(default)s)")
    sched.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="tokens per engine step, decodes included; longer prompts are "
                            "prefilled in chunks beside the decodes (default: %(default)s)")
    sched.add_argument("--max-prefill-chunk", type=int, default=None, metavar="N",
                       help="most prompt tokens one request prefills per step: smaller chunks "
                            "keep inter-token latency flat while long prompts arrive (default: "
                            "the step's budget)")
    sched.add_argument("--max-prefill-attention", type=int, default=None, metavar="PAIRS",
                       help="most (query, key) pairs one prompt chunk attends to per step: a "
                            "long prompt's chunks shrink as its context grows, so the decodes "
                            "sharing its steps do not slow down (e.g. 262144; default: no cap)")
    sched.add_argument("--step-time-ratio", type=_ratio, default=SchedulerConfig.step_time_ratio, metavar="R",
                       help="a step that runs decodes takes prompt tokens until its predicted "
                            "time (a cost model fitted to the steps the engine ran) is R times "
                            "that of its decodes alone, so a long prompt slows the running "
                            "decodes by at most about R; 0: the token budget alone bounds a "
                            "step, as in vLLM (default: %(default)s)")
    sched.add_argument("--prompt-drain", type=float, default=SchedulerConfig.prompt_drain_s,
                       metavar="SECONDS",
                       help="... unless the queued prompts would then take longer than this "
                            "to prefill: steps then grow to drain them in this time (up to "
                            "the token budget), so a deep queue runs at full throughput "
                            "(default: %(default)s)")
    sched.add_argument("--max-tokens-beside-decodes", type=int, default=0, metavar="N",
                       help="a hard cap beside --step-time-ratio: a step that runs decodes "
                            "takes prompt tokens only up to N tokens in all, its decodes "
                            "included (at least 32 prompt tokens) (0: no cap; default: "
                            "%(default)s)")
    sched.add_argument("--max-admission-wait", type=float, default=1.0, metavar="SECONDS",
                       help="a request waiting longer is admitted in arrival order, ahead of "
                            "adapters' round-robin turns (default: %(default)s)")
    sched.add_argument("--max-promotions-in-flight", type=int, default=2, metavar="N",
                       help="adapter landings started per step, and busy slots drained at once "
                            "for waiting adapters (default: %(default)s)")
    p.add_argument("--no-runtime-swaps", action="store_true",
                   help="freeze the adapter pool after start-up: no loads, swaps or "
                        "promotions at run time (default: off)")
    p.add_argument("--promotion-timeout", type=float, default=30.0,
                   help="seconds a request waits for a free adapter slot before POOL_FULL "
                        "(503) (default: %(default)s)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_FAMILIES],
                   help="how the model writes tool calls: auto = read from its chat template "
                        "(Hermes' <tool_call> when the template shows none) "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens-limit", type=int, default=2048,
                   help="refuse requests asking for more max_tokens (400) "
                        "(default: %(default)s)")
    p.add_argument("--peer-allow", action="append", default=[], metavar="NET",
                   help="hosts/networks adapters may be fetched from, and exported to "
                        "(repeatable; default loopback only)")
    p.add_argument("--peer-transport", default="auto", choices=["auto", "nixl", "http"],
                   help="peer data plane: nixl (RDMA/NVLink/UCX), http, or auto = NIXL when "
                        "installed, else HTTP (default: %(default)s)")
    p.add_argument("--peer-timeout", type=float, default=30.0,
                   help="seconds a whole peer landing may take before the slot is left EMPTY "
                        "(default: %(default)s)")
    p.add_argument("--peer-export-port", type=int, default=None, metavar="PORT",
                   help="export this server's resident adapters to peers on PORT (0 = any "
                        "free port; default: no export)")



def _ratio(text: str) -> float:
    """--step-time-ratio: 0 (off) or a ratio > 1, checked at parse time."""
    value = float(text)
    if value != 0 and not value > 1:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 (off) or > 1, got {text}")
    return value


def _extra_targets(text: str) -> tuple[str, ...]:
    """--lora-extra-targets: a comma list of EXTRA_TARGETS names, checked at parse time."""
    try:
        return check_extra_targets(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
