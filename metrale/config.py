"""Frozen configuration, validated at construction.

ModelConfig is what metrale needs of a Hugging Face `config.json`; PoolConfig
sizes the adapter slot pool; EngineConfig gathers the engine's knobs.

No torch here: the CLI's argument parsers read these values, and its HTTP commands
(`metrale adapters`, `metrale peer list`, `--help`) must start without torch.
Dtypes are names; metrale.dtypes turns them into torch dtypes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from metrale.errors import MetraleError

# The linear projections of a Llama-family decoder layer, in pool order.
LINEAR_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# A MoE layer's stacked experts as LoRA targets (PEFT's target_parameters on
# mlp.experts.gate_up_proj / down_proj): one A [r * E, in] and B [out, r * E] each.
EXPERT_MODULES = ("experts_gate_up", "experts_down")
# its router (target_parameters on mlp.gate.weight): a plain A [r, hidden], B [E, r]
ROUTER_MODULE = "router"
MOE_MODULES = (*EXPERT_MODULES, ROUTER_MODULE)  # pool memory with --lora-experts
# Qwen2-MoE's shared expert, a dense gated MLP beside the routed ones, and its sigmoid gate
# (a Linear to one output): plain Linears PEFT wraps (all-linear too), pool memory by default
SHARED_EXPERT_MODULES = ("shared_gate_proj", "shared_up_proj", "shared_down_proj",
                         "shared_expert_gate")
# every decoder module a pool can hold LoRA memory for (EXTRA_TARGETS aside)
POOL_MODULES = LINEAR_MODULES + SHARED_EXPERT_MODULES + MOE_MODULES
# the parameter PEFT's target_parameters names, under the module's path
MOE_PARAMS = {"experts_gate_up": "gate_up_proj", "experts_down": "down_proj",
              ROUTER_MODULE: "weight"}
# Model-level LoRA targets whose pool memory is opt-in (lm_head's B alone is
# max_rank x vocab per slot): PoolConfig.extra_targets / EngineConfig.lora_extra_targets.
# In every (layer, module) key they sit at layer 0 (they have no layer of their own).
EXTRA_TARGETS: tuple[str, ...] = ("embed_tokens", "lm_head")
EXTRA_TARGETS_FLAG = "--lora-extra-targets"
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
                         *MOE_MODEL_TYPES)
# Phi-3 fuses q/k/v and gate/up in its checkpoint, so PEFT wraps (and adapters name) the
# fused Linear: one lora_A for all, lora_B's rows split across the parts, in this order.
FUSED_PEFT_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                      "gate_up_proj": ("gate_proj", "up_proj")}

_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


class ConfigError(MetraleError):
    """A configuration value is out of range or inconsistent."""


class TensorParallelSizeError(ConfigError):
    """tensor_parallel_size is < 1, or does not divide the model's attention heads, KV heads
    or intermediate size (metrale.model.parallel.check_tensor_parallel)."""


def dtype_name(value: object) -> str:
    """'float32', 'bfloat16' or 'float16' for a name or alias, or for a torch.dtype (known by
    its str, 'torch.float32', so that this module needs no torch)."""
    if isinstance(value, str):
        try:
            return _DTYPE_NAMES[value.lower()]
        except KeyError:
            raise ConfigError(
                f"unknown dtype {value!r}; use one of float32, bfloat16, float16") from None
    name = str(value).removeprefix("torch.")
    if name not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype {value} is not supported; use float32, bfloat16 or float16")
    return name


def _check_positive(config: object, names: tuple[str, ...], optional: bool = False) -> None:
    """Each named field is > 0 (or, optional, None); NaN is refused too."""
    for name in names:
        value = getattr(config, name)
        if not (optional and value is None) and not value > 0:
            raise ConfigError(f"{name} must be positive, got {value}")


def _gemma_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text): layer types every other layer (Gemma 2) or five local to
    one global (Gemma 3's sliding_window_pattern 6) unless the config lists them."""
    gemma3 = cfg.get("model_type") == "gemma3_text"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"hidden_activation {act!r} is not served for gemma (gelu_pytorch_tanh)")
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or (6 if gemma3 else 2))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ConfigError(f"layer_types {types!r} is not one of sliding_attention / "
                          f"full_attention per layer ({layers})")
    window = cfg.get("sliding_window")
    local = ((cfg.get("rope_parameters") or {}).get("sliding_attention") or {}).get(
        "rope_theta", cfg.get("rope_local_base_freq", 10000.0)) if gemma3 else None
    return dict(
        hidden_act="gelu_tanh", gemma_norms=True,
        rope_local_theta=None if local is None else float(local),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        attn_softcap=_float_or_none(cfg.get("attn_logit_softcapping")),
        final_softcap=_float_or_none(cfg.get("final_logit_softcapping")),
        sliding_window=int(window) if window else None,
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if window else (),
    )


def _phi3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4: fused checkpoint projections, a window on every layer where given,
    partial rotary (Phi-4-mini rotates 3/4 of each head)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    window = cfg.get("sliding_window")
    return dict(fused_peft_modules=True, partial_rotary_factor=partial,
                sliding_window=int(window) if window else None,
                sliding_layers=tuple(range(int(cfg["num_hidden_layers"]))) if window else ())


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP's shape and routing (model/moe.py)."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1
    fp32_weights: bool  # Mixtral multiplies by float32 weights; the others cast them back
    layers: tuple[int, ...]  # the layers with experts; the others have a dense MLP
    shared_expert_size: int = 0  # Qwen2-MoE: a sigmoid-gated shared expert beside them

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts or self.expert_size <= 0:
            raise ConfigError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts "
                              f"({self.num_experts}), the expert size ({self.expert_size}) > 0")


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE (experts every decoder_sparse_step-th layer but the
    mlp_only_layers), Mixtral (always renormalised, float32 weights), OLMoE (q/k norms over
    the whole projection; clip_qkv refused)."""
    model_type, layers = cfg["model_type"], int(cfg["num_hidden_layers"])
    # transformers 5 writes num_local_experts for every family; hub configs num_experts
    experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
    if model_type == "mixtral":
        size, norm = int(cfg["intermediate_size"]), True
    else:
        size = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        norm = bool(cfg.get("norm_topk_prob", False))
    moe_layers = tuple(range(layers))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if model_type == "olmoe" and cfg.get("clip_qkv") is not None:
        raise ConfigError(f"clip_qkv {cfg['clip_qkv']!r} is not served for olmoe (null)")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    return dict(moe=MoeConfig(experts, int(cfg["num_experts_per_tok"]), size, norm,
                              model_type == "mixtral", moe_layers, shared),
                qk_norm_full=model_type == "olmoe")


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Gemma 2 and 3: GELU (tanh) MLP, (1 + w) RMSNorm weights, embeddings times sqrt(hidden),
    # a norm after each sublayer too, a query scale of its own, soft-capped attention and
    # logits, sliding-window attention on some layers
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    gemma_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rotary base (no scaling)
    fused_peft_modules: bool = False  # Phi-3: PEFT sees qkv_proj and gate_up_proj
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotary turns
    moe: MoeConfig | None = None  # mixture-of-experts MLPs on moe.layers
    qk_norm_full: bool = False  # OLMoE: q/k RMSNorm over the whole projection, not per head

    def layer_modules(self, layer: int) -> tuple[str, ...]:
        """The LoRA-targetable modules of a decoder layer: an expert layer offers attention,
        its shared expert's Linears (Qwen2-MoE), its stacked experts and its router."""
        if self.moe is not None and layer in self.moe.layers:
            shared = SHARED_EXPERT_MODULES if self.moe.shared_expert_size else ()
            return ATTN_MODULES + shared + MOE_MODULES
        return LINEAR_MODULES

    def window_masks(self, max_len: int) -> bool:
        """Whether the sliding window can hide a key within max_len positions (a key k is
        seen from q iff k > q - window): never once the window covers the whole context."""
        return bool(self.sliding_layers) and self.sliding_window < max_len

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not served; metrale serves "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _check_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                               "num_heads", "num_kv_heads", "head_dim"))
        _check_positive(self, ("query_pre_attn_scalar", "attn_softcap", "final_softcap",
                               "sliding_window"), optional=True)
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} gives "
                              f"{self.rotary_dim} rotary dims of {self.head_dim}: not an even "
                              "count in 2..head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a decoder-layer projection, or of a model-level
        target: embed_tokens as PEFT's LoRA sees it (in = vocab: A is [r, vocab]) and lm_head."""
        return self._linear_shapes[module]

    @functools.cached_property
    def _linear_shapes(self) -> dict[str, tuple[int, int]]:
        # once per config: planning a new layout asks ~1,000 times (8B, all-linear)
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "embed_tokens": (self.vocab_size, h), "lm_head": (h, self.vocab_size),
            "q_proj": (h, self.q_size), "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size), "o_proj": (self.q_size, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }
        if self.moe is not None:
            e, s = self.moe.expert_size, self.moe.shared_expert_size
            shapes.update(experts_gate_up=(h, 2 * e), experts_down=(e, h),
                          router=(h, self.moe.num_experts), shared_gate_proj=(h, s),
                          shared_up_proj=(h, s), shared_down_proj=(s, h),
                          shared_expert_gate=(h, 1))
        return shapes

    def module_rows(self, module: str) -> int:
        """LoRA rows per rank: an expert module stacks one rank-r factor per expert."""
        return self.moe.num_experts if module in EXPERT_MODULES else 1

    @staticmethod
    def module_path(layer: int, module: str) -> str:
        """The module's name in a transformers model (what PEFT matches against)."""
        if module == "embed_tokens":
            return "model.embed_tokens"
        if module == "lm_head":
            return "lm_head"
        if module in EXPERT_MODULES:
            return f"model.layers.{layer}.mlp.experts"
        if module == ROUTER_MODULE:
            return f"model.layers.{layer}.mlp.gate"
        if module == "shared_expert_gate":
            return f"model.layers.{layer}.mlp.shared_expert_gate"
        if module in SHARED_EXPERT_MODULES:  # shared_gate_proj -> mlp.shared_expert.gate_proj
            return f"model.layers.{layer}.mlp.shared_expert.{module.removeprefix('shared_')}"
        group = "self_attn" if module in ATTN_MODULES else "mlp"
        return f"model.layers.{layer}.{group}.{module}"

    def peft_path(self, layer: int, module: str) -> str:
        """The name PEFT wraps for a module: module_path's, or its fused Linear's."""
        path = self.module_path(layer, module)
        if self.fused_peft_modules:
            for fused, parts in FUSED_PEFT_MODULES.items():
                if module in parts:
                    return f"{path.rsplit('.', 1)[0]}.{fused}"
        return path

    def fused_rows(self, module: str) -> tuple[int, int, int]:
        """(first row, rows, all rows) of module's outputs within the Linear PEFT wraps."""
        if self.fused_peft_modules:
            for parts in FUSED_PEFT_MODULES.values():
                if module in parts:
                    outs = [self.linear_shape(p)[1] for p in parts]
                    i = parts.index(module)
                    return sum(outs[:i]), outs[i], sum(outs)
        out = self.linear_shape(module)[1]
        return 0, out, out

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 nests theta and scaling under rope_parameters.
        rope_params = cfg.get("rope_parameters") or {}
        if model_type == "gemma3_text":  # per layer type: the global layers' are the model's
            rope_params = rope_params.get("full_attention") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             model_type in ("gemma2", "gemma3_text"))),
            attention_bias=bool(cfg.get("attention_bias", cfg.get(
                "qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            **(_gemma_fields(cfg) if model_type in ("gemma2", "gemma3_text") else {}),
            **(_phi3_fields(cfg) if model_type == "phi3" else {}),
            **(_moe_fields(cfg) if model_type in MOE_MODEL_TYPES else {}),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"{path} not found: pass a Hugging Face model directory") from None
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"{path} is not a usable Llama-family config: {e}") from None


# What the host tier keeps when full (PoolConfig.eviction; metrale.pool.eviction).
EVICTION_POLICIES = ("cost", "lru")
# An FP8 base's GEMM inputs (EngineConfig.fp8_activations; metrale.ops.fp8_linear).
FP8_ACTIVATIONS = ("dynamic", "weight-only")


@dataclass(frozen=True)
class PoolConfig:
    """Size of the adapter slot pool. max_loras == 0 means no pool at all; None: sized
    from memory at start-up (metrale.engine.memory_plan)."""

    max_loras: int | None = None
    max_lora_rank: int = 16
    target_modules: tuple[str, ...] = LINEAR_MODULES + SHARED_EXPERT_MODULES
    allow_runtime_swaps: bool = True
    # Pinned host memory for recently landed adapters as slot images (0 = no host tier);
    # a re-promotion from it is one H2D copy. Each entry takes one slot's bytes.
    host_tier_bytes: int = 0
    # Adapter files kept mapped and registered with CUDA (pinned page cache), so landing
    # one again is a single DMA from it; 0 = read the file at every landing. CUDA only.
    mapped_file_bytes: int = 2 << 30
    # model-level targets (EXTRA_TARGETS) given pool memory; () = adapters needing them are refused
    extra_targets: tuple[str, ...] = ()
    # Which images the host tier keeps when full (metrale.pool.eviction): "cost", the uses
    # of each adapter weighted by what a miss costs and decayed with age, and the slots give
    # up first the idle adapters whose image the tier holds; "lru", the most recently used
    # at both, as before (measured against each other: bench/many_adapters.py --simulate).
    eviction: str = "cost"

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_targets", check_extra_targets(self.extra_targets))
        for name in ("host_tier_bytes", "mapped_file_bytes", "max_loras"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction {self.eviction!r} unknown; choose from "
                              f"{', '.join(EVICTION_POLICIES)}")
        _check_positive(self, ("max_lora_rank",))
        unknown = set(self.target_modules) - set(POOL_MODULES)
        if unknown or not self.target_modules:
            raise ConfigError(
                f"pool target_modules {sorted(unknown) or '()'} invalid; choose from "
                f"{', '.join(POOL_MODULES)}"
            )
        # Keep pool order canonical whatever order the caller gave.
        ordered = tuple(m for m in POOL_MODULES if m in self.target_modules)
        object.__setattr__(self, "target_modules", ordered)


@dataclass(frozen=True)
class SchedulerConfig:
    """How a step is composed and who is admitted (metrale.engine.scheduler): every step
    runs all running decodes, then prefill chunks of partial and newly admitted prompts up
    to the engine's max_num_batched_tokens."""

    # The most prompt tokens one sequence prefills in a step (None: the step's budget);
    # smaller chunks bound how long a long prompt delays the decodes sharing its steps.
    max_prefill_chunk: int | None = None
    # The most (query, key) pairs one prompt chunk may attend to in a step: at context c a
    # chunk of n tokens gets n * (c + n) <= this (never under MIN_ATTENTION_CHUNK tokens),
    # so the chunks of a long prompt shrink as its context grows and the steps it shares
    # with decodes stay as short as its first ones. None: chunks are bounded by tokens only.
    max_prefill_attention: int | None = None
    # A step that runs decodes takes prompt tokens until its predicted time (the step cost
    # model, fitted to the steps this engine ran: metrale.engine.step_cost) reaches this
    # multiple of its decodes' own, so a long prompt slows the decodes sharing its steps by
    # at most this factor (but every such step takes >= MIN_PROMPT_TOKENS_BESIDE_DECODES
    # prompt tokens). None: the token budget alone bounds a step (vLLM's policy).
    step_time_ratio: float | None = 1.75
    # ... unless a runnable queued prompt would then not be prefilled within this long of
    # its arrival: the step then takes what meets every such deadline (the whole budget
    # for a prompt that has waited this long already), so a deep queue (a burst, a
    # saturated server) is served at full throughput.
    prompt_drain_s: float = 1.0
    # A hard cap beside the above: a step that runs decodes takes prompt tokens only up to
    # this many tokens in all, its decodes included (but >= MIN_PROMPT_TOKENS_BESIDE_DECODES
    # prompt tokens). Measured on the H100 at saturation (Llama-3-8B, 256 decodes), 128
    # halved throughput: a fixed count cannot suit every batch. None: no cap.
    max_tokens_beside_decodes: int | None = None
    # A waiting request older than this is admitted in arrival order, whatever its
    # adapter: per-adapter round-robin never starves anyone past it.
    max_admission_wait_s: float = 1.0
    # Adapter promotions in flight at once (staged, landing, or draining a slot for one).
    max_promotions_in_flight: int = 2

    def __post_init__(self) -> None:
        _check_positive(self, ("max_prefill_chunk", "max_prefill_attention",
                               "max_tokens_beside_decodes"), optional=True)
        if self.step_time_ratio is not None and not self.step_time_ratio > 1:  # NaN too
            raise ConfigError(f"step_time_ratio must be > 1 (or None), got {self.step_time_ratio}")
        _check_positive(self, ("prompt_drain_s",))
        if not self.max_admission_wait_s >= 0:  # also refuses NaN
            raise ConfigError(f"max_admission_wait_s must be >= 0, got {self.max_admission_wait_s}")
        if self.max_promotions_in_flight < 1:
            raise ConfigError("max_promotions_in_flight must be >= 1, got "
                              f"{self.max_promotions_in_flight}")


def check_extra_targets(value) -> tuple[str, ...]:
    """A validated, canonically ordered tuple of EXTRA_TARGETS names (a comma string too)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    try:
        names = tuple(value)
    except TypeError:
        raise ConfigError(f"lora_extra_targets must be a list of names, got {value!r}") from None
    unknown = [n for n in names if n not in EXTRA_TARGETS]
    if unknown:
        raise ConfigError(f"lora_extra_targets {unknown!r} invalid; choose from "
                          f"{', '.join(EXTRA_TARGETS)}")
    return tuple(m for m in EXTRA_TARGETS if m in names)


@dataclass(frozen=True)
class EngineConfig:
    pool: PoolConfig = field(default_factory=PoolConfig)
    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory at start-up
    max_num_seqs: int = 32
    # tokens per step, decodes included (a longer prompt is prefilled in chunks)
    max_num_batched_tokens: int = 2048
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enable_prefix_caching: bool = True
    promotion_timeout_s: float = 30.0
    # on-demand disk promotions read and land off the engine thread (decoding goes on)
    async_promotions: bool = True
    peer_allow: tuple[str, ...] = ()  # hosts/networks peers may be fetched from; () = loopback
    peer_timeout_s: float = 30.0
    peer_transport: str = "auto"  # "nixl" | "http" | "auto" (NIXL when both sides have it)
    # CUDA only: run every decode step eagerly instead of replaying CUDA graphs.
    enforce_eager: bool = False
    # Launch each step before processing the previous one's outputs, so the host's work
    # (scheduling, inputs, outputs) overlaps the device's. None: on for a CUDA device.
    async_scheduling: bool | None = None
    # model-level LoRA targets to size pool memory for (EXTRA_TARGETS); mirrors pool.extra_targets
    lora_extra_targets: tuple[str, ...] = ()
    # pool memory for LoRA on a MoE model's experts and routers (MOE_MODULES: each slot then
    # holds one rank-r A and B per expert and layer); mirrors MOE_MODULES in pool.target_modules
    lora_experts: bool = False
    # "fp8": a dense checkpoint's linear weights rounded to FP8 per output channel at load
    # (vLLM's --quantization fp8); a quantized checkpoint keeps its own scheme
    quantization: str | None = None
    # An FP8 base's activations for its GEMMs (FP8_ACTIVATIONS): "dynamic"
    # rounds them to e4m3, a scale per 512 columns of a token (the fast path on Hopper);
    # "weight-only" keeps them in the model's dtype (exactly the dequantized base)
    fp8_activations: str = FP8_ACTIVATIONS[0]
    # worker processes (ranks) the base and the adapters are split over, Megatron-style
    # (metrale.model.parallel; vLLM's --tensor-parallel-size): rank 0 is this process
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise TensorParallelSizeError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        extra = check_extra_targets(self.lora_extra_targets)
        if extra and self.pool.extra_targets and extra != self.pool.extra_targets:
            raise ConfigError(f"lora_extra_targets {extra} disagrees with pool.extra_targets "
                              f"{self.pool.extra_targets}; set one of them")
        extra = extra or self.pool.extra_targets
        object.__setattr__(self, "lora_extra_targets", extra)
        if extra != self.pool.extra_targets:
            object.__setattr__(self, "pool", replace(self.pool, extra_targets=extra))
        experts = self.lora_experts or any(m in MOE_MODULES for m in self.pool.target_modules)
        object.__setattr__(self, "lora_experts", experts)
        missing = tuple(m for m in MOE_MODULES if m not in self.pool.target_modules)
        if experts and missing:
            object.__setattr__(self, "pool", replace(
                self.pool, target_modules=self.pool.target_modules + missing))
        if self.quantization not in (None, "fp8"):
            raise ConfigError(f"quantization {self.quantization!r}: only 'fp8' is served")
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ConfigError(f"fp8_activations {self.fp8_activations!r}: choose from "
                              f"{', '.join(FP8_ACTIVATIONS)}")
        _check_positive(self, ("max_model_len", "block_size", "max_num_seqs",
                               "max_num_batched_tokens"))
        _check_positive(self, ("num_kv_blocks",), optional=True)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence decodes one token per step")
        if self.peer_transport not in ("auto", "nixl", "http"):
            raise ConfigError(f"peer_transport must be auto, nixl or http, got {self.peer_transport!r}")
        object.__setattr__(self, "peer_allow", tuple(self.peer_allow))
