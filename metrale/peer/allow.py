"""Who may talk to whom: the engine only contacts peers on its allow-list, and an
exporter only serves clients on its own. Entries are IP networks ("10.0.0.0/8",
"::1") or host names ("store-1.cluster"). The default is loopback only, so a fresh
install never fetches weights from, or exports them to, another machine by accident.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from metrale.peer.errors import PeerNotAllowedError

LOOPBACK: tuple[str, ...] = ("127.0.0.0/8", "::1/128", "localhost")
DEFAULT_PEER_PORT = 7460

IPNet = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class PeerAddress:
    host: str  # as the caller wrote it (for messages and the Host header)
    ip: str  # the checked address we connect to
    port: int

    def __str__(self) -> str:
        return f"http://{self.host}:{self.port}"


class AllowList:
    def __init__(self, entries: Iterable[str] = LOOPBACK) -> None:
        self.entries = tuple(entries)
        self.networks: list[IPNet] = []
        self.names: set[str] = set()
        for entry in self.entries:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                self.names.add(entry.strip().lower().rstrip("."))

    def allows_ip(self, ip: str) -> bool:
        try:
            addr = ipaddress.ip_address(ip.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # a dual-stack server sees ::ffff:127.0.0.1
        return any(addr in net for net in self.networks)

    def __repr__(self) -> str:
        return f"AllowList({', '.join(self.entries) or 'nothing'})"


def as_allow_list(allow: AllowList | Iterable[str] | None) -> AllowList:
    if isinstance(allow, AllowList):
        return allow
    return _allow_list(LOOPBACK if allow is None else tuple(allow))


@functools.lru_cache(maxsize=64)
def _allow_list(entries: tuple[str, ...]) -> AllowList:
    """Parsed once per list: every landing checks its peer (~0.1 ms of ip_network parsing)."""
    return AllowList(entries)


def parse_peer_addr(addr: str) -> tuple[str, int]:
    """'host:port', 'http://host:port' or '[::1]:port' -> (host, port)."""
    if not isinstance(addr, str) or not addr or len(addr) > 512:
        raise PeerNotAllowedError(f"peer address {addr!r} is not a host:port or http URL")
    text = addr if "://" in addr else f"http://{addr}"
    try:
        parts = urlsplit(text)
        port = parts.port or DEFAULT_PEER_PORT
    except ValueError as e:
        raise PeerNotAllowedError(f"peer address {addr!r} is malformed: {e}") from None
    if parts.scheme != "http" or not parts.hostname:
        # No TLS yet: peers are meant for a trusted cluster network (see peer_allow).
        raise PeerNotAllowedError(f"peer address {addr!r}: use http://host:port or host:port")
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise PeerNotAllowedError(
            f"peer address {addr!r} must be scheme://host:port only (no path, user or query)"
        )
    return parts.hostname, port


def resolve_peer(addr: str, allow: AllowList | Iterable[str] | None) -> PeerAddress:
    """Check `addr` against the allow-list, contacting nothing, and pick the address to
    connect to: a name is resolved once, here, so it cannot change its mind between the
    check and the connection."""
    allow = as_allow_list(allow)
    host, port = parse_peer_addr(addr)
    try:  # an address resolves to itself, without asking any resolver
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise PeerNotAllowedError(f"peer host {host!r} does not resolve: {e}") from None
    # IPv4 first: servers (the peer store included) usually bind 127.0.0.1, not ::1.
    ips = sorted(dict.fromkeys(info[4][0] for info in infos), key=lambda ip: ":" in ip)
    by_name = host.lower().rstrip(".") in allow.names
    if not ips or not (by_name or all(allow.allows_ip(ip) for ip in ips)):
        raise PeerNotAllowedError(
            f"peer {host} ({', '.join(ips) or 'no address'}) is not in the peer allow-list "
            f"{allow}; add its name or network with --peer-allow to fetch adapters from it"
        )
    return PeerAddress(host, ips[0], port)
