"""DoRA and LoRA on embed_tokens / lm_head, served exactly as transformers + PEFT computes
them (the ground truth: PEFT's own forward), mixed per token with plain LoRA and base
requests, on tiny random Llama, Qwen2 (qkv bias: DoRA must keep the bias out of its gain)
and Qwen3 models; in the torch reference path and, for Llama, through the Triton kernels in
their interpreter.

Tolerance: fp32 everywhere; tokens must be equal and each generated token's logprob within
atol 2e-4, rtol 1e-4 of PEFT's (tests/helpers/reference.check), the bar every engine-vs-HF
test here uses: the only differences are float32 summation orders (PEFT computes the norm
from lora_B(lora_A(eye)), metrale from Bt^T @ A, chunked)."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import ExtraTargetsRequiredError
from metrale.ops import lora as lora_ops
from tests.helpers.reference import check, hf_greedy, prompts
from tests.helpers.tiny_models import make_adapter, make_model, save_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
EXTRA = ("embed_tokens", "lm_head")

ADAPTERS = {
    # DoRA on every linear, plain scaling
    "dora": dict(r=8, lora_alpha=16, target_modules="all-linear", use_dora=True),
    # DoRA with rsLoRA and rank/alpha patterns (q_proj: rank 6; down_proj: alpha 3)
    "dora_rs": dict(r=4, lora_alpha=6, use_rslora=True, use_dora=True,
                    target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
                    rank_pattern={"q_proj": 6}, alpha_pattern={"down_proj": 3}),
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
    # LoRA on the embedding and the output head (and one projection)
    "emb": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "o_proj"]),
    # the same with DoRA: PEFT's DoraEmbeddingLayer and a DoRA lm_head
    "emb_dora": dict(r=4, lora_alpha=4, use_dora=True,
                     target_modules=["embed_tokens", "lm_head", "gate_proj"]),
}


def _setup(root, arch, tied=False):
    base = make_model(arch, seed=3, tie_word_embeddings=tied)
    save_model(base, root / "model")
    peft = {name: make_adapter(base, root / name, seed=20 + i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    return base, peft


def _llm(root, **kw):
    args = dict(max_loras=3, max_lora_rank=8, block_size=4, max_model_len=64,
                num_kv_blocks=128, max_num_seqs=8, lora_extra_targets=EXTRA)
    llm = LLM(root / "model", **{**args, **kw})
    for name in ADAPTERS:
        llm.register_adapter(name, root / name)
    return llm


def _check_all(llm, base, peft, names, seed):
    ps = prompts(seed, len(names))
    outs = llm.generate(ps, GREEDY, names)
    for p, out, name in zip(ps, outs, names):
        check(out, *hf_greedy(base if name is None else peft[name], p, n=GREEDY.max_tokens))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return root, *_setup(root, request.param)


def test_mixed_batch_dora_embedding_plain_base(setup):
    """One batch: DoRA, DoRA+rsLoRA+patterns, plain LoRA, embedding/lm_head LoRA (plain and
    DoRA) and base requests; 3 slots for 5 adapters, so slots are reused across kinds."""
    root, base, peft = setup
    llm = _llm(root)
    _check_all(llm, base, peft, ["dora", "plain", None, "emb", "dora_rs", "emb_dora", "dora"], 1)
    llm.engine.check_integrity()


def test_tied_embeddings(tmp_path):
    """lm_head LoRA on a tied head: the base head is the embedding, the LoRA its own."""
    base, peft = _setup(tmp_path, "llama", tied=True)
    llm = _llm(tmp_path)
    _check_all(llm, base, peft, ["emb", "emb_dora", None, "plain"], 2)


def test_triton_kernels_in_interpreter(setup, monkeypatch):
    """The same mixed batch through the Triton kernels (Triton's interpreter on CPU)."""
    root, base, peft = setup
    if root.name.startswith(("qwen3", "llama")):  # keep the interpreter's time down:
        pytest.skip("qwen2 (DoRA with a qkv bias) covers the kernels' epilogue")
    pytest.importorskip("triton")
    import torch

    from tests.helpers.kernels import KERNELS
    if not KERNELS or torch.cuda.is_available():  # with CUDA: the gpu test runs them compiled
        pytest.skip("needs Triton's interpreter (a CPU-only box)")
    monkeypatch.setattr(lora_ops, "TRITON_ON_CPU", True)
    llm = _llm(root)
    _check_all(llm, base, peft, ["dora_rs", "plain", None, "emb_dora"], 3)


def test_swap_dora_into_plain_slot_and_back(tmp_path):
    """One slot: plain -> DoRA -> plain -> DoRA (with embedding and lm_head), each served
    exactly: a zeroed slot's gains are 1 again, a DoRA landing recomputes them."""
    base, peft = _setup(tmp_path, "llama")
    llm = _llm(tmp_path, max_loras=1)
    for i, name in enumerate(["plain", "dora", "plain", "emb_dora"]):
        _check_all(llm, base, peft, [name], 10 + i)
    assert llm.engine.adapters.num_promotions == 4


def test_extra_targets_refused_without_flag(tmp_path):
    base, _ = _setup(tmp_path, "llama")
    llm = LLM(tmp_path / "model", max_loras=1, max_lora_rank=8, max_model_len=64,
              num_kv_blocks=32)
    with pytest.raises(ExtraTargetsRequiredError, match="--lora-extra-targets"):
        llm.register_adapter("emb", tmp_path / "emb")
    llm.register_adapter("dora", tmp_path / "dora")  # DoRA needs no extra memory


def test_static_buffer_graph_paths(setup):
    """The CUDA-graph runner's static-buffer paths (eager here: capture=False): decode rows
    padded with slot -1, and mixed steps (prompt chunks beside decodes) whose logits rows
    are picked by an index, which must also pick those rows' lm_head LoRA slots."""
    from metrale.config import SchedulerConfig

    root, base, peft = setup
    if not root.name.startswith("llama"):
        pytest.skip("one architecture is enough for the runner paths")
    llm = _llm(root, max_num_batched_tokens=64, scheduler=SchedulerConfig(max_prefill_chunk=5))
    graphs = llm.engine.runner.enable_graphs(capture=False)
    _check_all(llm, base, peft, ["emb_dora", None, "emb", None, "dora", None], 4)
    mixed = sum(n for key, n in graphs.replays.items() if key[0] == "mixed")
    assert mixed >= 3 and graphs.num_replays > mixed  # mixed steps and decode steps


# --- on a GPU: compiled kernels and captured CUDA graphs, fp32 ---------------------------

def _hf_greedy_cuda(model, prompt):
    """PEFT's greedy tokens and [n, V] logprobs on the GPU, by full forwards."""
    import torch

    ids, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            logits = model(torch.tensor([ids], device="cuda")).logits[0, -1].float()  # [V]
            rows.append(torch.log_softmax(logits, dim=-1).cpu())
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], torch.stack(rows)


@pytest.mark.gpu
def test_gpu_graphs_mixed_kinds_across_swaps_match_peft(tmp_path):
    """fp32 on CUDA (exact-fp32 dots): the mixed batch through captured graphs, with DoRA and
    plain adapters swapped through one slot under the same graphs; tokens and logprobs equal
    PEFT's on the GPU within the CPU tolerance."""
    import torch

    base, peft = _setup(tmp_path, "qwen2")
    llm = _llm(tmp_path, device="cuda", dtype="float32", max_loras=4)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    captures = graphs.num_captures
    on_gpu = {n: m.cuda() for n, m in peft.items()}
    base = base.cuda()

    def check_all(names, seed):
        ps = prompts(seed, len(names))
        for p, out, name in zip(ps, llm.generate(ps, GREEDY, names), names):
            check(out, *_hf_greedy_cuda(base if name is None else on_gpu[name], p))

    check_all(["dora", "emb", None, "emb_dora", "plain", "dora_rs"], 5)
    for i, name in enumerate(["plain", "dora", "emb_dora", "plain"]):
        llm.engine.swap_lora_slot_from_disk(tmp_path / name, f"s{i}", 3)
        ps = prompts(20 + i, 2)
        outs = llm.generate(ps, GREEDY, [f"s{i}", None])
        for p, out, model in zip(ps, outs, [on_gpu[name], base]):
            check(out, *_hf_greedy_cuda(model, p))
    assert graphs.num_captures == captures and graphs.num_replays > 0
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_gains_at_8b_sizes_match_a_whole_matrix_norm():
    """compute_gains' chunks over a 14336 x 4096 weight equal one whole-matrix norm."""
    import torch

    from metrale.config import ModelConfig, PoolConfig
    from metrale.pool.landing import write_tables
    from metrale.pool.layout import SlotLayout
    from metrale.pool.pool import AdapterPool

    model = ModelConfig("llama", 128256, 4096, 14336, 1, 32, 8, 128)
    layout = SlotLayout(model, PoolConfig(2, 16, ("gate_proj",)), torch.float32)
    g = torch.Generator(device="cuda").manual_seed(0)
    W = torch.randn(14336, 4096, device="cuda", generator=g) * 0.02
    pool = AdapterPool(layout, "cuda", {(0, "gate_proj"): W})
    a = torch.randn(16, 4096, device="cuda", generator=g) * 0.02
    bt = torch.randn(16, 14336, device="cuda", generator=g) * 0.02
    m = torch.rand(14336, device="cuda", generator=g) + 0.5
    pool.lora_a(0, "gate_proj")[1] = a
    pool.lora_bt(0, "gate_proj")[1] = bt
    pool.magnitude(0, "gate_proj")[1, 0] = m
    ranks = torch.zeros(pool.ranks[1].shape, dtype=torch.int32)
    ranks[0, 0] = 16
    scales = torch.zeros(ranks.shape)
    scales[0, 0] = 2.0
    write_tables(pool.slot_tensors[1], layout, pool.base_weights, ranks, scales, (ranks > 0).int())
    want = m / torch.linalg.norm(W.double() + 2.0 * (bt.T.double() @ a.double()), dim=1)
    torch.testing.assert_close(pool.gain(0, "gate_proj")[1].double(), want, rtol=1e-5, atol=0)
