"""Adapter ids in messages: at most MAX_LISTED are shown, then "and N more"; an id from
the network that is not a valid adapter name (terminal escapes, megabytes) is counted,
never printed.
"""

from __future__ import annotations

from collections.abc import Iterable

from metrale.names import is_valid_name

MAX_LISTED = 20


def describe_ids(ids: Iterable[object]) -> str:
    """'a, b, c' / 'a, b and 7 more' / 'none'; invalid names are counted, not shown."""
    ids = list(ids)
    safe = sorted({item for item in ids if is_valid_name(item)})
    hidden = sum(not is_valid_name(item) for item in ids)
    shown = safe[:MAX_LISTED]
    rest = len(safe) - len(shown) + hidden
    if not shown:
        return f"{rest} id(s) that are not valid names" if rest else "none"
    text = ", ".join(shown)
    return f"{text} and {rest} more" if rest else text

