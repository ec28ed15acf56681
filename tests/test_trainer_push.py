"""A trainer pushes LoRA versions from its own memory (AdapterPublisher, no files) to an
engine while requests are in flight: every finished request equals transformers + PEFT
on the weights of the version it was bound to (the HTTP data plane here; from the
trainer's GPU over NIXL on the device). Refusals: a config the publisher cannot serve,
non-finite weights; a publisher gone before the engine read its newest version fails
those requests alone."""

from __future__ import annotations

import random

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.errors import MetraleError, NonFiniteWeightsError
from metrale.peer.nixl_shim import nixl_available
from metrale.peer.publisher import AdapterPublisher
from tests.helpers.engine import step_until
from tests.helpers.pool import snapshot
from tests.helpers.tiny_models import make_adapter, make_model, save_model

PUSHES = 100
GEN = 3
PROMPTS = [[5, 17, 99, 3, 42, 8, 120], [61, 2, 9, 13, 200, 7]]
MARGIN = 1e-3  # reference top-2 logits closer than this may flip under batching: not compared


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("push")
    base = make_model("llama", seed=4)
    save_model(base, root / "model")
    policy = make_adapter(base, root / "policy0", seed=9, r=4, lora_alpha=8,
                          target_modules="all-linear")
    return root / "model", policy


def train_step(policy, rng: torch.Generator) -> None:
    """What an optimizer step does to the LoRA weights, as far as serving can tell."""
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=rng))


def state(policy) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(policy)


@torch.no_grad()
def reference(model, prompt) -> tuple[list[int], int]:
    """Greedy tokens by full forward passes and how many of them no near-tie can flip."""
    ids, tokens, comparable = list(prompt), [], GEN
    for i in range(GEN):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        top2 = logits.topk(2)
        if comparable == GEN and float(top2.values[0] - top2.values[1]) < MARGIN:
            comparable = i
        tokens.append(int(top2.indices[0]))
        ids.append(tokens[-1])
    return tokens, comparable


def bind_notes(engine, version_of: dict[str, int]):
    """note(version, rids): record the version of every newly bound request; True once
    all of rids are bound (or finished)."""
    def note(version: int, rids: list[str]) -> bool:
        for rid, seq in engine.requests.items():
            if seq.bound and rid not in version_of:
                version_of[rid] = version
        return all(rid in version_of for rid in rids)
    return note


def publisher(model_dir, policy, device: str = "cpu", transport: str = "http") -> AdapterPublisher:
    return AdapterPublisher(model_dir, policy.peft_config["default"], device=device,
                            dtype=torch.float32, transport=transport)


# (device, transport): the trainer's GPU memory read over NIXL, one GPU, on the device
WHERE = [("cpu", "http"), pytest.param(("cuda", "nixl"), marks=[pytest.mark.gpu, pytest.mark.skipif(
    not nixl_available(), reason="NIXL not installed (pip install nixl-cu12 / nixl-cu13)")])]


@pytest.mark.parametrize("where", WHERE, ids=lambda w: "-".join(w))
def test_every_request_matches_the_version_it_was_bound_to(world, where):
    model_dir, policy = world
    device, transport = where
    llm = LLM(model_dir, max_loras=2, max_lora_rank=4, block_size=4, max_model_len=64,
              num_kv_blocks=256, max_num_seqs=8, peer_transport=transport, device=device,
              dtype="float32")
    engine, rng, gen = llm.engine, random.Random(3), torch.Generator().manual_seed(0)
    pub = publisher(model_dir, policy, device, transport)
    refs: dict[tuple[int, int], tuple[list[int], int]] = {}
    version_of: dict[str, int] = {}  # request -> the push it was bound to
    prompt_of: dict[str, int] = {}
    finished: dict = {}
    current = -1
    note = bind_notes(engine, version_of)
    try:
        for push in range(PUSHES):
            train_step(policy, gen)
            for p, prompt in enumerate(PROMPTS):
                refs[(push, p)] = reference(policy, prompt)
            pub.push("policy", {k: v.to(device) for k, v in state(policy).items()}, llm=llm)
            current = push
            added = []
            for _ in range(rng.randrange(1, 3)):
                p = rng.randrange(len(PROMPTS))
                rid = engine.add_request(PROMPTS[p], SamplingParams(
                    max_tokens=GEN, temperature=0, ignore_eos=True), "policy")
                prompt_of[rid] = p
                added.append(rid)

            # until this push's requests hold its version; then they decode on over the next
            step_until(engine, lambda added=added, current=current: note(current, added),
                       finished)
        while engine.has_unfinished_requests():
            note(current, [])
            outputs = engine.step()
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
            if not outputs:
                engine.wait_for_work(0.05)  # a promotion reads from the publisher meanwhile
    finally:
        pub.close()
    assert len(finished) == len(prompt_of)
    compared = 0
    for rid, out in finished.items():
        assert out.error is None, out.error
        want, comparable = refs[(version_of[rid], prompt_of[rid])]
        assert list(out.token_ids[:comparable]) == want[:comparable], (rid, version_of[rid])
        compared += comparable
    assert compared > PUSHES  # most tokens were compared, not skipped as near-ties
    assert len({version_of[rid] for rid in finished}) > PUSHES // 2
    engine.check_integrity()


def test_refusals_touch_nothing(world):
    model_dir, policy = world
    pub = publisher(model_dir, policy)
    try:
        good = state(policy)
        source = pub.publish(good)
        before, pool_before = pub.ids.routes(), snapshot(pub.slots)
        bad = dict(good)
        key = next(k for k in bad if "lora_B" in k)
        bad[key] = torch.full_like(bad[key], float("nan"))
        with pytest.raises(NonFiniteWeightsError):
            pub.publish(bad)
        with pytest.raises(MetraleError):
            pub.publish({**good, key: good[key].to(torch.int32)})
        assert pub.ids.routes() == before and source.endswith(f"/{next(iter(before))}")
        assert snapshot(pub.slots) == pool_before  # bytes, tables and slot identities
    finally:
        pub.close()
    with pytest.raises(MetraleError, match="slots"):
        AdapterPublisher(model_dir, policy.peft_config["default"], device="cpu", slots=1)


def test_a_publisher_gone_before_the_read_fails_those_requests_alone(world):
    model_dir, policy = world
    llm = LLM(model_dir, max_loras=2, max_lora_rank=4, block_size=4, max_model_len=64,
              num_kv_blocks=128, peer_transport="http", peer_timeout_s=5.0)
    engine = llm.engine
    pub = publisher(model_dir, policy)
    greedy = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    pub.push("policy", state(policy), llm=llm)
    assert llm.generate([PROMPTS[0]], greedy, "policy")[0].error is None
    pub.push("policy", state(policy), llm=llm)  # registered, not read yet
    pub.close()
    rid = engine.add_request(PROMPTS[0], greedy, "policy")
    base = engine.add_request(PROMPTS[1], greedy, None)
    done: dict = {}
    step_until(engine, lambda: rid in done and base in done, done)
    assert done[rid].error is not None and done[base].error is None
    engine.check_integrity()
