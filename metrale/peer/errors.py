"""Typed refusals of peer staging. Each derives from a metrale.errors class, so callers
that map classes to HTTP statuses (metrale.server.errors) already treat them sensibly.
"""

from __future__ import annotations

from metrale.errors import AdapterError, MetraleError, PeerUnavailableError, UnknownAdapterError

NIXL_PIP = "pip install nixl-cu12  (or: pip install 'metrale[peer]')"


class PeerNotAllowedError(MetraleError):
    """The peer address is outside the configured allow-list; nothing was contacted."""


class PeerConnectionError(PeerUnavailableError):
    """The peer's control plane could not be reached or answered with an error."""


class PeerTimeoutError(PeerUnavailableError):
    """A deadline passed while talking to the peer (control or data plane)."""


class PeerTransferError(PeerUnavailableError):
    """The data plane failed: a short or long stream, a NIXL error, a vanished peer."""


class NixlUnavailableError(PeerUnavailableError):
    """NIXL is not installed or cannot start here; HTTP staging still works."""


class PeerManifestError(AdapterError):
    """The peer's manifest is malformed, oversized or does not fit the local pool."""


class UnknownPeerAdapterError(UnknownAdapterError):
    """The peer holds no adapter of that id (or cannot export it right now)."""


class LeaseNotFoundError(MetraleError):
    """The lease id is unknown, released or expired (exporter side)."""


class DataRangeError(MetraleError):
    """A data stream's byte range is malformed or outside the leased bytes (exporter side)."""


class LeaseTTLError(MetraleError):
    """A lease asked for with a ttl_s that is not a positive, finite number of seconds
    (NaN would never expire; a negative or infinite one is no lifetime): refused, 400."""


class TooManyLeasesError(MetraleError):
    """The exporter holds its maximum number of open leases; retry after some end."""


class ManifestVersionError(PeerManifestError):
    """The peer speaks another manifest version than this engine; upgrade the older side."""
