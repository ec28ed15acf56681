"""bench/many_adapters.py's simulation, small: it runs end to end on the CPU, writes its
keys, and no policy beats the clairvoyant bound on the same trace (no timing asserted)."""

from __future__ import annotations

import json

from bench.many_adapters import main


def test_simulation_runs_and_stays_under_the_bound(tmp_path):
    out = tmp_path / "results.json"
    # 200 adapters, 43 places (32 slots + 11 images of 1 GB): misses beyond the first ones
    main(["--simulate", "--adapters", "200", "--requests", "600", "--host-tier-gb", "1",
          "--shift-s", "3", "--loads", "zipf1.1", "shift1.1", "--out", str(out)])
    res = json.loads(out.read_text())["many_adapters"]["simulate"]
    assert res["tier_entries"] == 11 and res["slots"] == 32
    for key in ("date", "command", "machine", "config", "rows", "service_times"):
        assert key in res
    for load in ("zipf1.1", "shift1.1"):
        row = res["loads"][load]
        bound = row["clairvoyant_hit_rate"]
        assert 0 < row["hit_rate"] <= bound and 0 < row["lru_hit_rate"] <= bound
        assert row["hit_rate"] == row["cost"]["hit_rate"]
        assert row["lru_hit_rate"] == row["lru"]["hit_rate"]
        for policy in ("cost", "lru"):
            run = row[policy]
            assert run["requests"] == 600
            assert run["disk_reads"] == run["landings"] - run["tier_landings"] > 0
