"""Tiny chat models whose tokenizers can write JSON (byte-level BPE, trained here on a few
lines) and carry a family's chat template with its tool-call format: Llama 3.x (JSON
calls with "parameters", <|eot_id|>) and Qwen 2.5 (Hermes' <tool_call>, <|im_end|>).
Holds no tests: the structured-output and tool tests build their worlds from it."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.tiny_models import make_adapter, make_model, save_model

QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none and tools %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none and tools %}
{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
{{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{{- "Do not use variables.\\n\\n" }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}{{- "<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{{- message.content }}{{- "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

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
] * 20
BPE_VOCAB = 420  # bytes, merges, specials; the tiny model's vocabulary is the tokenizer's length


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
    base = make_model("llama", seed=seed, vocab_size=vocab, max_position_embeddings=1024,
                      eos_token_id=eos, bos_token_id=tokenizer.bos_token_id)
    save_model(base, root / "model")
    peft = {}
    for i, name in enumerate(adapters):
        peft[name] = make_adapter(base, root / "adapters" / name, seed=60 + i, r=4, lora_alpha=8,
                                  target_modules="all-linear")
    return {"model": root / "model", "adapters": root / "adapters", "base": base, "peft": peft,
            "tokenizer": tokenizer, "eos": eos}
