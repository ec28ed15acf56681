"""The lease reply on the wire (manifest version 3): one binary body.

    prefix   24 bytes: b"MTRLPEER", u16 version, u16 flags (0), u32 header_len,
             u32 peft_len, u32 n_tensors (little-endian)
    header   header_len bytes of JSON: lease, ids, dtype, data_bytes, transports
    peft     peft_len bytes of JSON: the PEFT config, kept raw so an engine can compare
             it with the one it planned last time without parsing it
    table    n_tensors records of RECORD (32 bytes each), manifest order

A body of another length than its prefix announces is refused before any field is read.
The table is one np.frombuffer, checked column-wise (JSON objects per tensor cost ~5 ms
on an 8B adapter's 448 tensors).
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass

import numpy as np

from metrale.config import EXTRA_TARGETS, LINEAR_MODULES, MOE_MODULES, SHARED_EXPERT_MODULES
from metrale.peer.errors import ManifestVersionError, PeerManifestError

WIRE_VERSION = 3
MAGIC = b"MTRLPEER"
PREFIX = struct.Struct("<8sHHIII")
CONTENT_TYPE = "application/x-metrale-manifest"
MAX_MANIFEST_BYTES = 8 << 20  # a whole reply; far above any real model's
MAX_HEADER_BYTES = 2 << 20  # the NIXL agent metadata (<= 1 MiB, base64) dominates
MAX_PEFT_BYTES = 4 << 20
MAX_WIRE_TENSORS = 1 << 16

# Record fields: what the plan depends on (layer, module, kind, rows, cols, pad, nbytes:
# the first SHAPE_BYTES of a record), then the peer's address of the tensor (0 unless the
# reply offers NIXL). `pad` must be 0.
RECORD = np.dtype([("layer", "<u2"), ("module", "u1"), ("kind", "u1"), ("rows", "<u4"),
                   ("cols", "<u4"), ("pad", "<u4"), ("nbytes", "<u8"), ("addr", "<u8")])
SHAPE_BYTES = 24
# a record's module is an index into this; MoE experts and routers, then shared experts,
# came later, appended so that the earlier indices keep their meaning (an older engine
# refuses their records)
MODULES = LINEAR_MODULES + EXTRA_TARGETS + MOE_MODULES + SHARED_EXPERT_MODULES
KINDS = ("A", "B", "M")
assert RECORD.itemsize == 32


@dataclass(frozen=True)
class WireReply:
    header: bytes  # JSON, not decoded yet
    peft: bytes  # JSON, not decoded yet
    table: np.ndarray  # RECORD[n], read-only view of the body

    def shape_bytes(self) -> bytes:
        """The records without their addresses: equal bytes, equal plan."""
        raw = self.table.view(np.uint8).reshape(len(self.table), RECORD.itemsize)
        return raw[:, :SHAPE_BYTES].tobytes()


def encode(header: dict | bytes, peft: bytes, table: np.ndarray) -> bytes:
    """The reply body (exporters; tests build lying peers with it)."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    table = np.ascontiguousarray(table, dtype=RECORD)
    return b"".join((PREFIX.pack(MAGIC, WIRE_VERSION, 0, len(head), len(peft), len(table)),
                     head, peft, table.tobytes()))


def decode(raw: bytes, source: str) -> WireReply:
    """Split a reply body into its sections; every length is checked against the body's
    before anything is sliced. Raises PeerManifestError (ManifestVersionError for a peer
    of another protocol version)."""
    if len(raw) < PREFIX.size or not raw.startswith(MAGIC):
        raise _not_v3(raw, source)
    magic, version, flags, head_len, peft_len, n = PREFIX.unpack_from(raw)
    if version != WIRE_VERSION:
        raise ManifestVersionError(
            f"{source}: the peer speaks manifest version {version}, this engine "
            f"{WIRE_VERSION}; upgrade the older side")
    if flags:
        raise PeerManifestError(f"{source}: manifest flags {flags:#x} are not 0")
    if head_len > MAX_HEADER_BYTES or peft_len > MAX_PEFT_BYTES or n > MAX_WIRE_TENSORS:
        raise PeerManifestError(
            f"{source}: manifest sections of {head_len}/{peft_len} bytes and {n} tensors exceed "
            f"the caps ({MAX_HEADER_BYTES}/{MAX_PEFT_BYTES}/{MAX_WIRE_TENSORS})")
    want = PREFIX.size + head_len + peft_len + n * RECORD.itemsize
    if len(raw) != want:
        raise PeerManifestError(
            f"{source}: the manifest body is {len(raw)} bytes, its prefix announces {want}; "
            "truncated or padded")
    a = PREFIX.size
    b = a + head_len
    c = b + peft_len
    table = np.frombuffer(raw, dtype=RECORD, count=n, offset=c)
    return WireReply(bytes(raw[a:b]), bytes(raw[b:c]), table)


def _not_v3(raw: bytes, source: str) -> PeerManifestError:
    """A body without the magic: a version-2 peer's JSON gets a version error."""
    text = raw[:64].lstrip()
    if text.startswith(b"{") and b'"lease"' in raw[:1 << 16] and b'"manifest"' in raw:
        return ManifestVersionError(
            f"{source}: the peer answered with a JSON manifest (version 2 or older); this "
            f"engine speaks version {WIRE_VERSION}: upgrade the peer")
    return PeerManifestError(f"{source}: the lease reply is not a version-{WIRE_VERSION} "
                             f"manifest ({len(raw)} bytes without the {MAGIC!r} magic)")


def unb64(text: str, source: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise PeerManifestError(f"{source}: {what} is not base64") from None


# --- the logical form (tests, tools) -------------------------------------------------------


class Unrepresentable(ValueError):
    """A document value the binary table cannot hold (a float layer, a string shape)."""


def _u(value: object, bits: int) -> int:
    if type(value) is not int:
        raise Unrepresentable(f"{value!r} is not an integer")
    return value & ((1 << bits) - 1)  # wraps like a C cast: -1 arrives as 2**bits - 1


def encode_doc(doc: dict) -> bytes:
    """{"lease": {...}, "manifest": {... "tensors": [{layer, module, kind, shape, nbytes}],
    "transports": {"nixl": {..., "descs": [[addr, nbytes, device]]}}}} on the wire: the
    version-2 document's shape, kept so tests can edit one field of a reply and send it.
    Raises Unrepresentable when a tensor field is no integer (the table has no room for
    that lie; unknown module and kind names become out-of-range indices)."""
    m = dict(doc.get("manifest") or {})
    tensors = m.pop("tensors", [])
    peft = m.pop("peft", None)
    if not isinstance(tensors, list):
        raise Unrepresentable("tensors is not a list")
    transports = m.get("transports")
    descs = None
    if isinstance(transports, dict) and isinstance(transports.get("nixl"), dict):
        nixl = dict(transports["nixl"])
        descs = nixl.pop("descs", None)
        if isinstance(descs, list) and descs and isinstance(descs[0], list) and len(descs[0]) == 3:
            nixl.setdefault("device", descs[0][2])
        m["transports"] = {**transports, "nixl": nixl}
    table = np.zeros(len(tensors), dtype=RECORD)
    for i, t in enumerate(tensors):
        if not isinstance(t, dict) or not isinstance(t.get("shape"), list) or len(t["shape"]) != 2:
            raise Unrepresentable(f"tensor #{i} is not a record")
        module, kind = t.get("module"), t.get("kind")
        table[i] = (_u(t.get("layer"), 16), MODULES.index(module) if module in MODULES else 255,
                    KINDS.index(kind) if kind in KINDS else 255, _u(t["shape"][0], 32),
                    _u(t["shape"][1], 32), 0, _u(t.get("nbytes"), 64),
                    _u(descs[i][0], 64) if isinstance(descs, list) and i < len(descs)
                    and isinstance(descs[i], list) and descs[i] else 0)
    header = {"lease": doc.get("lease"), **m}
    return encode(header, b"null" if peft is None else json.dumps(peft).encode(), table)


def decode_doc(raw: bytes) -> dict:
    """The inverse of encode_doc for a well-formed body (tests)."""
    wire = decode(raw, "decode_doc")
    header = json.loads(wire.header)
    lease = header.pop("lease", None)
    tensors, descs = [], []
    nixl = (header.get("transports") or {}).get("nixl")
    for r in wire.table.tolist():
        layer, module, kind, rows, cols, _, nbytes, addr = r
        tensors.append({"layer": layer, "module": MODULES[module], "kind": KINDS[kind],
                        "shape": [rows, cols], "nbytes": nbytes})
        descs.append([addr, nbytes, (nixl or {}).get("device", 0)])
    if isinstance(nixl, dict):
        nixl["descs"] = descs
    return {"lease": lease, "manifest": {**header, "peft": json.loads(wire.peft),
                                         "tensors": tensors}}
