"""The peer watchdog: a thread that notices a lost or silent rank while the main thread is blocked.

Each rank bumps a heartbeat counter in the rendezvous store (through its own
client connection, with short timeouts) every few seconds and watches its
peers' counters. A peer whose counter has not moved for `timeout` seconds (a
stopped or hung process), or whose process is gone (seen at once when it runs
on this host), ends this rank with exit code 3 and a message naming the peer
and the step. It runs beside the main thread because that thread may be stuck
inside a collective whose own timeout is far longer.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from errors import EXIT_DISTRIBUTED

log = logging.getLogger(__name__)


def _process_gone(pid: int) -> bool:
    """True when `pid` no longer runs on this host (exited, or a zombie awaiting its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False


class PeerWatchdog:
    def __init__(self, rank: int, world_size: int, *, timeout_s: float, progress, interval_s: float | None = None):
        """progress: where the main loop is (its step and phase), for messages."""
        self.rank, self.world_size, self.timeout_s, self.progress = rank, world_size, timeout_s, progress
        self.interval_s = interval_s or max(0.5, min(5.0, timeout_s / 6))
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.address = f"{host}:{port}"
        op_timeout = timedelta(seconds=max(1.0, min(10.0, timeout_s / 3)))
        self.store = dist.TCPStore(host, port, is_master=False, timeout=op_timeout, wait_for_workers=False)
        self.prefix = "rvq_watchdog/{}/{}".format(os.environ.get("TORCHELASTIC_RUN_ID", "run"),
                                                  os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.host = socket.gethostname()
        self.store.set(f"{self.prefix}/who/{rank}", f"{self.host} {os.getpid()}")
        self._stop = threading.Event()
        self._verdict = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watchdog", daemon=True)

    def start(self) -> "PeerWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 15)

    def _peer_pids(self) -> dict:
        """Peers on this host, by rank: their pids, for an immediate check that they still run."""
        pids = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/who/{r}"
            if r != self.rank and self.store.check([key]):
                host, pid = self.store.get(key).decode().split()
                if host == self.host:
                    pids[r] = int(pid)
        return pids

    def _run(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        start = time.monotonic()
        seen = {r: (-1, start) for r in peers}
        store_ok, local_pids = start, {}
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self.store.add(f"{self.prefix}/hb/{self.rank}", 1)
                for r in peers:
                    count = self.store.add(f"{self.prefix}/hb/{r}", 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                if len(local_pids) < len(peers):
                    local_pids = self._peer_pids()
                store_ok = now
            except Exception as e:  # noqa: BLE001 - an unreachable store is itself the symptom
                if now - store_ok > self.timeout_s:
                    self._fail(f"the rendezvous store at {self.address} (hosted by rank 0 or the launcher) has not "
                               f"answered for {now - store_ok:.0f}s ({e})")
                continue
            dead = [r for r, pid in local_pids.items() if _process_gone(pid)]
            if dead:
                self._fail(f"rank(s) {dead} lost: the process is gone")
            silent = [r for r, (_, t) in seen.items() if now - t > self.timeout_s]
            if silent:
                self._fail(f"rank(s) {silent} silent: no heartbeat for more than {self.timeout_s:.0f}s "
                           "(stopped, hung or unreachable)")

    def _fail(self, what: str) -> None:
        self._verdict.set()
        log.error("rank %d stopping at step %s: %s. Exit code 3; restart with --resume auto to continue from the "
                  "last checkpoint", self.rank, self.progress, what)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_DISTRIBUTED)  # the main thread may be blocked in a collective: no clean unwinding

    def await_verdict(self, max_wait_s: float) -> None:
        """After a failed collective: give the watchdog time to name the lost rank (it then exits the process)."""
        if self._thread.is_alive():
            self._verdict.wait(max_wait_s)
