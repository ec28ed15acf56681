"""LLMEngine: requests in, one batched step at a time, outputs out.

Adapter operations run between steps on the thread that calls step(): call them
directly from that thread, or hand them to `call_soon` from another (the server does).
A swap needs only *its* slot to be idle, never an empty server.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from metrale.adapters.plan import plan_adapter
from metrale.adapters.weights_check import check_weights
from metrale.config import ConfigError, EngineConfig, ModelConfig
from metrale.dtypes import parse_dtype
from metrale.engine.adapters import AdapterManager
from metrale.engine.block_manager import BlockManager
from metrale.engine.grammar import GrammarBackend
from metrale.engine.memory_plan import MemoryPlan, host_available_bytes, plan_memory
from metrale.engine.output_processor import OutputProcessor, failed_output
from metrale.engine.outputs import RequestOutput
from metrale.engine.registry import AdapterRegistry, AdapterSource, AdapterVersion, PeerRef
from metrale.engine.residency import ResidencyRow, loading_of, residency_rows
from metrale.engine.runner import ModelRunner
from metrale.engine.sampler import DeferredDraw, SampledTokens
from metrale.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from metrale.engine.scheduler import ScheduledBatch, Scheduler
from metrale.engine.sequence import Sequence
from metrale.engine.sequence_sampling import SequenceSampling
from metrale.engine.siblings import SiblingGate, sibling_id
from metrale.engine.token_counts import TokenCounts
from metrale.engine.tp_group import TpGroup
from metrale.errors import MetraleError, UnknownAdapterError
from metrale.model.llama import LlamaForCausalLM
from metrale.model.loader import load_model
from metrale.model.parallel import check_tensor_parallel, shard_config
from metrale.peer.allow import resolve_peer
from metrale.peer.landing import warm_up_nixl, warm_up_peer
from metrale.peer.lookup import check_peer_holds
from metrale.peer.plans import plan_cache_for
from metrale.pool.landing_area import SlicedServing
from metrale.pool.layout import SlotLayout
from metrale.pool.slots import SlotInfo
from metrale.pool.swap import LoraSlots, Prepared

log = logging.getLogger("metrale.engine")


def warms_peers(pool) -> bool:
    """Whether registering an adapter from a new peer warms that path first: on a GPU,
    where a cold first landing costs ~14x a warm one; a CPU engine lands at CPU speed."""
    return pool is not None and pool.buffer.is_cuda


@dataclass(frozen=True)
class _InFlight:
    """A launched step whose tokens the host has not processed yet."""

    batch: ScheduledBatch
    sampled: SampledTokens | DeferredDraw


class LLMEngine:
    def __init__(self, model_dir: str | Path, cfg: EngineConfig, tokenizer=None,
                 model: LlamaForCausalLM | None = None,
                 tp_worker_init: Callable[[int], None] | None = None) -> None:
        """model: one already built for model_dir's config.json (benchmarks); None: load it.
        tp_worker_init(rank): run first in each tensor-parallel worker (tests inject faults)."""
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tp: TpGroup | None = None
        if cfg.tensor_parallel_size > 1:
            self._check_tensor_parallel(model)
            # the workers load their shards while this process loads its own
            self.tp = TpGroup.start(model_dir, cfg, torch.device(cfg.device), tp_worker_init)
        try:
            self._build(model_dir, cfg, tokenizer, model)
        except BaseException:
            self.close()
            raise

    def _check_tensor_parallel(self, model: LlamaForCausalLM | None) -> None:
        """Refuse, before any worker starts, what the split does not cover (yet)."""
        cfg = self.cfg
        check_tensor_parallel(self.model_config, cfg.tensor_parallel_size)
        if model is not None:
            raise ConfigError("tensor parallelism loads its shards itself: pass no model")
        if cfg.pool.extra_targets or cfg.lora_experts:
            raise ConfigError("tensor parallelism serves LoRA on the decoder layers' linears "
                              "only (no embed_tokens / lm_head / expert LoRA yet)")
        if cfg.async_scheduling:
            raise ConfigError("tensor parallelism runs synchronous steps (async_scheduling off)")

    def _build(self, model_dir: str | Path, cfg: EngineConfig, tokenizer,
               model: LlamaForCausalLM | None) -> None:
        tp = cfg.tensor_parallel_size
        # the config this rank's layers are built from: the whole model's, or its shard's
        self.layer_config = shard_config(self.model_config, tp)
        shard = self.tp.shard if self.tp is not None else None
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # kernels launch on the current device: make it this engine's (e.g. cuda:1)
            torch.cuda.set_device(self.device)
        self.dtype = parse_dtype(cfg.dtype)
        if self.model_config.gemma_norms and "embed_tokens" in cfg.pool.extra_targets:
            raise ConfigError("embed_tokens LoRA is not served on gemma2 yet (its embeddings "
                              "are scaled)")
        self.tokenizer = tokenizer
        if model is None:
            model = load_model(model_dir, self.layer_config, self.dtype, self.device,
                               cfg.max_model_len, cfg.quantization, cfg.fp8_activations, shard)
        elif model.rotary.max_positions < cfg.max_model_len:  # its tables would be read past
            raise ConfigError(f"the given model's rotary tables cover {model.rotary.max_positions} "
                              f"positions, fewer than max_model_len {cfg.max_model_len}")
        model.requires_grad_(False)  # an inference engine: nothing may build autograd graphs
        sliced = SlicedServing(self.layer_config, shard, self._landing_slots()) \
            if shard is not None else None
        self.memory = self._plan_memory(model, sliced)
        log.info("%s", self.memory.describe())
        # under TP rank 0's pool, like each worker's, holds its slice of every adapter, landed
        # whole in its landing area first; DoRA is not split yet: the ranks' agreement
        # refuses it (tp_group), so no base weights are needed
        self.lora = LoraSlots(self.model_config, replace(cfg.pool, max_loras=self.memory.num_slots),
                              self.device, self.dtype,
                              model.lora_base_weights() if self.tp is None else None, sliced)
        pool = self.lora.pool
        if self.tp is not None:
            self.lora.peers = self.tp  # every landing commits on all ranks or on none
            self.tp.setup(self.memory.num_slots, self.memory.kv_blocks,
                          self.lora.landing_pool.layout if pool is not None else None,
                          pool.layout if pool is not None else None)
        # an adapter named like the base model would shadow it in every API
        self.registry = AdapterRegistry(reserved_names=("base", Path(model_dir).name))
        self.adapters = AdapterManager(self.lora, self.registry, cfg)
        if self.device.type == "cuda" and cfg.peer_transport != "http":
            warm_up_nixl(self.lora)  # a first peer landing then costs ~1.3 s less
        self.runner = ModelRunner(model, self.layer_config, cfg, self.device, self.dtype,
                                  pool, self.memory.kv_blocks, tp=self.tp)
        self.blocks = BlockManager(self.runner.num_blocks, cfg.block_size,
                                   cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        eos_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(eos_ids))
        self.max_seq_tokens = min(cfg.max_model_len, self.runner.num_blocks * cfg.block_size)
        self.output_processor = OutputProcessor(tokenizer, eos_ids, self.max_seq_tokens)
        # requests that shape their logits: grammars (compiled once, cached), token counts
        self.grammars = GrammarBackend(tokenizer, self.model_config.vocab_size, self.eos_ids)
        self.token_counts = TokenCounts(self.model_config.vocab_size, self.device)
        self.siblings = SiblingGate()
        # overlap the host's work with the device's: only a device runs ahead of the host
        self.async_scheduling = cfg.async_scheduling if cfg.async_scheduling is not None \
            else self.device.type == "cuda" and self.tp is None
        self._in_flight: _InFlight | None = None

    def _landing_slots(self) -> int:
        """Landings open at once under TP, each in a whole slot of rank 0's landing area: a
        promotion written off the engine thread beside one run inline, else one."""
        return 2 if self.cfg.async_promotions else 1

    def _plan_memory(self, model: LlamaForCausalLM, sliced: SlicedServing | None) -> MemoryPlan:
        """Adapter slots and KV blocks from one budget (memory_plan), before either is made.
        Under TP a slot is this rank's slice, and rank 0's landing area is set aside first."""
        cfg, m = self.cfg, self.model_config
        cuda = self.device.type == "cuda"
        if cuda:  # what torch's allocator holds but does not use is free to our tensors
            free = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(
                self.device) - torch.cuda.memory_allocated(self.device)
        else:
            free = host_available_bytes()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        one_slot = replace(cfg.pool, max_loras=1)
        lora = cfg.pool.max_loras != 0
        slot_bytes = SlotLayout(self.layer_config, one_slot, self.dtype).slot_bytes if lora else 0
        area_bytes = sliced.landing_slots * SlotLayout(m, one_slot, self.dtype).slot_bytes \
            if lora and sliced is not None else 0
        kv_heads = self.layer_config.num_kv_heads  # this rank's under TP
        block_bytes = 2 * m.num_layers * cfg.block_size * kv_heads * m.head_dim * self.dtype.itemsize
        return plan_memory(cfg.pool.max_loras, slot_bytes, cfg.num_kv_blocks, cfg.max_num_seqs,
                           cfg.max_model_len, cfg.block_size, block_bytes, weights, free, cuda,
                           area_bytes)

    # --- requests ----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None) -> str:
        params = sampling_params or SamplingParams()
        ids = self._encode(prompt)
        if len(ids) + params.max_tokens > self.max_seq_tokens:
            raise InvalidSamplingParamsError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"engine's limit of {self.max_seq_tokens} tokens (--max-model-len)"
            )
        if adapter is not None and self.lora.pool is None:
            raise UnknownAdapterError("this engine was started without LoRA (--max-loras 0)")
        request_id = request_id or f"req-{next(self._ids)}"
        seq_ids = [sibling_id(request_id, i) for i in range(params.n)]
        if any(i in self.requests for i in seq_ids):
            raise MetraleError(f"request id {request_id!r} is already in use")
        self._check_logit_bias(params)
        if self.tp is not None and params.prompt_logprobs is not None:
            # their extra head passes would be rank 0's alone: the workers' collectives
            # would not match
            raise InvalidSamplingParamsError(
                "prompt_logprobs are not served under tensor parallelism yet", "prompt_logprobs")
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a refusal before anything is queued
        seqs = [self._new_sequence(i, seq_id, ids, params, adapter)
                for i, seq_id in enumerate(seq_ids)]
        bound = []
        try:
            for seq in seqs:
                self.adapters.bind(seq)  # raises UnknownAdapterError before anything is queued
                bound.append(seq)
        except BaseException:
            for seq in seqs:
                if seq in bound:
                    self.adapters.release(seq)
                if seq.sampling is not None:
                    seq.sampling.release()
            raise
        for seq in seqs:
            self.requests[seq.request_id] = seq
        self.scheduler.add(seqs[0])
        if len(seqs) > 1:
            if self.cfg.enable_prefix_caching:
                self.siblings.hold(seqs[0], seqs[1:])
            else:  # nothing to share: each computes the prompt
                for seq in seqs[1:]:
                    self.scheduler.add(seq)
        return request_id

    def _new_sequence(self, index: int, seq_id: str, ids: list[int], params: SamplingParams,
                      adapter: str | None) -> Sequence:
        own = params.sibling(index) if params.n > 1 else params
        seq = Sequence(seq_id, ids, own, adapter, index=index,
                       max_len=min(len(ids) + params.max_tokens, self.max_seq_tokens))
        if params.min_tokens and not params.ignore_eos:
            seq.suppress_ids = self.eos_ids
        if own.shapes_logits:
            state = SequenceSampling(bias_ids=tuple(t for t, _ in own.logit_bias),
                                     bias_values=tuple(b for _, b in own.logit_bias))
            if own.structured is not None:
                state.grammar = self.grammars.matcher(own.structured)
            if own.penalised:
                state.counts = self.token_counts
            seq.sampling = state
        return seq

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise InvalidSamplingParamsError(
                f"logit_bias: token id {params.logit_bias[-1][0]} is not in the vocabulary "
                f"[0, {vocab})", "logit_bias")

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MetraleError("this model has no tokenizer: pass the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(map(int, prompt))
        if not ids:
            raise InvalidSamplingParamsError("the prompt is empty")
        vocab = self.model_config.vocab_size
        # min/max run in C: an 8k-token prompt's check took ~0.5 ms of the engine loop
        # as a generator, time every decoding request waited for
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidSamplingParamsError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def abort(self, request_id: str) -> None:
        self._end(request_id, "abort")

    def reset_prefix_cache(self) -> int:
        """vLLM's reset_prefix_cache: returns how many cached blocks were dropped."""
        return self.blocks.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (a single-device engine holds nothing
        to stop)."""
        if self.tp is not None:
            self.tp.close()

    # --- the loop ----------------------------------------------------------------------

    def call_soon(self, fn: Callable[[], object]) -> Future:
        """Run fn on the engine thread before the next step (thread-safe)."""
        future: Future = Future()
        self._commands.put((fn, future))
        return future

    def step(self) -> list[RequestOutput]:
        """Schedule, launch, process outputs. With async scheduling the step launched here
        runs on the device while the host processes the previous one's outputs: a step
        returns the outputs of the one before it."""
        outputs = self._between_steps()
        batch = self.scheduler.schedule()
        launched = None
        if batch:
            in_flight = self._in_flight.sampled.tokens if self._in_flight else None
            launched = _InFlight(batch, self.runner.run(batch, in_flight))
            self.scheduler.launched(batch)
        if self._in_flight is not None:
            outputs += self._complete(self._in_flight)
        if launched is not None:  # a draw waiting for the tokens just processed (grammars)
            launched.sampled.finish()
        self._in_flight = launched
        if launched is not None and (not self.async_scheduling or launched.sampled.ready):
            outputs += self._complete(launched)
            self._in_flight = None
        return outputs

    def _complete(self, step: _InFlight) -> list[RequestOutput]:
        """A launched step's tokens into outputs; end the requests they finish."""
        batch = step.batch
        outputs = self.output_processor.process(batch.sampling_seqs, step.sampled.results())
        self.scheduler.completed(batch)
        for shape, seconds in self.runner.timer.finished():
            self.scheduler.observe(shape, seconds)
        for out in outputs:
            if out.finished:
                self._end(out.request_id, out.finish_reason)
        for seq in self.siblings.released():  # n > 1: the prompt's blocks are published
            self.scheduler.add(seq)
        return outputs

    def wait_for_work(self, timeout: float) -> bool:
        """When a step produced nothing, block up to `timeout` for an in-flight promotion
        to move instead of spinning; False when nothing is in flight."""
        if self._in_flight is not None:
            return True  # a launched step: the next step() returns its outputs
        if self.adapters.promoting() is None:
            return False
        if self._commands.empty():
            self.adapters.job.wait(timeout)
        return True

    def _between_steps(self) -> list[RequestOutput]:
        """Commands, then unloads and promotions: every adapter change lands here (its
        device writes queue behind the step in flight, which may still read the slot)."""
        self._run_commands()
        self.adapters.finish_unloads()
        outputs = [failed_output(seq) for seq in self.adapters.advance(time.monotonic())]
        for out in outputs:
            self._end(out.request_id, out.finish_reason)
        return outputs

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the caller gets it; the loop goes on
                    future.set_exception(e)

    def _end(self, request_id: str, reason: str | None) -> None:
        """Free what a finished or aborted request holds (its KV, its slot reference)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)
            self.adapters.release(seq)
            seq.finish_reason = reason
            if seq.sampling is not None:
                seq.sampling.release()

    # --- adapters: the registry's operations ----------------------------------------------

    def check_adapter(self, name: str, source: str | Path | AdapterSource) -> AdapterSource:
        """Validate a disk adapter's files and weights against this engine, once, at
        registration (thread-safe); with source.verify_on_landing its config and header
        only (its first landing checks the weights, before a slot is chosen). A peer is checked against the
        allow-list and asked whether it holds the id; its manifest is validated when it
        lands."""
        source = AdapterSource.of(source)
        if source.path is not None:
            plan = plan_adapter(source.path, name, self.model_config, self.lora.pool_config,
                                source.root)
            if not source.verify_on_landing:  # reads the whole file: ~40-85 ms for 84 MB
                check_weights(plan, self.dtype)  # NaN/Inf, or too large for the pool's dtype
        else:  # a peer off the allow-list could never land: refuse it before contacting it
            addr = resolve_peer(source.peer.addr, self.cfg.peer_allow or None)
            check_peer_holds(addr, source.peer.adapter_id, self.cfg.peer_timeout_s)
            self._warm_up_peer(name, source, f"{addr.ip}:{addr.port}")
        return source

    def _warm_up_peer(self, name: str, source: AdapterSource, peer_key: str) -> None:
        """On a GPU, the first adapter registered from a peer warms the path (warm_up_peer:
        its plan, agent, runs and memory mapping), so that its first landing costs about a
        warm one, not ~14x. Best effort: a landing reports what fails here."""
        peer, pool = source.peer, self.lora.landing_pool  # the pool peer plans are cached for
        if not warms_peers(pool) or source.peft is not None \
                or self.cfg.peer_transport == "http" or plan_cache_for(pool).knows(peer_key):
            return
        try:
            transport = warm_up_peer(self.lora, peer.addr, peer.adapter_id,
                                     transport=self.cfg.peer_transport,
                                     timeout_s=self.cfg.peer_timeout_s,
                                     peer_allow=self.cfg.peer_allow or None)
            log.info("peer %s warmed up for %r (%s)", peer.addr, name, transport)
        except MetraleError as e:
            log.info("peer %s not warmed up for %r: %s", peer.addr, name, e)

    def read_adapter(self, name: str, source: AdapterSource) -> Future:
        """Promoter.read (thread-safe)."""
        return self.adapters.promoter.read(name, source)

    def register_adapter(self, name: str, source: str | Path | AdapterSource, pinned: bool = False,
                         reload: bool = False, checked: bool = False,
                         prepared: Prepared | None = None) -> AdapterVersion:
        """Register `name` (reload=True: a new version; requests in flight finish on the
        old one). Pinned adapters land now; a pinned name's reload lands into its own slot
        once idle. checked: check_adapter ran already; prepared: the bytes, read off this
        thread (used if it lands now)."""
        self.registry.check_new(name, reload)  # the one name check of this operation
        source = self.check_adapter(name, source) if not checked else AdapterSource.of(source)
        old = self.registry.get(name)
        own = self.registry.slot_of(name)
        if pinned or (old is not None and old.pinned):
            if own is None or not self.lora.table.ref_count(own):
                self.adapters.promote(self.registry.new_version(name, source, True), own,
                                      prepared, installs=True)
                return self.registry.current(name)
        if prepared is not None:
            prepared.close()
        return self.registry.install(self.registry.new_version(name, source, pinned))

    def unload_adapter(self, name: str) -> str:
        """'unloaded', or 'draining' while its slot still serves in-flight requests."""
        return self.adapters.unload(name)

    def pin_adapter(self, name: str, pinned: bool = True,
                    prepared: Prepared | None = None) -> AdapterVersion:
        """Pinning a non-resident adapter lands it now."""
        version = self.registry.current(name)
        if pinned and self.registry.slot_of(name) is None:
            self.promote(version, None, prepared)
        elif prepared is not None:
            prepared.close()
        return self.registry.set_pinned(name, pinned)

    def promote(self, version: AdapterVersion, slot: int | None = None,
             prepared: Prepared | None = None,
             origin: AdapterSource | None = None) -> tuple[int, str | None]:
        """Land a registered version now, into `slot` or a victim: (slot, evicted).
        origin: where `prepared` was read from, when not the version's source."""
        return self.adapters.promote(version, slot, prepared, origin)

    # --- the seed's four operations: land these bytes as a new version of `name` now ------

    def swap_lora_slot_from_disk(self, adapter_dir: str | Path | AdapterSource, name: str, slot: int,
                                 prepared: Prepared | None = None, reload: bool = True) -> None:
        """prepared: the files' bytes, read and checked off this thread (the server does);
        reload=False: refuse a registered name (the server's swap of a new registration).
        An AdapterSource keeps its root (the server's --adapter-root confinement)."""
        self._land_new(name, _unchecked_dir(adapter_dir, prepared), slot, prepared, reload)

    def promote_lora_slot_from_disk(self, adapter_dir: str | Path,
                                    name: str) -> tuple[int, str | None]:
        return self._land_new(name, _unchecked_dir(adapter_dir))

    def swap_lora_slot_from_peer(self, peer_addr: str, adapter_id: str, adapter_name: str,
                                 slot: int, peft=None) -> None:
        self._land_new(adapter_name, AdapterSource(peer=PeerRef(peer_addr, adapter_id), peft=peft),
                       slot)

    def promote_lora_slot_from_peer(self, peer_addr: str, adapter_id: str, adapter_name: str,
                                    peft=None) -> tuple[int, str | None]:
        return self._land_new(adapter_name,
                              AdapterSource(peer=PeerRef(peer_addr, adapter_id), peft=peft))

    def _land_new(self, name: str, source: AdapterSource, slot: int | None = None,
                  prepared: Prepared | None = None, reload: bool = True) -> tuple[int, str | None]:
        try:
            self.registry.check_new(name, reload)
        except MetraleError:
            if prepared is not None:
                prepared.close()
            raise
        return self.adapters.promote(self.registry.new_version(name, source), slot, prepared,
                                     installs=True)

    def slot_info(self) -> list[SlotInfo]:
        return self.lora.table.infos()

    def check_integrity(self) -> None:
        """The registry and the slot table agree (tests and debugging)."""
        self.registry.check_integrity(self.lora.table)

    def residency(self) -> list[ResidencyRow]:
        return residency_rows(self.registry, self.lora.table, loading_of(self.adapters.job))


def _unchecked_dir(adapter_dir: str | Path | AdapterSource,
                   prepared: Prepared | None = None) -> AdapterSource:
    """A directory landed without a registration: no check_weights read it (unless the
    caller's `prepared` came from check_adapter), so its landings bound the weights."""
    if isinstance(adapter_dir, AdapterSource):
        return replace(adapter_dir, verify_on_landing=prepared is None)
    return AdapterSource(path=Path(adapter_dir), verify_on_landing=prepared is None)
