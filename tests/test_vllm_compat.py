"""Offline-engine features vLLM users expect: LLM.chat, reset_prefix_cache and
min_tokens, on a tiny model with a word-level tokenizer and chat template."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import ChatTemplateError
from tests.helpers.server import save_tokenizer
from tests.helpers.tiny_models import make_model, save_model

CONV = [{"role": "system", "content": "tell me a story"},
        {"role": "user", "content": "what about the moon"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("compat") / "model"
    base = make_model("llama", seed=11)
    save_model(base, path)
    save_tokenizer(path, base.config.vocab_size)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_loras=1, max_lora_rank=8, max_model_len=256, block_size=4,
               num_kv_blocks=128)


# --- LLM.chat -------------------------------------------------------------------------------


def test_chat_prompt_is_the_templates_token_ids(llm):
    want = llm.tokenizer.apply_chat_template(CONV, tokenize=True, add_generation_prompt=True,
                                             return_dict=False)
    (out,) = llm.chat(CONV, GREEDY)
    assert out.prompt_token_ids == list(want)
    assert out.token_ids == llm.generate([list(want)], GREEDY)[0].token_ids


def test_chat_takes_a_batch_of_conversations(llm):
    other = [{"role": "user", "content": "hello world"}]
    outs = llm.chat([CONV, other], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [llm.chat_prompt_ids(CONV),
                                                 llm.chat_prompt_ids(other)]
    assert [len(o.token_ids) for o in outs] == [6, 6]


def test_chat_without_a_template_is_refused(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ChatTemplateError):
        llm.chat(CONV, GREEDY)


# --- reset_prefix_cache ---------------------------------------------------------------------


def test_reset_prefix_cache_drops_cached_blocks_and_changes_no_output(llm):
    prompt = list(range(10, 30))  # 5 full blocks of 4
    runs = [llm.generate([prompt], GREEDY)[0]]
    runs.append(llm.generate([prompt], GREEDY)[0])
    assert runs[1].num_cached_tokens > 0
    assert llm.engine.reset_prefix_cache() > 0
    runs.append(llm.generate([prompt], GREEDY)[0])
    assert runs[2].num_cached_tokens == 0
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert llm.engine.reset_prefix_cache() > 0  # the third run cached them again


def test_reset_keeps_blocks_that_running_requests_hold(llm):
    from tests.helpers.engine import run_until_done, step_until_running

    engine = llm.engine
    prompt = list(range(40, 60))
    long = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([prompt], long)[0]
    engine.reset_prefix_cache()
    rid = engine.add_request(prompt, long)
    step_until_running(engine, rid)
    keyed = {b: engine.blocks.key[b] for b in engine.requests[rid].block_table
             if engine.blocks.key[b] is not None}
    assert keyed  # the prompt's full blocks
    engine.reset_prefix_cache()
    assert {b: engine.blocks.key[b] for b in keyed} == keyed
    out = run_until_done(engine)[rid]
    assert out.token_ids == alone.token_ids
