"""Decode steps replayed from CUDA graphs.

One graph per (batch size, variant), captured once at start-up over static input
buffers; a step copies its inputs into those buffers (one host->device copy) and
replays the smallest graph that fits, padding the batch. Variants:
- lora: the LoRA kernels run and read each row's slot from the static slot_ids buffer;
- base: no LoRA work at all (a batch with no adapter token must not pay for LoRA).

Adapter swaps and promotions never invalidate a graph: the pool buffer and its
rank/scale tables are fixed device addresses that landings rewrite in place, and the
kernels look slots up at run time. Padded rows read slot -1 (base model), write their
K/V into a reserved padding block no sequence owns, and attend over that one key.

`capture=False` runs the same static-buffer path eagerly (CPU tests of the padding
and buffer logic; the forward pass is the one that would be captured).
"""

from __future__ import annotations

import bisect
from collections import Counter

import torch

from metrale.engine.sequence import Sequence
from metrale.forward_context import AttentionMetadata, ForwardContext, LoraBatch, forward_context
from metrale.model.llama import LlamaForCausalLM
from metrale.pool.pool import AdapterPool

# Batch sizes captured (those <= max_num_seqs, plus max_num_seqs itself up to the cap).
# Capped at the LoRA kernels' per-token decode limit (lora_triton.DECODE_MAX_T): above it
# they sort tokens by slot, which is untested under capture; bigger batches run eagerly.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MAX_GRAPH_BATCH = 64
_FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens", "slot_ids")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_num_seqs]
    if max_num_seqs <= MAX_GRAPH_BATCH and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, pool: AdapterPool | None, max_num_seqs: int,
                 max_blocks: int, block_size: int, pad_block: int, max_model_len: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size, self.pad_block = block_size, pad_block
        self.max_model_len = max_model_len
        B, W = self.sizes[-1], max_blocks
        self.max_batch, self.width = B, W
        # Every input in one int64 buffer: one H2D copy per step. Layout: five [B] fields,
        # then block_tables [B, W]. The kernels read int64 metadata as they read int32.
        n = B * (len(_FIELDS) + W)
        self._dev = torch.zeros(n, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._views = {f: self._dev[i * B:(i + 1) * B] for i, f in enumerate(_FIELDS)}
        self._tables = self._dev[len(_FIELDS) * B:].view(B, W)  # [B, W]
        self._cu = torch.arange(B + 1, dtype=torch.int32, device=device)  # decode: 1 query/seq
        self._copied: torch.cuda.Event | None = None
        self.capture_enabled = capture
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.num_captures = 0
        self.replays: Counter = Counter()  # (batch size, lora variant) -> replays
        self._mempool = None

    def variants(self) -> list[bool]:
        return [False, True] if self.pool is not None else [False]

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    # --- the forward pass a graph holds ------------------------------------------------

    def _forward(self, b: int, lora: bool) -> torch.Tensor:
        v = self._views
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=v["slot_mapping"][:b], context_lens=v["context_lens"][:b],
            block_tables=self._tables[:b], cu_query=self._cu[:b + 1], max_query_len=1,
            max_context_len=self.max_model_len,  # an upper bound: decode kernels never read it
        )
        batch = LoraBatch(self.pool, v["slot_ids"][:b]) if lora else None
        with forward_context(ForwardContext(meta, batch)):
            hidden = self.model(v["input_ids"][:b], v["positions"][:b])  # [b, hidden]
            return self.model.compute_logits(hidden)  # [b, V] float32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, variant), largest first so smaller graphs reuse its memory."""
        self._fill([], self.max_batch)
        self._upload()
        if not self.capture_enabled:
            return
        self._mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        for b in reversed(self.sizes):
            for lora in self.variants():
                with torch.cuda.stream(side):  # warm-up: Triton compiles, LoRA descriptors cached
                    for _ in range(2):
                        self._forward(b, lora)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._mempool):
                    out = self._forward(b, lora)
                self.graphs[(b, lora)] = (graph, out)
                self.num_captures += 1
        torch.cuda.synchronize(self.device)

    # --- a step ------------------------------------------------------------------------

    def run(self, seqs: list[Sequence], lora: bool) -> torch.Tensor:
        """Logits [len(seqs), V] of one decode step (each sequence's newest token)."""
        n = len(seqs)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        lora = lora and self.pool is not None
        self._fill(seqs, b)
        self._upload()
        self.replays[(b, lora)] += 1
        if not self.capture_enabled:
            return self._forward(b, lora)[:n]
        graph, out = self.graphs[(b, lora)]
        graph.replay()
        return out[:n]

    def _fill(self, seqs: list[Sequence], b: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy must have read the host buffer
        B, W, bs = self.max_batch, self.width, self.block_size
        h = self._host_np
        f = {name: h[i * B:(i + 1) * B] for i, name in enumerate(_FIELDS)}
        tables = h[len(_FIELDS) * B:].reshape(B, W)
        for i, seq in enumerate(seqs):
            pos = len(seq) - 1
            bt = seq.block_table
            f["input_ids"][i] = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
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

    def _upload(self) -> None:
        self._dev.copy_(self._host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

