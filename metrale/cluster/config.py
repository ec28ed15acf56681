"""Frozen settings of the cluster layer, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.config import EVICTION_POLICIES, FP8_ACTIVATIONS


@dataclass(frozen=True)
class RouterConfig:
    """The routing policy's settings; docs/DESIGN.md ("Routing") gives their effect."""

    # affinity may load a replica up to (1 + epsilon) x the mean load, this request counted
    epsilon: float = 0.5  # bench/cluster_sim.py: 0.25 loses hits, 1.0 loses balance (> 1.25)
    spread_queue: int = 8  # every holder has this many of the adapter's requests: spread (0: never)
    stall_over_bound: bool = True  # no slot free now within the bound: a holder over it goes first
    tail_fraction: float = 0.375  # share of replicas (rounded down) landing the cold adapters first
    heat_half_life_s: float = 5.0  # the request rates' decay, which ranks the hot set

    def __post_init__(self) -> None:
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")
        if self.spread_queue < 0:
            raise ValueError(f"spread_queue must be >= 0, got {self.spread_queue}")
        if not 0 <= self.tail_fraction < 1:
            raise ValueError(f"tail_fraction must be in [0, 1), got {self.tail_fraction}")
        if not self.heat_half_life_s > 0:
            raise ValueError(f"heat_half_life_s must be > 0, got {self.heat_half_life_s}")


@dataclass(frozen=True)
class ReplicaSpec:
    """What every engine replica is built from (sent to each replica by Ray)."""

    model: str  # a Hugging Face model dir, visible at the same path on every node
    registry_name: str  # the ClusterRegistry actor's name
    registry_namespace: str
    internal_key: str  # guards each replica's own HTTP server (the ingress holds it)
    device: str = "cpu"
    dtype: str | None = None
    quantization: str | None = None  # EngineConfig.quantization
    fp8_activations: str = FP8_ACTIVATIONS[0]  # EngineConfig.fp8_activations
    max_loras: int = 4
    max_lora_rank: int = 16
    host_tier_bytes: int = 0  # PoolConfig.host_tier_bytes, per replica
    adapter_eviction: str = EVICTION_POLICIES[0]  # PoolConfig.eviction
    max_model_len: int = 2048
    num_kv_blocks: int | None = None
    promotion_timeout_s: float = 30.0
    peer_allow: tuple[str, ...] = ()  # () = loopback only
    peer_transport: str = "auto"
    peer_timeout_s: float = 30.0
    host: str = "127.0.0.1"  # where the replica's own HTTP and peer servers listen
    torch_threads: int = 1
    stage_from_peers: bool = True  # off: every landing reads disk (the baseline runs)
    # each replica's own /metrics without a key (deploy() sets it: metrics_public())
    public_metrics: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("a cluster replica needs adapter slots (max_loras >= 1)")
        if self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1")
        if self.host_tier_bytes < 0:
            raise ValueError(f"host_tier_bytes must be >= 0, got {self.host_tier_bytes}")
        if self.adapter_eviction not in EVICTION_POLICIES:
            raise ValueError(f"adapter_eviction {self.adapter_eviction!r}: choose from "
                             f"{EVICTION_POLICIES}")
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ValueError(f"fp8_activations {self.fp8_activations!r}: choose from "
                             f"{FP8_ACTIVATIONS}")


ROUTERS = ("metrale", "ray_default")


@dataclass(frozen=True)
class ClusterConfig:
    """routing: "metrale" (AdapterAffinityRouter) or "ray_default" (Ray Serve's own
    multiplexed routing, the adapter as the multiplexed model id: the baseline)."""

    replicas: int
    router: RouterConfig = field(default_factory=RouterConfig)
    routing: str = "metrale"
    stats_period_s: float = 1.0  # how often Ray asks replicas for routing stats
    sync_timeout_s: float = 60.0  # a registry change waits this long for every replica
    retries: int = 3  # a request whose replica died is resent up to this many times
    max_ongoing_requests: int = 64  # per replica, Ray Serve's admission bound

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not self.stats_period_s > 0 or not self.sync_timeout_s > 0:
            raise ValueError("stats_period_s and sync_timeout_s must be positive")
        if self.routing not in ROUTERS:
            raise ValueError(f"routing {self.routing!r}: choose from {ROUTERS}")
        if self.retries < 0 or self.max_ongoing_requests < 1:
            raise ValueError("retries must be >= 0 and max_ongoing_requests >= 1")
