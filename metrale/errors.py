"""Typed refusals. Every error metrale raises on purpose derives from MetraleError.

Each message says what went wrong and what to change; callers (the server, the
CLI) map the classes to status codes, never the message text.
"""

from __future__ import annotations


class MetraleError(Exception):
    """Base of every deliberate metrale refusal."""


# --- pool / slot refusals (nothing was touched) -------------------------------


class NoAdapterPoolError(MetraleError):
    """The engine was started without LoRA (max_loras == 0)."""


class RuntimeSwapsDisabledError(MetraleError):
    """Runtime swaps are switched off by configuration (the seed's 'rotation not armed')."""


class SlotOutOfRangeError(MetraleError):
    """slot >= max_loras or negative."""


class SlotBusyError(MetraleError):
    """The slot has in-flight sequences; an adapter is never replaced mid-decode."""


class PoolFullError(MetraleError):
    """Every cache slot is busy or pinned; retry once a sequence finishes."""


class AllSlotsPinnedError(PoolFullError):
    """Every slot is pinned: waiting cannot help, only an unpin or a bigger pool."""


class SlotPinnedError(SlotBusyError):
    """A swap into a slot whose adapter is pinned; unpin it first."""


class UnknownAdapterError(MetraleError):
    """No adapter of that name is registered or resident."""


class DrainingAdapterError(UnknownAdapterError):
    """The name was unloaded and its slot still serves requests that started before: new
    requests find no adapter of that name (404)."""


class AdapterExistsError(MetraleError):
    """register() of a name that is already registered, without reload."""


class StaleVersionError(MetraleError):
    """An operation on an adapter version that a reload or an unload replaced meanwhile."""


class InvalidNameError(MetraleError):
    """An adapter name that could break routing, URLs, metrics labels or paths."""


class PeerUnavailableError(MetraleError):
    """Peer staging is not available in this build or the peer could not be reached."""


class ObjectStoreError(PeerUnavailableError):
    """An adapter store (an S3 bucket, the Hugging Face Hub: an upstream, as a peer is, 502)
    refused a request, broke off a download, missed its deadline or sent bytes that fail
    their checks; nothing was published to the cache."""


class SourceBusyError(MetraleError):
    """Every fetch slot of one adapter source stayed taken for a whole deadline (a slow
    store): this look-up was not started; retry later (503). Other sources are unaffected."""


# --- adapter refusals (validated before any slot is touched) -------------------


class AdapterError(MetraleError):
    """The adapter cannot be served; the message names the part to change."""


class AdapterFileError(AdapterError):
    """Unreadable, truncated, non-safetensors or lying file, or pickled weights."""


class AdapterOutsideRootError(AdapterFileError):
    """A file of the adapter resolves outside the root it was found in (an --adapter-source,
    an --adapter-root, a download cache): a symlink out, or its directory swapped for one.
    Nothing outside was opened."""


class AdapterConfigError(AdapterError):
    """adapter_config.json is missing, malformed or inconsistent."""


class UnsupportedAdapterError(AdapterError):
    """A PEFT feature this engine does not serve yet (DoRA, bias, modules_to_save, MoE...)."""


class AdapterMismatchError(AdapterError):
    """The adapter does not fit the base model or the pool: rank, targets, shapes, dtype."""


class NonFiniteWeightsError(AdapterFileError):
    """The adapter holds NaN or Inf."""


class LandingError(MetraleError):
    """A landing failed after the slot was zeroed; the slot is now EMPTY with a new identity."""

    @staticmethod
    def caused_by(reason: BaseException | str, message: str) -> LandingError:
        """The error for a landing that `reason` ended. A typed refusal keeps its class: a
        peer lost mid-transfer is the same fault (502) as one lost before it, weights refused
        in the slot the same (422) as weights refused in staging; only the rest is ours (500)."""
        if isinstance(reason, PeerUnavailableError):
            return PeerLandingError(message)
        if isinstance(reason, NonFiniteWeightsError):
            return WeightsLandingError(message)
        if isinstance(reason, AdapterError):
            return AdapterLandingError(message)
        return LandingError(message)


class PeerLandingError(PeerUnavailableError, LandingError):
    """The peer failed or vanished while its bytes were landing (the slot is EMPTY)."""


class AdapterLandingError(AdapterError, LandingError):
    """The landed bytes were refused in the slot, e.g. NaN/Inf in the pool's dtype (the slot is EMPTY)."""


class WeightsLandingError(NonFiniteWeightsError, AdapterLandingError):
    """The landed weights hold NaN/Inf in the pool's dtype, or could overflow it (the slot
    is EMPTY)."""


class TensorParallelWorkerError(MetraleError):
    """A tensor-parallel worker could not start (load its shard, build its pool or KV cache);
    the message names the rank and its error."""


class ShardLandingError(LandingError):
    """A rank of a tensor-parallel group could not land its slice of an adapter: no rank
    committed, and the slot is EMPTY on every rank."""


class ChatTemplateError(MetraleError):
    """The model has no chat template, or its template refused the messages."""


# --- generation failures (one sequence fails, the batch goes on) ----------------


class SamplingError(MetraleError):
    """No token could be drawn for one sequence (its logits were NaN, +inf or all -inf);
    only that sequence fails."""


class ExtraTargetsRequiredError(AdapterMismatchError):
    """The adapter has LoRA on embed_tokens / lm_head, and the engine was started without
    pool memory for them (lora_extra_targets / --lora-extra-targets)."""
