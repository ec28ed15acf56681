"""Where a client may point the server at an adapter: only inside --adapter-root.

A client-supplied path is attacker input. It is resolved with every symlink
followed (strict: it must exist) and must land inside a configured root; the
files the loader will open are checked the same way, so a symlinked
adapter_model.safetensors cannot read /dev/zero or another tenant's files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from metrale.adapters.identity import CONFIG_FILE, WEIGHTS_FILE
from metrale.server.errors import AdapterPathError, BadRequestError

# The files plan_adapter opens inside an adapter directory.
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


def resolve_adapter_path(raw: object, roots: tuple[Path, ...], param: str = "path") -> Path:
    """The resolved adapter directory for `raw`, or a refusal that says why.

    Relative paths are looked up under each root in order; absolute paths must
    resolve inside one. `roots` must already be resolved (ServerSettings does it)."""
    if not roots:
        raise AdapterPathError(
            "loading adapters by path is disabled: start the server with --adapter-root DIR "
            "to allow paths inside DIR", param)
    if not isinstance(raw, str) or not raw.strip() or "\x00" in raw:
        raise BadRequestError(f"{param} must be a non-empty directory path", param)
    path = Path(raw)
    if ".." in path.parts:
        raise BadRequestError(f"{param} must not contain '..' components", param)
    candidates = [path] if path.is_absolute() else [root / path for root in roots]
    for candidate in candidates:
        try:
            resolved = candidate.resolve(strict=True)
        except (OSError, RuntimeError):  # missing, symlink loop, unreadable parent
            continue
        _require_inside(resolved, roots, raw, param)
        _require_adapter_dir(resolved, roots, raw, param)
        return resolved
    raise BadRequestError(f"{param} {raw!r} does not exist under the adapter roots", param)


def _require_inside(resolved: Path, roots: tuple[Path, ...], raw: str, param: str) -> None:
    if not any(resolved.is_relative_to(root) for root in roots):
        raise AdapterPathError(  # the roots are the server's own paths: never shown
            f"{param} {raw!r} resolves outside the adapter roots; symlinks are followed "
            "before the check", param)


def _require_adapter_dir(resolved: Path, roots: tuple[Path, ...], raw: str, param: str) -> None:
    if not resolved.is_dir():
        raise BadRequestError(f"{param} {raw!r} is not a directory", param)
    for name in ADAPTER_FILES:
        entry = resolved / name
        if not os.path.lexists(entry):
            continue  # the loader reports missing files with its own clear message
        try:
            target = entry.resolve(strict=True)
        except (OSError, RuntimeError):
            raise BadRequestError(f"{param} {raw!r}: {name} is a dangling symlink", param) from None
        _require_inside(target, roots, f"{raw}/{name}", param)
        if not stat.S_ISREG(target.stat().st_mode):
            raise BadRequestError(f"{param} {raw!r}: {name} is not a regular file", param)
