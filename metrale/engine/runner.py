"""ModelRunner: owns the model and its KV cache; runs one forward pass per scheduled batch
(from CUDA graphs when it fits, unless `enforce_eager`) and samples. The KV cache holds
one block more than the block manager hands out: the one padded graph rows write into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from metrale.config import EngineConfig, ModelConfig
from metrale.engine import prompt_logprobs
from metrale.engine.cuda_graphs import StepGraphs
from metrale.engine.pending import pending_inputs, resolve_pending
from metrale.engine.sampler import SampledTokens, draw
from metrale.engine.scheduler import ScheduledBatch
from metrale.engine.step_cost import StepTimer
from metrale.engine.step_inputs import upload
from metrale.forward_context import (
    AttentionMetadata,
    ForwardContext,
    LoraBatch,
    LoraViews,
    forward_context,
)
from metrale.model.llama import LlamaForCausalLM
from metrale.ops import lora_triton
from metrale.ops.attention_triton import prefill_block_m, prefill_tiles
from metrale.ops.lora_launch import segment_order
from metrale.ops.lora_ref import token_groups


class StepBroadcast(Protocol):
    """A tensor-parallel group's rank 0 (metrale.engine.tp_group): sends each step's
    inputs to the other ranks, which run the same forward on their shards."""

    def step(self, inputs: HostInputs) -> None: ...


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_cfg: ModelConfig, cfg: EngineConfig,
                 device: torch.device, dtype: torch.dtype, pool: LoraViews | None,
                 num_blocks: int, tp: StepBroadcast | None = None) -> None:
        """model_cfg: the config the model was built from (a rank's shard_config under TP);
        tp: rank 0 of a tensor-parallel group (eager steps only)."""
        self.model, self.model_cfg, self.cfg, self.tp = model, model_cfg, cfg, tp
        self.device, self.dtype, self.pool = device, dtype, pool
        self.group = model_cfg.num_heads // model_cfg.num_kv_heads  # query heads per KV head
        self.num_blocks = num_blocks  # the engine's memory plan
        self.pad_block = self.num_blocks  # never handed out: padded graph rows write here
        shape = (self.num_blocks + 1, cfg.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        for attn in model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.graphs: StepGraphs | None = None
        self.timer = StepTimer(device)  # each step's time, for the scheduler's cost model
        if device.type == "cuda" and not cfg.enforce_eager and tp is None:
            self.enable_graphs(capture=True)

    def enable_graphs(self, capture: bool = True) -> StepGraphs:
        """capture=False: run the graphs' static-buffer path eagerly (tests off the GPU)."""
        cfg = self.cfg
        self.graphs = StepGraphs(
            self.model, self.pool, cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_size),
            cfg.block_size, self.pad_block, cfg.max_model_len, self.device, capture=capture,
            max_num_batched_tokens=cfg.max_num_batched_tokens, group=self.group)
        self.graphs.capture()
        return self.graphs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, in_flight: torch.Tensor | None = None) -> SampledTokens:
        """Queue one forward pass over the batch and its draws, a token per sampling
        sequence. in_flight: the tokens [B'] of the step still running (pending inputs)."""
        seqs, graphs = batch.seqs, self.graphs
        mark = self.timer.start()
        lora = self.pool is not None and any(s.slot >= 0 for s in seqs)
        if any(s.params.prompt_logprobs is not None for s in seqs) and any(
                prompt_logprobs.wants_prompt_logprobs(s, n) for s, n in zip(seqs, batch.num_new)):
            graphs = None  # a graph keeps the last position's logits only
        if graphs is not None and batch.is_decode and len(seqs) <= graphs.max_batch:
            logits = graphs.run(seqs, lora, in_flight)  # [B, V]
        elif graphs is not None and graphs.can_run_mixed(batch):
            logits = graphs.run_mixed(batch, lora, in_flight)  # [sampling B, V]
        else:
            logits = self._run_eager(batch, in_flight)  # [sampling B, V]
        sampled = draw(logits, batch.sampling_seqs)
        self.timer.stop(mark, batch.shape)
        return sampled

    def _run_eager(self, batch: ScheduledBatch, in_flight: torch.Tensor | None) -> torch.Tensor:
        inputs = self.host_inputs(batch)
        if self.tp is not None:  # every rank runs this forward on its shard
            self.tp.step(inputs)
        return self.forward(inputs, in_flight, batch)

    def host_inputs(self, batch: ScheduledBatch) -> HostInputs:
        """The eager step's inputs as host lists (what a tensor-parallel group broadcasts)."""
        ids, positions, slot_mapping, cu, slot_ids, ctx = [], [], [], [0], [], []
        bs = self.cfg.block_size
        for seq, n in zip(batch.seqs, batch.num_new):
            start, end = seq.num_computed, seq.num_computed + n
            ids += seq.tokens(start, end)
            table = seq.block_table
            for pos in range(start, end):
                positions.append(pos)
                slot_mapping.append(table[pos // bs] * bs + pos % bs)
            cu.append(cu[-1] + n)
            ctx.append(end)
            slot_ids += [seq.slot] * n
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in batch.seqs]
        cuda = self.device.type == "cuda"
        # a mixed step's decodes (its first rows) go to the decode kernel on CUDA
        d = batch.num_decodes if cuda and not batch.is_decode else 0
        chunk_cu = [c - cu[d] for c in cu[d:]]
        tiles = prefill_tiles(chunk_cu, block_m=prefill_block_m(max(batch.num_new[d:]), self.group)) \
            if cuda and not batch.is_decode else []
        lora = self.pool is not None and any(s.slot >= 0 for s in batch.seqs)
        # the last token of each sampling sequence
        last = [end - 1 for end, sampled in zip(cu[1:], batch.samples) if sampled]
        rows, src = pending_inputs(batch.seqs, cu)
        # the LoRA kernels' slot order (CUDA): prefill chunks, and decode batches past the
        # per-token kernels' limit, built here once for every layer (docs/DESIGN.md)
        sort = lora and cuda and (not batch.is_decode or len(slot_ids) > lora_triton.DECODE_MAX_T)
        return HostInputs(
            ids=ids, positions=positions, slot_mapping=slot_mapping, context_lens=ctx,
            block_tables=tables, cu_query=cu, tiles=tiles, last=last, rows=rows, src=src,
            slot_ids=slot_ids if lora else [],
            order=segment_order(np.asarray(slot_ids)) if sort else [],
            is_prefill=not batch.is_decode, max_query_len=max(batch.num_new), num_decodes=d)

    def forward(self, inputs: HostInputs, in_flight: torch.Tensor | None = None,
                batch: ScheduledBatch | None = None) -> torch.Tensor:
        """One eager forward over the step's inputs -> the sampling rows' logits [B', V].
        batch: the engine's (prompt logprobs read its sequences); None on a TP worker."""
        dev = self.device
        t = upload(dev, **inputs.lists())
        slot_ids = inputs.slot_ids
        meta = AttentionMetadata(
            is_prefill=inputs.is_prefill, slot_mapping=t["slot_mapping"],
            context_lens=t["context_lens"], block_tables=t["block_tables"], cu_query=t["cu_query"],
            max_query_len=inputs.max_query_len, max_context_len=max(inputs.context_lens),
            # built here once, not by the kernel wrapper in every layer (a host sync each)
            prefill_tiles=t["tiles"].view(-1, 2) if inputs.tiles else None,
            num_decodes=inputs.num_decodes,
        )
        if slot_ids:
            order = t["order"] if len(inputs.order) else None
            # the CPU reference groups tokens by slot once here, not in each of its calls
            groups = token_groups(slot_ids, dev) if dev.type != "cuda" else None
            lora = LoraBatch(self.pool, t["slot_ids"], order, groups)
        else:
            lora = None
        ids_t = t["ids"]  # [T]
        if inputs.rows:
            resolve_pending(ids_t, t["rows"], t["src"], in_flight)
        with forward_context(ForwardContext(meta, lora)):
            hidden = self.model(ids_t, t["positions"])  # [T, hidden]
            if batch is not None:
                prompt_logprobs.record(self.model, hidden, batch.seqs, batch.num_new,
                                       inputs.cu_query)
            last_t = t["last"]
            return self.model.compute_logits(hidden[last_t], last_t)  # [B', V] (last_t: lm_head LoRA)


@dataclass(frozen=True)
class HostInputs:
    """An eager step's inputs on the host: lists, scalars and the slot order's int64 array
    (picklable: a tensor-parallel group broadcasts them to the workers)."""

    ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    context_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B, max_blocks], -1 padded
    cu_query: list[int]  # [B + 1]
    tiles: list  # prefill tiles (CUDA), [] elsewhere
    last: list[int]  # [B']: the row of each sampling sequence's last token
    rows: list[int]  # pending inputs (async scheduling)
    src: list[int]
    slot_ids: list[int]  # [T], [] without LoRA in the step
    order: np.ndarray | list  # the LoRA kernels' slot order (lora_launch.segment_order), or []
    is_prefill: bool
    max_query_len: int
    num_decodes: int

    def lists(self) -> dict[str, list]:
        return {f: getattr(self, f) for f in (
            "ids", "positions", "slot_mapping", "context_lens", "block_tables", "cu_query",
            "tiles", "last", "rows", "src", "slot_ids", "order")}
