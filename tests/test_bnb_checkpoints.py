"""QLoRA as it is made: a tiny model quantized by bitsandbytes itself (transformers'
BitsAndBytesConfig, NF4 and FP4, with and without double quantization) and saved by
transformers, adapters trained by PEFT on that 4-bit model. metrale holds the checkpoint in
4 bits and its greedy tokens equal the bitsandbytes model's + PEFT's, base and adapters
mixed in one batch (a sequence compared up to a reference top-2 gap under 1e-3: FP4's
coarse codes make near-ties). Skipped where bitsandbytes does not import."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.reference import assert_mixed_batch_matches
from tests.helpers.tiny_models import make_adapter, make_model, save_model

bnb = pytest.importorskip("bitsandbytes")
PROMPTS = [[5, 17, 99, 3, 42, 8], [61, 2, 9, 13, 200, 7, 1]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("quant_type, double", [("nf4", True), ("nf4", False), ("fp4", True)])
def test_bitsandbytes_checkpoint_with_qlora_adapters_equals_peft(tmp_path, arch, quant_type,
                                                                 double):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    save_model(make_model(arch, seed=13, intermediate_size=128), tmp_path / "dense")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double,
                                bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=config,
                                                device_map="cpu", dtype=torch.float32)
    base.save_pretrained(tmp_path / "q")
    adapters = {name: (make_adapter(base, tmp_path / name, seed=seed, r=4, lora_alpha=8,
                                    target_modules="all-linear"), tmp_path / name)
                for name, seed in (("x", 3), ("y", 4))}
    llm = assert_mixed_batch_matches(tmp_path / "q", base, adapters, PROMPTS, 6, tie_gap=1e-3)
    layer = llm.engine.runner.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert proj.quant == "int4" and proj.codebook is not None
