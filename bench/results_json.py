"""The results file's one writer, torch-free so that CPU-only benches (bench/cluster_sim.py)
use it too: each command merges its figures beside every other command's."""

from __future__ import annotations

import json
import os
from pathlib import Path


def merge_results(path: Path, section: str, key: str, value: dict, keep: bool = False) -> None:
    """results[section][key] = value, merged into the file's other keys; keep: value's keys
    replace those of an existing entry, its other keys stay (a run of some batch sizes
    keeps an earlier run's other batch sizes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    entries = data.setdefault(section, {})
    old = entries.get(key) if keep else None
    entries[key] = {**old, **value} if isinstance(old, dict) else value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
