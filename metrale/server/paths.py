"""Where a client may point the server at an adapter: only inside --adapter-root.

A client-supplied path is attacker input. It is resolved with every symlink followed
(strict: it must exist) and must land inside a configured root; the files the loader will
open are checked the same way, by the one rule every adapter source keeps
(metrale.adapters.confined), so a symlinked adapter_model.safetensors cannot read /dev/zero
or another tenant's files. The registration keeps its root: every later landing opens the
files confined to it again, so a tree changed after the check cannot lead out either.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from metrale.adapters.confined import ConfinedDir, resolve_inside, stat_inside
from metrale.adapters.identity import CONFIG_FILE, WEIGHTS_FILE
from metrale.errors import AdapterError, AdapterOutsideRootError
from metrale.server.errors import AdapterPathError, BadRequestError

# The files plan_adapter opens inside an adapter directory.
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


def resolve_adapter_path(raw: object, roots: tuple[Path, ...], param: str = "path") -> ConfinedDir:
    """The resolved adapter directory for `raw`, confined to the root it lies in, or a
    refusal that says why.

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
    if path.is_absolute():  # confined to the root it resolves into (none: refused below)
        real = Path(os.path.realpath(path))
        candidates = [(path, next((r for r in roots if real.is_relative_to(r)), roots[0]))]
    else:
        candidates = [(root / path, root) for root in roots]
    for candidate, root in candidates:
        resolved = _checked(lambda c=candidate, r=root: resolve_inside(c, r, AdapterError), raw, param)
        if resolved is None:
            continue  # missing under this root: the next one may hold it
        _require_adapter_dir(resolved, root, raw, param)
        return ConfinedDir(resolved, root)
    raise BadRequestError(f"{param} {raw!r} does not exist under the adapter roots", param)


def _checked(check, raw: str, param: str):
    """check(), its refusals as the HTTP layer words them: outside a root 403, else 400."""
    try:
        return check()
    except AdapterOutsideRootError:
        raise AdapterPathError(  # the roots are the server's own paths: never shown
            f"{param} {raw!r} resolves outside the adapter roots; symlinks are followed "
            "before the check", param) from None
    except AdapterError as e:
        raise BadRequestError(f"{param} {raw!r}: {e}", param) from None


def _require_adapter_dir(resolved: Path, root: Path, raw: str, param: str) -> None:
    if not resolved.is_dir():
        raise BadRequestError(f"{param} {raw!r} is not a directory", param)
    for name in ADAPTER_FILES:  # missing files: the loader says so with its own message
        found = _checked(lambda n=name: stat_inside(resolved / n, root, AdapterError),
                         f"{raw}/{name}", param)
        if found is not None and not stat.S_ISREG(found.st_mode):
            raise BadRequestError(f"{param} {raw!r}: {name} is not a regular file", param)
