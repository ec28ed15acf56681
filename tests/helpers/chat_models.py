"""Tiny chat models whose tokenizers can write JSON (byte-level BPE, trained here on a few
lines) and carry a family's chat template with its tool-call format: Llama 3.x (JSON
calls with "parameters", <|eot_id|>) and Qwen 2.5 (Hermes' <tool_call>, <|im_end|>).
Holds no tests: the structured-output and tool tests build their worlds from it."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.tiny_models import make_adapter, make_model, save_model

# the families' templates, their tool sections as the real ones write them
TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
QWEN_TEMPLATE = (TEMPLATES / "qwen2_5.jinja").read_text()
LLAMA3_TEMPLATE = (TEMPLATES / "llama3_1.jinja").read_text()

FAMILIES = {
    "llama3": dict(template=LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>",
                   specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                             "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                   added=[]),
    "qwen": dict(template=QWEN_TEMPLATE, bos=None, eos="<|im_end|>",
                 specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 added=["<tool_call>", "</tool_call>"]),  # Qwen's: not special, decoded as text
}
# what the merges are learnt from: JSON, tool calls and a little English
CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "Alice", "age": 31, "tags": ["a", "b"], "ok": true, "score": 0.5, "x": null}',
    "The weather in Paris is sunny. What is the capital of France? Tell me about the moon.",
    '[{"id": 1, "items": [1, 2, 3]}, {"id": 2, "items": []}]',
    '{"type": "function", "function": {"name": "get_time", "description": "the weather", '
    '"parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, '
    '"required": ["zone"], "enum": ["celsius", "fahrenheit"]}}}',
] * 20 + [QWEN_TEMPLATE, LLAMA3_TEMPLATE] * 5
BPE_VOCAB = 1200  # bytes, merges, specials; the tiny model's vocabulary is the tokenizer's length


def save_chat_tokenizer(path: Path, family: str) -> int:
    """A byte-level BPE tokenizer with the family's specials and template; returns its length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=spec["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"],
                                   eos_token=spec["eos"], pad_token=spec["eos"])
    if spec["added"]:
        fast.add_tokens(spec["added"])
    fast.chat_template = spec["template"]
    fast.save_pretrained(path)
    return len(fast)


def make_chat_world(root: Path, family: str, adapters: tuple[str, ...] = ("a", "b"),
                    seed: int = 11) -> dict:
    """root/model: a tiny llama with the family's tokenizer (its EOS the template's end of
    turn); root/adapters/<name>: PEFT adapters of it. Returns the paths and the HF models."""
    from transformers import AutoTokenizer

    vocab = save_chat_tokenizer(root / "model", family)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    eos = tokenizer.convert_tokens_to_ids(FAMILIES[family]["eos"])
    base = make_model("llama", seed=seed, vocab_size=vocab, max_position_embeddings=4096,
                      eos_token_id=eos, bos_token_id=tokenizer.bos_token_id)
    save_model(base, root / "model")
    peft = {}
    for i, name in enumerate(adapters):
        peft[name] = make_adapter(base, root / "adapters" / name, seed=60 + i, r=4, lora_alpha=8,
                                  target_modules="all-linear")
    return {"model": root / "model", "adapters": root / "adapters", "base": base, "peft": peft,
            "tokenizer": tokenizer, "eos": eos}
