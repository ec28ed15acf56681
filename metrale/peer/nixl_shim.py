"""The one place metrale imports NIXL. Its per-CUDA wheels differ in import name
(`nixl-cu12` installs `nixl_cu12`, `nixl-cu13` `nixl_cu13`, the `nixl` meta package
`nixl`); each exposes `nixl_agent` and `nixl_agent_config` at top level.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

import torch

from metrale.peer.errors import NIXL_PIP, NixlUnavailableError
from metrale.peer.ucx import configure_ucx

MODULE_NAMES = ("nixl_cu13", "nixl_cu12", "nixl")

_cached: ModuleType | None = None


def load_nixl() -> ModuleType:
    """The NIXL API module (nixl_agent, nixl_agent_config), or a clear refusal."""
    global _cached
    if _cached is not None:
        return _cached
    configure_ucx(torch.cuda.is_available())  # UCX reads its environment when it loads
    failures = []
    for name in MODULE_NAMES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            failures.append(f"{name}: {e}")
            continue
        if hasattr(module, "nixl_agent") and hasattr(module, "nixl_agent_config"):
            if "NIXL_LOG_LEVEL" not in os.environ:
                # NIXL logs every agent start at INFO to stdout; metrale logs its own.
                logging.getLogger("nixl").setLevel(logging.WARNING)
            _cached = module
            return module
        failures.append(f"{name}: has no nixl_agent")
    raise NixlUnavailableError(
        f"NIXL is not installed ({'; '.join(failures)}); install it with `{NIXL_PIP}` "
        "or use the HTTP transport (transport='http')"
    )


def nixl_available() -> bool:
    try:
        load_nixl()
    except NixlUnavailableError:
        return False
    return True
