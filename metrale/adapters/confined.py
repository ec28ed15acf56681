"""Opening an adapter's files so that none of them resolves outside a root: the tree of an
--adapter-source, an --adapter-root, a download cache. Whoever writes into that tree
controls every name in it, symlinks included, and may change it between two reads.

A file is resolved (symlinks followed: a link that stays inside the root is fine, e.g. the
Hugging Face cache's snapshot -> blob links or an alias directory) and the result must lie
inside the root; it is then opened by walking that resolved path from a descriptor of the
root, one component at a time with O_NOFOLLOW, so a component swapped for a symlink between
the check and the open fails the walk instead of leading out. The last component is
lstat'ed (only a regular file is opened: a FIFO or a device is never opened at all), opened
O_NONBLOCK|O_NOFOLLOW, and the descriptor must be the file that was checked.

The directory itself must still be where it was registered: with a root, callers pass the
resolved directory, and a directory replaced by a symlink (to anywhere) since then is
refused, so a landing never reads another tree than the one its registration read.

Errors are the caller's AdapterError subclass (AdapterOutsideRootError for an escape), and
name the file relative to the root: the adapter's own name, never the server's paths.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from metrale.errors import AdapterError, AdapterOutsideRootError


@dataclass(frozen=True)
class ConfinedDir:
    """An adapter directory (resolved) and the root every read of its files must resolve in."""

    path: Path
    root: Path


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


def shown(path: Path, root: Path) -> str:
    """path as a message shows it: relative to the root (which is the server's, not the
    client's), or its last component when it is not under it."""
    try:
        return str(path.relative_to(root)) or "."
    except ValueError:
        return path.name


def resolve_inside(path: str | Path, root: Path, error: type[AdapterError]) -> Path | None:
    """`path` with every symlink followed, checked to lie inside `root` (resolved); None when
    nothing is there. A symlink loop, a dangling link, a link out of the root: `error`
    (AdapterOutsideRootError for the last). Opens nothing."""
    path = Path(path)
    where = shown(path, root)
    try:
        real = Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        _refuse_dangling(path, root, where, error)
        return None
    except NotADirectoryError:
        return None  # a component is a file: nothing of that name
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{where} is a symlink loop") from None
        raise error(f"cannot access {where}: {e.strerror}") from None
    except ValueError:  # an embedded NUL
        raise error(f"{where!r} is not a valid path") from None
    if not real.is_relative_to(root):
        raise AdapterOutsideRootError(f"{where} resolves outside its adapter root (symlinks are "
                                      "followed before the check)")
    return real


def _refuse_dangling(path: Path, root: Path, where: str, error: type[AdapterError]) -> None:
    """Nothing at `path`: a dangling symlink on the way says so (one out of the root is an
    escape, whether or not its target exists); a plain missing name is no error."""
    target = Path(os.path.realpath(path))  # non-strict: follows what it can
    if not target.is_relative_to(root):
        raise AdapterOutsideRootError(f"{where} resolves outside its adapter root (a symlink "
                                      "to a path that does not exist)")
    probe = path
    while probe != root and probe.is_relative_to(root):
        if os.path.islink(probe):
            raise error(f"{where} is a dangling symlink ({shown(probe, root)} points nowhere)")
        probe = probe.parent


def stat_inside(path: str | Path, root: Path, error: type[AdapterError]) -> os.stat_result | None:
    """stat(path) of what `path` resolves to inside `root`; None when nothing is there."""
    real = resolve_inside(path, root, error)
    if real is None:
        return None
    _require_same_directory(Path(path), root, error)
    try:
        return os.stat(real, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise error(f"cannot access {shown(Path(path), root)}: {e.strerror}") from None


def open_fd(path: str | Path, root: Path, error: type[AdapterError]) -> int:
    """A read-only descriptor of the regular file `path` resolves to inside `root`."""
    path = Path(path)
    where = shown(path, root)
    real = resolve_inside(path, root, error)
    if real is None:
        raise error(f"{where} not found")
    _require_same_directory(path, root, error)
    parts = real.relative_to(root).parts
    if not parts:
        raise error(f"{where} is not a regular file (it is the adapter root)")
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError as e:
        raise error(f"the adapter root of {where} cannot be opened: {e.strerror}") from None
    try:
        for part in parts[:-1]:
            inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
        checked = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(checked.st_mode):
            raise error(f"{where} is not a regular file")
        out = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
    except OSError as e:  # ELOOP, ENOTDIR: a component became a symlink since the check
        raise error(f"{where} changed while it was opened ({e.strerror}); it is refused") from None
    finally:
        os.close(fd)
    opened = os.fstat(out)
    if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino) \
            or not stat.S_ISREG(opened.st_mode):
        os.close(out)
        raise error(f"{where} was replaced while it was opened; it is refused")
    return out


def open_inside(path: str | Path, root: Path, error: type[AdapterError]) -> BinaryIO:
    return os.fdopen(open_fd(path, root, error), "rb")


def _require_same_directory(path: Path, root: Path, error: type[AdapterError]) -> None:
    """The directory holding `path` is still the resolved one the caller registered (not
    replaced by a symlink to another tree since)."""
    if path == root:
        return
    folder = path.parent
    if not folder.is_relative_to(root):
        raise AdapterOutsideRootError(f"{path.name} is not inside its adapter root")
    try:
        real = Path(os.path.realpath(folder, strict=True))
    except (OSError, ValueError):
        raise error(f"the directory {shown(folder, root)} is gone or unreadable") from None
    if real != folder:
        if not real.is_relative_to(root):
            raise AdapterOutsideRootError(
                f"the directory {shown(folder, root)} now resolves outside its adapter root")
        raise error(f"the directory {shown(folder, root)} was replaced by a symlink since it "
                    "was registered; register it again")
