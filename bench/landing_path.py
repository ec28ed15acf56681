"""How often a landing's code path leaves a file of metrale/pool and comes back to it.

Issue 52 asks for a landing that reads top to bottom in one file. This traces (sys.settrace)
three landings on a CPU pool of the tests' tiny llama, each from its entry point
`LoraSlots.land` to its commit or failure, and prints the sequence of pool files the
running code is in: a new entry each time a call, or a return, moves it to another of the
files looked at (code elsewhere, torch's or the adapters', is skipped over; a return goes
to the nearest caller in a file looked at). "returns" counts the entries whose file the
path had left before. Three sets of files: the protocol's (swap.py, slots.py, landing.py,
pool.py: the files issue 52 names), every file of metrale/pool but layout.py (a frozen
SlotLayout's lookups, one per tensor on the CPU path), and every file. The landings:

  disk   a PEFT file, staged and checked (prepare_disk), then land: bytes, tables, commit
  range  a transport writing raw bytes into the slot's address range (NIXL's way), then
         verify's NaN/Inf and gain-bound check of the written bytes, then commit
  fail   the same with a NaN in the bytes: verify fails, the slot is zeroed, EMPTY

    python bench/landing_path.py        # prints each path and its counts
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from metrale.errors import LandingError  # noqa: E402
from metrale.pool.swap import Prepared  # noqa: E402
from tests.helpers.pool import tiny_llama_slots  # noqa: E402
from tests.helpers.tiny_models import write_lora  # noqa: E402

POOL = str(ROOT / "metrale" / "pool") + "/"
PROTOCOL = ("swap.py", "slots.py", "landing.py", "pool.py")


def pool_files_path(fn, files) -> list[str]:
    """Run fn() under a tracer: the pool files (those `files(name)` accepts) the running
    code is in, consecutive repeats collapsed."""
    path: list[str] = []

    def looked_at(frame) -> str | None:
        name = frame.f_code.co_filename
        if not name.startswith(POOL):
            return None
        name = name[len(POOL):]
        return name if files(name) else None

    def note(name: str) -> None:
        if not path or path[-1] != name:
            path.append(name)

    def tracer(frame, event, arg):
        if event == "call":
            name = looked_at(frame)
            if name is not None:
                note(name)
            return local
        return None

    def local(frame, event, arg):
        if event == "return":
            back = frame.f_back  # where execution continues: the nearest file looked at
            while back is not None and looked_at(back) is None:
                back = back.f_back
            if back is not None and looked_at(frame) is not None:
                note(looked_at(back))
        return local

    sys.settrace(tracer)
    try:
        fn()
    except LandingError:
        pass
    finally:
        sys.settrace(None)
    return path


def returns(path: list[str]) -> int:
    """Entries whose file the path had left before."""
    return sum(1 for i, f in enumerate(path) if f in path[:i])


def _image(slots, adapter_dir: Path, nan: bool) -> tuple:
    """(the plan, the bytes a transport would write: a slot image of the adapter)."""
    scratch = tiny_llama_slots(max_loras=1)
    prepared = scratch.prepare_disk(adapter_dir, "x")
    scratch.land(0, 1, prepared)
    image = scratch.pool.slot_region(0).clone()
    if nan:
        image[0] = float("nan")
    return slots.plan_from_disk(adapter_dir, "x"), image


def _range_write(plan, image):
    def write(landing) -> None:
        span = landing.slot_range(plan)
        ctypes.memmove(span.addr, image.data_ptr(), span.nbytes)  # the transport's copy
    return Prepared(write)


def paths(files) -> dict[str, list[str]]:
    torch.manual_seed(0)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_lora(Path(tmp) / "a", r=4, target_modules=["q_proj", "v_proj", "down_proj"])
        slots = tiny_llama_slots()
        landings = {"disk": (0, slots.prepare_disk(adapter, "a"))}
        for label, nan in (("range", False), ("fail", True)):
            landings[label] = (1, _range_write(*_image(slots, adapter, nan)))
        for label, (slot, prepared) in landings.items():
            out[label] = pool_files_path(lambda s=slot, p=prepared: slots.land(s, 7, p), files)
    return out


def main() -> None:
    for title, files in (("the protocol's files (issue 52's four)", lambda f: f in PROTOCOL),
                         ("every metrale/pool file but layout.py (frozen lookups)",
                          lambda f: f != "layout.py"),
                         ("every metrale/pool file", lambda f: True)):
        print(f"--- {title}")
        for label, path in paths(files).items():
            print(f"{label}: {len(path)} visits, {returns(path)} returns to a file already left")
            print("   " + " -> ".join(name.removesuffix(".py") for name in path))


if __name__ == "__main__":
    main()
