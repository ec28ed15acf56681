"""What an adapter directory holds, as a key for caches that must never serve old bytes:
a digest of what decides a landing plan (adapter_config.json, the safetensors header) and
the weights file's stat, inode and ctime included (a rewrite that keeps size and mtime,
`cp -p` or `rsync -t`, changes them). Unchanged stats reuse an earlier digest, remembered,
as git's "racily clean" rule, only for files last changed well before they were read (a
rewrite within one timestamp tick keeps every stat field).
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from metrale.adapters.input_limits import open_regular, probe
from metrale.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Larger files are refused by the planner; here they just get no key (no caching).
_MAX_KEYED_BYTES = 1 << 24


@dataclass(frozen=True)
class AdapterIdentity:
    path: str  # the directory, absolute
    plan_digest: str  # blake2b of adapter_config.json + the safetensors header
    data_stat: tuple[int, ...]  # (dev, inode, size, mtime_ns, ctime_ns) of the weights file


def file_stat(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# (directory, config stat, weights stat) -> identity: a landing of unchanged files then
# costs two stats, not two reads and a digest (~0.6 ms on an 8B adapter's header)
_known: OrderedDict[tuple, AdapterIdentity] = OrderedDict()
_KNOWN_MAX = 1024
_known_lock = threading.Lock()
_SETTLED_NS = 200_000_000  # files changed less than this before their read: not remembered


def adapter_identity(adapter_dir: str | Path, root: Path | None = None) -> AdapterIdentity | None:
    """None when the files cannot be read or look unreasonable: the caller then takes the
    uncached path, which raises the planner's precise error. root: the files must resolve
    inside it (adapters.confined); a file that does not gets no identity."""
    d = Path(adapter_dir)
    where = str(d.absolute())  # no resolve(): the inode already names the file
    try:
        found = (probe(d / CONFIG_FILE, AdapterError, root), probe(d / WEIGHTS_FILE, AdapterError, root))
        if not all(st is not None and stat.S_ISREG(st.st_mode) for st in found):
            return None  # a FIFO would block the open below; the planner refuses it
        stats = (file_stat(found[0]), file_stat(found[1]))
        with _known_lock:
            known = _known.get((where, *stats))
        if known is not None:
            return known
        read_at = time.time_ns()
        # open_regular: never blocks on a FIFO swapped in after the stat
        with open_regular(d / CONFIG_FILE, AdapterError, root) as cf, \
                open_regular(d / WEIGHTS_FILE, AdapterError, root) as wf:
            opened = (file_stat(os.fstat(cf.fileno())), file_stat(os.fstat(wf.fileno())))
            config = cf.read(_MAX_KEYED_BYTES + 1)
            head = wf.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= n <= _MAX_KEYED_BYTES or len(config) > _MAX_KEYED_BYTES:
                return None
            header = wf.read(n)
    except (OSError, ValueError, AdapterError):  # ValueError: a NUL in the path
        return None
    digest = hashlib.blake2b(digest_size=16)
    for part in (config, head, header):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    identity = AdapterIdentity(where, digest.hexdigest(), opened[1])
    if opened == stats and all(read_at - max(st[3], st[4]) > _SETTLED_NS for st in stats):
        with _known_lock:
            _known[(where, *stats)] = identity
            while len(_known) > _KNOWN_MAX:
                _known.popitem(last=False)
    return identity
