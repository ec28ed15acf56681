"""The adapter-name rule, one for the registry, the HTTP routes and the peers.

A name is what requests send as `model` and what metrics, logs, URLs and peer ids
carry; it is never used as a path. As in vLLM (and Hugging Face's `org/name`) it may
hold '/' between parts: each part starts with a letter or digit and holds letters,
digits, '.', '_' or '-'; no empty part, no '..' anywhere (so never '.', '..', a leading
or trailing '/'), at most MAX_NAME_CHARS in all. It may end in one `@revision` of the
same characters (a Hugging Face Hub branch, tag or commit: `org/adapter@v2`). No torch
here: the CLI uses it.
"""

from __future__ import annotations

import re

from metrale.errors import InvalidNameError

MAX_NAME_CHARS = 128
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME_RE = re.compile(rf"{_PART}(?:/{_PART})*(?:@{_PART})?")
_SHOWN_CHARS = 64  # a refused name is quoted in the message, bounded


def is_valid_name(name: object) -> bool:
    return (isinstance(name, str) and len(name) <= MAX_NAME_CHARS and ".." not in name
            and _NAME_RE.fullmatch(name) is not None)


def shown(name: object) -> str:
    """`name` for a message: quoted, at most _SHOWN_CHARS of it (it may be anything a
    client sent)."""
    if not isinstance(name, str):
        return f"of type {type(name).__name__}"
    return repr(name[:_SHOWN_CHARS]) + ("..." if len(name) > _SHOWN_CHARS else "")


def validate_adapter_name(name: object) -> str:
    if not is_valid_name(name):
        raise InvalidNameError(
            f"adapter name {shown(name)} is invalid: use 1-{MAX_NAME_CHARS} letters, digits, '.', "
            "'_' or '-', with '/' between parts (as in org/adapter) and at most one '@revision' "
            "at the end; each part starts with a letter or digit, and '..' is not allowed")
    return name
