"""`metrale peer list --url URL`: the adapter ids a peer serves, one per line, each with
the `peer://` source that registers it. No torch, no lease."""

from __future__ import annotations

from metrale.names import is_valid_name
from metrale.peer.allow import PeerAddress, parse_peer_addr
from metrale.peer.client import PeerClient
from metrale.peer.deadline import Deadline


def fetch_ids(url: str, timeout_s: float = 10.0) -> list[str]:
    """Valid ids listed by the peer at `url` (host:port or http://host:port), sorted."""
    host, port = parse_peer_addr(url)
    # No allow-list: the user named this peer, and only its ids are read from it.
    ids = PeerClient(PeerAddress(host, host, port), Deadline(timeout_s)).list_ids()
    return sorted({i for i in ids if is_valid_name(i)})  # from the network: names only


def peer_source(url: str, adapter_id: str) -> str:
    host, port = parse_peer_addr(url)
    return f"peer://{host}:{port}/{adapter_id}"


def print_ids(url: str) -> int:
    ids = fetch_ids(url)
    for adapter_id in ids:
        print(f"{adapter_id}\t{peer_source(url, adapter_id)}")
    if not ids:
        print(f"(peer {url} serves no adapter)")
    return 0
