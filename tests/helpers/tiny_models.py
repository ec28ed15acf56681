"""Tiny random Hugging Face models and PEFT adapters made in the test run: the
ground truth every metrale test compares against."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)
# large enough that the GPU kernels run their real tiles (K of a whole 256-column chunk)
GPU_DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=3)


def hf_config(arch: str, **overrides):
    import transformers

    kw = {**TINY, **overrides}
    if arch == "llama":
        return transformers.LlamaConfig(**kw)
    if arch == "qwen2":
        return transformers.Qwen2Config(**kw)
    if arch == "qwen3":
        # head_dim deliberately != hidden / heads, as in real Qwen3 checkpoints
        return transformers.Qwen3Config(head_dim=kw.pop("head_dim", 32), **kw)
    if arch == "mistral":
        return transformers.MistralConfig(**kw)
    if arch == "gemma3":
        gemma = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                     tie_word_embeddings=True, attn_implementation="eager",
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     rope_parameters={
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
        return transformers.Gemma3TextConfig(**{**kw, **gemma, **overrides})
    if arch == "phi3":
        return transformers.Phi3Config(**{**kw, "pad_token_id": 0})
    if arch == "gemma2":
        # caps and a window small enough to matter on short prompts; eager attention: the
        # only one that soft-caps
        gemma = dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                     final_logit_softcapping=3.0, sliding_window=5, tie_word_embeddings=True,
                     attn_implementation="eager")
        return transformers.Gemma2Config(**{**kw, **gemma, **overrides})
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers): the two kinds of layer mixed
        return transformers.Qwen3MoeConfig(**{**kw, **moe, "head_dim": 32, "norm_topk_prob": True,
                                              "mlp_only_layers": [1], **overrides})
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**{**kw, **moe, "shared_expert_intermediate_size": 80,
                                              "norm_topk_prob": False, **overrides})
    if arch == "mixtral":
        return transformers.MixtralConfig(**{**kw, "num_local_experts": 4, "num_experts_per_tok": 2,
                                             "intermediate_size": 48, **overrides})
    if arch == "olmoe":
        return transformers.OlmoeConfig(**{**kw, "num_experts": 4, "num_experts_per_tok": 2,
                                           "intermediate_size": 48, "pad_token_id": 0,
                                           "bos_token_id": None, "eos_token_id": None,
                                           **overrides})
    raise ValueError(arch)


def make_model(arch: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, **overrides))
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: hides bugs
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # MoE routers: decisive top-k choices
                p.normal_(0, 1.0)
            elif ".experts." in name:  # experts that move the answer (init's 0.02 barely does)
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
    return model.float().eval()


def save_model(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def saved_tiny_model(path: Path, arch: str = "llama", seed: int = 0, tokenizer=None,
                     **overrides):
    """The tests' tiny-model set-up in one call: make_model(arch, seed, **overrides) saved
    as a model directory at path, with tokenizer(path, vocab_size) when given (e.g.
    tests.helpers.server.save_tokenizer). Returns the model: the PEFT references' base."""
    base = make_model(arch, seed, **overrides)
    save_model(base, path)
    if tokenizer is not None:
        tokenizer(path, base.config.vocab_size)
    return base


def make_adapter(base_model, path: Path, seed: int = 0, **lora_kwargs):
    """A PEFT adapter with random (non-zero) A and B, saved to path.

    Returns the PeftModel, whose modules give the reference scaling * B @ A."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(init_lora_weights=False, **lora_kwargs)
    peft_model = get_peft_model(copy.deepcopy(base_model), cfg)
    with torch.no_grad():
        # PEFT initialises DoRA's magnitude to ||W + sBA||, i.e. gain 1, which would hide
        # a missing or misplaced gain: move it off 1 as training does
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    peft_model.save_pretrained(path, safe_serialization=True)
    return peft_model.eval()


def peft_deltas(peft_model) -> dict[str, torch.Tensor]:
    """{module path: scaling * B @ A} for every LoRA-wrapped module, float32."""
    out = {}
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a = module.lora_A["default"].weight.float()
            b = module.lora_B["default"].weight.float()
            out[name] = module.scaling["default"] * (b @ a)
    return out


def write_lora(path: Path, arch: str = "llama", seed: int = 0, dtype=torch.float32,
               **config) -> Path:
    """A PEFT-format adapter dir (adapter_config.json + adapter_model.safetensors) written
    directly, without building a model: for validation tests that corrupt it. `config`
    overrides the adapter_config.json fields (r, lora_alpha, target_modules...); the
    tensors cover target_modules (a list of short names) on every layer at rank r, with
    PEFT's names for embed_tokens (lora_embedding_A/B) and lm_head, and each module's
    lora_magnitude_vector when use_dora is set."""
    import json

    from safetensors.torch import save_file

    from metrale.config import ModelConfig

    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
           "bias": "none", "use_dora": False, "use_rslora": False, **config}
    model = ModelConfig.from_hf_dict(hf_config(arch).to_dict())
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for module in cfg["target_modules"]:
            if module in ("embed_tokens", "lm_head") and layer:
                continue  # model-level: once
            d_in, d_out = model.linear_shape(module)
            prefix = f"base_model.model.{model.module_path(layer, module)}"
            a, b = ((f"{prefix}.lora_embedding_A", f"{prefix}.lora_embedding_B")
                    if module == "embed_tokens" else
                    (f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"))
            tensors[a] = torch.randn(cfg["r"], d_in, generator=gen).to(dtype)
            tensors[b] = torch.randn(d_out, cfg["r"], generator=gen).to(dtype)
            if cfg.get("use_dora"):
                tensors[f"{prefix}.lora_magnitude_vector"] = (
                    torch.rand(d_out, generator=gen) + 0.5).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, path / "adapter_model.safetensors")
    return path
