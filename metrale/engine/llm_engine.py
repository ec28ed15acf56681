"""LLMEngine: requests in, one batched step at a time, outputs out.

Adapter operations run between steps on the thread that calls step(): call
them directly from that thread, or hand them to `call_soon` from another (the
server does). A swap needs only *its* slot to be idle, never an empty server.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import torch

from metrale.config import EngineConfig, ModelConfig, parse_dtype
from metrale.engine.adapters import AdapterManager, AdapterSource, PeerRef
from metrale.engine.block_manager import BlockManager
from metrale.engine.outputs import RequestOutput
from metrale.engine.runner import ModelRunner
from metrale.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from metrale.engine.scheduler import Scheduler
from metrale.engine.sequence import Sequence
from metrale.errors import MetraleError, UnknownAdapterError
from metrale.model.llama import LlamaForCausalLM
from metrale.model.loader import load_model
from metrale.pool.slots import SlotInfo
from metrale.pool.swap import LoraSlots

log = logging.getLogger("metrale.engine")
_IDLE_WAIT_S = 0.01  # an idle step re-checks for commands this often while a promotion runs


class LLMEngine:
    def __init__(self, model_dir: str | Path, cfg: EngineConfig, tokenizer=None,
                 model: LlamaForCausalLM | None = None) -> None:
        """model: an already built model for model_dir's config.json (benchmarks build
        random-weight models on the device); None loads model_dir's weights."""
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(model_dir)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # kernels launch on the current device: make it this engine's (e.g. cuda:1)
            torch.cuda.set_device(self.device)
        self.dtype = parse_dtype(cfg.dtype)
        self.tokenizer = tokenizer
        if model is None:
            model = load_model(model_dir, self.model_config, self.dtype, self.device,
                               cfg.max_model_len)
        self.lora = LoraSlots(self.model_config, cfg.pool, self.device, self.dtype)
        self.adapters = AdapterManager(
            self.lora, cfg.promotion_timeout_s,
            lambda ref, name: self.lora_promote_from_peer_ref(ref, name),
            async_promotions=cfg.async_promotions)
        self.runner = ModelRunner(model, self.model_config, cfg, self.device, self.dtype,
                                  self.lora.pool)
        self.blocks = BlockManager(self.runner.num_blocks, cfg.block_size,
                                   cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.eos_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.max_seq_tokens = min(cfg.max_model_len, self.runner.num_blocks * cfg.block_size)

    # --- requests ----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None) -> str:
        params = sampling_params or SamplingParams()
        ids = self._encode(prompt)
        if len(ids) + params.max_tokens > self.max_seq_tokens:
            raise InvalidSamplingParamsError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"engine's limit of {self.max_seq_tokens} tokens (max_model_len)"
            )
        if adapter is not None and self.lora.pool is None:
            raise UnknownAdapterError("this engine was started without LoRA (max_loras=0)")
        self.adapters.check_known(adapter)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise MetraleError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, adapter)
        self.adapters.bind(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MetraleError("this model has no tokenizer: pass the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidSamplingParamsError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidSamplingParamsError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the loop ----------------------------------------------------------------------

    def call_soon(self, fn: Callable[[], object]) -> Future:
        """Run fn on the engine thread before the next step (thread-safe)."""
        future: Future = Future()
        self._commands.put((fn, future))
        return future

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

    def step(self) -> list[RequestOutput]:
        self._run_commands()
        outputs = self._promotions()
        seqs, is_prefill = self.scheduler.schedule()
        while not seqs and self.adapters.promotion_busy() and self._commands.empty():
            # nothing to decode: wait for the in-flight promotion rather than spin
            self.adapters.wait_promotion(_IDLE_WAIT_S)
            outputs += self._promotions()
            seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return outputs
        results = self.runner.run(seqs, is_prefill)
        now = time.monotonic()
        for seq, result in zip(seqs, results):
            if result.error is not None:  # a bad row fails its own sequence, never the batch
                seq.error = result.error
                outputs.append(self._fail(seq))
                continue
            outputs.append(self._append(seq, result.token, result.logprob, now))
        return outputs

    def _promotions(self) -> list[RequestOutput]:
        outputs = [self._fail(s) for s in self.adapters.run_promotions()]
        return outputs + [self._fail(s) for s in self.adapters.expire(time.monotonic())]

    def _append(self, seq: Sequence, token: int, lp: dict | None, now: float) -> RequestOutput:
        seq.output_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        seq.first_token_time = seq.first_token_time or now
        p = seq.params
        reason = "stop" if token in self.eos_ids and not p.ignore_eos else None
        full = self._decode(seq.output_ids)
        for stop in p.stop:
            at = full.find(stop)
            if at >= 0:
                full, reason = full[:at], "stop"
                break
        if reason is None and (len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_seq_tokens):
            reason = "length"
        prev = seq.text
        seq.text = full if reason else _stable_prefix(full, p.stop, prev)
        out = self._output(seq, delta_text=seq.text[len(prev):], delta_ids=[token])
        if reason is not None:
            self.requests.pop(seq.request_id, None)
            self._finish(seq, reason)
            out.finished, out.finish_reason = True, reason
        return out

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq)
        self.adapters.release(seq)
        seq.finish_reason = reason

    def _fail(self, seq: Sequence) -> RequestOutput:
        self.requests.pop(seq.request_id, None)
        self._finish(seq, "error")
        out = self._output(seq, delta_text="", delta_ids=[])
        out.finished, out.finish_reason, out.error = True, "error", seq.error
        return out

    def _output(self, seq: Sequence, delta_text: str, delta_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            seq.request_id, seq.prompt_ids, seq.text, list(seq.output_ids), False,
            delta_text=delta_text, delta_token_ids=delta_ids,
            logprobs=list(seq.logprobs),
            adapter=seq.adapter, num_cached_tokens=seq.num_cached_tokens,
        )

    # --- adapter operations (between steps; the seed's names) ---------------------------

    def register_adapter(self, name: str, source: str | Path, pinned: bool = False) -> None:
        """source: a PEFT adapter dir or peer://host:port/ADAPTER_ID. Pinned adapters
        are landed now and their slot never becomes a promotion victim."""
        src = self.adapters.register(name, source, pinned)
        if pinned:
            slot = self.lora.table.slot_of(name)
            if slot is None:
                slot, _ = self.adapters.promote(src)
            self.lora.table.set_pinned(slot, True)

    def promote_registered(self, name: str) -> tuple[int, str | None]:
        """Land a registered adapter from wherever it comes from (disk or peer)."""
        self.adapters.check_known(name)
        result = self.adapters.promote(self.adapters.registry[name])
        self.adapters.bind_waiters(name)
        return result

    def swap_registered(self, name: str, slot: int) -> None:
        """Land a registered adapter into `slot` from its disk dir or its peer."""
        self.adapters.check_known(name)
        source = self.adapters.registry[name]
        if source.peer is not None:
            self.swap_lora_slot_from_peer(source.peer.addr, source.peer.adapter_id, name, slot)
        else:
            self.swap_lora_slot_from_disk(source.path, name, slot)

    def swap_lora_slot_from_disk(self, adapter_dir: str | Path, name: str, slot: int) -> None:
        self.lora.swap_lora_slot_from_disk(adapter_dir, name, slot)
        self._after_landing(AdapterSource(name, path=Path(adapter_dir)))

    def promote_lora_slot_from_disk(self, adapter_dir: str | Path,
                                    name: str) -> tuple[int, str | None]:
        result = self.lora.promote_lora_slot_from_disk(adapter_dir, name)
        self._after_landing(AdapterSource(name, path=Path(adapter_dir)))
        return result

    def swap_lora_slot_from_peer(self, peer_addr: str, adapter_id: str, adapter_name: str,
                                 slot: int, peft=None) -> None:
        from metrale.peer.landing import swap_from_peer

        swap_from_peer(self.lora, peer_addr, adapter_id, adapter_name, slot, peft,
                       **self._peer_options())
        self._after_landing(AdapterSource(adapter_name, peer=PeerRef(peer_addr, adapter_id)))

    def promote_lora_slot_from_peer(self, peer_addr: str, adapter_id: str, adapter_name: str,
                                    peft=None) -> tuple[int, str | None]:
        result = self.lora_promote_from_peer_ref(PeerRef(peer_addr, adapter_id), adapter_name, peft)
        self._after_landing(AdapterSource(adapter_name, peer=PeerRef(peer_addr, adapter_id)))
        return result

    def lora_promote_from_peer_ref(self, ref: PeerRef, name: str,
                                   peft=None) -> tuple[int, str | None]:
        from metrale.peer.landing import promote_from_peer

        return promote_from_peer(self.lora, ref.addr, ref.adapter_id, name, peft,
                                 **self._peer_options())

    def _peer_options(self) -> dict:
        cfg = self.cfg
        return dict(transport=cfg.peer_transport, timeout_s=cfg.peer_timeout_s,
                    peer_allow=cfg.peer_allow or None)

    def _after_landing(self, source: AdapterSource) -> None:
        """The name now routes to the new contents; remember where they came from
        so an eviction can be undone by a later request."""
        old = self.adapters.registry.get(source.name)
        self.adapters.registry[source.name] = replace(source, pinned=bool(old and old.pinned))
        self.adapters.bind_waiters(source.name)

    def slot_info(self) -> list[SlotInfo]:
        return self.lora.slot_info()


def _stable_prefix(full: str, stops: tuple[str, ...], emitted: str) -> str:
    """The part of `full` that can be streamed now: never text a stop string may
    still cut (hold back len(stop) - 1 chars), nor a half-decoded character, and
    never shorter than or different from what was already sent."""
    hold = max((len(s) for s in stops), default=1) - 1
    stable = full[:len(full) - hold] if hold else full
    stable = stable.rstrip("\ufffd")
    return stable if stable.startswith(emitted) and len(stable) >= len(emitted) else emitted
