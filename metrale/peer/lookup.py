"""Does a peer hold an adapter id? Asked once at registration, without a lease, so a
`peer://host:port/ID` source whose peer does not serve ID is refused when registered,
naming what the peer serves. The manifest is still checked in full when the adapter lands.
"""

from __future__ import annotations

from metrale.peer.allow import PeerAddress
from metrale.peer.client import PeerClient
from metrale.peer.deadline import Deadline
from metrale.peer.errors import UnknownPeerAdapterError
from metrale.peer.ids import describe_ids


def check_peer_holds(addr: PeerAddress, adapter_id: str, timeout_s: float) -> None:
    """Raise UnknownPeerAdapterError (listing what it serves) unless the peer holds the id;
    an unreachable peer raises the peer client's PeerUnavailableError."""
    ids = PeerClient(addr, Deadline(timeout_s)).list_ids()
    if adapter_id not in ids:
        raise UnknownPeerAdapterError(
            f"peer {addr} holds no adapter {adapter_id!r}; it serves: {describe_ids(ids)} "
            f"(`metrale peer list --url {addr}` lists them)")
