"""`metrale peer list --url URL`: the adapter ids a peer serves, one per line, each with
the `peer://` source that registers it. A plain HTTP GET: no torch, no lease."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from metrale.errors import PeerUnavailableError
from metrale.names import is_valid_name

# An adapter list is small JSON; a peer that sends more is not one we can read.
MAX_LIST_BYTES = 4 << 20


def fetch_ids(url: str, timeout_s: float = 10.0) -> list[str]:
    """Valid ids listed by the peer at `url` (http://host:port), sorted."""
    base = _base(url)
    try:
        with urllib.request.urlopen(f"{base}/peer/v1/adapters", timeout=timeout_s) as resp:
            raw = resp.read(MAX_LIST_BYTES + 1)
    except (urllib.error.URLError, OSError) as e:
        raise PeerUnavailableError(f"peer {base}: cannot list adapters ({e})") from None
    if len(raw) > MAX_LIST_BYTES:
        raise PeerUnavailableError(f"peer {base}: adapter list larger than {MAX_LIST_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except ValueError:
        raise PeerUnavailableError(f"peer {base}: adapter list is not JSON") from None
    items = doc.get("adapters") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise PeerUnavailableError(f"peer {base}: adapter list is not {{'adapters': [...]}}")
    ids = {i.get("id") for i in items if isinstance(i, dict)}
    # Ids come from the network: print only what is a valid adapter name.
    return sorted(i for i in ids if is_valid_name(i))


def peer_source(url: str, adapter_id: str) -> str:
    parts = urlsplit(_base(url))
    return f"peer://{parts.hostname}:{parts.port or 80}/{adapter_id}"


def _base(url: str) -> str:
    return (url if "://" in url else f"http://{url}").rstrip("/")


def print_ids(url: str) -> int:
    ids = fetch_ids(url)
    for adapter_id in ids:
        print(f"{adapter_id}\t{peer_source(url, adapter_id)}")
    if not ids:
        print(f"(peer {url} serves no adapter)")
    return 0
