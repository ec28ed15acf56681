"""Churn over adapter versions: thousands of requests on 8 slots while names are reloaded
in place and to new directories, swapped into chosen slots, pinned, unpinned, unloaded and
re-registered, and requests aborted, all between steps. Every finished request must equal,
token for token, transformers + PEFT on the files of the version it was bound to; the slot
table's integrity check runs after every operation and every step."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.errors import MetraleError, PoolFullError, SlotBusyError, UnknownAdapterError
from tests.helpers.engine import step_until
from tests.helpers.tiny_models import make_adapter, make_model, save_model

N_CONTENTS = 24  # distinct adapter files; every registration or reload is a new version
N_NAMES = 12
N_REQUESTS = 2000
GEN = 3
PROMPTS = [[5, 17, 99, 3, 42, 8, 120], [61, 2, 9, 13, 200, 7], [33, 44, 55, 66, 77, 88, 99, 11]]
# Tokens whose reference top-2 logits are closer than this are not compared: batching
# changes float32 summation order, which may flip a near-tie without any adapter mix-up.
MARGIN = 1e-3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("churn")
    base = make_model("llama", seed=4)
    save_model(base, root / "model")
    refs = {}  # (content, prompt index) -> (tokens, comparable prefix length)
    for c in range(N_CONTENTS):
        r = (2, 4, 8)[c % 3]
        peft = make_adapter(base, root / f"c{c}", seed=100 + c, r=r, lora_alpha=(8, 16)[c % 2],
                            target_modules=("all-linear", ["q_proj", "v_proj"])[c % 5 == 0])
        for p, prompt in enumerate(PROMPTS):
            refs[(c, p)] = _reference(peft, prompt)
    for p, prompt in enumerate(PROMPTS):
        refs[(None, p)] = _reference(base, prompt)
    return root, refs


@torch.no_grad()
def _reference(model, prompt) -> tuple[list[int], int]:
    """Greedy tokens by full forward passes (EOS does not stop it: the engine runs with
    ignore_eos) and how many of them a near-tie cannot flip."""
    ids, tokens, comparable = list(prompt), [], GEN
    for i in range(GEN):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        top2 = logits.topk(2)
        if comparable == GEN and float(top2.values[0] - top2.values[1]) < MARGIN:
            comparable = i  # this token may flip, and the ones after it follow it
        tokens.append(int(top2.indices[0]))
        ids.append(tokens[-1])
    return tokens, comparable


@pytest.mark.soak
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_token_matches_its_version_under_churn(world, tmp_path, async_scheduling):
    """async: each step is launched before the previous one's outputs are processed, so
    requests end, abort and release their slots with a step already planned for them."""
    root, refs = world
    rng = random.Random(7)
    llm = LLM(root / "model", max_loras=8, max_lora_rank=8, block_size=4, max_model_len=64,
              num_kv_blocks=512, max_num_seqs=32, host_tier_bytes=1 << 22,
              async_scheduling=async_scheduling)
    engine, table = llm.engine, llm.engine.lora.table
    names = [f"n{i}" for i in range(N_NAMES)]
    content: dict[str, int] = {}  # name -> content of its current version
    in_place = {name: tmp_path / name for name in names}  # each name's own directory

    def register(name: str, reload: bool) -> None:
        c = rng.randrange(N_CONTENTS)
        if rng.random() < 0.5:  # rewrite the name's own directory in place
            in_place[name].mkdir(exist_ok=True)
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copyfile(root / f"c{c}" / f, in_place[name] / f)
            engine.register_adapter(name, in_place[name], reload=reload)
        else:
            engine.register_adapter(name, root / f"c{c}", reload=reload)
        content[name] = c
        counts["versions"] += 1

    counts = {"ok": 0, "error": 0, "abort": 0, "refused_ops": 0, "ops": 0, "versions": 0}
    for name in names:
        register(name, reload=False)

    expected: dict[str, tuple[int | None, int]] = {}  # request -> (content, prompt) once bound
    bound_uid: dict[str, int] = {}  # request -> the landing uid of its binding
    started: set[str] = set()
    prompt_of: dict[str, int] = {}
    adapter_of: dict[str, str | None] = {}
    finished: dict = {}
    submitted = 0

    def note_bindings() -> None:
        # a request's version is the one it is bound to when it starts: a queued request
        # may give a draining slot back and be bound again later, to the version current
        # then (bindings happen between steps, before the step that may start it)
        for rid, seq in engine.requests.items():
            if seq.bound and seq.adapter_uid != bound_uid.get(rid):  # a new binding
                assert rid not in started, f"{rid} was bound anew after it started"
                bound_uid[rid] = seq.adapter_uid
                name = adapter_of[rid]
                expected[rid] = (content[name] if name else None, prompt_of[rid])
            if seq.scheduled_at is not None:
                started.add(rid)

    def operate() -> None:
        name = rng.choice(names)
        op = rng.choice(["reload", "reload", "swap", "pin", "unpin", "unload", "abort"])
        counts["ops"] += 1
        try:
            if op == "reload":
                register(name, reload=name in content)
            elif op == "swap":
                c = rng.randrange(N_CONTENTS)
                engine.swap_lora_slot_from_disk(root / f"c{c}", name, rng.randrange(8))
                content[name] = c
                counts["versions"] += 1
            elif op in ("pin", "unpin"):
                if op == "pin" and len(engine.registry.pinned_slots()) >= 3:
                    return  # keep cache slots for everyone else
                engine.pin_adapter(name, op == "pin")
            elif op == "unload":
                engine.unload_adapter(name)
                del content[name]
            elif engine.requests:
                engine.abort(rng.choice(list(engine.requests)))
        except (SlotBusyError, PoolFullError, UnknownAdapterError):
            counts["refused_ops"] += 1  # typed refusals; nothing may have changed
        finally:
            engine.check_integrity()

    while submitted < N_REQUESTS or engine.has_unfinished_requests():
        for _ in range(rng.randrange(4)):
            if submitted >= N_REQUESTS:
                break
            name = rng.choice(names + [None])
            if name is not None and name not in content:
                try:
                    register(name, reload=False)
                except SlotBusyError:  # still draining from its unload
                    name = None
            p = rng.randrange(len(PROMPTS))
            rid = engine.add_request(PROMPTS[p], SamplingParams(max_tokens=GEN, temperature=0,
                                                                ignore_eos=True), name)
            prompt_of[rid], adapter_of[rid] = p, name
            submitted += 1
        note_bindings()
        if rng.random() < 0.3:
            operate()
        outputs = engine.step()
        engine.check_integrity()
        note_bindings()
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
        if not outputs:
            engine.wait_for_work(0.05)

    for rid in prompt_of:
        out = finished.get(rid)
        if out is None:
            counts["abort"] += 1
            continue
        if out.finish_reason == "error":
            assert isinstance(out.error, MetraleError), out.error
            assert isinstance(out.error, UnknownAdapterError), out.error  # unloaded while waiting
            counts["error"] += 1
            continue
        tokens, comparable = refs[expected[rid]]
        assert out.token_ids[:comparable] == tokens[:comparable], (rid, adapter_of[rid], expected[rid])
        counts["ok"] += 1
    assert counts["ok"] > N_REQUESTS // 2, counts
    assert engine.adapters.num_promotions > 50, counts
    assert counts["versions"] >= 64, counts
    print("churn:", counts, "promotions:", engine.adapters.num_promotions)
    # wait for nothing left in flight, then the pool is consistent and idle
    step_until(engine, lambda: engine.adapters.job is None)
    engine.check_integrity()
    assert all(i.ref_count == 0 for i in table.infos())
