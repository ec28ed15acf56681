"""Peer adapter staging: land adapters from another engine or a `metrale peer
serve` store over NIXL (RDMA / NVLink / shared memory / TCP via UCX) or an HTTP
byte stream, and export this engine's READY slots to peers.

Engine side:    prepare_from_peer (a byte source for the engine's promotions)  (metrale.peer.landing)
Exporter side:  AdapterExporter + PeerHTTPServer       (metrale.peer.exporter, .http_server)
Store:          AdapterStore, serve_store              (metrale.peer.store)
NIXL is optional (pip install nixl-cu12); everything works over HTTP without it.
"""

from importlib import import_module

# Resolved on first use, so that `metrale peer list` (metrale.peer.listing, plain HTTP)
# does not import the exporter's torch just by naming a module of this package.
_EXPORTS = {"LOOPBACK": "allow", "AllowList": "allow", "AdapterExporter": "exporter",
            "PeerHTTPServer": "http_server", "prepare_from_peer": "landing"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'metrale.peer' has no attribute {name!r}")
    return getattr(import_module(f"metrale.peer.{_EXPORTS[name]}"), name)
