"""A Hugging Face Hub organisation as an adapter source (hf://org) through huggingface_hub,
against a local server that speaks the Hub's file routes (tests/helpers/hub_server.py;
nothing reaches the internet): names org/adapter[@revision], the library's cache (its
snapshot links stay inside the repo's cache folder, the confinement root), offline mode,
safetensors only, an LFS file checked against its SHA-256, every request bounded by the
fetch deadline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from metrale.adapters.fetch_deadline import FetchDeadlineError, FetchLimits
from metrale.adapters.hub_source import HubSource
from metrale.adapters.sources import AdapterSources
from metrale.errors import InvalidNameError, ObjectStoreError
from tests.helpers.hub_server import HubServer
from tests.helpers.peers import adapter_dir

FILES = ("adapter_config.json", "adapter_model.safetensors")


def files_of(src: str) -> dict[str, bytes]:
    return {f: (adapter_dir(src) / f).read_bytes() for f in FILES}


@pytest.fixture
def hub():
    server = HubServer()
    yield server
    server.close()


def source(hub: HubServer, tmp_path: Path, **limits) -> HubSource:
    return HubSource("hf://org", FetchLimits(**limits), cache_dir=tmp_path / "hf", endpoint=hub.url)


def same_files(found, src: str) -> bool:
    return all((found.path / f).read_bytes() == (adapter_dir(src) / f).read_bytes() for f in FILES)


def test_names_revisions_and_the_cache(hub, tmp_path):
    hub.put("org/a", files_of("a"))
    v2 = hub.put("org/a", files_of("b"), revision="v2")
    hub.put("org/a", {**files_of("c"), "adapter_model.bin": b"pickle"}, revision="pickled")
    hub.put("org/only-bin", {FILES[0]: files_of("a")[FILES[0]], "adapter_model.bin": b"pickle"})
    hf = source(hub, tmp_path)
    found = hf.find("org/a")
    assert same_files(found, "a")
    assert found.root == (tmp_path / "hf" / "models--org--a").resolve()
    assert all(os.path.realpath(found.path / f).startswith(str(found.root)) for f in FILES)
    assert same_files(hf.find("org/a@v2"), "b") and same_files(hf.find(f"org/a@{v2}"), "b")
    assert same_files(hf.find("org/a@pickled"), "c")
    assert hf.find("org/only-bin") is None  # safetensors only
    assert not any(r.endswith(".bin") for r in hub.requests)  # never fetched
    for name in ("org/missing", "org/a@nope", "other/a", "org"):
        assert hf.find(name) is None, name
    asked = len(hub.requests)
    assert hf.find("org/a", revalidate=False) == found and len(hub.requests) == asked
    hub.put("org/a", files_of("c"))  # main moved: a registration's look-up follows it
    assert same_files(hf.find("org/a"), "c")


def test_names_with_a_revision_pass_the_name_rule_and_go_through_the_sources(hub, tmp_path):
    hub.put("org/a", files_of("b"), revision="v1.0")
    sources = AdapterSources(["hf://org"], limits=FetchLimits())
    sources.sources[0].endpoint, sources.sources[0].cache_dir = hub.url, tmp_path
    assert same_files(sources.find("org/a@v1.0"), "b") and sources.from_remote("org/a@v1.0")
    for bad in ("org/a@", "org/a@v1@v2", "org/a@../x", "@v1"):
        with pytest.raises(InvalidNameError):
            sources.find(bad)


def test_offline_mode_serves_the_cache_and_asks_nothing(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub.put("org/a", files_of("a"))
    hf = source(hub, tmp_path)
    found = hf.find("org/a")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked = len(hub.requests)
    assert hf.find("org/a") == found
    assert hf.find("org/never-fetched") is None
    assert len(hub.requests) == asked


def test_an_lfs_file_that_does_not_match_its_sha256_is_refused_and_dropped(hub, tmp_path):
    hub.put("org/a", files_of("a"))
    hub.lie.add(f"/org/a/resolve/main/{FILES[1]}")
    with pytest.raises(ObjectStoreError, match="SHA-256"):
        source(hub, tmp_path).find("org/a")
    weights = files_of("a")[FILES[1]]
    assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file() and p.read_bytes() == weights]


def test_a_trickling_hub_is_cut_off_by_the_deadline(hub, tmp_path):
    hub.put("org/a", files_of("a"))
    hub.trickle.add(f"/org/a/resolve/main/{FILES[1]}")
    with pytest.raises(FetchDeadlineError, match="deadline"):
        source(hub, tmp_path, timeout_s=1.0, min_rate=1e9).find("org/a")


def test_an_unreachable_hub_is_a_store_error_not_a_miss(tmp_path):
    hf = HubSource("hf://org", FetchLimits(timeout_s=5), cache_dir=tmp_path,
                   endpoint="http://127.0.0.1:9")  # the discard port: nobody listens
    with pytest.raises(ObjectStoreError):
        hf.find("org/a")
