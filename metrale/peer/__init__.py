"""Peer adapter staging: land adapters from another engine or a `metrale peer
serve` store over NIXL (RDMA / NVLink / shared memory / TCP via UCX) or an HTTP
byte stream, and export this engine's READY slots to peers.

Engine side:    prepare_from_peer (a byte source for the engine's promotions)  (metrale.peer.landing)
Exporter side:  AdapterExporter + PeerHTTPServer       (metrale.peer.exporter, .http_server)
Store:          AdapterStore, serve_store              (metrale.peer.store)
NIXL is optional (pip install nixl-cu12); everything works over HTTP without it.
Import from the modules: the package imports nothing, so `metrale peer list` (plain HTTP,
metrale.peer.listing) never loads the exporter's torch.
"""
