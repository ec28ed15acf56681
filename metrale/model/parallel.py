"""Tensor parallelism, Megatron's split: what one rank holds and the collectives that join
the ranks' partial results (docs/DESIGN.md, "Tensor parallelism").

- qkv and gate/up are column-parallel: rank k holds rows [k*n/tp, (k+1)*n/tp) of each
  part (whole heads, whole KV heads), so its attention and activation are local;
- o and down are row-parallel: rank k holds the matching input columns; its output is a
  partial sum, all-reduced;
- embed_tokens and lm_head are vocabulary-parallel: rank k holds ceil(V/tp) rows (zero
  padded past V); a token outside a rank's rows embeds to 0 there (mask + all-reduce),
  and the logits are all-gathered.

A rank's model is an ordinary LlamaForCausalLM built from `shard_config` (heads, KV heads
and intermediate size divided by tp) with a `Shard` that names its rank: the layers' code is
the single-device code plus the two reductions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ModelConfig, TensorParallelSizeError

# NVLink multicast (NVLS) stays off in every process (the device machines' drivers fail on
# it): set before any process group or NCCL communicator starts, here and in every worker
# (a spawned process inherits os.environ as it is at spawn time, and sets these again).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    os.environ.update(MULTICAST_OFF)


def backend_for(device: torch.device) -> str:
    """The collectives' backend follows the device: NCCL between GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Refuse a split the layers cannot make (TensorParallelSizeError, a ConfigError)."""
    if not isinstance(tp, int) or tp < 1:
        raise TensorParallelSizeError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % tp:
            raise TensorParallelSizeError(
                f"tensor_parallel_size {tp} does not divide the model's {what} ({n})")
    # parts of the model the split does not cover yet: refused, never served wrong
    if cfg.moe is not None:
        raise TensorParallelSizeError("tensor parallelism does not split mixture-of-experts "
                                      "layers yet")
    if cfg.qk_norm_full:
        raise TensorParallelSizeError("tensor parallelism does not split a q/k norm over the "
                                      "whole projection (OLMoE) yet")
    if cfg.fused_peft_modules:
        raise TensorParallelSizeError("tensor parallelism does not split a checkpoint's fused "
                                      "qkv/gate_up weights (Phi-3) yet")


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's layers are built from: heads, KV heads and intermediate size
    divided by tp (head_dim, hidden and vocab as they are: the vocabulary split is the
    embedding's and the head's own)."""
    check_tensor_parallel(cfg, tp)
    if tp == 1:
        return cfg
    return replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                   intermediate_size=cfg.intermediate_size // tp)


@dataclass(frozen=True)
class Shard:
    """One rank of a tensor-parallel group (torch.distributed's default group: one group
    per process)."""

    rank: int
    size: int

    def vocab_rows(self, vocab: int) -> int:
        """Rows of embed_tokens / lm_head each rank holds (the last ones zero padded)."""
        return -(-vocab // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, in place."""
        torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank, concatenated in rank order: [..., size * n]."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def slice_weight(self, target: str, tensor: torch.Tensor, vocab: int) -> torch.Tensor:
        """This rank's part of a checkpoint tensor bound for our parameter `target`
        (loader.param_name's); one checkpoint part (q, k or v; gate or up) of a fused one."""
        if target.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
            return tensor.chunk(self.size, 0)[self.rank]  # column-parallel: output rows
        if target.endswith(("o_proj.weight", "down_proj.weight")):
            return tensor.chunk(self.size, 1)[self.rank]  # row-parallel: input columns
        if target in ("embed_tokens.weight", "lm_head.weight"):
            rows = self.vocab_rows(vocab)
            padded = F.pad(tensor, (0, 0, 0, rows * self.size - tensor.shape[0]))  # [tp*rows, h]
            return padded[self.rank * rows:(self.rank + 1) * rows]
        return tensor  # norms, rotary: replicated


def reduce_sum(x: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """A row-parallel layer's partial output summed over the ranks (x itself unsharded)."""
    return x if shard is None else shard.all_reduce(x)


def gather_vocab(logits: torch.Tensor, shard: Shard | None, vocab: int) -> torch.Tensor:
    """[N, rows] of this rank's vocabulary rows -> [N, vocab] (every rank gets them all: an
    all-gather costs what a gather to rank 0 does on two ranks, and keeps one code path)."""
    if shard is None:
        return logits
    return shard.all_gather_last(logits)[:, :vocab]


class VocabParallelEmbedding(nn.Embedding):
    """embed_tokens split by vocabulary rows: each rank looks up the ids it holds, zeroes
    the others, and the ranks' rows are summed (exactly one rank holds each id)."""

    def __init__(self, vocab: int, hidden: int, shard: Shard) -> None:
        rows = shard.vocab_rows(vocab)
        super().__init__(rows, hidden)
        self.shard, self.start = shard, shard.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        h.masked_fill_(outside[:, None], 0)
        return self.shard.all_reduce(h)


def embedding(vocab: int, hidden: int, shard: Shard | None) -> nn.Embedding:
    return nn.Embedding(vocab, hidden) if shard is None else VocabParallelEmbedding(vocab, hidden, shard)


def head_rows(vocab: int, shard: Shard | None) -> int:
    """lm_head's rows on this rank."""
    return vocab if shard is None else shard.vocab_rows(vocab)
