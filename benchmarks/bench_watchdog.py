"""Watchdog traffic against world size: N simulated ranks' heartbeat rounds against one TCPStore on 127.0.0.1.

Each simulated rank has a client connection of its own and a PeerWatchdog (training/watchdog.py) whose `round`,
the function the watchdog thread calls each interval, runs on the rank's schedule: once per interval (5 s, the
interval at the default --sync_timeout of 300 s), the ranks' rounds spread evenly over it, 8 ranks per simulated
node. A few worker processes share the simulated ranks and run their rounds one at a time; the store runs in a
process of its own, whose CPU time is read from /proc.

The "before" rows replay, through the same connections, the store calls one round of the per-peer design made
(training/watchdog.py before the batched round): a set of its state, an add to its own heartbeat and one per peer
to read theirs, a check and a get per peer for its host and pid (every round once the ranks span more than one
node: the lookup stopped only when every peer had been found on this host), a check and get of the verdict, and a
check and multi_get of the states.

Requests are counted as TCPStore's client sends them (torch/csrc/distributed/c10d/TCPStore.cpp): get and
multi_get send a WAIT, then the read, and wait for each reply; set and multi_set get no reply. Bytes are the keys
and values sent and received, each counted once. The store's CPU is given as measured (a share of one core over
the run) and scaled to the rounds due where the workers did not keep pace.

    python benchmarks/bench_watchdog.py [--ranks 16 128 1024] [--seconds 30] [--interval 5] [--workers 2]
"""
from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.demo_run import machine  # noqa: E402
from training.progress import Progress  # noqa: E402
from training.watchdog import PeerWatchdog, stuck_ranks, where  # noqa: E402

SYNC_TIMEOUT = 300  # the flag's default: no simulated rank is silent or stuck within a run
RANKS_PER_NODE = 8
BEFORE = "rvq_watchdog_before"
SERVER = ("import datetime, sys, torch.distributed as dist\n"
          "store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
          "timeout=datetime.timedelta(seconds=60))\n"
          "print(store.port, flush=True)\n"
          "sys.stdin.read()\n")


@dataclass
class Counter:
    requests: int = 0
    bytes: int = 0


def payload(x) -> int:
    if isinstance(x, (str, bytes)):
        return len(x)
    if isinstance(x, (list, tuple)):
        return sum(payload(v) for v in x)
    return 0


class CountedStore:
    """A store client that counts, into a shared Counter, the requests it sends and the bytes of keys and values."""

    def __init__(self, store, counter: Counter):
        self.store, self.counter = store, counter

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args):
            result = method(*args)
            self.counter.requests += 2 if name in ("get", "multi_get") else 1
            self.counter.bytes += payload(args) + payload(result)
            return result
        return call


def before_state(wd: PeerWatchdog) -> dict:
    p = wd.progress
    return {"step": p.step, "phase": p.phase, "for": round(time.monotonic() - p.since, 1), "where": where(wd.main_id)}


def before_round(wd: PeerWatchdog) -> None:
    """The store calls of one round of the per-peer design, through `wd`'s connection, under a prefix of its own."""
    store, rank, mine = wd.store, wd.rank, before_state(wd)
    store.set(f"{BEFORE}/state/{rank}", json.dumps(mine))
    store.add(f"{BEFORE}/hb/{rank}", 1)
    for r in wd.peers:
        store.add(f"{BEFORE}/hb/{r}", 0)
    for r in wd.peers:
        if store.check([f"{BEFORE}/who/{r}"]):
            store.get(f"{BEFORE}/who/{r}").decode().split()
    if store.check([f"{BEFORE}/verdict"]):
        store.get(f"{BEFORE}/verdict")
    keys = [f"{BEFORE}/state/{r}" for r in wd.peers]
    if store.check(keys):
        states = {r: json.loads(v) for r, v in zip(wd.peers, store.multi_get(keys))}
        stuck_ranks({**states, rank: mine}, wd.allowance)


def paced(rounds: list, offsets: list, start: float, end: float, interval: float) -> list:
    """Run each rank's round at start + its offset + k x interval until `end`, one at a time; the durations."""
    due = [(start + offset, i) for i, offset in enumerate(offsets)]
    heapq.heapify(due)
    durations = []
    while due and due[0][0] < end and time.monotonic() < end:
        at, i = heapq.heappop(due)
        time.sleep(max(0.0, at - time.monotonic()))
        began = time.monotonic()
        rounds[i](began)
        durations.append(time.monotonic() - began)
        heapq.heappush(due, (at + interval, i))
    return durations


def worker(conn, port: int, world: int, ranks: list, interval: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    counter = Counter()
    wds = []
    for r in ranks:
        wd = PeerWatchdog(r, world, timeout_s=SYNC_TIMEOUT, slow_timeout_s=2 * SYNC_TIMEOUT, interval_s=interval,
                          progress=Progress(step=100, phase="forward"), host=f"node{r // RANKS_PER_NODE}")
        wd.store.multi_set([f"{BEFORE}/who/{r}", f"{BEFORE}/state/{r}"],
                           [f"{wd.host} {os.getpid()}", json.dumps(before_state(wd))])
        wd.store = CountedStore(wd.store, counter)
        wds.append(wd)
    conn.send("connected")
    rounds = {"before": [lambda now, wd=wd: before_round(wd) for wd in wds], "after": [wd.round for wd in wds]}
    while (design := conn.recv()) != "stop":
        if design == "after":  # the first round also checks that every rank published and reads who is where
            for wd in wds:
                wd.round(time.monotonic())
        conn.send("warm")
        start, end = conn.recv()
        counter.requests = counter.bytes = 0
        durations = paced(rounds[design], [r / world * interval for r in ranks], start, end, interval)
        conn.send({"durations": durations, "requests": counter.requests, "bytes": counter.bytes,
                   "finished": time.monotonic()})


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rounds_due(world: int, seconds: float, interval: float) -> int:
    return sum(int(np.ceil((seconds - r / world * interval) / interval)) for r in range(world))


def measure(port: int, server_pid: int, world: int, args) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    count = min(args.workers, world)
    pipes, procs = [], []
    began = time.monotonic()
    for w in range(count):
        ours, theirs = ctx.Pipe()
        procs.append(ctx.Process(target=worker, args=(theirs, port, world, list(range(w, world, count)),
                                                      args.interval), daemon=True))
        procs[-1].start()
        pipes.append(ours)
    for pipe in pipes:
        pipe.recv()
    print(f"{world} ranks: {world} clients connected in {time.monotonic() - began:.0f}s", flush=True)
    rows = []
    for design in ("before", "after"):
        for pipe in pipes:
            pipe.send(design)
        for pipe in pipes:
            pipe.recv()
        start = time.monotonic() + 1.0
        end = start + args.seconds
        for pipe in pipes:
            pipe.send((start, end))
        time.sleep(max(0.0, start - time.monotonic()))
        cpu = cpu_seconds(server_pid)
        done = [pipe.recv() for pipe in pipes]
        window = max(d["finished"] for d in done) - start
        cpu = cpu_seconds(server_pid) - cpu
        durations = np.concatenate([d["durations"] for d in done]) * 1000
        requests, moved = sum(d["requests"] for d in done), sum(d["bytes"] for d in done)
        row = {"ranks": world, "design": design, "rounds_done": len(durations),
               "rounds_due": rounds_due(world, args.seconds, args.interval),
               "requests_per_round": requests / len(durations), "kb_per_round": moved / len(durations) / 1000,
               "requests_per_s": requests / window, "round_p50_ms": float(np.percentile(durations, 50)),
               "round_p99_ms": float(np.percentile(durations, 99)), "store_cpu_pct": 100 * cpu / window}
        row["requests_per_s_at_pace"] = row["requests_per_round"] * world / args.interval
        row["store_cpu_pct_at_pace"] = row["store_cpu_pct"] * row["rounds_due"] / row["rounds_done"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for pipe in pipes:
        pipe.send("stop")
    for proc in procs:
        proc.join(timeout=60)
    return rows


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each measured run")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a rank's rounds")
    parser.add_argument("--workers", type=int, default=2, help="processes driving the simulated ranks")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_watchdog.json")
    args = parser.parse_args()
    # a TCPStore client looks up its peer's name as it connects; where the resolver drops such lookups each costs
    # 5 s: fail fast instead (connecting is not what is measured)
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    info = f"{machine()}, 1-minute/5/15 load at start {load()}"
    print(info, flush=True)
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        rows = [row for world in args.ranks for row in measure(port, server.pid, world, args)]
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    info += f", at end {load()}"
    print(f"\n{info}; {args.workers} worker processes, one round every {args.interval:g}s per rank, "
          f"{args.seconds:g}s per run\n")
    print("| ranks | design | requests/round | KB/round | requests/s due | requests/s served | rounds done/due "
          "| round p50 | round p99 | store CPU | store CPU at pace |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['ranks']:,} | {r['design']} | {r['requests_per_round']:,.0f} | {r['kb_per_round']:,.1f} "
              f"| {r['requests_per_s_at_pace']:,.0f} | {r['requests_per_s']:,.0f} "
              f"| {r['rounds_done']:,}/{r['rounds_due']:,} | {r['round_p50_ms']:.2f} ms | {r['round_p99_ms']:.2f} ms "
              f"| {r['store_cpu_pct']:.1f}% | {r['store_cpu_pct_at_pace']:.1f}% |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "interval_s": args.interval, "seconds": args.seconds,
                                    "workers": args.workers, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
