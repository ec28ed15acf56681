"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, after the
requests' own logit shaping (grammar masks, logit bias, penalties: logits_shaping.py).

One sequence's bad logits (NaN, +inf, nothing above -inf) fail that sequence alone, and
never reach a draw (torch.multinomial on CUDA would trip a device-side assert and take the
engine down). Rows without a seed draw together; a seeded row draws alone from its own
generator, so its tokens do not depend on what shares its batch.

A grammar's mask for a step depends on the token the step before drew. With async
scheduling that token is still on the device when the step is launched: the draw is then
deferred (DeferredDraw) until the host has processed the previous step, so the grammar
work runs on the host while the device runs the step's forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.engine.logits_shaping import shape_logits, shaped_rows
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.sequence import Sequence
from metrale.engine.uploads import upload
from metrale.errors import MetraleError, SamplingError


@dataclass(frozen=True)
class SampleResult:
    """A token (plus its logprobs where asked), or the error that failed the sequence."""

    token: int | None
    logprob: dict | None = None
    error: MetraleError | None = None


class SampledTokens:
    """One step's draws. tokens [B] stays on the device, where the next step may read its
    inputs (async scheduling); results() waits for the host copy. A batch with a seeded
    row or logprobs is resolved when drawn (the next step overwrites a graph's logits)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, row_max: torch.Tensor,
                 finite: torch.Tensor) -> None:
        self.seqs, self.tokens, self.row_max = seqs, tokens, row_max  # [B] each
        pin = tokens.is_cuda
        self._host = torch.empty((2, len(seqs)), dtype=torch.int64, pin_memory=pin)  # [2, B]
        self._host.copy_(torch.stack((finite.long(), tokens)), non_blocking=pin)
        self._copied = torch.cuda.Event() if pin else None
        if self._copied is not None:
            self._copied.record()
        self._results: list[SampleResult] | None = None

    @property
    def ready(self) -> bool:
        """Whether results() is known without waiting on the device for it."""
        return self._results is not None

    def finish(self) -> None:
        """Drawn already (DeferredDraw draws here)."""

    def results(self) -> list[SampleResult]:
        if self._results is None:
            if self._copied is not None:
                self._copied.synchronize()
            usable, tokens = self._host.tolist()
            self._results = [SampleResult(t) if ok else self._failed(i)
                             for i, (ok, t) in enumerate(zip(usable, tokens))]
        return self._results

    def _failed(self, i: int) -> SampleResult:
        seq = self.seqs[i]
        blame = "" if seq.adapter is None else "; the adapter's weights may overflow the pool's dtype"
        return SampleResult(None, error=SamplingError(
            f"{_who(seq)}: the model produced non-finite logits (max {float(self.row_max[i])}); "
            f"no token can be drawn{blame}"))

    def resolve(self, logits: torch.Tensor) -> None:
        """Now, on the host: the seeded sampled rows and the logprobs (both read logits)."""
        results, seqs = self.results(), self.seqs
        seeded = {}
        for i, seq in enumerate(seqs):
            if results[i].error is None and not seq.params.greedy and seq.params.seed is not None:
                try:
                    if seq.generator is None:
                        seq.generator = torch.Generator(logits.device).manual_seed(seq.params.seed)
                    seeded[i] = int(_sample_rows(logits[i:i + 1], self.row_max[i:i + 1],
                                                 [seq.params], seq.generator)[0])
                except RuntimeError as e:  # a backstop: the row is checked, this must not happen
                    results[i] = SampleResult(
                        None, error=SamplingError(f"{_who(seq)}: sampling failed: {e}"))
        if seeded:  # the device copy too: a next step may read its inputs from it
            self.tokens[list(seeded)] = torch.tensor(list(seeded.values()), device=self.tokens.device)
        tokens = [seeded.get(i, r.token) for i, r in enumerate(results)]
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and results[i].error is None]
        logprobs = _logprobs(logits, seqs, tokens, wanted)
        self._results = [r if r.error is not None else SampleResult(tokens[i], logprobs.get(i))
                         for i, r in enumerate(results)]


def _who(seq: Sequence) -> str:
    """The request, and the adapter it ran with: a failure may be the adapter's."""
    return f"request {seq.request_id}" + ("" if seq.adapter is None else f" on adapter {seq.adapter!r}")


def needs_logits(seq: Sequence) -> bool:
    """Whether drawing seq's token reads its logits on the host (no deferred result)."""
    p = seq.params
    return p.logprobs is not None or (not p.greedy and p.seed is not None)


class DeferredDraw:
    """A step's draw that waits for the host to know the previous step's tokens (a
    grammar row's mask needs them): finish() draws, after the engine processed that step
    and while the device still runs this one's forward pass. Until then the logits stay
    in their buffer: nothing else runs on the device between the two."""

    def __init__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        self.seqs, self._logits = seqs, logits
        self._drawn: SampledTokens | None = None

    @torch.inference_mode()  # as runner.run, whose step this draw ends
    def finish(self) -> None:
        if self._drawn is None:
            self._drawn = _draw_now(self._logits, self.seqs, shaped_rows(self.seqs))
            self._logits = None

    def _finished(self) -> SampledTokens:
        if self._drawn is None:
            raise RuntimeError("a deferred draw was read before finish()")
        return self._drawn

    @property
    def tokens(self) -> torch.Tensor:
        return self._finished().tokens

    @property
    def ready(self) -> bool:
        return self._drawn is not None and self._drawn.ready

    def results(self) -> list[SampleResult]:
        return self._finished().results()


def waits_for_token(seq: Sequence) -> bool:
    """Whether seq's logits cannot be shaped yet: its grammar has a token in flight."""
    return seq.num_pending > 0 and seq.sampling is not None and seq.sampling.grammar is not None


def draw(logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens | DeferredDraw:
    """logits: [B, V] float32 -> the batch's tokens, queued on logits' device (deferred
    when a grammar row waits for its previous token)."""
    shaped = shaped_rows(seqs)  # a plain batch: empty, and nothing below runs for it
    if any(waits_for_token(seqs[i]) for i in shaped):
        return DeferredDraw(logits, seqs)
    return _draw_now(logits, seqs, shaped)


def _draw_now(logits: torch.Tensor, seqs: list[Sequence], shaped: list[int]) -> SampledTokens:
    logits = shape_logits(logits, seqs, shaped)
    # One reduction for the batch: the argmax of every greedy row, and the row max,
    # which is finite exactly when the row has no NaN, no +inf and some finite value.
    row_max, argmax = logits.max(dim=-1)  # [B], [B]
    finite = torch.isfinite(row_max)  # [B]
    # rows without a seed draw together (one kernel per stage for all of them); seeded
    # rows draw alone from their own generator (resolve), so a seed gives the same tokens
    # whatever shares the batch
    batched = [i for i, s in enumerate(seqs) if not s.params.greedy and s.params.seed is None]
    drawn = argmax
    if batched:
        rows = upload(batched, torch.int64, logits.device)  # [N]
        drawn = argmax.index_put((rows,), _sample_rows(logits[rows], row_max[rows],
                                                       [seqs[i].params for i in batched]))
    sampled = SampledTokens(seqs, drawn, row_max, finite)
    if any(needs_logits(s) for s in seqs):
        sampled.resolve(logits)
    _count(seqs, shaped, sampled.tokens)
    return sampled


def _count(seqs: list[Sequence], shaped: list[int], tokens: torch.Tensor) -> None:
    """The penalised rows' drawn tokens into their counts, on the device (the next step
    reads them behind this one). A failed row's token is counted too: it ends its sequence."""
    rows = [i for i in shaped if seqs[i].sampling is not None and seqs[i].sampling.penalised]
    if rows:
        table = seqs[rows[0]].sampling.counts
        dev = tokens.device
        at = upload(rows, torch.int64, dev)
        counts_rows = [seqs[i].sampling.row(seqs[i].prompt_ids, seqs[i].output_ids) for i in rows]
        table.count(upload(counts_rows, torch.int64, dev), tokens.index_select(0, at))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
    """logits: [B, V] float32 -> one result per sequence, in order (waits for them)."""
    return _draw_now(logits, seqs, shaped_rows(seqs)).results()


def _sample_rows(x: torch.Tensor, row_max: torch.Tensor, params: list[SamplingParams],
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """x: [N, V] logits and row_max [N] their row maxima -> [N] tokens (temperature, min-p,
    top-k, top-p), one kernel per stage for all rows. A row whose max is not finite draws from a
    stand-in (all zeros) that the caller discards."""
    vocab, dev = x.shape[1], x.device
    finite = torch.isfinite(row_max)[:, None]  # [N, 1]
    inv_temp = upload([1 / p.temperature for p in params], x.dtype, dev)[:, None]  # [N, 1]
    # max 0 before scaling by 1/T: a tiny temperature must not overflow finite logits to inf
    x = x.sub(torch.where(finite, row_max[:, None], 0.0)).mul_(inv_temp).masked_fill_(~finite, 0.0)
    min_p = [p.min_p for p in params]
    if max(min_p) > 0:
        # the row max is 0 now: a token's probability over the top one's is exp(x), so
        # p >= min_p * p_max is x >= log(min_p) (log 0 = -inf keeps every token)
        floor = upload(min_p, x.dtype, dev).log()[:, None]  # [N, 1]
        x = x.masked_fill(x < floor, float("-inf"))
    ks = [min(p.top_k, vocab) if p.top_k else vocab for p in params]
    if min(ks) < vocab:
        top = torch.topk(x, max(ks), dim=-1).values  # [N, kmax], descending
        kth = top.gather(1, upload(ks, torch.int64, dev)[:, None] - 1)  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [N, V]
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        p_t = upload(top_p, x.dtype, dev)[:, None]  # [N, 1]
        sorted_p, order = _nucleus_candidates(probs, p_t)  # [N, C], C <= V
        drop = sorted_p.cumsum(-1) - sorted_p >= p_t
        # the top token always stays (a top_p under float32's smallest value rounds to 0)
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))
    # inverse CDF with one uniform per row: multinomial's distribution at a fraction of
    # its cost (it draws per element: 0.7 ms a row of 49k on one CPU core). A token of
    # zero probability adds nothing to the CDF, so no u can land on it; u stays below
    # the row's total so it lands on a token.
    cdf = probs.cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    u = torch.rand(total.shape, generator=generator, dtype=total.dtype, device=dev) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)  # [N]


NUCLEUS_CANDIDATES = 1024  # on the CPU, top-p first looks among this many tokens


def _nucleus_candidates(probs: torch.Tensor, top_p: torch.Tensor):
    """(probabilities, token ids) [N, C] in descending order, C <= V, holding every row's
    top-p nucleus. On the CPU a full sort of a 49k vocabulary costs ~1.4 ms a row, and the
    top NUCLEUS_CANDIDATES hold the nucleus of any but a near-flat row (on a GPU sorting
    is cheap and the check would cost a sync)."""
    if not probs.is_cuda and probs.shape[1] > NUCLEUS_CANDIDATES:
        vals, ids = probs.topk(NUCLEUS_CANDIDATES, dim=-1)  # [N, C], descending
        if bool((vals.sum(-1, keepdim=True) >= top_p).all()):
            return vals, ids
    return probs.sort(dim=-1, descending=True)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int],
              wanted: list[int]) -> dict[int, dict]:
    if not wanted:
        return {}
    lp = torch.log_softmax(logits[wanted], dim=-1)  # [W, V]
    # a -inf logit (masked, or overflowed in half precision) must still serialise as JSON
    lp = lp.clamp(min=torch.finfo(lp.dtype).min)
    out = {}
    for row, i in enumerate(wanted):
        k = min(seqs[i].params.logprobs, lp.shape[-1])
        top = torch.topk(lp[row], k) if k else None
        out[i] = {
            "token": tokens[i], "logprob": float(lp[row, tokens[i]]),
            "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())),
        }
    return out
