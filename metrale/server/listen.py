"""The address `metrale serve` will listen on, checked before anything slow starts
(loading the model, training the demo adapters, starting Ray): a port another server
holds is one line at once, not a traceback a minute later. Nothing here imports torch
or Ray."""

from __future__ import annotations

import errno
import importlib.util
import socket

from metrale.errors import MetraleError


class ListenError(MetraleError):
    """The server cannot listen where it was told to."""


class MissingExtraError(MetraleError):
    """A feature's optional dependencies are not installed."""


def check_can_listen(host: str, port: int) -> None:
    """Bind (host, port) as the server will (SO_REUSEADDR, as uvicorn and Ray Serve do,
    so a socket in TIME_WAIT is no conflict), then let it go. Port 0 means any."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}; check --host") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ListenError(f"{host}:{port} is already in use (another `metrale serve`, or "
                                  "`make run`?): stop it or pass another --port") from None
            raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def require_ray() -> None:
    """`--replicas` / `--ray-address` run on Ray Serve, the optional `cluster` extra."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise MissingExtraError("--replicas needs Ray Serve, which is not installed: run "
                                "`make cluster` (or pip install -e '.[cluster]')")
