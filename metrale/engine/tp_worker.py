"""A tensor-parallel worker: ranks 1.. of the group, one process each (spawned by
metrale.engine.tp_group.TpGroup). It holds its shard of the base (parallel.shard_config),
its slice of every adapter slot (pool/shard.py) and of the KV cache, and runs what rank 0
sends down its pipe: a step's forward, a landing's slice, a slot emptied, a read-back,
stop. No scheduler, no registry: rank 0 decides everything, here only tensors change."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from metrale.config import EngineConfig, ModelConfig
from metrale.dtypes import parse_dtype
from metrale.engine.runner import ModelRunner
from metrale.engine.tp_wire import init_group
from metrale.model.loader import load_model
from metrale.model.parallel import Shard, disable_multicast, shard_config
from metrale.pool.slots import SlotState
from metrale.pool.swap import LoraSlots

log = logging.getLogger("metrale.tp")


def rank_device(device: str, rank: int) -> torch.device:
    """Rank k's device: the k-th GPU under CUDA (rank 0 holds cuda:0), else the same."""
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" else d


def worker_main(rank: int, size: int, port: int, model_dir: str, cfg: EngineConfig,
                worker_init: Callable[[int], None] | None, threads: int,
                commands: Connection) -> None:
    disable_multicast()  # a spawned process: set again before any process group starts
    torch.set_num_threads(threads)  # as many as rank 0: the ranks share the host's cores
    if worker_init is not None:
        worker_init(rank)
    device = rank_device(cfg.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group(device, rank, size, port)
    code = 0
    try:
        Worker(rank, size, model_dir, cfg, device).serve(commands)
    except BaseException:  # rank 0's next collective or command then fails too
        log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    finally:
        dist.destroy_process_group()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # no interpreter teardown: in about 1 exit of 10 a C++ thread torch leaves joinable
        # aborted it ("terminate called without an active exception", exit code -6) after
        # the group was gone; nothing of ours needs a teardown (the group and pipe are closed)
        os._exit(code)


class Worker:
    def __init__(self, rank: int, size: int, model_dir: str, cfg: EngineConfig,
                 device: torch.device) -> None:
        # eager like rank 0's TP steps: a graph captured here alone would replay
        # collectives rank 0 never joins
        self.cfg = replace(cfg, enforce_eager=True)
        self.device, self.dtype = device, parse_dtype(cfg.dtype)
        self.shard = Shard(rank, size)
        self.model_cfg = shard_config(ModelConfig.from_dir(model_dir), size)
        self.model_dir = model_dir
        self.slots: LoraSlots | None = None
        self.runner: ModelRunner | None = None

    def serve(self, commands: Connection) -> None:
        error = None
        try:  # loads while rank 0 loads its own shard
            model = load_model(self.model_dir, self.model_cfg, self.dtype, self.device,
                               self.cfg.max_model_len, tp_shard=self.shard)
            model.requires_grad_(False)
        except Exception as e:  # told to rank 0 at setup: it raises, then stops us
            log.exception("rank %d could not load its shard", self.shard.rank)
            error, model = f"{type(e).__name__}: {e}", None
        while True:
            try:
                command = commands.recv()  # as long as the engine idles
            except EOFError:  # rank 0's process ended without a stop
                return
            kind = command[0]
            if kind == "step":
                with torch.inference_mode():
                    self.runner.forward(command[1])  # the logits are rank 0's to sample
            elif kind == "land":
                self._land(*command[1:])
            elif kind == "setup":
                if error is None:
                    error = self._setup(model, *command[1:])
                dist.all_gather_object([None] * self.shard.size, error)
            elif kind == "empty":
                self._empty(command[1])
            elif kind == "slots":
                infos = self.slots.table.infos() if self.slots is not None else []
                dist.all_gather_object([None] * self.shard.size, infos)
            elif kind == "stop":
                dist.barrier()  # rank 0's close: every rank past its last collective
                return

    def _setup(self, model, num_slots: int, num_blocks: int) -> str | None:
        try:
            if num_slots:
                self.slots = LoraSlots(self.model_cfg, replace(self.cfg.pool, max_loras=num_slots),
                                       self.device, self.dtype)
            pool = self.slots.pool if self.slots is not None else None
            self.runner = ModelRunner(model, self.model_cfg, self.cfg, self.device, self.dtype,
                                      pool, num_blocks)
        except Exception as e:
            log.exception("rank %d could not set up", self.shard.rank)
            return f"{type(e).__name__}: {e}"
        return None

    def _empty(self, slot: int) -> None:
        """Rank 0's slot went EMPTY (a landing failed before the ranks were asked, or an
        unload): this rank's too, zeroed (its refs are always 0: no request binds here)."""
        if self.slots.table.info(slot).state is not SlotState.EMPTY:
            self.slots.unload_slot(slot)

    def _land(self, slot: int, version: int, tables: tuple) -> None:
        """Rank 0's landing protocol on this rank: begin (zeroed, LOADING), the slice in and
        checked, then the agreement: commit if every rank landed, else fail (EMPTY)."""
        layout = self.slots.pool.layout
        data = torch.empty(layout.slot_elems, dtype=layout.dtype, device=self.device)
        dist.recv(data, src=0)
        landing, why = None, None
        try:
            landing = self.slots.begin(slot)
            landing.write_slice(data, tables)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        answers: list = [None] * self.shard.size
        dist.all_gather_object(answers, why)
        if landing is None:
            return  # begin refused: nothing was touched
        if any(answers):
            if landing.is_open:
                landing.fail("; ".join(f"rank {r}: {a}" for r, a in enumerate(answers) if a))
            return
        landing.commit(version)
