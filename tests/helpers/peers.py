"""Helpers shared by the test_peer_* files (this module holds no tests).

A tiny Llama and three PEFT adapters built once per test process; a real
`metrale peer serve` subprocess; a fake peer (an in-test HTTP server that says
whatever a test wants). Pool snapshots are tests.helpers.pool's.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import torch

from metrale.config import ModelConfig, PoolConfig
from metrale.peer.wire import encode_doc
from metrale.pool.swap import LoraSlots
from tests.helpers.pool import land_disk
from tests.helpers.process import BOUND_S, POLL_S, Bound, exited, timed_out
from tests.helpers.tiny_models import make_adapter, make_model, peft_deltas, save_model

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "b": dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear",
              rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3}),
    "c": dict(r=2, lora_alpha=5, target_modules=["k_proj", "o_proj", "up_proj"],
              layers_to_transform=[1, 2]),
}


@functools.cache
def peer_root() -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """(root with model/ and adapters/{a,b,c}, {adapter: PEFT's scaling * B @ A per module})."""
    root = Path(tempfile.mkdtemp(prefix="metrale-peer-"))
    atexit.register(shutil.rmtree, root, True)
    base = make_model("llama", seed=7)
    save_model(base, root / "model")
    deltas = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        peft_model = make_adapter(base, root / "adapters" / name, seed=30 + i, **kw)
        deltas[name] = {k: v.detach() for k, v in peft_deltas(peft_model).items()}
    return root, deltas


def model_config() -> ModelConfig:
    return ModelConfig.from_dir(peer_root()[0] / "model")


def new_slots(max_loras: int = 3, rank: int = 8, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> LoraSlots:
    return LoraSlots(model_config(), PoolConfig(max_loras, rank), device, dtype)


def adapter_dir(name: str) -> Path:
    return peer_root()[0] / "adapters" / name


def disk_exporter(*names: str, rank: int = 8, dtype: torch.dtype = torch.float32, **exporter_kw):
    """An AdapterExporter over a bare pool of len(names) slots of `rank`, slot i holding
    adapter_dir(names[i]) under that name (named as a peer store names its slots)."""
    from metrale.peer.exporter import AdapterExporter
    from metrale.peer.store import StoreNames

    slots, served = new_slots(max_loras=len(names), rank=rank, dtype=dtype), StoreNames()
    for slot, name in enumerate(names):
        land_disk(slots, adapter_dir(name), slot)
        served.add(name, slot)
    return AdapterExporter(slots, served, **exporter_kw)


def peer_engine(*names: str, **engine_kw):
    """An engine on peer_root's model whose slot i holds adapter_dir(names[i]) as names[i]
    (3 slots of rank 8 unless engine_kw says otherwise)."""
    from tests.helpers.engine import tiny_engine

    engine = tiny_engine(peer_root()[0] / "model", **engine_kw)
    for slot, name in enumerate(names):
        engine.swap_lora_slot_from_disk(adapter_dir(name), name, slot)
    return engine


def assert_matches_disk(slots: LoraSlots, slot: int, name: str) -> None:
    """The slot holds exactly what a disk landing of the same adapter gives, and
    its deltas are PEFT's scaling * B @ A."""
    ref = LoraSlots(slots.model_config, slots.pool_config, slots.pool.device, slots.pool.layout.dtype)
    land_disk(ref, adapter_dir(name), slot)
    assert torch.equal(slots.pool.slot_region(slot), ref.pool.slot_region(slot))
    assert torch.equal(slots.pool.ranks[slot], ref.pool.ranks[slot])
    assert torch.equal(slots.pool.scales[slot], ref.pool.scales[slot])
    model, deltas = slots.model_config, peer_root()[1][name]
    tol = 1e-5 if slots.pool.layout.dtype == torch.float32 else 3e-2
    for layer, module in slots.pool.layout.module_keys:
        if module not in model.layer_modules(layer):  # a model-level target, at layer 0
            continue
        got = slots.pool.delta(slot, layer, module).cpu()
        want = deltas.get(model.module_path(layer, module))
        if want is None:
            assert not got.any(), f"{name}: {layer} {module} should be untouched"
        else:
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# --- a real peer store in a subprocess -------------------------------------------------


def start_store(*extra: str, adapters: Path | None = None, model: Path | None = None,
                timeout_s: float = BOUND_S):
    """`metrale peer serve` on a free port: (process, base URL)."""
    root = peer_root()[0] if adapters is None or model is None else None
    cmd = [sys.executable, "-m", "metrale", "peer", "serve", "--adapters",
           str(adapters or root / "adapters"), "--model", str(model or root / "model"),
           "--port", "0", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, wait_for_line(proc, "metrale peer: serving", timeout_s).rsplit(" on ", 1)[1].split()[0]


def wait_for_line(proc: subprocess.Popen, marker: str, timeout_s: float = BOUND_S) -> str:
    """The first output line of proc containing marker; ProcessStartError (exit code and
    output) at once if proc exits first, or at the load-stretched bound. Reads the pipe
    unbuffered: a buffered readline may take several lines at once, and select() then
    waits on an empty pipe for a line that is already in the buffer."""
    name, waited_for = f"`{' '.join(map(str, proc.args))}`", f"a line containing {marker!r}"
    fd = proc.stdout.fileno()
    bound, pending, seen, open_ = Bound(timeout_s), b"", [], True
    while True:
        if open_ and select.select([fd], [], [], POLL_S)[0]:
            chunk = os.read(fd, 1 << 16)
            open_ = bool(chunk)  # end of output: the process is exiting
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                seen.append(line)
                if marker in line:
                    threading.Thread(target=_drain, args=(fd,), daemon=True).start()
                    return line.strip()
        elif not open_:
            try:  # the pause before the next check ends the moment the process exits
                proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
        # an exited process's last output is read first (select answers at once for it)
        if proc.poll() is not None and not (open_ and select.select([fd], [], [], 0)[0]):
            raise exited(name, proc, waited_for, bound, _text(seen, pending))
        if bound.expired():
            raise timed_out(name, proc, waited_for, bound, _text(seen, pending))


def _text(lines: list[str], pending: bytes) -> str:
    return "\n".join([*lines, pending.decode(errors="replace")])


def stop(proc: subprocess.Popen) -> None:
    """Kill proc at once (a peer vanishing, not a clean shutdown) and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 1 << 16):  # keep the pipe from filling up
            pass
    except OSError:  # the pipe was closed under us: nothing left to drain
        pass


# --- a peer that says whatever the test wants ------------------------------------------


LEASE = "fakelease0001"  # the lease id fake peers grant


class FakePeer:
    """list -> `ids` (what engines check at registration); lease -> `lease_reply` (a
    reply in its logical form, sent through wire.encode_doc, or raw bytes); data ->
    `data`, delivered per `mode`:
    full | half-close | half-stall | long | long-unannounced.
    With `ranges`, a data request's ?offset=&length= picks those bytes of `data`, and
    `mode` may be {offset: mode} (full for the offsets it leaves out); without, the
    query is ignored, as a peer older than ranges does."""

    def __init__(self, lease_reply, data: bytes = b"", mode: str | dict[int, str] = "full",
                 ids: tuple[str, ...] = ("a",), ranges: bool = False) -> None:
        self.lease_reply, self.data, self.mode, self.ids = lease_reply, data, mode, ids
        self.ranges = ranges
        self.requests: list[tuple[str, str]] = []
        self.release_stall = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def close(self) -> None:
        self.release_stall.set()
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _record(self):
                peer.requests.append((self.command, self.path))
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)

            def do_POST(self):
                self._record()
                body = peer.lease_reply
                raw = body if isinstance(body, bytes) else encode_doc(body)
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_DELETE(self):
                self._record()
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_GET(self):
                self._record()
                if self.path == "/peer/v1/adapters":  # honest: the lies are in the lease and data
                    raw = json.dumps({"adapters": [{"id": i} for i in peer.ids]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                    return
                data, mode = peer._part(self.path)
                self.send_response(200)
                if mode == "long":
                    data += b"\0" * 8
                if mode != "long-unannounced":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if mode in ("half-close", "half-stall"):
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    if mode == "half-stall":
                        peer.release_stall.wait(30)
                    self.close_connection = True
                    return
                self.wfile.write(data + (b"\0" * 8 if mode == "long-unannounced" else b""))
                self.close_connection = True

        return Handler

    def _part(self, path: str) -> tuple[bytes, str]:
        """The bytes and mode of one data request."""
        query = dict(parse_qsl(urlsplit(path).query)) if self.ranges else {}
        offset = int(query.get("offset", 0))
        stop = offset + int(query["length"]) if "length" in query else len(self.data)
        mode = self.mode.get(offset, "full") if isinstance(self.mode, dict) else self.mode
        return self.data[offset:stop], mode


def assert_store_serves(model_dir, adapters: dict, names: list[str], store_dir, prompt_list,
                        n: int, **llm_kw):
    """A peer store (`metrale peer serve`) over copies of `names`' directories ({name: (PEFT
    model, its directory)}); an engine with two slots and --lora-experts registers each by
    peer:// and serves every prompt with each equal to its PEFT model. Returns the store."""
    from metrale import LLM, SamplingParams
    from metrale.peer.http_server import PeerHTTPServer
    from metrale.peer.store import AdapterStore
    from tests.helpers.reference import hf_greedy

    for name in names:
        shutil.copytree(adapters[name][1], Path(store_dir) / name)
    store = AdapterStore(store_dir, ModelConfig.from_dir(model_dir))
    server = PeerHTTPServer(store.exporter()).start()
    try:
        url = server.url.removeprefix("http://")
        llm = LLM(model_dir, max_loras=2, lora_experts=True, max_model_len=64, block_size=4,
                  num_kv_blocks=64, **llm_kw)
        for name in names:
            llm.register_adapter(f"p{name}", f"peer://{url}/{name}")
        outs = llm.generate([p for p in prompt_list for _ in names],
                            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                            [f"p{name}" for _ in prompt_list for name in names])
        for i, out in enumerate(outs):
            name, p = names[i % len(names)], prompt_list[i // len(names)]
            assert list(out.token_ids) == hf_greedy(adapters[name][0], p, n)[0], name
    finally:
        server.close()
    return store


@contextlib.contextmanager
def serve_engine_slots(engine):
    """An in-process peer HTTP endpoint exporting what engine's slots hold, by its
    registry's names: yields its host:port."""
    from metrale.peer.client import wait_for_releases
    from metrale.peer.exporter import AdapterExporter
    from metrale.peer.http_server import PeerHTTPServer

    server = PeerHTTPServer(AdapterExporter(engine.lora, engine.registry)).start()
    try:
        yield server.url.removeprefix("http://")
    finally:
        wait_for_releases()  # engines release leases on a background thread: to this server
        server.close()
