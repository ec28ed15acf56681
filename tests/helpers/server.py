"""Shared by the server tests (holds no tests): a tiny model with a word-level
tokenizer and chat template, tiny PEFT adapters, a real `metrale serve`
process on a free loopback port, and offline references from LLM.generate."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import torch

from metrale import LLM, SamplingParams
from tests.helpers.process import BOUND_S, stop, wait_ready
from tests.helpers.tiny_models import make_adapter, saved_tiny_model

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = ("a", "b", "c", "d", "p")  # p is pinned at start-up where a test says so
WORDS = ("user assistant system hello world the moon tell me about sun sea sky story "
         "a of and is what why how").split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
POOL = dict(max_loras=3, max_lora_rank=8, max_model_len=1024)


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer covering every id of the tiny vocab (random models emit any)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(WORDS)
    tokens += [f"w{i}" for i in range(len(tokens), vocab_size)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_world(root: Path) -> dict[str, Path]:
    """root/model (tiny llama + tokenizer), root/adapters/{a,b,c,d,p} (inside the adapter
    root), root/adapters/bad (rank 32 > max_lora_rank 8), root/outside/evil (outside)."""
    base = saved_tiny_model(root / "model", seed=7, tokenizer=save_tokenizer,
                            max_position_embeddings=1024)
    for i, name in enumerate(ADAPTERS):
        make_adapter(base, root / "adapters" / name, seed=40 + i, r=4 + (i % 2) * 4,
                     lora_alpha=8, target_modules="all-linear")
    make_adapter(base, root / "adapters" / "bad", seed=1, r=32, lora_alpha=8,
                 target_modules="all-linear")
    make_adapter(base, root / "outside" / "evil", seed=2, r=4, lora_alpha=8,
                 target_modules="all-linear")
    return {"model": root / "model", "adapters": root / "adapters", "outside": root / "outside"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m metrale serve ...` on a free loopback port, ready (its /health answers
    200) when constructed; a server that exits or hangs first raises ProcessStartError
    with its exit code and the tail of its log. stop() (or leaving a `with`) ends it."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = BOUND_S) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # One intra-op thread: on a shared 2-core machine torch's spinning OpenMP
        # workers make a tiny model 10-100x slower, and the test timings meaningless.
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.pop("METRALE_API_KEY", None)
        env.pop("METRALE_ADMIN_KEY", None)
        cmd = [sys.executable, "-m", "metrale", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        with open(log_path, "wb") as log:  # the child writes through its own copy
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=env)
        try:
            wait_ready(self.proc, f"`metrale serve` (log: {log_path})",
                       f"{self.url}/health to answer 200", self._healthy, self.log,
                       startup_timeout_s)
        except BaseException:  # an interrupted start must not leave a server behind
            self.stop()
            raise

    def _healthy(self) -> bool:
        try:  # trust_env=False: a proxy from the environment must not stand in for the server
            return httpx.get(f"{self.url}/health", timeout=5, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        stop(self.proc)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Reference:
    """Offline outputs (LLM.generate, one request at a time), cached per request."""

    def __init__(self, world: dict[str, Path]) -> None:
        self.llm = LLM(world["model"], **POOL)
        self.world = world
        self._cache: dict = {}

    def register(self, name: str, source: str | None = None) -> None:
        self.llm.register_adapter(name, self.world["adapters"] / (source or name))

    def complete(self, prompt, adapter: str | None, **params):
        key = (repr(prompt), adapter, tuple(sorted(params.items())))
        if key not in self._cache:
            sp = SamplingParams(**{"temperature": 0, **params})
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as the server runs (see ServerProcess); restored after
            try:
                self._cache[key] = self.llm.generate(prompt, sp, adapter)[0]
            finally:
                torch.set_num_threads(threads)
        return self._cache[key]

    def chat(self, message: str, adapter: str | None, **params):
        return self.complete(self.llm.chat_prompt(message), adapter, **params)


def sse_events(response: httpx.Response):
    """The JSON payloads of an SSE response, up to (not including) [DONE]."""
    import json

    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)
