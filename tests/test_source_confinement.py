"""Every file of an adapter from a directory source (--adapter-source DIR) or an
--adapter-root is opened so that it cannot resolve outside its root, at registration and
again at every landing: a weights or config file symlinked out, a directory symlinked out,
a parent directory symlinked out, a directory replaced by a symlink after its
registration, symlink loops, dangling links, FIFOs and directories where a file belongs.
Each is a 4xx naming the adapter (403 for an escape, 422 for a broken tree), never a 500
or a hang, the pool and its slots stay as they were, and nothing outside the root is
opened: the kernel (inotify) reports every open of a file in the outside tree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from metrale.cli import build_parser
from metrale.config import ModelConfig
from metrale.server.serve import build_app
from tests.helpers.opened import OpenWatch
from tests.helpers.peers import adapter_dir, peer_root
from tests.helpers.pool import snapshot
from tests.helpers.server import save_tokenizer

FILES = ("adapter_config.json", "adapter_model.safetensors")


def put(folder: Path, src: str = "a") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copyfile(adapter_dir(src) / f, folder / f)
    return folder


def half(folder: Path, real: str, link_name: str, target) -> None:
    """An adapter directory with its `real` file copied and `link_name` a symlink."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(adapter_dir("a") / real, folder / real)
    (folder / link_name).symlink_to(target)


@pytest.fixture
def tree(tmp_path):
    """src/ (the source or root) and outside/ (an adapter, a passwd-like file, a FIFO, a
    tree with an adapter in it): every hostile layout of the module inside src/."""
    src, out = tmp_path / "src", tmp_path / "outside"
    put(src / "org" / "good", "a")
    put(src / "org" / "other", "c")
    put(out / "other", "b")
    (out / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    os.mkfifo(out / "fifo")
    put(out / "tree" / "x", "b")
    weights, config = FILES[1], FILES[0]
    half(src / "esc" / "weights", config, weights, out / "other" / weights)
    half(src / "esc" / "relative", config, weights, Path("../../../outside/other") / weights)
    half(src / "esc" / "config", weights, config, out / "passwd")
    half(src / "esc" / "fifo-out", config, weights, out / "fifo")
    half(src / "esc" / "dangling-out", config, weights, out / "nothing")
    (src / "link-out").symlink_to(out / "other" / weights)  # a chain: in, then out
    half(src / "esc" / "chain", config, weights, src / "link-out")
    (src / "esc" / "dir").symlink_to(out / "other", target_is_directory=True)
    (src / "parent").symlink_to(out / "tree", target_is_directory=True)
    half(src / "bad" / "loop", config, weights, weights)  # itself
    (src / "bad" / "dirloop").symlink_to(src / "bad" / "dirloop")
    half(src / "bad" / "dangling", config, weights, src / "nothing")
    half(src / "bad" / "fifo", config, weights, src / "nothing")
    (src / "bad" / "fifo" / weights).unlink()
    os.mkfifo(src / "bad" / "fifo" / weights)
    (src / "bad" / "dirfile").mkdir()
    shutil.copyfile(adapter_dir("a") / config, src / "bad" / "dirfile" / config)
    (src / "bad" / "dirfile" / weights).mkdir()
    (src / "bad" / "dirconfig").mkdir()
    shutil.copyfile(adapter_dir("a") / weights, src / "bad" / "dirconfig" / weights)
    (src / "bad" / "dirconfig" / config).mkdir()
    return src, out


ESCAPES = ["esc/weights", "esc/relative", "esc/config", "esc/fifo-out", "esc/dangling-out",
           "esc/chain", "esc/dir", "parent/x"]
BROKEN = ["bad/loop", "bad/dirloop", "bad/dangling", "bad/fifo", "bad/dirfile", "bad/dirconfig"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The peers' tiny model with a tokenizer (/tokenize registers without landing)."""
    path = tmp_path_factory.mktemp("confinement") / "model"
    shutil.copytree(peer_root()[0] / "model", path)
    save_tokenizer(path, ModelConfig.from_dir(path).vocab_size)
    return path


def serve(model: Path, *extra: str) -> TestClient:
    args = build_parser().parse_args([
        "serve", "--model", str(model), "--max-loras", "2",
        "--max-lora-rank", "8", "--max-model-len", "64", "--num-kv-blocks", "64", *extra])
    return TestClient(build_app(args)[0])


def complete(client: TestClient, model: str):
    return client.post("/v1/completions", json={"model": model, "prompt": [3, 14, 15, 92],
                                                "max_tokens": 2, "temperature": 0})


def pool_state(client: TestClient):
    return snapshot(client.app.state.engine.engine.lora)


def assert_refused(reply, status: int, name: str) -> None:
    assert reply.status_code == status, (name, reply.status_code, reply.text)
    message = reply.json()["error"]["message"]
    assert name.rsplit("/", 1)[-1] in message, (name, message)  # names the adapter


def test_every_escape_and_broken_tree_from_a_source_is_a_4xx_opening_nothing_outside(tree, model):
    src, out = tree
    with serve(model, "--adapter-source", str(src)) as client:
        assert complete(client, "org/good").status_code == 200
        before = pool_state(client)
        with OpenWatch(out) as watch:
            for name in ESCAPES:
                assert_refused(complete(client, name), 403, name)
            for name in BROKEN:
                assert_refused(complete(client, name), 422, name)
            opened = watch.opened()
        assert opened == [], f"files outside the source were opened: {opened}"
        assert pool_state(client) == before  # every refusal changed nothing
        assert complete(client, "org/other").status_code == 200  # and the server serves on


def test_a_directory_swapped_for_a_symlink_after_registration_is_refused_at_its_landing(tree, model):
    """Registered by a first request that does not land it (/tokenize), then its directory
    is replaced by a symlink to another tree (out of the source; or inside it, to another
    adapter): its landing is refused and reads nothing of the other tree. The same after
    it landed once and was evicted."""
    src, out = tree
    put(src / "swap" / "out", "a")
    put(src / "swap" / "in", "a")
    put(src / "swap" / "landed", "a")
    with serve(model, "--adapter-source", str(src), "--max-loras", "1") as client:
        for name in ("swap/out", "swap/in"):
            reply = client.post("/tokenize", json={"model": name, "prompt": "hello"})
            assert reply.status_code == 200, reply.text
        assert complete(client, "swap/landed").status_code == 200
        assert complete(client, "org/good").status_code == 200  # swap/landed evicted
        before = pool_state(client)
        for name, target in (("swap/out", out / "other"), ("swap/in", src / "org" / "other"),
                             ("swap/landed", out / "other")):
            shutil.rmtree(src / name)
            (src / name).symlink_to(target, target_is_directory=True)
        with OpenWatch(out) as watch:
            assert_refused(complete(client, "swap/out"), 403, "swap/out")
            assert_refused(complete(client, "swap/landed"), 403, "swap/landed")
            opened = watch.opened()
        assert opened == [], f"files outside the source were opened: {opened}"
        assert_refused(complete(client, "swap/in"), 422, "swap/in")
        assert pool_state(client) == before


def test_the_adapter_root_keeps_the_same_rule_at_registration_and_at_landing(tree, model):
    """POST /v1/adapters under --adapter-root: the same layouts refused (403 out, 400 for a
    broken tree, as before), and a directory registered and then swapped for a symlink
    out is refused at its landing, opening nothing outside."""
    src, out = tree
    put(src / "swapped", "a")
    with serve(model, "--adapter-root", str(src)) as client:
        with OpenWatch(out) as watch:
            for path in ESCAPES:
                reply = client.post("/v1/adapters", json={"name": "x", "path": path})
                assert reply.status_code == 403, (path, reply.text)
            for path in BROKEN:
                reply = client.post("/v1/adapters", json={"name": "x", "path": path})
                assert reply.status_code in (400, 422), (path, reply.text)
            opened = watch.opened()
        assert opened == [], f"files outside the root were opened: {opened}"
        reply = client.post("/v1/adapters", json={"name": "swapped", "path": "swapped"})
        assert reply.status_code == 201, reply.text
        before = pool_state(client)
        shutil.rmtree(src / "swapped")
        (src / "swapped").symlink_to(out / "other", target_is_directory=True)
        with OpenWatch(out) as watch:
            assert_refused(complete(client, "swapped"), 403, "swapped")
            opened = watch.opened()
        assert opened == [], f"files outside the root were opened: {opened}"
        assert pool_state(client) == before
        assert complete(client, "model").status_code == 200


def test_a_component_swapped_between_the_check_and_the_open_fails_the_walk(tmp_path, monkeypatch):
    """The file is resolved and checked, then opened by walking the resolved path from the
    root without following symlinks: a directory replaced by a symlink out in between
    (here: the resolution is made to answer with what it saw before the swap) is refused,
    and nothing outside is opened."""
    from metrale.adapters import confined
    from metrale.errors import AdapterFileError

    root, out = (tmp_path / "root").resolve(), (tmp_path / "out").resolve()
    put(root / "org" / "a")
    put(out / "a", "b")
    stale = {str(p): os.path.realpath(p) for p in (root / "org" / "a" / FILES[1], root / "org" / "a")}
    shutil.rmtree(root / "org" / "a")
    (root / "org" / "a").symlink_to(out / "a", target_is_directory=True)
    real = os.path.realpath
    monkeypatch.setattr(confined.os.path, "realpath",
                        lambda p, strict=False: stale.get(str(p)) or real(p, strict=strict))
    with OpenWatch(out) as watch:
        with pytest.raises(AdapterFileError, match="changed while it was opened"):
            confined.open_fd(root / "org" / "a" / FILES[1], root, AdapterFileError)
        assert watch.opened() == []
