"""Triton's CPU interpreter (TRITON_INTERPRET=1), made cheaper to launch for the tests.

Each interpreted launch re-patches triton.language with interpreted builtins, and finds them
with inspect.getmembers over the language modules every time: in the tests' MoE kernels
that was 14 s of a 96 s test (getmembers and is_builtin, ~100 calls per launch). The set of
builtins of a module never changes, so it is looked up once per module here; the patching
itself (and so what every kernel computes) is Triton's own. Off the interpreter, and on a
Triton whose interpreter lacks the function this wraps, nothing changes.
"""

from __future__ import annotations

import inspect
import sys

_MODULE = "triton.runtime.interpreter"


def cache_builtin_lookups() -> bool:
    """Once triton's interpreter is imported: wrap its _patch_builtin with a per-module cache
    of the builtins it finds. Returns whether the wrapper is in place."""
    interpreter = sys.modules.get(_MODULE)
    if interpreter is None:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "cached", False):
        return original is not None
    try:
        is_builtin = interpreter.tl.core.is_builtin
        patch_attr = interpreter._patch_attr  # private to Triton: absent, nothing changes
    except AttributeError:
        return False  # another Triton: leave its interpreter as it is
    builtins: dict[object, list[tuple[str, object]]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        members = builtins.get(pkg)
        if members is None:  # first launch: pkg is unpatched (every launch restores it)
            members = builtins[pkg] = [(name, member) for name, member in inspect.getmembers(pkg)
                                       if is_builtin(member)]
        if members and getattr(pkg, members[0][0]) is not members[0][1]:
            return  # a device function's call inside a launch: all patched (Triton finds none)
        for name, member in members:
            patch_attr(pkg, name, member, builder, scope)

    patch_builtin.cached = True
    interpreter._patch_builtin = patch_builtin
    return True
