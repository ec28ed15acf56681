"""Requests/s and latency of `metrale serve` on the embedded default model, at 1
and 8 concurrent clients (chat completions through the demo adapters and the base
model, 32 new tokens, greedy). Prints a table and writes JSON.

    .venv/bin/python bench/server_load.py [--requests 24] [--port 8011]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

MODELS = ("SmolLM2-135M-Instruct", "shout", "pirate")
QUESTIONS = ("Tell me about the moon.", "What is the capital of France?", "Name three colors.",
             "Why is the sky blue?")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def one(url: str, i: int) -> float:
    body = {"model": MODELS[i % len(MODELS)], "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - start


def run(url: str, clients: int, requests: int) -> dict:
    one(url, 0)  # warm-up: the first request of each adapter promotes it
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = list(pool.map(lambda i: one(url, i), range(requests)))
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": requests, "req_s": requests / wall,
            "p50_s": pct(latencies, 50), "p99_s": pct(latencies, 99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--port", type=int, default=8011)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "metrale", "serve", "--port", str(args.port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("server did not start")
            time.sleep(0.5)
        rows = [run(url, c, args.requests) for c in (1, 8)]
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"{'clients':>7} {'requests':>8} {'req/s':>7} {'p50 s':>7} {'p99 s':>7}")
    for r in rows:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['req_s']:>7.2f} {r['p50_s']:>7.2f} "
              f"{r['p99_s']:>7.2f}")
    day = datetime.date.today().isoformat()
    out = Path(__file__).parent / "results" / f"{day.replace('-', '')}-cpu-server.json"
    out.write_text(json.dumps({"date": day, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                               "command": "python bench/server_load.py", "server_load": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
