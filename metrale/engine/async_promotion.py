"""On-demand disk promotions that do not stall decoding.

One promotion at a time goes through three phases, each advanced by the engine
thread at a step boundary (AdapterManager.run_promotions):

1. staging, on a worker thread: validate (plan_adapter), read the file into this
   promoter's own pinned staging, copy it to its own device buffer and check for
   NaN/Inf, all on its own CUDA stream. No slot, no shared staging is touched, so a
   refusal here leaves the pool's bytes and identities as they were.
2. launch, on the engine thread: pick a victim (POOL_FULL: keep the staged bytes and
   wait), LOADING, zero and land on the side stream, record an event; no sync. A
   LOADING slot has no name, so nothing routes to it while the batch runs.
3. finish, at a later boundary once the event has completed: rank/scale tables,
   READY, host tier fill; the caller then binds the waiters.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.adapters.plan import AdapterPlan, plan_adapter
from metrale.errors import AdapterFileError, MetraleError
from metrale.pool.host_tier import adapter_key
from metrale.pool.staging import StagingBuffers
from metrale.pool.swap import LandingEvent, LoraSlots, _on_device, read_adapter_data

OP = "promote_lora_slot_from_disk"


@dataclass
class PromotionJob:
    name: str
    path: Path
    future: Future  # -> (plan, views): the staged, checked tensors
    start: float
    slot: int | None = None  # set once launched (the slot is LOADING)
    evicted: str | None = None
    event: torch.cuda.Event | None = None  # the landing's completion on CUDA
    plan: AdapterPlan | None = None

    @property
    def staged(self) -> bool:
        return self.future.done()


class AsyncPromoter:
    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self.device = slots.staging.device
        self.staging = StagingBuffers(self.device)  # never the synchronous path's buffers
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="metrale-promote")
        self.job: PromotionJob | None = None

    @property
    def busy(self) -> bool:
        """Progressing without the engine's help: staging, or bytes landing."""
        job = self.job
        return job is not None and (not job.staged or job.slot is not None)

    def tier_hit(self, path: Path) -> bool:
        tier = self.slots.host_tier
        return tier is not None and tier.enabled and tier.has(adapter_key(path))

    def start(self, name: str, path: Path) -> None:
        """Refusals that need no I/O raise here; the rest happens on the worker."""
        assert self.job is None, "one promotion at a time"
        self.slots._require_swappable(OP)
        self.job = PromotionJob(name, path, self._worker.submit(self._stage, name, path),
                                time.perf_counter())

    def _stage(self, name: str, path: Path) -> tuple[AdapterPlan, list[torch.Tensor]]:
        """Worker thread: everything that may refuse the adapter, nothing that mutates."""
        slots = self.slots
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with _on_device(self.device), stream:
            plan = plan_adapter(path, name, slots.model_config, slots.pool_config)
            data = read_adapter_data(plan, self.staging)
            return plan, slots.pool.stage_views(plan, data)  # NaN/Inf: syncs this stream only

    def staged_result(self) -> tuple[AdapterPlan, list[torch.Tensor]]:
        """The worker's result; its refusal as a MetraleError (the pool is untouched)."""
        try:
            return self.job.future.result()
        except MetraleError:
            raise
        except Exception as e:  # an unexpected failure still only refuses this adapter
            raise AdapterFileError(f"staging {self.job.path} failed: {e!r}") from e

    def launch(self) -> None:
        """Victim, LOADING, zero + land queued on the side stream (no host sync).
        Raises PoolFullError (nothing touched: keep waiting) or LandingError (slot EMPTY)."""
        job, slots = self.job, self.slots
        plan, views = self.staged_result()
        slot = slots.table.select_victim()
        evicted = slots.table.info(slot).name

        def write() -> None:
            slots.pool.land(slot, plan, views, tables=False)

        with _on_device(self.device):
            if self.stream is None:
                slots.begin_landing(slot, job.name, "disk", write)
            else:
                # after every kernel already queued (the last step may have read the victim)
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    slots.begin_landing(slot, job.name, "disk", write)
                    job.event = torch.cuda.Event()
                    job.event.record(self.stream)
        job.slot, job.evicted, job.plan = slot, evicted, plan

    def landed(self) -> bool:
        job = self.job
        return job.event is None or job.event.query()

    def finish(self, keep: bool) -> tuple[int, str | None] | None:
        """The bytes are in: READY under the job's name (keep; returns (slot, evicted)),
        or EMPTY again when the name was unloaded or re-landed elsewhere meanwhile
        (returns None). Raises LandingError (the slot is then EMPTY)."""
        job, slots = self.job, self.slots
        self.job = None
        slot = job.slot
        with _on_device(self.device):
            try:
                if job.event is not None:
                    job.event.synchronize()  # already complete; raises a device error if any
                if keep:
                    slots.pool.set_tables(slot, job.plan)
            except BaseException as e:
                error = slots.fail_landing(slot, job.name, "disk", e)
                self.notify(job, None, None, error)
                raise error from e
            if not keep:
                slots.fail_landing(slot, job.name, "disk", "superseded while landing")
                return None
            slots.finish_landing(slot, job.name, "disk", job.start)
            tier = slots.host_tier
            if tier is not None and tier.enabled:
                tier.put(adapter_key(job.path), slot)
        self.notify(job, slot, job.evicted, None)
        return slot, job.evicted

    def clear(self) -> None:
        """Drop a job that never touched a slot (refused, abandoned or superseded)."""
        assert self.job is None or self.job.slot is None
        self.job = None

    def notify(self, job: PromotionJob, slot: int | None, evicted: str | None,
               error: MetraleError | None) -> None:
        self.slots._notify(LandingEvent(OP, job.name, slot, evicted,
                                        time.perf_counter() - job.start, error))

    def wait(self, timeout: float) -> None:
        """Block up to timeout for the current phase (the engine has nothing to run)."""
        job = self.job
        if job is None:
            return
        if not job.staged:
            wait([job.future], timeout)
        elif job.event is not None:
            deadline = time.monotonic() + timeout
            while not job.event.query() and time.monotonic() < deadline:
                time.sleep(50e-6)

