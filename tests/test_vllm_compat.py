"""Offline-engine features vLLM users expect: LLM.chat, reset_prefix_cache and
min_tokens, on a tiny model with a word-level tokenizer and chat template."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import ChatTemplateError
from tests.helpers.server import save_tokenizer
from tests.helpers.tiny_models import saved_tiny_model

CONV = [{"role": "system", "content": "tell me a story"},
        {"role": "user", "content": "what about the moon"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("compat") / "model"
    saved_tiny_model(path, seed=11, tokenizer=save_tokenizer)
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


# --- min_tokens -----------------------------------------------------------------------------

PROMPT = list(range(5, 17))


@pytest.fixture(scope="module")
def early_eos(model_dir, llm, tmp_path_factory):
    """(LLM, eos id, greedy tokens): the same model with its second greedy token declared
    EOS in config.json, so that plain greedy decoding ends after two tokens."""
    import json
    import shutil

    tokens = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True))[0].token_ids
    eos = tokens[1]
    assert eos != tokens[0]
    path = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(model_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    return LLM(path, max_loras=1, max_lora_rank=8, max_model_len=256, block_size=4,
               num_kv_blocks=128), eos, tokens


def test_min_tokens_suppresses_eos(early_eos):
    llm, eos, tokens = early_eos
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    assert plain.token_ids == tokens[:2] and plain.finish_reason == "stop"
    held = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, min_tokens=5))[0]
    assert len(held.token_ids) >= 5 and eos not in held.token_ids[:5]
    assert held.token_ids[0] == tokens[0]
    # sampled decoding cannot draw it either
    sampled = llm.generate([PROMPT] * 4, [SamplingParams(max_tokens=6, temperature=2.0, seed=s,
                                                         min_tokens=6) for s in range(4)])
    assert all(len(o.token_ids) == 6 and eos not in o.token_ids for o in sampled)


def test_min_tokens_defers_stop_strings(llm):
    free = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0,
                                                 ignore_eos=True))[0]
    first_word = llm.tokenizer.decode(free.token_ids[:1])
    stopped = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                    stop=(first_word,)))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 1
    held = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                 stop=(first_word,), min_tokens=3))[0]
    # the stop string appeared before min_tokens: it no longer counts
    assert len(held.token_ids) >= 3 and held.text.startswith(first_word)


@pytest.mark.parametrize("value", [-1, 9, True, 1.0])
def test_min_tokens_range(value):
    from metrale.engine.sampling_params import InvalidSamplingParamsError

    with pytest.raises(InvalidSamplingParamsError) as e:
        SamplingParams(max_tokens=8, min_tokens=value)
    assert e.value.param == "min_tokens"
