"""Peer adapter staging (docs/DESIGN.md, "Peers"): land adapters from another engine or a
`metrale peer serve` store over NIXL or HTTP, and export this engine's READY slots.
NIXL is optional. The package imports nothing, so `metrale peer list` never loads torch.
"""
