"""`metrale serve` with no model arguments: the embedded default model and its
demo adapters, the banner's curl pasted as is, equal to the offline engine.

Slow (the real 135M model) and skipped until the default model and the demo
adapters are in the tests' recipe-keyed cache (tests/helpers/default_model.py):
training them is tests/test_default_model.py's job, not this test's."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

from metrale.demo_adapters import DEMO_ADAPTERS
from metrale.model.default_model import MODEL_NAME
from tests.helpers.default_model import is_cached
from tests.helpers.server import ServerProcess

# The default model and demo adapters of the tests' recipe-keyed cache (see conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_model_cache")]


def test_serve_without_arguments(tmp_path, default_model_cache):
    from metrale import LLM, SamplingParams
    from metrale.demo_adapters import demo_adapter_dir

    # asked when the test runs, not at collection: on a fresh machine the suite's
    # tests/test_default_model.py builds the cache first (a skipif skipped this in CI)
    if not is_cached(default_model_cache):
        pytest.skip("default model or demo adapters not in the tests' cache yet "
                    "(tests/test_default_model.py builds them)")

    server = ServerProcess([], tmp_path / "server.log", startup_timeout_s=180)
    try:
        log = server.log()
        assert f"at {server.url}/v1" in log
        curl = re.search(r"^\s+(curl .*)$", log, re.M).group(1)
        assert '"model": "shout"' in curl
        reply = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True,
                                          timeout=120, check=True).stdout)
        models = subprocess.run(["curl", "-s", f"{server.url}/v1/models"], capture_output=True,
                                text=True, timeout=30, check=True).stdout
    finally:
        server.stop()
    ids = {m["id"]: m for m in json.loads(models)["data"]}
    assert set(ids) == {MODEL_NAME, *DEMO_ADAPTERS}
    assert not any(ids[name]["residency"]["pinned"] for name in DEMO_ADAPTERS)  # on demand

    body = json.loads(curl.split(" -d ", 1)[1].strip("'"))
    llm = LLM()
    for name in DEMO_ADAPTERS:
        llm.register_adapter(name, demo_adapter_dir(name))
    prompt = llm.chat_prompt(body["messages"][0]["content"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server process runs: same kernels, same rounding
    try:
        want = llm.generate(prompt, SamplingParams(max_tokens=body["max_tokens"], temperature=0),
                            "shout")[0]
    finally:
        torch.set_num_threads(threads)
    assert reply["choices"][0]["message"]["content"] == want.text
