"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/3, Phi-3, Gemma 2/3, and the
MoE families of model/moe.py) over a flat token batch with paged KV; fused projections
(qkv, gate/up) add each token's LoRA delta from the forward context."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from metrale.config import SHARED_EXPERT_MODULES, ModelConfig
from metrale.forward_context import get_context
from metrale.model.layers import LoraProjection, RMSNorm, RotaryEmbedding
from metrale.model.moe import MoeMLP
from metrale.model.parallel import Shard, embedding, gather_vocab, head_rows, reduce_sum
from metrale.ops import fused_triton as fused
from metrale.ops.attention import paged_attention
from metrale.ops.head import head_logits
from metrale.ops.lora import lora_embed, lora_logits


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding,
                 shard: Shard | None = None) -> None:
        """shard: this rank of a tensor-parallel group (cfg is then its shard_config)."""
        super().__init__()
        self.cfg, self.rotary, self.shard = cfg, rotary, shard
        self.qkv_proj = LoraProjection(
            layer, ("q_proj", "k_proj", "v_proj"), cfg.hidden_size,
            (cfg.q_size, cfg.kv_size, cfg.kv_size), bias=cfg.attention_bias,
        )
        self.o_proj = LoraProjection(layer, ("o_proj",), cfg.q_size, (cfg.hidden_size,))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm_full:  # OLMoE: over the whole projection, before the head split
            self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_softcap
        # a window as long as the context hides nothing (Phi-3's 2047 under 2k): dropped, so
        # the layer runs the GPU kernels
        masks = layer in cfg.sliding_layers and cfg.window_masks(rotary.max_positions)
        self.window = cfg.sliding_window if masks else None
        # [num_blocks, block_size, KV, D]; bound by the runner once the cache is sized
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        if cfg.qk_norm_full:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)  # [T, H, D]
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)  # [T, KV, D]
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        meta = get_context().attn
        q = self.rotary.rotate_and_store(positions, q, k, v, self.k_cache, self.v_cache,
                                         meta.slot_mapping)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, positions,
                            self.softcap, self.window)  # [T, H, D]
        # row-parallel under TP: each rank's o_proj (and its LoRA) gave a partial sum
        return reduce_sum(self.o_proj(o.reshape(T, cfg.q_size)), self.shard)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard | None = None) -> None:
        super().__init__()
        self.shard = shard
        self.inter = cfg.intermediate_size
        self.gate_up_proj = LoraProjection(
            layer, ("gate_proj", "up_proj"), cfg.hidden_size, (self.inter, self.inter)
        )
        self.down_proj = LoraProjection(layer, ("down_proj",), self.inter, (cfg.hidden_size,))
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]: gate, then up
        if fused.rows_usable(gate_up):  # one launch, not two
            act_mul = fused.gelu_tanh_mul if self.gelu else fused.silu_mul
        else:
            act_mul = fused.gelu_tanh_mul_ref if self.gelu else fused.silu_mul_ref
        return reduce_sum(self.down_proj(act_mul(gate_up)), self.shard)  # row-parallel under TP


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding,
                 shard: Shard | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rotary, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe is not None and layer in cfg.moe.layers
        self.mlp = MoeMLP(cfg, layer) if moe else MLP(cfg, layer, shard)

    def forward(self, positions: torch.Tensor, h: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden], the last sublayer's output not yet added to residual (None at layer
        0) -> the same pair after this layer: each add is done by the next norm, in its launch
        (vLLM's scheme; bitwise what `h = h + sublayer(norm(h))` gives)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class SandwichDecoderLayer(nn.Module):
    """Gemma's layer: each sublayer's output is normed before it joins the stream, and the
    MLP's input has a norm of its own. As in DecoderLayer, each residual add is done by the
    next pre-norm in its launch (bitwise the plain adds)."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding,
                 shard: Shard | None = None) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Attention(cfg, layer, rotary, shard)
        self.mlp = MLP(cfg, layer, shard)

    def forward(self, positions: torch.Tensor, h: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer.forward's contract: h is the last sublayer's normed output."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, shard: Shard | None = None) -> None:
        """shard: this rank of a tensor-parallel group, cfg its parallel.shard_config."""
        super().__init__()
        self.cfg, self.shard = cfg, shard
        rotary = RotaryEmbedding(cfg, max_positions)
        # Gemma 3: the sliding layers rotate with a base of their own, unscaled
        local = rotary if cfg.rope_local_theta is None else RotaryEmbedding(
            replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None), max_positions)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, shard)
        layer_cls = SandwichDecoderLayer if cfg.gemma_norms else DecoderLayer
        self.layers = nn.ModuleList(
            layer_cls(cfg, i, local if i in cfg.sliding_layers else rotary, shard)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, head_rows(cfg.vocab_size, shard), bias=False)
        self.rotary = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        if self.cfg.gemma_norms:  # sqrt(hidden) rounded to the weights' dtype, as Gemma does
            h = h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype)
        lora = get_context().lora
        if lora is not None:
            lora_embed(h, input_ids, lora)  # embed_tokens LoRA, when the pool serves it
        residual = None  # [T, hidden]: the stream h is added to, once there is one
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits; rows: [N] indices of these rows among the
        forward's tokens, for lm_head LoRA (None: row i is token i)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = head_logits(hidden, weight)  # [N, V] ([N, V/tp] on a rank of a TP group)
        lora = get_context().lora
        if lora is not None:
            lora_logits(logits, hidden, lora, rows)  # lm_head LoRA, when the pool serves it
        logits = gather_vocab(logits, self.shard, self.cfg.vocab_size)  # [N, V]
        logits = logits.float()
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def lora_base_weights(self) -> BaseWeights:
        """(layer, module) -> the base weight W [out, in] its LoRA adds to (DoRA's norms)."""
        return BaseWeights(self)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]


class BaseWeights:
    """The model's base weights by (layer, module), looked up at each access (weights replaced
    after start-up are read). embed_tokens is PEFT's DoRA view E^T; a tied lm_head is E."""

    _PROJ = {"q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
             "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
             "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
             "down_proj": ("mlp", "down_proj", 0)}

    def __init__(self, model: LlamaForCausalLM) -> None:
        self._model = model

    def __getitem__(self, key: tuple[int, str]) -> torch.Tensor:
        layer, module = key
        model = self._model
        if module == "embed_tokens":
            return model.embed_tokens.weight.T  # [hidden, vocab]
        if module == "lm_head":
            return (model.embed_tokens if model.lm_head is None else model.lm_head).weight
        if module in SHARED_EXPERT_MODULES:
            return model.layers[layer].mlp.shared_weight(module)
        part, name, i = self._PROJ[module]
        proj = getattr(getattr(model.layers[layer], part), name)
        dense = proj.dense_weight(model.embed_tokens.weight.dtype)  # an FP8 one dequantized
        return dense[proj.out_slices[i]]  # [out_m, in]
