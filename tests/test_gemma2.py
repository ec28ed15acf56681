"""Gemma 2 and Gemma 3 (text) on the CPU reference path: (1 + w) norms before and after
each sublayer, GELU (tanh) MLP, embeddings scaled by sqrt(hidden), the query scale,
soft-capped attention and logits, sliding-window layers beside global ones, tied
embeddings; Gemma 3's q/k norms and the sliding layers' own rotary base (the global ones
linearly scaled). Greedy tokens equal transformers (eager attention) + PEFT for the base
and adapters mixed in one batch, on prompts longer than the window."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import ConfigError, ModelConfig
from tests.helpers.reference import assert_mixed_batch_matches, hf_greedy
from tests.helpers.tiny_models import make_adapter, make_model, save_model

PROMPTS = [[5, 17, 99, 3, 42, 8, 120, 7, 9], [61, 2, 9, 13, 200, 7, 1, 4, 77, 31, 5]]
GEN = 8


def sharp(arch: str, seed: int, **change):
    """The tiny Gemma with sharper attention (q and k scaled up), so that the scores
    reach the cap and the window decides which keys win."""
    model = make_model(arch, seed=seed, **change)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    return model


def gemma2(**change):
    return sharp("gemma2", 21, **change)


def gemma3(**change):
    return sharp("gemma3", 22, **change)


def test_gemma2_equals_transformers_peft(tmp_path):
    base = gemma2()
    save_model(base, tmp_path / "model")
    cfg = ModelConfig.from_dir(tmp_path / "model")
    assert cfg.sliding_layers == (0, 2) and cfg.attn_softcap == 2.0 and cfg.tie_word_embeddings
    adapters = {name: (make_adapter(base, tmp_path / name, seed=seed, r=4, lora_alpha=8,
                                    target_modules="all-linear"), tmp_path / name)
                for name, seed in (("x", 3), ("y", 4))}
    assert_mixed_batch_matches(tmp_path / "model", base, adapters, PROMPTS, GEN)


def test_gemma2_features_each_change_the_answer(tmp_path):
    """Each Gemma-specific piece matters on these prompts: the reference differs when the
    attention cap, the window or the query scale is changed, so the equality above tests
    them (the logit cap is monotonic: greedy tokens cannot see it; logprobs below do)."""
    want = [hf_greedy(gemma2(), p, GEN)[0] for p in PROMPTS]
    for change in ({"attn_logit_softcapping": None}, {"sliding_window": 64},
                   {"query_pre_attn_scalar": 16}):
        other = gemma2(**change)
        assert [hf_greedy(other, p, GEN)[0] for p in PROMPTS] != want, change


def test_gemma2_logprobs_see_the_logit_cap(tmp_path):
    base = gemma2(final_logit_softcapping=0.3)  # tight: every logit is bent by the cap
    save_model(base, tmp_path / "model")
    llm = LLM(tmp_path / "model", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=32)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    with torch.no_grad():
        logits = base(torch.tensor([PROMPTS[0]])).logits[0, -1].float()  # capped by transformers
    want = torch.log_softmax(logits, -1)
    top = out.logprobs[0]["top"]
    assert len(top) == 5
    for token, logprob in top:
        assert abs(logprob - float(want[token])) < 1e-4, token


def test_gemma2_refusals(tmp_path):
    base = gemma2()
    save_model(base, tmp_path / "model")
    with pytest.raises(ConfigError, match="embed_tokens"):
        LLM(tmp_path / "model", max_loras=1, max_lora_rank=4, max_model_len=64, block_size=4,
            num_kv_blocks=16, lora_extra_targets=("embed_tokens",))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gpu_gemma_through_the_kernels_and_graphs_equals_peft(tmp_path, arch):
    """fp32 on CUDA (exact-fp32 dots): the Triton attention with its soft-cap and sliding
    windows under CUDA graphs, plain adapters beside the base, against transformers (eager)
    + PEFT on the CPU."""
    base = gemma2() if arch == "gemma2" else gemma3()
    save_model(base, tmp_path / "model")
    adapters = {name: (make_adapter(base, tmp_path / name, seed=seed, r=4, lora_alpha=8,
                                    target_modules="all-linear"), tmp_path / name)
                for name, seed in (("x", 3), ("y", 4))}
    llm = assert_mixed_batch_matches(tmp_path / "model", base, adapters, PROMPTS, GEN,
                                     device="cuda", dtype="float32")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0


def test_gemma3_equals_transformers_peft(tmp_path):
    base = gemma3()
    save_model(base, tmp_path / "model")
    cfg = ModelConfig.from_dir(tmp_path / "model")
    assert cfg.qk_norm and cfg.sliding_layers == (0, 2) and cfg.rope_local_theta == 10_000.0
    assert cfg.rope_theta == 1_000_000.0 and dict(cfg.rope_scaling)["factor"] == 2.0
    adapter = make_adapter(base, tmp_path / "x", seed=3, r=4, lora_alpha=8,
                           target_modules="all-linear")
    assert_mixed_batch_matches(tmp_path / "model", base, {"x": (adapter, tmp_path / "x")},
                               PROMPTS, GEN)
    # the local base matters here: one rotary for every layer answers otherwise
    other = gemma3(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})
    assert [hf_greedy(other, p, GEN)[0] for p in PROMPTS] != \
        [hf_greedy(base, p, GEN)[0] for p in PROMPTS]
