import importlib.util
import os

import pytest
import torch

# torch only: triton stays unimported
from tests.helpers.tiny_models import make_adapter, make_model, saved_tiny_model
from tests.helpers.triton_interpreter import cache_builtin_lookups

# Triton kernels run in Triton's CPU interpreter off the GPU. The flag must be set
# before anything imports triton (any metrale module may), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One process: both cores of a 2-core CI machine. Under pytest-xdist each worker already has
# a core of its own: more torch threads than cores would only make the workers take turns.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

# The server tests need the `server` extra; a GPU box's bare image may lack it.
collect_ignore_glob = [] if importlib.util.find_spec("fastapi") else [
    "test_server*.py", "test_daily_use.py", "test_hostile_edges.py", "test_vllm_metrics.py"]


def pytest_runtest_setup(item):
    # once something imported Triton's interpreter: launches that skip its getmembers scans
    cache_builtin_lookups()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- fixtures shared by several test modules (a module's own fixture of the same name wins) ---


@pytest.fixture(scope="session")
def adapters(tmp_path_factory):
    """Three PEFT adapters a, b, c (rank 4, attention + down_proj) of tiny_models' llama;
    made once per run (read-only: a test that changes one copies it first)."""
    root = tmp_path_factory.mktemp("adapters")
    base = make_model("llama")
    for i, name in enumerate(("a", "b", "c")):
        make_adapter(base, root / name, seed=i, r=4, lora_alpha=8,
                     target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])
    return root


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_models' llama, the base of `adapters`, saved as a model directory (for engines);
    made once per run (read-only)."""
    path = tmp_path_factory.mktemp("model")
    saved_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def default_model_cache():
    """METRALE_CACHE_DIR, for one module, set to the recipe-keyed dir of
    tests/helpers/default_model.py: the default model is converted and the demo adapters
    trained once per recipe, not once per run. Module scope: the env change ends with the
    module that asked for it."""
    from metrale.model.default_model import CACHE_ENV  # metrale: after the triton switch above
    from tests.helpers.default_model import claim, recipe_cache_dir

    root = recipe_cache_dir()
    claim(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(root))
        yield root


@pytest.fixture(scope="module")
def genuine():
    """A real lease reply for adapter "a" (from an in-process exporter, decoded by
    metrale.peer.wire.decode_doc; FakePeer encodes it back) and its bytes."""
    from metrale.peer.nixl_shim import nixl_available  # metrale: after the triton switch above
    from metrale.peer.wire import decode_doc
    from tests.helpers.peers import LEASE, disk_exporter

    exporter = disk_exporter("a", transports=("http", "nixl") if nixl_available() else ("http",))
    lease = exporter.lease("a")
    reply = decode_doc(lease.body)  # the wire reply in its logical form, for tests to edit
    n, chunks = exporter.open_data(lease.lease_id)
    data = b"".join(bytes(c) for c in chunks)
    assert len(data) == n
    exporter.release(lease.lease_id)
    reply["lease"]["id"] = LEASE
    reply["manifest"]["transports"]["http"]["data_path"] = f"/peer/v1/leases/{LEASE}/data"
    return reply, data, exporter  # the exporter keeps its NIXL memory registered
