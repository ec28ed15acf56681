"""Decode through CUDA graphs: padded static-buffer steps give transformers + PEFT's
tokens, graphs survive adapter swaps (replayed, never recaptured), and a batch with no
adapter token replays the graph that does no LoRA work.

On CPU the runner's static-buffer path runs eagerly (`capture=False`): padding rows, the
padding KV block and the buffer layout are checked exactly against HF in float32. The
`gpu` test captures real graphs in bf16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import SchedulerConfig
from metrale.engine import cuda_graphs
from metrale.ops import lora as lora_ops
from metrale.ops import lora_triton
from tests.helpers.kernels import KERNELS
from tests.helpers.reference import assert_greedy_close, check, prompts
from tests.helpers.tiny_models import GPU_DIMS, make_adapter, make_model, save_model

needs_kernels = pytest.mark.skipif(not KERNELS, reason="needs triton or its interpreter")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
# no logprobs: async scheduling overlaps these steps (logprobs make a step synchronous)
OVERLAPPED = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and [n, V] logprobs by full forwards (no EOS stop, no cache quirks)."""
    device = next(model.parameters()).device
    ids, rows = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()  # [V]
        rows.append(torch.log_softmax(logits, dim=-1).cpu())
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], torch.stack(rows)


def check_run(out, ref: tuple[list[int], torch.Tensor]) -> None:
    """out against hf_greedy's (tokens, logprobs): logprobs too where it has them."""
    if out.logprobs:
        check(out, *ref)
    else:
        assert out.token_ids == ref[0]


@pytest.fixture(scope="module")
def cpu_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    base = make_model("llama", seed=5)
    save_model(base, root / "model")
    peft = {n: make_adapter(base, root / n, seed=30 + i, r=4, lora_alpha=8,
                            target_modules="all-linear") for i, n in enumerate("AB")}
    return root, base, peft


def _static_buffer_llm(root, **kw):
    """6 rows through the CPU static-buffer graph path, adapters A and B in slots 0 and 1."""
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=64, max_num_seqs=6, **kw)
    graphs = llm.engine.runner.enable_graphs(capture=False)
    llm.engine.swap_lora_slot_from_disk(root / "A", "A", 0)
    llm.engine.swap_lora_slot_from_disk(root / "B", "B", 1)
    return llm, graphs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_static_buffer_path_matches_hf_across_swap(cpu_root, overlap):
    """overlap: async scheduling, each decode's input token read from the step before
    it on the device (graphs' pend_rows/pend_src)."""
    root, base, peft = cpu_root
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=64, max_num_seqs=6, async_scheduling=overlap)
    greedy = OVERLAPPED if overlap else GREEDY
    graphs = llm.engine.runner.enable_graphs(capture=False)
    assert graphs.sizes == [1, 2, 4, 6]
    engine = llm.engine
    engine.swap_lora_slot_from_disk(root / "A", "A", 1)
    ps = prompts(7, 3)  # 3 rows padded to the size-4 graph
    outs = llm.generate(ps, greedy, ["A", None, "A"])
    for p, out, model in zip(ps, outs, [peft["A"], base, peft["A"]]):
        check_run(out, hf_greedy(model, p, 8))
    assert graphs.replays[(4, True)] == 7  # 8 tokens: one prefill, 7 decode steps
    engine.swap_lora_slot_from_disk(root / "B", "B", 1)
    outs = llm.generate(ps[:2], greedy, ["B", "B"])
    for p, out in zip(ps[:2], outs):
        check_run(out, hf_greedy(peft["B"], p, 8))
    assert graphs.replays[(2, True)] == 7
    outs = llm.generate(ps[:1], greedy, [None])  # no adapter token: the no-LoRA variant
    check_run(outs[0], hf_greedy(base, ps[0], 8))
    assert graphs.replays[(1, False)] == 7


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_mixed_step_graph_path_matches_hf(cpu_root, overlap):
    """Prompt chunks beside decodes through the mixed-step static buffers: token padding,
    sequence rows with no queries, the logits index and the slot-sorted token order."""
    root, base, peft = cpu_root
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=64, max_num_seqs=6, max_num_batched_tokens=64,
              scheduler=SchedulerConfig(max_prefill_chunk=5), async_scheduling=overlap)
    greedy = OVERLAPPED if overlap else GREEDY
    graphs = llm.engine.runner.enable_graphs(capture=False)
    assert graphs.buckets == [64]
    llm.engine.swap_lora_slot_from_disk(root / "A", "A", 0)
    llm.engine.swap_lora_slot_from_disk(root / "B", "B", 1)
    ps = prompts(9, 4)
    names = ["A", None, "B", "A"]
    outs = llm.generate(ps, greedy, names)
    for p, out, name in zip(ps, outs, names):
        check_run(out, hf_greedy(base if name is None else peft[name], p, 8))
    mixed = sum(n for key, n in graphs.replays.items() if key[0] == "mixed")
    assert mixed >= 3 and graphs.replays[("mixed", 64, True)] == mixed


@needs_kernels
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_decode_graphs_past_the_per_token_limit_pass_a_slot_order(cpu_root, monkeypatch, overlap):
    """Decode rows past lora_triton.DECODE_MAX_T reach the kernels with a slot order the
    step fills on the host (the path batches of 96-256 take on a GPU), here with the
    limit at 2 and the kernels in Triton's interpreter: every token of a batch mixing two
    adapters and the base model gets its own adapter, also when rows finish and the
    padding changes."""
    monkeypatch.setattr(lora_ops, "TRITON_ON_CPU", True)
    monkeypatch.setattr(lora_triton, "DECODE_MAX_T", 2)
    root, base, peft = cpu_root
    llm, graphs = _static_buffer_llm(root, async_scheduling=overlap)
    ps = prompts(11, 5)
    names = ["B", None, "A", "B", "A"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                             logprobs=None if overlap else 2)
              for n in (8, 8, 5, 8, 3)]  # rows finish early: the batch shrinks to size 4
    outs = llm.generate(ps, params, names)
    for p, out, name, sp in zip(ps, outs, names, params):
        check_run(out, hf_greedy(base if name is None else peft[name], p, sp.max_tokens))
    assert graphs.replays[(6, True)] >= 1 and graphs.replays[(4, True)] >= 1


@needs_kernels
def test_decode_steps_sharing_few_adapters_replay_the_slot_sorted_variant(cpu_root, monkeypatch):
    """A LoRA decode step whose rows share few adapters replays the slot-sorted variant
    (each adapter read once for its rows), one with more adapters per row the per-token
    one; both give every token its own adapter (Triton's interpreter, thresholds scaled
    down to a 6-row batch)."""
    monkeypatch.setattr(lora_ops, "TRITON_ON_CPU", True)
    monkeypatch.setattr(lora_triton, "DECODE_MAX_T", 8)
    monkeypatch.setattr(cuda_graphs, "SORTED_MIN_BATCH", 4)
    monkeypatch.setattr(cuda_graphs, "SORTED_MIN_ROWS_PER_SLOT", 3)
    root, base, peft = cpu_root
    llm, graphs = _static_buffer_llm(root, async_scheduling=True)
    ps = prompts(12, 6)
    names = ["B", None, "A", "B", "A", "A"]
    # 6 rows on 2 adapters: sorted; then 3 rows (padded to 4) on 2 adapters: per token
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (8, 4, 8, 4, 4, 8)]
    outs = llm.generate(ps, params, names)
    for p, out, name, sp in zip(ps, outs, names, params):
        assert out.token_ids == hf_greedy(base if name is None else peft[name], p, sp.max_tokens)[0]
    assert graphs.replays[(6, True, "sorted")] >= 1 and graphs.replays[(4, True)] >= 1


def test_batches_beyond_the_largest_graph_run_eagerly(cpu_root):
    root, base, _ = cpu_root
    llm = LLM(root / "model", max_loras=1, max_lora_rank=8, block_size=4, max_model_len=64,
              num_kv_blocks=64, max_num_seqs=3)
    graphs = llm.engine.runner.enable_graphs(capture=False)
    graphs.sizes, graphs.max_batch = [1, 2], 2  # pretend only sizes 1 and 2 were captured
    ps = prompts(8, 3)
    outs = llm.generate(ps, GREEDY)
    for p, out in zip(ps, outs):
        check(out, *hf_greedy(base, p, 8))
    assert graphs.num_replays == 0


# --- on a GPU: real capture, bf16 -----------------------------------------------------------

def gpu_model(root, seed: int, names: str, adapter_seed: int):
    """A small Llama saved under root/model and r=8 all-linear PEFT adapters root/<name>."""
    base = make_model("llama", seed=seed, **GPU_DIMS)
    save_model(base, root / "model")
    peft = {n: make_adapter(base, root / n, seed=adapter_seed + i, r=8, lora_alpha=16,
                            target_modules="all-linear") for i, n in enumerate(names)}
    return base, peft


@pytest.mark.gpu
def test_gpu_graphs_survive_swap_and_match_peft(tmp_path):
    base, peft = gpu_model(tmp_path, 6, "AB", 40)
    kw = dict(max_loras=2, max_lora_rank=8, block_size=16, max_model_len=128,
              num_kv_blocks=64, max_num_seqs=8, device="cuda", dtype="bfloat16")
    llm = LLM(tmp_path / "model", **kw)
    eager = LLM(tmp_path / "model", enforce_eager=True, **kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and eager.engine.runner.graphs is None
    captures = graphs.num_captures
    assert captures == 2 * (len(graphs.sizes) + len(graphs.buckets))
    ps = prompts(9, 3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    compared = 0
    for name in "AB":  # A into slot 1, then B swapped over it: same graphs replayed
        for e in (llm.engine, eager.engine):
            e.swap_lora_slot_from_disk(tmp_path / name, name, 1)
        before = graphs.replays[(4, True)]
        outs = llm.generate(ps, params, [name, None, name])
        ref_outs = eager.generate(ps, params, [name, None, name])
        assert graphs.replays[(4, True)] == before + 5 and graphs.num_captures == captures
        for p, out, ref, who in zip(ps, outs, ref_outs, [name, None, name]):
            compared += compare_to_eager_and_peft(p, out, ref, base if who is None else peft[who],
                                                  who)
    assert compared >= 12, "too few tokens compared before bf16 divergence"


def compare_to_eager_and_peft(prompt, out, eager_out, model, who) -> int:
    """A graph run's output against our eager path (same dtype and kernels up to the
    padding: tight) and against transformers + PEFT in fp32 (bf16 tolerance); returns
    the tokens compared with PEFT before a permitted divergence."""
    lps = [lp["logprob"] for lp in out.logprobs]
    eager_lp = torch.full((len(lps), 256), -1e9)  # the eager run's top logprobs
    for i, lp in enumerate(eager_out.logprobs):
        for tok, val in lp["top"]:
            eager_lp[i, tok] = val
    assert_greedy_close(out.token_ids, lps, eager_out.token_ids, eager_lp, 0.05, "eager")
    hf_tokens, hf_lp = hf_greedy(model.cuda(), prompt, len(lps))
    return assert_greedy_close(out.token_ids, lps, hf_tokens, hf_lp.cpu(), 0.15, f"peft {who}")


@pytest.mark.gpu
def test_gpu_mixed_step_graphs_match_peft(tmp_path):
    """Prompt chunks beside decodes through captured mixed-step graphs, mixed adapters:
    the same tokens as transformers + PEFT (bf16 tolerance) and as the eager path."""
    base, peft = gpu_model(tmp_path, 7, "AB", 50)
    kw = dict(max_loras=2, max_lora_rank=8, block_size=16, max_model_len=256,
              num_kv_blocks=128, max_num_seqs=8, device="cuda", dtype="bfloat16",
              max_num_batched_tokens=128, scheduler=SchedulerConfig(max_prefill_chunk=24))
    llm = LLM(tmp_path / "model", **kw)
    eager = LLM(tmp_path / "model", enforce_eager=True, **kw)
    for e in (llm.engine, eager.engine):
        e.swap_lora_slot_from_disk(tmp_path / "A", "A", 0)
        e.swap_lora_slot_from_disk(tmp_path / "B", "B", 1)
    ps = [p * 6 for p in prompts(10, 4)]  # 18-114 tokens: several chunks each
    names = ["A", None, "B", "A"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate(ps, params, names)
    ref_outs = eager.generate(ps, params, names)
    graphs = llm.engine.runner.graphs
    assert sum(n for key, n in graphs.replays.items() if key[0] == "mixed") >= 3
    compared = sum(compare_to_eager_and_peft(p, out, ref, base if who is None else peft[who], who)
                   for p, out, ref, who in zip(ps, outs, ref_outs, names))
    assert compared >= 12, "too few tokens compared before bf16 divergence"


@pytest.mark.gpu
def test_gpu_decode_graphs_past_64_rows_match_eager_and_peft(tmp_path):
    """A captured decode graph of 96 rows (slot order filled per step, past the per-token
    kernels' limit), three adapters and the base mixed: the eager path's tokens and
    transformers + PEFT's (bf16 tolerance)."""
    base, peft = gpu_model(tmp_path, 8, "ABC", 60)
    kw = dict(max_loras=3, max_lora_rank=8, block_size=16, max_model_len=64,
              num_kv_blocks=512, max_num_seqs=96, max_num_batched_tokens=96 * 16,
              device="cuda", dtype="bfloat16")
    llm = LLM(tmp_path / "model", **kw)
    eager = LLM(tmp_path / "model", enforce_eager=True, **kw)
    for e in (llm.engine, eager.engine):
        for slot, name in enumerate("ABC"):
            e.swap_lora_slot_from_disk(tmp_path / name, name, slot)
    graphs = llm.engine.runner.graphs
    assert 96 in graphs.sizes
    ps = prompts(11, 90)
    names = [("A", "B", None, "C")[i % 4] for i in range(90)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate(ps, params, names)
    ref_outs = eager.generate(ps, params, names)
    assert graphs.replays[(96, True)] >= 4
    compared = sum(compare_to_eager_and_peft(p, out, ref, base if who is None else peft[who], who)
                   for p, out, ref, who in zip(ps, outs, ref_outs, names))
    assert compared >= 300, "too few tokens compared before bf16 divergence"


@pytest.mark.gpu
def test_gpu_async_scheduling_gives_the_synchronous_tokens(tmp_path):
    """On a GPU (async scheduling is the default there) each step is queued before the
    previous step's tokens reach the host and reads its pending inputs on the device:
    through mixed steps and decode graphs with and without LoRA, requests ending at
    different lengths, the greedy tokens equal a synchronous engine's (the same batches
    through the same kernels), which the tests above hold to transformers + PEFT."""
    gpu_model(tmp_path, 9, "AB", 70)
    kw = dict(max_loras=2, max_lora_rank=8, block_size=16, max_model_len=128,
              num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=128,
              device="cuda", dtype="bfloat16")
    overlapped = LLM(tmp_path / "model", **kw)
    sync = LLM(tmp_path / "model", async_scheduling=False, **kw)
    assert overlapped.engine.async_scheduling and not sync.engine.async_scheduling
    for e in (overlapped.engine, sync.engine):
        for slot, name in enumerate("AB"):
            e.swap_lora_slot_from_disk(tmp_path / name, name, slot)
    ps = prompts(12, 24)
    names = [("A", None, "B")[i % 3] for i in range(24)]
    params = [SamplingParams(max_tokens=4 + i % 9, temperature=0, ignore_eos=True)
              for i in range(24)]
    for first in (True, False):  # all rows with an adapter, then only the base model
        who = names if first else [None] * 24
        got = overlapped.generate(ps, params, who)
        want = sync.generate(ps, params, who)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
    replays = overlapped.engine.runner.graphs.replays
    decode = [k for k in replays if k[0] != "mixed"]
    assert len(decode) < len(replays)  # some mixed steps
    assert any(k[1] for k in decode) and any(not k[1] for k in decode)
