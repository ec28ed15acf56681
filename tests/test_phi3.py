"""Phi-3: q/k/v and gate/up fused in the checkpoint and in its adapters (PEFT wraps
qkv_proj and gate_up_proj: one lora_A, lora_B's rows split across the parts). Greedy
tokens equal transformers + PEFT for the base and three adapters mixed in one batch
(fused and unfused targets, a rank pattern on a fused module, DoRA). Partial rotary and
LongRoPE (Phi-3.5-mini, Phi-4-mini)."""

from __future__ import annotations

import json

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import ConfigError, ModelConfig
from tests.helpers.reference import assert_mixed_batch_matches, check, hf_greedy
from tests.helpers.tiny_models import make_adapter, make_model, save_model

PROMPTS = [[5, 17, 99, 3, 42, 8, 120], [61, 2, 9, 13, 200, 7, 1, 4]]
GEN = 8


def test_phi3_with_fused_adapters_equals_transformers_peft(tmp_path):
    base = make_model("phi3", seed=31)
    save_model(base, tmp_path / "model")
    assert ModelConfig.from_dir(tmp_path / "model").fused_peft_modules
    specs = {
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "qkv": dict(r=4, lora_alpha=16, target_modules=["qkv_proj", "down_proj"],
                    rank_pattern={"layers.1.self_attn.qkv_proj": 2}),
        "dora": dict(r=4, lora_alpha=8, target_modules=["gate_up_proj", "o_proj"], use_dora=True),
    }
    adapters = {name: (make_adapter(base, tmp_path / name, seed=i + 3, **spec), tmp_path / name)
                for i, (name, spec) in enumerate(specs.items())}
    assert_mixed_batch_matches(tmp_path / "model", base, adapters, PROMPTS, GEN)


HEAD = 16  # the tiny config's head_dim (64 / 4 heads)
ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.5, 3.0, 3.5],
        "original_max_position_embeddings": 16}  # 4 factors: rotary_dim 8 / 2
LONGROPE = dict(partial_rotary_factor=0.5, max_position_embeddings=64,
                original_max_position_embeddings=16, rope_parameters=ROPE)


def _hf_stepwise(model, prompt, n):
    """transformers' greedy tokens and their log-softmax rows, one forward per token with
    explicit positions. (generate switches LongRoPE to the long factors one token later
    than the forward does at the same positions: this follows the forward.)"""
    from transformers import DynamicCache

    cache, ids, rows = DynamicCache(), list(prompt), []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache,
                       position_ids=torch.arange(len(prompt))[None]).logits[0, -1]
        for _ in range(n):
            row = torch.log_softmax(logits.float(), dim=-1)
            rows.append(row)
            ids.append(int(row.argmax()))
            logits = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache,
                           position_ids=torch.tensor([[len(ids) - 1]])).logits[0, -1]
    return ids[len(prompt):], torch.stack(rows)


def test_phi4_mini_style_partial_rotary_and_longrope_equal_transformers(tmp_path):
    """Half of each head rotated (Phi-4-mini: 3/4), LongRoPE with an original context of 16:
    a 10-token prompt decoded to position 24 crosses into the long factors; tokens and
    logprobs equal transformers' (short factors below 16, long from 16 on, cos/sin scaled
    by sqrt(1 + ln 4 / ln 16))."""
    base = make_model("phi3", seed=31, **LONGROPE)
    save_model(base, tmp_path / "model")
    assert ModelConfig.from_dir(tmp_path / "model").rotary_dim == HEAD // 2
    prompt, n = [5, 17, 99, 3, 42, 8, 120, 9, 11, 12], 14
    llm = LLM(tmp_path / "model", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                logprobs=1))[0]
    ref = _hf_stepwise(base, prompt, n)
    check(out, *ref)
    # the comparison sees each feature: transformers' own answer moves without it
    for change in ({"long_factor": ROPE["short_factor"]}, {"attention_factor": 1.0}):
        other = make_model("phi3", seed=31, **{**LONGROPE, "rope_parameters": {**ROPE, **change}})
        assert not torch.allclose(_hf_stepwise(other, prompt, n)[1], ref[1], atol=1e-3), change


def test_phi3_partial_rotary_with_adapters_equals_transformers_peft(tmp_path):
    base = make_model("phi3", seed=32, partial_rotary_factor=0.5)
    save_model(base, tmp_path / "model")
    adapters = {"all": (make_adapter(base, tmp_path / "all", seed=3, r=4, lora_alpha=8,
                                     target_modules="all-linear"), tmp_path / "all")}
    assert_mixed_batch_matches(tmp_path / "model", base, adapters, PROMPTS, GEN)


def test_a_rotary_share_that_is_not_an_even_count_is_refused(tmp_path):
    base = make_model("phi3", seed=31)
    save_model(base, tmp_path / "model")
    cfg = json.loads((tmp_path / "model" / "config.json").read_text())
    cfg["partial_rotary_factor"] = 0.3  # 16 * 0.3 = 4.8 -> 4 dims: even, served
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(tmp_path / "model").rotary_dim == 4
    cfg["partial_rotary_factor"] = 0.2  # 3 dims
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        LLM(tmp_path / "model", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=16)


def test_a_window_shorter_than_the_context_masks_and_a_longer_one_is_dropped(tmp_path):
    """Phi-3's sliding window (2047 in Phi-3-mini-4k): shorter than max_model_len it masks
    (the reference attention, CPU only); covering the whole context it can hide nothing,
    so the layers drop it and the model may run the GPU kernels. Tokens equal transformers'
    both ways."""
    base = make_model("phi3", seed=33, sliding_window=6)
    save_model(base, tmp_path / "model")
    prompt = [5, 17, 99, 3, 42, 8, 120, 9, 11]
    for max_len, window in ((64, 6), (6, None)):
        llm = LLM(tmp_path / "model", max_loras=0, max_model_len=max_len, block_size=2,
                  num_kv_blocks=64)
        n = 8 if window else 6 - len(prompt[:3])
        p = prompt if window else prompt[:3]
        out = llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        assert list(out.token_ids) == hf_greedy(base, p, n)[0]
        assert llm.engine.runner.model.layers[0].self_attn.window == window
        cfg = llm.engine.model_config
        assert cfg.window_masks(max_len) == (window is not None)


@pytest.mark.gpu
def test_gpu_phi4_mini_style_model_serves_on_cuda(tmp_path):
    """fp32 on CUDA: partial rotary (the torch rotary path), LongRoPE, a window the context
    never outgrows, adapters on the fused projections through the Triton kernels."""
    base = make_model("phi3", seed=34, sliding_window=64, **LONGROPE)
    save_model(base, tmp_path / "model")
    adapters = {"all": (make_adapter(base, tmp_path / "all", seed=3, r=4, lora_alpha=8,
                                     target_modules="all-linear"), tmp_path / "all")}
    assert_mixed_batch_matches(tmp_path / "model", base, adapters, PROMPTS, GEN,
                               device="cuda", dtype="float32")
