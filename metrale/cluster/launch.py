"""`metrale serve --replicas N`: start (or attach to) Ray, the registry actor, N engine
replicas and the ingress, on Ray Serve.

    metrale serve --replicas 2 --device cpu               # a local Ray on this host
    metrale serve --replicas 8 --device cuda --ray-address auto   # an existing cluster

`deploy` is the whole recipe without argparse (tests call it on a local Ray).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import secrets
import time
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from metrale.cluster.config import ClusterConfig, ReplicaSpec, RouterConfig
from metrale.cluster.ingress import ClusterIngress, unwrap
from metrale.cluster.registry import RegistryActor
from metrale.cluster.replica import EngineReplica, multiplexed_replica

APP_NAME = "metrale"
NAMESPACE = "metrale"


def metrics_public(settings_kwargs: dict) -> bool:
    """Whether each replica's /metrics answers without a key: as the ingress's does (no
    --api-key, or --public-metrics). Routers and benchmarks written for vLLM scrape each
    replica as they would a vLLM pod; the replicas' own key is internal to the cluster."""
    return bool(settings_kwargs.get("public_metrics")) or not settings_kwargs.get("api_key")


def deploy(spec: ReplicaSpec, cluster: ClusterConfig, settings_kwargs: dict,
           replica_resources: dict | None = None) -> None:
    """Registry actor, replicas and ingress on the Ray this process is connected to
    (serve.start must have set the HTTP address). Returns once the app is RUNNING."""
    spec = dataclasses.replace(spec, public_metrics=metrics_public(settings_kwargs))
    registry_actor = ray.remote(RegistryActor).options(
        name=spec.registry_name, namespace=spec.registry_namespace, lifetime="detached",
        get_if_exists=True, num_cpus=0, max_concurrency=1000)
    registry = registry_actor.remote(reserved_names=("base", Path(spec.model).name))
    ray.get(registry.members.remote())  # up and named before any replica looks it up
    common = dict(name="EngineReplica", num_replicas=cluster.replicas,
                  max_ongoing_requests=cluster.max_ongoing_requests,
                  ray_actor_options=replica_resources or {"num_cpus": 1},
                  health_check_period_s=2.0, health_check_timeout_s=30.0)
    if cluster.routing == "ray_default":  # the baseline: Ray's own multiplexed routing
        replicas = serve.deployment(multiplexed_replica(spec.max_loras), **common)
    else:
        replicas = serve.deployment(EngineReplica, **common, request_router_config=RequestRouterConfig(
            request_router_class="metrale.cluster.router:AdapterAffinityRouter",
            request_router_kwargs=dataclasses.asdict(cluster.router),
            request_routing_stats_period_s=cluster.stats_period_s,
            request_routing_stats_timeout_s=max(cluster.stats_period_s, 5.0)))
    ingress = serve.deployment(serve.ingress()(ClusterIngress), name="ClusterIngress",
                               num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    app = ingress.bind(replicas.bind(spec), spec, cluster, settings_kwargs)
    serve.run(app, name=APP_NAME, route_prefix="/")


def shutdown(spec: ReplicaSpec) -> None:
    serve.delete(APP_NAME)
    with contextlib.suppress(ValueError):  # no such actor
        ray.kill(ray.get_actor(spec.registry_name, namespace=spec.registry_namespace))


def serve_cluster(args: argparse.Namespace, on_demand: dict[str, Path] | None = None) -> int:
    """The CLI's entry: args are `metrale serve`'s, with --replicas and --ray-address;
    on_demand: adapters registered unpinned at start-up (a --adapter of the same name wins)."""
    from metrale.server.serve import model_and_adapter_roots, parse_adapter_args, settings_fields

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    model_dir, adapter_roots = model_and_adapter_roots(args)
    local = args.ray_address is None
    if local:
        ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False, namespace=NAMESPACE)
    else:
        ray.init(address=args.ray_address, namespace=NAMESPACE)
    serve.start(http_options={"host": args.host, "port": args.port})
    cuda = args.device.startswith("cuda")
    spec = ReplicaSpec(
        model=str(model_dir.resolve()), registry_name=f"{APP_NAME}-registry",
        registry_namespace=NAMESPACE, internal_key=secrets.token_urlsafe(24),
        device="cuda" if cuda else args.device, dtype=args.dtype, quantization=args.quantization,
        fp8_activations=args.fp8_activations, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, host_tier_bytes=args.host_tier_bytes,
        adapter_eviction=args.adapter_eviction, max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks, promotion_timeout_s=args.promotion_timeout,
        peer_allow=tuple(args.peer_allow), peer_transport=args.peer_transport,
        peer_timeout_s=args.peer_timeout, host="127.0.0.1" if local else "0.0.0.0",
        torch_threads=args.replica_threads)
    cluster = ClusterConfig(replicas=args.replicas,
                            router=RouterConfig(args.router_epsilon, args.router_spread_queue))
    settings_kwargs = settings_fields(args, model_dir.name, [str(r.resolve()) for r in adapter_roots])
    # one GPU per replica (Ray places them); on a CPU host, --replica-threads cores each
    resources = {"num_gpus": 1, "num_cpus": 1} if cuda else {"num_cpus": args.replica_threads}
    deploy(spec, cluster, settings_kwargs, resources)
    register_startup(spec, {**{n: (str(p), False) for n, p in (on_demand or {}).items()},
                            **{n: (p, True) for n, p in parse_adapter_args(args.adapter).items()}})
    print(f"metrale: {args.replicas} replicas of {model_dir.name} behind "
          f"http://{args.host}:{args.port}/v1 (Ray Serve; Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        shutdown(spec)
        return 0


def register_startup(spec: ReplicaSpec, adapters: dict[str, tuple[str, bool]],
                     timeout_s: float = 300.0) -> None:
    """Start-up adapters (name -> (dir, pinned)), trusted like --adapter on one server
    (no --adapter-root confinement): validated on one replica, then cluster-wide."""
    replicas = serve.get_deployment_handle("EngineReplica", APP_NAME)
    registry = ray.get_actor(spec.registry_name, namespace=spec.registry_namespace)
    for name, (path, pinned) in adapters.items():
        source = unwrap(replicas.validate.remote(name, str(Path(path).resolve())).result())
        version = unwrap(ray.get(registry.register.remote(name, source, pinned, False)))
        ray.get(registry.wait_applied.remote(version, timeout_s))
    ray.get(registry.mark_started.remote())  # /health turns 200 from here
