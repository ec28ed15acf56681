"""Rank 0 of a tensor-parallel group: the engine's process. It starts one worker process per
other rank (metrale.engine.tp_worker), and from the engine thread alone (collectives must be
issued in the same order on every rank) it drives them: each eager step's inputs, each
landing's slices (sent to each worker) and the agreement before its commit, a slot emptied, the slot tables'
read-back, stop.

Every message is a small picklable command down each worker's pipe (tp_wire), then what
the command moves over the process group (each worker's slot slice, an all-gather of the
ranks' answers)."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from metrale.config import EngineConfig
from metrale.engine.runner import HostInputs
from metrale.engine.tp_wire import free_port, init_group
from metrale.engine.tp_worker import worker_main
from metrale.errors import TensorParallelWorkerError
from metrale.model.parallel import Shard, disable_multicast
from metrale.pool.layout import SlotLayout
from metrale.pool.pool import SlotTensors
from metrale.pool.shard import slice_slot

log = logging.getLogger("metrale.tp")


class TpGroup:
    """Implements ModelRunner's StepBroadcast and the landing's LandingPeers."""

    def __init__(self, size: int, procs: list, pipes: list) -> None:
        self.shard = Shard(0, size)
        self._procs, self._pipes = procs, pipes
        self._full: SlotLayout | None = None
        self._slice: SlotLayout | None = None
        self.closed = False

    @classmethod
    def start(cls, model_dir: str | Path, cfg: EngineConfig, device: torch.device,
              worker_init: Callable[[int], None] | None = None) -> TpGroup:
        """Spawn ranks 1..size-1 (they load their shards meanwhile) and join the group.
        worker_init(rank): run first in each worker (tests inject faults with it)."""
        disable_multicast()  # before the spawn: the workers inherit the environment too
        size, port = cfg.tensor_parallel_size, free_port()
        ctx = multiprocessing.get_context("spawn")  # a forked process would share CUDA state
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]  # (worker's end, ours)
        procs = [ctx.Process(target=worker_main, daemon=True, name=f"metrale-tp{rank}",
                             args=(rank, size, port, str(model_dir), cfg, worker_init,
                                   torch.get_num_threads(), pipes[rank - 1][0]))
                 for rank in range(1, size)]
        for p in procs:
            p.start()
        for theirs, _ in pipes:
            theirs.close()  # the worker holds it now: its recv ends when our end closes
        init_group(device, 0, size, port)
        log.info("tensor-parallel group of %d ranks (%s)", size, dist.get_backend())
        return cls(size, procs, [ours for _, ours in pipes])

    def setup(self, num_slots: int, num_blocks: int, full: SlotLayout | None,
              sliced: SlotLayout | None) -> None:
        """Rank 0's memory plan to the workers, which build their pools and KV caches from
        it; raises if a worker could not. full: the layout rank 0 lands adapters in (its
        landing area's); sliced: every rank's serving layout."""
        self._full, self._slice = full, sliced
        self._send(("setup", num_slots, num_blocks))
        self._answers(None, "starting")

    # --- ModelRunner's StepBroadcast ------------------------------------------------------

    def step(self, inputs: HostInputs) -> None:
        self._send(("step", inputs))

    # --- the landing's LandingPeers -------------------------------------------------------

    def land(self, slot: int, tensors: SlotTensors, version: int) -> list[str | None]:
        """`tensors`: rank 0's landing-area slot, holding the whole adapter, checked (its
        own slice is in its serving slot already). Each worker gets its slice (its bytes
        only) and the table rows, lands them, and the ranks' answers are gathered by all
        (the agreement: each commits iff all landed)."""
        tables = (tensors.ranks.cpu(), tensors.scales.cpu(), tensors.doras.cpu())  # [L, M] each
        self._send(("land", slot, version, tables))
        for k in range(1, self.shard.size):
            part = slice_slot(self._full, tensors.data, self._slice, Shard(k, self.shard.size))
            dist.send(part, dst=k)  # [sliced slot_elems]
        # rank 0 landed its slot before asking; DoRA's gain needs the norm of whole rows of
        # W + sBA, which a row-parallel rank does not hold: refused until it is split too
        mine = "DoRA adapters are not split across ranks yet" if bool(tensors.doras.any()) else None
        answers: list = [None] * self.shard.size
        dist.all_gather_object(answers, mine)
        return answers

    def empty(self, slot: int) -> None:
        self._send(("empty", slot))

    # --- read-back and stop -----------------------------------------------------------------

    def slot_infos(self) -> list:
        """Each worker's slot table (SlotInfo lists, ranks 1..), for tests and debugging."""
        self._send(("slots",))
        infos: list = [None] * self.shard.size
        dist.all_gather_object(infos, None)
        return infos[1:]

    @property
    def worker_exitcodes(self) -> list[int | None]:
        """Ranks 1..'s exit codes (None while running)."""
        return [p.exitcode for p in self._procs]

    def close(self) -> None:
        """Stop the workers and leave the group (a later TP engine in this process may
        start its own)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._send(("stop",))
            dist.barrier()  # every rank is past its last collective: the group may go
        finally:
            for pipe in self._pipes:
                pipe.close()
            dist.destroy_process_group()
            for p in self._procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()

    def _send(self, command: tuple) -> None:
        """A command to every worker, in the order rank 0 issues its collectives."""
        for pipe in self._pipes:
            pipe.send(command)

    def _answers(self, mine: str | None, what: str) -> None:
        answers: list = [None] * self.shard.size
        dist.all_gather_object(answers, mine)
        failed = [f"rank {r}: {a}" for r, a in enumerate(answers) if a]
        if failed:
            raise TensorParallelWorkerError(
                f"tensor-parallel workers failed {what}: {'; '.join(failed)}")
