"""Steps replayed from CUDA graphs: decode steps, and mixed steps (prompt chunks beside
decodes) of up to the largest token bucket. Graphs are captured once over static input
buffers; a step copies its inputs into them (one H2D copy) and replays the smallest graph
that fits, padded. Each has a `lora` and a `base` variant (a batch with no adapter token
pays nothing for LoRA). Swaps never invalidate a graph: the pool is rewritten in place and
the kernels look slots up at run time. Padded rows read slot -1 and write their K/V into a
padding block no sequence owns. `capture=False` runs the same path eagerly (CPU tests).
"""

from __future__ import annotations

import bisect
from collections import Counter
from functools import partial

import numpy as np
import torch

from metrale.engine.pending import pending_inputs, resolve_pending
from metrale.engine.scheduler import ScheduledBatch
from metrale.engine.sequence import Sequence
from metrale.engine.step_inputs import aligned_size
from metrale.forward_context import AttentionMetadata, ForwardContext, LoraBatch, forward_context
from metrale.model.llama import LlamaForCausalLM
from metrale.ops import lora_triton
from metrale.ops.attention_triton import max_prefill_tiles, prefill_block_m, prefill_tiles
from metrale.ops.lora_launch import segment_order, segment_order_rows
from metrale.pool.pool import AdapterPool

# Batch sizes captured (those <= max_num_seqs, plus max_num_seqs itself up to the cap);
# bigger batches run eagerly. Past lora_triton.DECODE_MAX_T rows the kernels take a slot
# order, computed on the host and uploaded with the step's inputs (eagerly, a batch of
# 256 paid ~0.3 ms per LoRA group: 8B decode with adapters ran at 0.3x base).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPH_BATCH = 256
# Mixed steps are captured only when every sequence row of a step fits this many rows.
MAX_MIXED_GRAPH_BATCH = 64
# Token buckets of mixed steps (those <= max_num_batched_tokens); bigger steps run eagerly.
MIXED_TOKEN_BUCKETS = (64, 128, 256, 512)
# pend_rows/pend_src: engine/pending.py's rows
_TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "slot_ids", "pend_rows", "pend_src")
_SEQ_FIELDS = ("context_lens", "logits_index")


# A LoRA decode graph of at least this many rows also has a slot-sorted variant (the
# kernels that read each adapter once for all its rows), replayed when the step's rows
# average SORTED_MIN_ROWS_PER_SLOT per adapter or more. Llama-3-8B, H200, batch 32/64:
# one adapter for every row decodes 1.04x/1.10x faster sorted, 32 distinct adapters
# 2.3x/1.6x slower (bench/decode.py --override ...DECODE_MAX_T=16, decode_ab).
SORTED_MIN_BATCH = 16
SORTED_MIN_ROWS_PER_SLOT = 8


def sorts_decode(batch: int) -> bool:
    """Whether every LoRA decode step of this many rows hands the kernels a slot order."""
    return batch > lora_triton.DECODE_MAX_T


def has_sorted_variant(batch: int) -> bool:
    return SORTED_MIN_BATCH <= batch <= lora_triton.DECODE_MAX_T


def few_slots(seqs: list[Sequence]) -> bool:
    """Whether the rows share adapters enough for the slot-sorted kernels to pay."""
    slots = {s.slot for s in seqs if s.slot >= 0}
    return len(seqs) >= SORTED_MIN_ROWS_PER_SLOT * max(len(slots), 1)


class StepGraphs:
    def __init__(self, model: LlamaForCausalLM, pool: AdapterPool | None, max_num_seqs: int,
                 max_blocks: int, block_size: int, pad_block: int, max_model_len: int,
                 device: torch.device, capture: bool = True,
                 max_num_batched_tokens: int = 0, group: int = 1) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_num_seqs]
        if max_num_seqs <= MAX_GRAPH_BATCH and max_num_seqs not in self.sizes:
            self.sizes.append(max_num_seqs)
        # mixed steps need every sequence row of a step: only when all fit one graph
        self.buckets = [t for t in MIXED_TOKEN_BUCKETS if t <= max_num_batched_tokens] \
            if max_num_seqs <= MAX_MIXED_GRAPH_BATCH else []
        self.block_size, self.pad_block = block_size, pad_block
        self.max_model_len = max_model_len
        B, W = self.sizes[-1], max_blocks
        self.max_batch = B
        # Every input in one int64 buffer (the kernels read it as they read int32): one H2D
        # copy per step. Layout: the [T] token fields, the [B] sequence fields, cu_query
        # [B + 1], the attention's query tiles [tiles, 2], then block_tables [B, W].
        T = max([B, *self.buckets])
        self.group = group  # query heads per KV head (the attention's tile size needs it)
        tiles = max((max_prefill_tiles(t, B, self._block_m(t)) for t in self.buckets), default=0)
        # the LoRA kernels' slot order of t tokens takes its first order_rows(t) entries
        self._num_slots = pool.layout.pool.max_loras if pool is not None else 0
        order = max(self._order_rows(t) for t in (B, *self.buckets))
        fields = [(f, T) for f in _TOKEN_FIELDS] + [(f, B) for f in _SEQ_FIELDS] + [
            ("cu_query", B + 1), ("tiles", 2 * tiles), ("order", order)]
        # each field starts 16-byte aligned, as the kernels are compiled for (step_inputs)
        n = sum(aligned_size(size) for _, size in fields) + B * W
        self._dev = torch.zeros(n, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._views, self._host_views, at = {}, {}, 0
        for f, size in fields:
            self._views[f] = self._dev[at:at + size]
            self._host_views[f] = self._host_np[at:at + size]
            at += aligned_size(size)
        self._tables = self._dev[at:].view(B, W)  # [B, W]
        self._host_tables = self._host_np[at:].reshape(B, W)
        self._decode_cu = torch.arange(B + 1, dtype=torch.int32, device=device)  # 1 query/seq
        self._copied: torch.cuda.Event | None = None
        self.capture_enabled = capture
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.num_captures = 0
        # (batch size, lora variant), (batch size, True, "sorted") or ("mixed", token
        # bucket, lora variant) -> replays; last_key: the latest step's
        self.replays: Counter = Counter()
        self.last_key: tuple | None = None

    def _block_m(self, t: int) -> int:
        return prefill_block_m(t, self.group)

    def _order_rows(self, t: int) -> int:
        return segment_order_rows(t, self._num_slots) if self._num_slots else t

    def _fill_order(self, t: int) -> None:
        """The LoRA kernels' slot order of the step's t token rows (padding rows: slot -1)."""
        f = self._host_views
        n = self._order_rows(t)
        f["order"][:n] = segment_order(f["slot_ids"][:t], n)

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    def can_run_mixed(self, batch: ScheduledBatch) -> bool:
        return bool(self.buckets) and len(batch) <= self.max_batch \
            and batch.num_tokens <= self.buckets[-1]

    # --- the forward passes a graph holds ----------------------------------------------

    def _forward(self, b: int, lora: bool, sort: bool = False) -> torch.Tensor:
        v = self._views
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=v["slot_mapping"][:b], context_lens=v["context_lens"][:b],
            block_tables=self._tables[:b], cu_query=self._decode_cu[:b + 1], max_query_len=1,
            max_context_len=self.max_model_len,  # an upper bound: decode kernels never read it
        )
        order = v["order"][:self._order_rows(b)] if sort or sorts_decode(b) else None  # _fill
        batch = LoraBatch(self.pool, v["slot_ids"][:b], order) if lora else None
        with forward_context(ForwardContext(meta, batch)):
            hidden = self.model(v["input_ids"][:b], v["positions"][:b])  # [b, hidden]
            return self.model.compute_logits(hidden)  # [b, V] float32

    def _forward_mixed(self, t: int, lora: bool) -> torch.Tensor:
        v, B = self._views, self.max_batch
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=v["slot_mapping"][:t], context_lens=v["context_lens"],
            block_tables=self._tables, cu_query=v["cu_query"], max_query_len=t,
            max_context_len=self.max_model_len,
            prefill_tiles=v["tiles"][:2 * max_prefill_tiles(t, B, self._block_m(t))].view(-1, 2),
        )
        batch = LoraBatch(self.pool, v["slot_ids"][:t], v["order"][:self._order_rows(t)]) \
            if lora else None
        with forward_context(ForwardContext(meta, batch)):
            hidden = self.model(v["input_ids"][:t], v["positions"][:t])  # [t, hidden]
            rows = v["logits_index"][:B]  # [B]; also picks the rows' lm_head LoRA slots
            return self.model.compute_logits(hidden[rows], rows)  # [B, V] float32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first so smaller graphs reuse its memory."""
        self._fill([], self.max_batch)
        self._upload()
        if not self.capture_enabled:
            return
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        variants = [False, True] if self.pool is not None else [False]  # lora: without, with
        captures = [(("mixed", t, lora), partial(self._forward_mixed, t, lora))
                    for t in reversed(self.buckets) for lora in variants]
        captures += [((b, lora), partial(self._forward, b, lora))
                     for b in reversed(self.sizes) for lora in variants]
        if self.pool is not None:
            captures += [((b, True, "sorted"), partial(self._forward, b, True, True))
                         for b in reversed(self.sizes) if has_sorted_variant(b)]
        for key, forward in captures:
            with torch.cuda.stream(side):  # warm-up: Triton compiles, LoRA descriptors cached
                for _ in range(2):
                    forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                out = forward()
            self.graphs[key] = (graph, out)
            self.num_captures += 1
        torch.cuda.synchronize(self.device)

    # --- a step ------------------------------------------------------------------------

    def run(self, seqs: list[Sequence], lora: bool,
            in_flight: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(seqs), V] of one decode step (each sequence's newest token).
        in_flight: the sampled tokens of the step still running (pending inputs)."""
        n = len(seqs)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        lora = lora and self.pool is not None
        sort = lora and has_sorted_variant(b) and few_slots(seqs)
        self._upload(self._fill(seqs, b, sort), in_flight)
        key = (b, True, "sorted") if sort else (b, lora)
        return self._replay(key, lambda: self._forward(b, lora, sort))[:n]

    def run_mixed(self, batch: ScheduledBatch, lora: bool,
                  in_flight: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [sampling sequences, V] of one mixed step."""
        t = self.buckets[bisect.bisect_left(self.buckets, batch.num_tokens)]
        lora = lora and self.pool is not None
        n_samples, n_pending = self._fill_mixed(batch, t)
        self._upload(n_pending, in_flight)
        return self._replay(("mixed", t, lora), lambda: self._forward_mixed(t, lora))[:n_samples]

    def _replay(self, key: tuple, eager) -> torch.Tensor:
        self.replays[key] += 1
        self.last_key = key
        if not self.capture_enabled:
            return eager()
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _wait_host_buffer(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy must have read the host buffer

    def _fill(self, seqs: list[Sequence], b: int, sort: bool = False) -> int:
        """The step's rows into [0, b); returns how many input tokens are pending."""
        self._wait_host_buffer()
        f, tables, bs = self._host_views, self._host_tables, self.block_size
        for i, seq in enumerate(seqs):
            pos = len(seq) - 1
            bt = seq.block_table
            f["input_ids"][i] = seq.tokens(pos, pos + 1)[0]  # 0 when pending
            f["positions"][i] = pos
            f["slot_mapping"][i] = bt[pos // bs] * bs + pos % bs
            f["context_lens"][i] = pos + 1
            f["slot_ids"][i] = seq.slot
            tables[i, :len(bt)] = bt
            tables[i, len(bt):] = self.pad_block
        # padding rows: base model, one key in the padding block, writes go there too
        n = len(seqs)
        for name, value in (("input_ids", 0), ("positions", 0), ("context_lens", 1),
                            ("slot_ids", -1), ("slot_mapping", self.pad_block * bs)):
            f[name][n:b] = value
        tables[n:b] = self.pad_block
        if self.pool is not None and (sort or sorts_decode(b)):
            self._fill_order(b)
        return self._fill_pending(seqs, range(n + 1))

    def _fill_mixed(self, batch: ScheduledBatch, t: int) -> tuple[int, int]:
        """The step's tokens into rows [0, t) and its sequences into rows [0, B); returns
        how many sequences sample (their logits rows come first, in batch order) and how
        many input tokens are pending."""
        self._wait_host_buffer()
        f, tables, bs = self._host_views, self._host_tables, self.block_size
        ids, positions, slot_mapping, slot_ids, cu, ctx, last = [], [], [], [], [0], [], []
        for i, (seq, n, sampled) in enumerate(zip(batch.seqs, batch.num_new, batch.samples)):
            start, bt = seq.num_computed, seq.block_table
            ids += seq.tokens(start, start + n)
            span = range(start, start + n)
            positions += span
            slot_mapping += [bt[p // bs] * bs + p % bs for p in span]
            slot_ids += [seq.slot] * n
            cu.append(cu[-1] + n)
            ctx.append(start + n)
            if sampled:
                last.append(cu[-1] - 1)
            tables[i, :len(bt)] = bt
            tables[i, len(bt):] = self.pad_block
        at, b, n_samples = cu[-1], len(batch), len(last)
        f["input_ids"][:at] = ids
        f["positions"][:at] = positions
        f["slot_mapping"][:at] = slot_mapping
        f["slot_ids"][:at] = slot_ids
        f["cu_query"][:b + 1] = cu
        f["context_lens"][:b] = ctx
        f["logits_index"][:n_samples] = last
        # padding: tokens of no sequence (base model, written into the padding block) and
        # sequence rows with no queries
        for name, value in (("input_ids", 0), ("positions", 0), ("slot_ids", -1),
                            ("slot_mapping", self.pad_block * bs)):
            f[name][at:t] = value
        f["cu_query"][b + 1:] = at
        f["context_lens"][b:] = 1
        tables[b:] = self.pad_block
        f["logits_index"][n_samples:] = 0
        if self.pool is not None:
            self._fill_order(t)
        block_m = self._block_m(t)
        n_tiles = max_prefill_tiles(t, self.max_batch, block_m)
        f["tiles"][:2 * n_tiles] = np.asarray(prefill_tiles(cu, n_tiles, block_m)).reshape(-1)
        return n_samples, self._fill_pending(batch.seqs, cu)

    def _fill_pending(self, seqs: list[Sequence], cu) -> int:
        """The pending input tokens' rows (cu: the token rows' prefix sums); returns how many."""
        rows, src = pending_inputs(seqs, cu)
        self._host_views["pend_rows"][:len(rows)] = rows
        self._host_views["pend_src"][:len(src)] = src
        return len(rows)

    def _upload(self, num_pending: int = 0, in_flight: torch.Tensor | None = None) -> None:
        self._dev.copy_(self._host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if num_pending:  # before the replay, on its stream: the graph reads input_ids
            v = self._views
            resolve_pending(v["input_ids"], v["pend_rows"][:num_pending],
                            v["pend_src"][:num_pending], in_flight)
