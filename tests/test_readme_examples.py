"""The README's client examples as a new user runs them: what `make run` installs holds
the `openai` client they import, and each Python block that talks to the server runs as
written (its port pointed at the test's server) against the default model and its demo
adapters, printing what the README says it prints.

The run is slow (the real 135M model) and skipped until the default model and the demo
adapters are in the tests' recipe-keyed cache (tests/test_default_model.py builds them)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers.default_model import is_cached
from tests.helpers.server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SERVER = "http://127.0.0.1:8000/v1"


def _client_blocks() -> list[str]:
    return [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if SERVER in b]


def test_make_run_installs_the_openai_client():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("$(VENV)/.installed-run:", 1)[1].split("\n\n", 1)[0]
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', target).group(1).split(",")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = [req for extra in extras for req in optional[extra]]
    assert any(re.match(r"openai\b", req) for req in installed), (extras, installed)
    assert "from openai import OpenAI" in README and _client_blocks()


@pytest.mark.slow
def test_the_readme_client_examples_run_as_written(default_model_cache, tmp_path):
    if not is_cached(default_model_cache):
        pytest.skip("default model or demo adapters not in the tests' cache yet "
                    "(tests/test_default_model.py builds them)")
    blocks = _client_blocks()
    assert len(blocks) >= 3
    with ServerProcess([], tmp_path / "server.log", startup_timeout_s=180) as server:
        outputs = []
        for block in blocks:
            code = block.replace(SERVER, f"{server.url}/v1")
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 timeout=600)
            assert run.returncode == 0, f"{block}\n{run.stderr[-3000:]}"
            outputs.append(run.stdout)
    # what the README says they print
    text = "\n".join(outputs)
    for model in ("SmolLM2-135M-Instruct", "shout", "pirate"):
        assert f"{model} ->" in text
    for claim in re.findall(r"prints `([^`]+)`", README):
        assert claim in text, claim
