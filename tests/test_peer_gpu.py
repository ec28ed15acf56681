"""Peer staging into a CUDA pool: from a host store (pinned DRAM -> VRAM) and from
a GPU store (VRAM -> VRAM), over NIXL and HTTP. Run on the device machine."""

from __future__ import annotations

import pytest
import torch

from metrale.peer.nixl_shim import nixl_available
from tests.helpers.peers import assert_matches_disk, new_slots, start_store, stop
from tests.helpers.pool import land_peer

pytestmark = pytest.mark.gpu

TRANSPORTS = ["http", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="NIXL not installed (pip install nixl-cu12 / nixl-cu13)"))]


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def store(request):
    proc, url = start_store("--device", request.param)
    yield url
    stop(proc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cuda_pool_from_store(store, transport, dtype, caplog):
    if transport == "nixl" and dtype != torch.float32:
        pytest.skip("the store holds float32: NIXL lands bytes unconverted")
    slots = new_slots(dtype=dtype, device="cuda")
    for name in ("a", "b", "c"):
        with caplog.at_level("INFO", logger="metrale.peer"):
            slot, version = land_peer(slots, store, name, transport=transport, timeout_s=30)
        assert f"via {transport}" in caplog.text
        assert slots.table.holds(slot, version)
        assert_matches_disk(slots, slot, name)
    slots.table.check_integrity()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_warm_up_touches_no_slot_and_the_first_landing_reuses_it(store, transport):
    """warm_up_peer on a CUDA pool (over NIXL: the peer's agent and a READ into the
    endpoint's scratch) leaves every slot's bytes as they were; the landing after it
    reuses its plan and lands the adapter exactly."""
    from metrale.peer.landing import warm_up_peer

    slots = new_slots(dtype=torch.float32, device="cuda")
    before = slots.pool.buffer.clone()
    assert warm_up_peer(slots, store, "a", transport=transport) == transport
    torch.cuda.synchronize()
    assert torch.equal(slots.pool.buffer, before)
    stats: dict = {}
    slot, _ = land_peer(slots, store, "a", transport=transport, timeout_s=30, stats=stats)
    assert stats["plan_cached"]
    assert_matches_disk(slots, slot, "a")


def test_an_overflowing_peer_adapter_is_refused_by_a_cuda_pool_over_http():
    """Over HTTP a CUDA pool lands through the plan's recipe (write_staged); the bytes get
    the gain bound registration applies to a file, in the scratch pool first: a peer whose
    slot was written after its own checks (3e38 in a lora_A) is refused, and the slot it
    would have filled keeps its adapter (tests.test_peer_refusals: the CPU pool's path)."""
    from metrale.adapters.weights_check import WeightsOverflowError
    from metrale.peer.http_server import PeerHTTPServer
    from tests.helpers.peers import adapter_dir, disk_exporter
    from tests.helpers.pool import land_disk

    exporter = disk_exporter("a")
    exporter.slots.pool.lora_a(1, "q_proj")[0, 0, 0] = 3e38
    server = PeerHTTPServer(exporter).start()
    try:
        slots = new_slots(dtype=torch.float32, device="cuda")
        land_disk(slots, adapter_dir("b"), 0)
        before = slots.pool.buffer.clone(), slots.table.infos()
        with pytest.raises(WeightsOverflowError):
            land_peer(slots, server.url.removeprefix("http://"), "a", 0, transport="http")
        assert torch.equal(slots.pool.buffer, before[0]) and slots.table.infos() == before[1]
    finally:
        server.close()
        exporter.close()
