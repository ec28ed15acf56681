"""OutputProcessor: sampled tokens -> RequestOutputs (detokenised, stop strings, length
limits, finished or not). The engine frees what finished requests hold."""

from __future__ import annotations

from metrale.engine.detokenizer import detokenize_new
from metrale.engine.outputs import Prefix, RequestOutput
from metrale.engine.sampler import SampleResult
from metrale.engine.sequence import Sequence
from metrale.errors import SamplingError


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_seq_tokens: int) -> None:
        self.tokenizer, self.eos_ids, self.max_seq_tokens = tokenizer, eos_ids, max_seq_tokens

    def process(self, seqs: list[Sequence], results: list[SampleResult]) -> list[RequestOutput]:
        """seqs: the step's sampling sequences; one that ended meanwhile drops its token."""
        outputs = []
        for seq, result in zip(seqs, results, strict=True):
            if seq.is_finished:
                continue
            seq.num_pending -= 1
            if result.error is not None:  # a bad row fails its own sequence, never the batch
                seq.error = result.error
                outputs.append(failed_output(seq))
            elif not _grammar_accepts(seq, result.token):
                seq.error = SamplingError(
                    f"request {seq.request_id}: its grammar refused token {result.token}")
                outputs.append(failed_output(seq))
            else:
                outputs.append(self._append(seq, result.token, result.logprob))
        return outputs

    def _append(self, seq: Sequence, token: int, lp: dict | None) -> RequestOutput:
        seq.output_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        p = seq.params
        early = len(seq.output_ids) < p.min_tokens
        reason = "stop" if token in self.eos_ids and not p.ignore_eos and not early else None
        if reason is None and seq.sampling is not None and seq.sampling.grammar is not None \
                and seq.sampling.grammar.is_terminated:
            reason = "stop"  # the grammar is complete and took its stop token: nothing may follow
        if reason is None and (len(seq.output_ids) >= p.max_tokens or seq.known_len >= self.max_seq_tokens):
            reason = "length"
        searched = len(seq.detok.text)  # stop strings ending before here were looked for
        if self.tokenizer is not None:
            detokenize_new(self.tokenizer, seq.output_ids, seq.detok, final=reason is not None)
        full = seq.detok.text
        if p.stop and not early:
            full, stopped = self._apply_stops(seq, full, searched)
            reason = stopped or reason
        prev = seq.text
        seq.text = full if reason else _stable_prefix(full, p.stop, prev)
        out = output_of(seq, delta_text=seq.text[len(prev):], delta_ids=[token])
        if reason is not None:
            out.finished, out.finish_reason = True, reason
        return out

    def _apply_stops(self, seq: Sequence, full: str, searched: int) -> tuple[str, str | None]:
        """searched: the text before it was looked through already (a stop string may
        still end after it), so each token's search costs its own text, not the output's."""
        p = seq.params
        if p.min_tokens and len(seq.output_ids) == p.min_tokens:
            # the first token that may stop: only stop strings ending in its text count
            seq.stop_from = searched
        for stop in p.stop:
            at = full.find(stop, max(0, max(seq.stop_from, searched) - len(stop) + 1))
            if at >= 0:
                return full[:at], "stop"
        return full, None


def _grammar_accepts(seq: Sequence, token: int) -> bool:
    """Advance seq's grammar past its new token (the mask allowed only such tokens: False
    would be a bug, failing this sequence alone)."""
    state = seq.sampling
    return state is None or state.grammar is None or state.grammar.accept(token)


def output_of(seq: Sequence, delta_text: str = "", delta_ids: list[int] | None = None) -> RequestOutput:
    bound, ran = seq.bound_at, seq.scheduled_at
    return RequestOutput(
        seq.request_id, seq.prompt_ids, seq.text, Prefix(seq.output_ids), False,
        delta_text=delta_text, delta_token_ids=delta_ids or [],
        logprobs=Prefix(seq.logprobs), adapter=seq.adapter, num_cached_tokens=seq.num_cached_tokens,
        adapter_wait_s=None if bound is None else bound - seq.arrival,
        queue_wait_s=None if bound is None or ran is None else ran - bound,
        index=seq.index, prompt_logprobs=_prompt_logprobs(seq),
    )


def _prompt_logprobs(seq: Sequence) -> list[dict | None] | None:
    """Once every prompt token has its entry (the prefill computed them all)."""
    n = len(seq.prompt_ids)
    if seq.params.prompt_logprobs is None or len(seq.prompt_logprobs) < n - 1:
        return None
    return [None] + [seq.prompt_logprobs[p] for p in range(1, n)]


def failed_output(seq: Sequence) -> RequestOutput:
    out = output_of(seq)
    out.finished, out.finish_reason, out.error = True, "error", seq.error
    return out


def _stable_prefix(full: str, stops: tuple[str, ...], emitted: str) -> str:
    """The part of `full` that can be streamed now: never text a stop string may still cut,
    nor a half-decoded character, nor less than or other than what was already sent."""
    hold = max((len(s) for s in stops), default=1) - 1
    stable = full[:len(full) - hold] if hold else full
    stable = stable.rstrip("\ufffd")
    return stable if stable.startswith(emitted) and len(stable) >= len(emitted) else emitted
