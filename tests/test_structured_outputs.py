"""Structured outputs in the engine: a constrained request's tokens are, step by step,
greedy decoding of transformers + PEFT logits under xgrammar's own mask (its
apply_token_bitmask_inplace), with constrained and free requests, the base model and
adapters in one batch, with and without async scheduling (where the mask of step t+1 is
computed while step t runs). Specs xgrammar cannot compile are refused naming the field;
compiled grammars are cached; a batch without constrained rows is left untouched."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar

from metrale.engine.grammar import JSON_OPTIONS
from metrale.engine.param_errors import InvalidSamplingParamsError
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.structured import StructuredOutput
from tests.helpers.chat_models import make_chat_world

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age"]}
SPECS = [
    StructuredOutput.json_schema(SCHEMA),
    StructuredOutput("json_object"),
    StructuredOutput("regex", r"(yes|no), [0-9]{2,4}"),
    StructuredOutput.choice(["Paris", "London", "the moon"]),
    StructuredOutput("grammar", 'root ::= "{" ws "\\"x\\": " num ws "}"\nws ::= " "?\n'
                                'num ::= [0-9] [0-9]?'),
]
N = 20  # tokens: enough to finish the short specs, a prefix of the long ones


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_chat_world(tmp_path_factory.mktemp("qwen"), "qwen")


def _prompt(world, text: str) -> list[int]:
    tok = world["tokenizer"]
    text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _xgrammar_reference(model, prompt: list[int], spec: StructuredOutput, compiler, stops,
                        n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding of model's logits with xgrammar's own mask applied: the tokens, and
    each step's gap between the best and the second-best allowed logit (a near tie there
    may break either way under other rounding)."""
    compiled = {
        "json": lambda: compiler.compile_json_schema(spec.spec, **JSON_OPTIONS),
        "json_object": lambda: compiler.compile_json_schema('{"type": "object"}', **JSON_OPTIONS),
        "regex": lambda: compiler.compile_regex(spec.spec),
        "choice": lambda: compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(c) for c in spec.choices)),
        "grammar": lambda: compiler.compile_grammar(spec.spec),
    }[spec.kind]()
    matcher = xgrammar.GrammarMatcher(compiled)
    vocab = model.config.vocab_size
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    ids, out, gaps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()[None]  # [1, V]
            matcher.fill_next_token_bitmask(bitmask)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            top2 = logits[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            token = int(logits[0].argmax())
            assert matcher.accept_token(token)
            ids.append(token)
            out.append(token)
            if token in stops or matcher.is_terminated():
                break
    return out, gaps


def _assert_same_up_to_ties(got: list[int], want: list[int], gaps: list[float], label: str) -> int:
    """got == want token by token; a divergence only where the reference had a near tie.
    Returns how many tokens were compared."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert gaps[i] < 1e-3, f"{label}: token {i} is {g}, the reference's {w} (gap {gaps[i]})"
            return i
    assert len(got) == len(want), f"{label}: {len(got)} tokens, the reference {len(want)}"
    return len(got)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_tokens_equal_xgrammar_masked_peft_greedy(world, async_scheduling):
    from metrale import LLM

    llm = LLM(world["model"], max_loras=2, max_lora_rank=4, max_model_len=256, block_size=4,
              num_kv_blocks=256, async_scheduling=async_scheduling)
    for name in world["peft"]:
        llm.register_adapter(name, world["adapters"] / name)
    adapters = [None, *world["peft"]]
    prompt = _prompt(world, "Tell me about the moon as JSON.")
    requests = []  # (spec or None, adapter)
    for i, spec in enumerate(SPECS):
        requests += [(spec, adapters[i % len(adapters)]), (spec, adapters[(i + 1) % len(adapters)])]
    requests += [(None, a) for a in adapters]  # free rows in the same batch
    params = [SamplingParams(max_tokens=N, temperature=0, structured=s) for s, _ in requests]
    outs = llm.generate([prompt] * len(requests), params, [a for _, a in requests])

    info = xgrammar.TokenizerInfo.from_huggingface(
        world["tokenizer"], vocab_size=world["base"].config.vocab_size,
        stop_token_ids=list(llm.engine.eos_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)  # 2 shared cores: no thread pool
    compared = 0
    for (spec, adapter), out in zip(requests, outs):
        model = world["peft"][adapter] if adapter else world["base"]
        if spec is None:
            want = model.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False,
                                  pad_token_id=0, eos_token_id=list(llm.engine.eos_ids))
            want = want[0, len(prompt):].tolist()
            assert list(out.token_ids) == want, adapter
            continue
        want, gaps = _xgrammar_reference(model, prompt, spec, compiler, set(llm.engine.eos_ids), N)
        compared += _assert_same_up_to_ties(list(out.token_ids), want, gaps, f"{spec.kind}/{adapter}")
    assert compared >= 0.8 * sum(len(o.token_ids) for (s, _), o in zip(requests, outs) if s)
    # the short specs completed: their text is what they allow
    for (spec, _), out in zip(requests, outs):
        if spec is not None and spec.kind == "choice":
            assert out.text in spec.choices and out.finish_reason == "stop"


def test_a_spec_the_library_cannot_compile_is_refused_naming_its_field(world):
    from metrale import LLM

    llm = LLM(world["model"], max_loras=1, max_lora_rank=4, max_model_len=128, block_size=4,
              num_kv_blocks=64)
    bad = [StructuredOutput.json_schema({"type": "strin"}, "response_format"),
           StructuredOutput("regex", "(unclosed", "guided_regex"),
           StructuredOutput("grammar", "root ::= undefined_rule", "structured_outputs")]
    for spec in bad:
        with pytest.raises(InvalidSamplingParamsError) as info:
            llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, structured=spec))
        assert info.value.param == spec.param and spec.param in str(info.value)
        assert not llm.engine.requests  # nothing was queued
    with pytest.raises(InvalidSamplingParamsError, match="structured_outputs"):
        StructuredOutput("regex", "")


def test_compiled_grammars_are_cached(world):
    from metrale import LLM

    llm = LLM(world["model"], max_loras=1, max_lora_rank=4, max_model_len=128, block_size=4,
              num_kv_blocks=64)
    grammars = llm.engine.grammars
    spec = StructuredOutput.json_schema(SCHEMA)
    first = grammars.compile(spec)
    misses = grammars.misses
    assert grammars.compile(StructuredOutput.json_schema(json.loads(json.dumps(SCHEMA)))) is first
    assert grammars.misses == misses and grammars.hits >= 1


def test_a_batch_without_shaped_rows_is_not_copied(world):
    from metrale.engine.logits_shaping import shape_logits, shaped_rows
    from metrale.engine.sampler import SampledTokens, draw
    from metrale.engine.sequence import Sequence

    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(temperature=0), None) for i in range(4)]
    logits = torch.randn(4, 50)
    assert shaped_rows(seqs) == [] and shape_logits(logits, seqs, []) is logits
    drawn = draw(logits, seqs)
    assert isinstance(drawn, SampledTokens)
    assert [r.token for r in drawn.results()] == logits.argmax(-1).tolist()


def test_with_async_scheduling_the_mask_is_computed_after_its_step_is_launched(world):
    """The grammar's work for a step runs once that step's forward pass is queued on the
    device (the host fills the mask while the device computes), except for a sequence's
    first token, whose grammar has nothing in flight."""
    from metrale import LLM
    from metrale.engine.grammar import GrammarMatcher

    llm = LLM(world["model"], max_loras=1, max_lora_rank=4, max_model_len=256, block_size=4,
              num_kv_blocks=256, async_scheduling=True)
    runner = llm.engine.runner
    state = {"in_run": False}
    fills = []  # (inside runner.run, tokens the sequence had) per mask filled
    run, fill_rows = runner.run, GrammarMatcher.fill_rows

    def traced_run(*args, **kw):
        state["in_run"] = True
        try:
            return run(*args, **kw)
        finally:
            state["in_run"] = False

    def traced_fill_rows(matchers, bitmask, rows):
        fills.extend((state["in_run"], m.num_accepted) for m in matchers)
        return fill_rows(matchers, bitmask, rows)

    runner.run = traced_run
    GrammarMatcher.fill_rows = staticmethod(traced_fill_rows)
    try:
        spec = StructuredOutput.json_schema(SCHEMA)
        outs = llm.generate([_prompt(world, "A person, please.")] * 3,
                            SamplingParams(max_tokens=N, temperature=0, structured=spec))
    finally:
        GrammarMatcher.fill_rows = staticmethod(fill_rows)
    assert sum(len(o.token_ids) for o in outs) > 3 * 2
    assert fills and all(not inside for inside, seen in fills if seen > 0)  # overlapped
    assert any(inside for inside, seen in fills if seen == 0)  # the first token's: at once


def test_constrained_and_penalised_requests_ending_while_a_draw_waits(world):
    """With async scheduling a request may end (its grammar complete) while the next
    step, launched before the host knew, waits to draw its row: that row is skipped, its
    counts row given back, and the batch's tokens are those of synchronous steps."""
    from metrale import LLM

    prompt = _prompt(world, "Pick one.")
    params = [SamplingParams(max_tokens=N, temperature=0, presence_penalty=1.5,
                             repetition_penalty=1.3, structured=spec) for spec in SPECS]
    params += [SamplingParams(max_tokens=N, temperature=0, frequency_penalty=1.0)]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(world["model"], max_loras=1, max_lora_rank=4, max_model_len=256, block_size=4,
                  num_kv_blocks=256, async_scheduling=async_scheduling)
        outs = llm.generate([prompt] * len(params), params)
        runs.append([list(o.token_ids) for o in outs])
        assert llm.engine.token_counts.rows_in_use == 0
    assert runs[0] == runs[1]
    assert any(len(t) < N for t in runs[1])  # some ended early, while others still ran
