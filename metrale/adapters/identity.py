"""What an adapter directory holds, as a key for caches that must never serve old bytes.

The key digests the bytes that decide a landing plan (adapter_config.json and the
safetensors header) and fingerprints the data section by its file's stat. The stat
includes the inode and ctime: every rewrite changes one of them, also one that keeps the
size and the mtime (`cp -p`, tar, `rsync -t`), since ctime cannot be set from user space.
Reading the config and header costs one small read each, far below a landing.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Larger files are refused by the planner; here they just get no key (no caching).
_MAX_KEYED_BYTES = 1 << 24


@dataclass(frozen=True)
class AdapterIdentity:
    path: str  # the directory, absolute
    plan_digest: str  # blake2b of adapter_config.json + the safetensors header
    data_stat: tuple[int, ...]  # (dev, inode, size, mtime_ns, ctime_ns) of the weights file


def adapter_identity(adapter_dir: str | Path) -> AdapterIdentity | None:
    """None when the files cannot be read or look unreasonable: the caller then takes the
    uncached path, which raises the planner's precise error."""
    d = Path(adapter_dir)
    try:
        digest = hashlib.blake2b(digest_size=16)
        with open(d / CONFIG_FILE, "rb") as f:
            config = f.read(_MAX_KEYED_BYTES + 1)
        with open(d / WEIGHTS_FILE, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= n <= _MAX_KEYED_BYTES or len(config) > _MAX_KEYED_BYTES:
                return None
            header = f.read(n)
        where = str(d.absolute())  # no resolve(): the inode already names the file
    except OSError:
        return None
    for part in (config, head, header):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    stat = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return AdapterIdentity(where, digest.hexdigest(), stat)
