"""The peer watchdog: a thread that notices a lost, silent or stuck rank while the main thread is blocked.

Every few seconds each rank makes one exchange with the rendezvous store
(through its own client connection, with short timeouts): it writes its state,
which carries a beat number that goes up by one each time, and reads every
rank's state and the verdict key in one batched call, so the store sees the
same few requests per rank whatever the world size. A peer whose beat number
has not moved for `timeout` seconds (a stopped or hung process), or whose
process is gone (seen at once when it runs on this host), ends this rank with
exit code 3 and a message naming the peer and the step. It runs beside the main
thread because that thread may be stuck inside a collective whose own timeout
is far longer. A second thread, the clock, never touches the store: it ends the
rank when one round has waited on the store for longer than the same timeout (a
store request can block for good where the store's host is stopped).

A live process whose main thread is stuck beats on, so each rank also publishes
its main thread's progress: step, phase, how long it has been in that phase and,
under a key of its own, where it is (file, line, function), read once it has
stayed in its phase for half the phase's allowance. The ranks furthest
behind are the ones the others wait for; when one of them has overstayed its
phase's allowance (--sync_timeout, or --slow_phase_timeout for a slow phase) the
first rank to see it reads where every main thread is and writes a verdict to
the store. Every rank then logs the same paragraph, the stuck rank writes all
its threads' stacks to its log, and all exit 3.

An exception in the main thread is judged here too, not by its text (a collective
inside a compiled step fails with the compiler's own words): the peer lost is named
and the rank exits 3, or every peer proves alive by beating on, and the error is the
rank's own (`lost_peers`). A rank that leaves on a stop with nothing to save publishes
so first (`leave`); its peers, finding it gone, stop too with exit 0.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import re
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from errors import EXIT_DISTRIBUTED, EXIT_OK
from training.log_stream import exit_now
from training.progress import FAILED, STOPPED, is_slow, order

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


PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_THREAD = re.compile(r"(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'  File "(.*)", line (\S+) in (.*)')


def thread_stacks() -> dict[int, list[tuple[str, str, str]]]:
    """Every Python thread's frames, innermost first, as (file, line, function), by thread id.

    Read by faulthandler in one call that holds the GIL throughout, so that no thread's frames change while they
    are read, and no frame object is made for them. Walking another thread's frame objects from Python
    (sys._current_frames(), f_back, f_code) lets that thread run between steps, and has ended a rank with a
    segmentation fault (CPython 3.11's PyFrame_GetCode, on this thread, reading a frame the main thread had left).
    faulthandler keeps a thread's innermost 100 frames. The dump goes to a file in memory (a pipe could fill while
    the GIL is held), so a full or unwritable temporary folder does not touch the heartbeat."""
    with _memory_file() as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read().decode("utf-8", "replace")
    stacks: dict[int, list[tuple[str, str, str]]] = {}
    frames = None
    for line in text.splitlines():
        if head := _THREAD.match(line):
            frames = stacks.setdefault(int(head.group(1), 16), [])
        elif frames is not None and (frame := _FRAME.match(line)):
            frames.append(frame.groups())
    return stacks


def _memory_file():
    """A binary file held in memory (Linux's memfd), or a temporary file where there is none."""
    if hasattr(os, "memfd_create"):
        return os.fdopen(os.memfd_create("thread stacks", os.MFD_CLOEXEC), "w+b")
    return tempfile.TemporaryFile()


def _frame_text(path: str, line: str, function: str) -> str:
    if path.startswith(PROJECT + os.sep):
        path = os.path.relpath(path, PROJECT)
    return f"{path}:{line} in {function}"


def where(thread_id: int) -> str:
    """A thread's innermost Python frame as `file:line in function`, and the project's frame that led there."""
    try:
        frames = thread_stacks().get(thread_id)
    except OSError:  # no file to dump into (out of memory, or of descriptors): the beat goes on without it
        frames = None
    if not frames:
        return "unknown"
    text = _frame_text(*frames[0])
    caller = next((i for i, frame in enumerate(frames) if frame[0].startswith(PROJECT + os.sep)), None)
    if caller:  # not None, and not the innermost frame itself
        text += f", called from {_frame_text(*frames[caller])}"
    return text


def in_collective(state: dict) -> bool:
    return "torch/distributed/" in state.get("where", "").split(", called from")[0]


def stuck_ranks(states: dict, allowance) -> tuple[list, bool]:
    """The ranks the others wait for that have overstayed their phase (empty: none), and whether every rank
    is at the same point inside a collective (then it is one collective that does not complete). Of ranks at
    the same step and phase, one waiting in a collective waits for one that is not: only the latter is
    behind. That needs where each main thread is (a state's "where"); without it, ranks at one point count
    alike."""
    states = {r: s for r, s in states.items() if s["phase"] not in (FAILED, STOPPED)}  # reported already
    if not states:
        return [], False
    keys = {r: order(s["step"], s["phase"]) for r, s in states.items()}
    furthest_behind = min(keys.values())
    behind = [r for r, k in keys.items() if k == furthest_behind]
    outside = [r for r in behind if "where" in states[r] and not in_collective(states[r])]
    together = len(behind) == len(states) and not outside
    behind = outside or behind
    late = [r for r in behind if states[r]["for"] > allowance(states[r]["phase"], states[r]["step"])]
    return sorted(late), together


class PeerWatchdog:
    def __init__(self, rank: int, world_size: int, *, timeout_s: float, slow_timeout_s: float, progress,
                 interval_s: float | None = None, on_verdict=None, on_peer_stopped=None, host: str | None = None,
                 stop=None):
        """progress: where the main loop is (its step and phase). stop: this rank's StopRequest, published with
        the state (within a quarter second of its request) and told of a peer's (`seen_on`). on_verdict() runs
        before any exit and returns text for the message (the flight-recorder dump on NCCL). on_peer_stopped(text)
        runs before the exit 0 that follows a peer's `leave` (rank 0 records the stop). host: the name peers
        compare with their own to check this rank's process directly (default: this machine's)."""
        self.rank, self.world_size, self.timeout_s, self.progress = rank, world_size, timeout_s, progress
        self.stop_request = stop
        self.stop_published = False
        self.slow_timeout_s, self.on_verdict, self.on_peer_stopped = slow_timeout_s, on_verdict, on_peer_stopped
        self.interval_s = interval_s or max(0.5, min(5.0, timeout_s / 6))
        store_host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.address = f"{store_host}:{port}"
        op_timeout = timedelta(seconds=max(1.0, min(10.0, timeout_s / 3)))
        self.store = dist.TCPStore(store_host, port, is_master=False, timeout=op_timeout, wait_for_workers=False)
        prefix = "rvq_watchdog/{}/{}".format(os.environ.get("TORCHELASTIC_RUN_ID", "run"),
                                             os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.verdict_key, self.acked_key = f"{prefix}/verdict", f"{prefix}/acked"
        self.state_keys = [f"{prefix}/state/{r}" for r in range(world_size)]  # beat number, step, phase, time in it
        self.where_keys = [f"{prefix}/where/{r}" for r in range(world_size)]  # read only to write a verdict
        self.peers = [r for r in range(world_size) if r != rank]
        self.who_keys = [f"{prefix}/who/{r}" for r in self.peers]  # "host pid", read once
        self.host = host or socket.gethostname()
        self.main_id = threading.main_thread().ident
        self.beat = 0
        self.published = 0  # the beat number of the last state the store took
        self.states = {}  # every rank's state, as the last round read it
        self.moved = {r: (-1, time.monotonic()) for r in self.peers}  # each peer's beat number and when it last moved
        self.local_pids = None  # peers on this host, by rank: read with the first full read
        self.all_published = False  # until every rank's keys exist, multi_get would wait for the missing ones
        self.store.set(f"{prefix}/who/{rank}", f"{self.host} {os.getpid()}")
        self._publish()
        self.store.compare_set(self.verdict_key, "", "")  # creates it empty; a verdict written already stays
        # who hosts the store: torchrun's agent (on the first node), or rank 0 (srun, hand-started ranks)
        self.store_host = ("the launcher (torchrun's agent)" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                           else "rank 0")
        self.answered = time.monotonic()  # when the store last answered a whole round
        self.round_started = None  # when the round in progress began (None between rounds)
        self._stop = threading.Event()
        self._wake = threading.Event()  # starts the next round now (leave)
        self._verdict = threading.Event()
        self._ending = False  # a verdict or failure is being reported: the clock leaves it to finish
        self._thread = threading.Thread(target=self._run, name="peer-watchdog", daemon=True)
        # A store request can block for good, past its own timeout, where the store's host is stopped with its
        # socket open: the client reads the reply to its cancelled wait with no timeout. The clock thread, which
        # never touches the store, ends the rank when a round has been waiting for longer than the timeout.
        self._clock = threading.Thread(target=self._watch_store, name="peer-watchdog-clock", daemon=True)

    def allowance(self, phase: str, step: int) -> float:
        """How long the main thread may stay in one phase: the first step may run the k-means init."""
        return self.slow_timeout_s if is_slow(phase, step) else self.timeout_s

    def start(self) -> "PeerWatchdog":
        self._thread.start()
        self._clock.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in (self._thread, self._clock):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=self.interval_s + 15)

    def _publish(self) -> None:
        """This rank's state with its next beat number, and where its main thread is once that thread has stayed in
        its phase for half the phase's allowance ("" before): one message, no reply. A healthy run never reads
        another thread's stack: in CPython 3.11 no way of reading it is safe while threads start and end (walking
        frame objects has ended a rank with a segmentation fault; faulthandler's dump of every thread can crash on
        a thread that starts or ends meanwhile, CPython issues 116008 and 131580)."""
        p = self.progress
        self.beat += 1
        step, phase, in_phase = p.step, p.phase, time.monotonic() - p.since
        state = {"beat": self.beat, "step": step, "phase": phase, "for": round(in_phase, 1)}
        if self.stop_request:  # peers read it: their slow phases cut their work short (StopRequest.anywhere)
            state["stop"] = 1
        self.stop_published = "stop" in state
        place = where(self.main_id) if in_phase >= self.allowance(phase, step) / 2 else ""
        self.store.multi_set([self.state_keys[self.rank], self.where_keys[self.rank]], [json.dumps(state), place])
        self.published = state["beat"]

    def round(self, now: float) -> tuple[str, list, list]:
        """One heartbeat: publish this rank's state, then read every rank's state and the verdict in one batched
        call, and propose a verdict when a rank the others wait for is stuck. The store sees the same few
        requests whatever the world size. Returns the verdict ("" for none) and the peers found dead or silent."""
        self._publish()
        keys = [self.verdict_key, *self.state_keys, *(self.who_keys if self.local_pids is None else ())]
        self.all_published = self.all_published or self.store.check(keys)  # asked only until it is true
        verdict = ""
        if self.all_published:
            values = self.store.multi_get(keys)
            verdict = values[0].decode()
            states = self.states = dict(enumerate(json.loads(b"[" + b",".join(values[1:1 + self.world_size]) + b"]")))
            if self.local_pids is None:
                whos = (v.decode().rsplit(" ", 1) for v in values[1 + self.world_size:])
                self.local_pids = {r: int(pid) for r, (host, pid) in zip(self.peers, whos) if host == self.host}
            for r in self.peers:
                if states[r]["beat"] != self.moved[r][0]:
                    self.moved[r] = (states[r]["beat"], now)
                if self.stop_request is not None and states[r].get("stop"):
                    self.stop_request.seen_on(r)
            # a peer whose beats stopped publishes a stale state: the silence check names it instead
            beating = all(now - t <= 2 * self.interval_s + 1 for _, t in self.moved.values())
            if not verdict and beating:
                verdict = self._judge(states)
        dead = [r for r, pid in (self.local_pids or {}).items() if _process_gone(pid)]
        silent = [r for r, (_, t) in self.moved.items() if now - t > self.timeout_s]
        return verdict, dead, silent

    def _judge(self, states: dict) -> str:
        """The verdict when a rank the others wait for has overstayed its phase's allowance, or "": the first
        rank to see it writes it, with where every main thread is; every rank reads the same one."""
        if not stuck_ranks(states, self.allowance)[0]:  # where the main threads are is read only past here
            return ""
        wheres = [w.decode() for w in self.store.multi_get(self.where_keys)]  # "": a main thread not read
        states = {r: {**states[r], **({"where": wheres[r]} if wheres[r] else {})} for r in sorted(states)}
        late, together = stuck_ranks(states, self.allowance)
        if not late:
            return ""
        proposal = json.dumps({"late": late, "together": together, "by": self.rank,
                               "states": {str(r): s for r, s in states.items()}})
        return self.store.compare_set(self.verdict_key, "", proposal).decode()

    def _sleep(self) -> bool:
        """Wait for the next round (an interval, a wake-up, or a stop requested on this rank and not yet
        published); False once the watchdog is to stop."""
        end = time.monotonic() + self.interval_s
        while (left := end - time.monotonic()) > 0 and not self._wake.wait(min(left, 0.25)):
            if self.stop_request and not self.stop_published:
                break
        self._wake.clear()
        return not self._stop.is_set()

    def _run(self) -> None:
        while self._sleep():
            now = time.monotonic()
            self.round_started = now
            try:
                verdict, dead, silent = self.round(now)
                self.answered = now
            except Exception as e:  # noqa: BLE001 - an unreachable store is itself the symptom
                dead = [r for r, pid in (self.local_pids or {}).items() if _process_gone(pid)]
                if dead:  # the store's host may be the one gone: the process table needs no store
                    self._lost(dead, f"rank(s) {dead} lost: the process is gone", reread=False)
                if now - self.answered > self.timeout_s:
                    self._fail(self._store_silent(now - self.answered, e))
                continue
            finally:
                self.round_started = None
            if (dead or silent) and not verdict:  # a rank that wrote a verdict exits at once: it explains the loss
                with contextlib.suppress(Exception):
                    verdict = self.store.get(self.verdict_key).decode()
            if verdict:
                self._stuck(json.loads(verdict))
            if dead:
                self._lost(dead + silent, f"rank(s) {dead} lost: the process is gone")
            if silent:
                self._lost(silent, f"rank(s) {silent} silent: no heartbeat for more than {self.timeout_s:.0f}s "
                           "(stopped, hung or unreachable)")

    def _lost(self, ranks: list, what: str, reread: bool = True) -> None:
        """Peers gone: exit 0 when each left on a stop with nothing to save (its last state says so), else 3.
        reread: their states are read again first (one may have left after this round read them)."""
        if reread:
            with contextlib.suppress(Exception):
                for r, value in zip(ranks, self.store.multi_get([self.state_keys[r] for r in ranks])):
                    self.states[r] = json.loads(value)
        if all(self.states.get(r, {}).get("phase") == STOPPED for r in ranks):
            self._peers_stopped(sorted(ranks))
        self._fail(what)

    def _watch_store(self) -> None:
        """The clock: ends the rank when one round has waited on the store for longer than the timeout, seen so at
        two checks an interval apart (after a pause of the whole process the round is let finish first)."""
        overdue = None
        while not self._stop.wait(self.interval_s):
            started = self.round_started
            if started is None or time.monotonic() - started <= self.timeout_s or self._ending:
                overdue = None
                continue
            if overdue == started:
                self._fail(self._store_silent(time.monotonic() - started, None))
            overdue = started

    def _store_silent(self, seconds: float, error: Exception | None) -> str:
        return (f"the rendezvous store at {self.address}, hosted by {self.store_host}, has not answered for "
                f"{seconds:.0f}s{f' ({error})' if error is not None else ''}: its host is stopped, hung, gone or "
                "unreachable")

    def paragraph(self, verdict: dict) -> str:
        states = {int(r): s for r, s in verdict["states"].items()}
        late = verdict["late"]

        def at(r):
            s = states[r]
            place = f", at {s['where']}" if "where" in s else ""  # read once a rank is half its allowance in
            return f"rank {r} in {s['phase']} at step {s['step']} for {s['for']:.0f}s{place}"

        if verdict["together"]:
            head = (f"ranks {late} have all waited in the same place longer than its allowance "
                    f"({self.allowance(states[late[0]]['phase'], states[late[0]]['step']):.0f}s): "
                    "a collective that does not complete (ranks in different collectives, or a network fault): ")
            return head + "; ".join(at(r) for r in sorted(states))
        if all(in_collective(s) for s in states.values()):
            head = f"ranks in different collectives (a desync), rank(s) {late} stuck longest: "
            return head + "; ".join(at(r) for r in sorted(states))
        stuck = "; ".join(f"{at(r)} (allowance {self.allowance(states[r]['phase'], states[r]['step']):.0f}s)"
                          for r in late)
        others = "; ".join(f"{at(r)}" for r in sorted(states) if r not in late)
        return f"rank(s) {late} stuck: {stuck}" + (f". The others wait: {others}" if others else "")

    def _stuck(self, verdict: dict) -> None:
        self._ending = True
        text = self.paragraph(verdict)
        if self.rank in verdict["late"]:
            log.error("rank %d is stuck; the stacks of all its threads follow (the main thread is the one in %s)",
                      self.rank, self.progress.phase)
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with contextlib.suppress(Exception):
            self.store.add(self.acked_key, 1)
        if self.rank == 0:  # rank 0 may host the store: the others read the verdict from it before it goes
            deadline = time.monotonic() + 2 * self.interval_s + 5
            with contextlib.suppress(Exception):
                while self.store.add(self.acked_key, 0) < self.world_size and time.monotonic() < deadline:
                    time.sleep(0.2)
        self._fail(text)

    def _fail(self, what: str) -> None:
        self._ending = True
        self._verdict.set()
        if self.on_verdict is not None:
            with contextlib.suppress(Exception):  # the exit must not depend on a diagnostic
                what += self.on_verdict()
        log.error("rank %d stopping at step %s: %s. Exit code 3; restart with --resume auto to continue from the "
                  "last checkpoint", self.rank, self.progress, what)
        exit_now(EXIT_DISTRIBUTED)  # the main thread may be blocked in a collective: no clean unwinding

    def lost_peers(self, max_wait_s: float | None = None, beats: int = 3) -> list[int]:
        """After an exception in the main thread (its progress's phase set to FAILED): [] once every peer has
        published `beats` more beats than this rank had seen, the last of them after the exception (alive: the
        error is this rank's own). A peer lost, silent or stuck is named by the watchdog, which exits the process
        (code 3) meanwhile, or 0 after a peer's `leave`. Returns the peers not seen alive when `max_wait_s`
        (default: past the watchdog's own timeout) is up, or at once when the watchdog is not running."""
        seen = {r: self.moved[r][0] for r in self.peers}
        deadline = time.monotonic() + (self.timeout_s + 4 * self.interval_s if max_wait_s is None else max_wait_s)
        while True:
            waiting = [r for r in self.peers if self.moved[r][0] < max(seen[r], 0) + beats]
            if not waiting or not self._thread.is_alive() or time.monotonic() >= deadline:
                return waiting
            self._verdict.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def leave(self) -> None:
        """This rank leaves at once on a stop with nothing to save (its progress's phase set to STOPPED): the store
        takes that state before it goes, so that the peers, finding it gone, stop too rather than fail. Waits for
        the round that publishes it (one now), for at most two intervals and a store timeout."""
        beat = self.beat
        self._wake.set()
        deadline = time.monotonic() + 2 * self.interval_s + self.timeout_s / 3
        while self.published <= beat and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.rank == 0 and self.store_host == "rank 0":  # the store goes with this process: each peer reads the
            base = {r: self.moved[r][0] for r in self.peers}  # state first (a round of theirs after it, seen here)
            deadline = time.monotonic() + 4 * self.interval_s + self.timeout_s / 3
            while (any(self.moved[r][0] < base[r] + 3 for r in self.peers) and self._thread.is_alive()
                   and time.monotonic() < deadline):
                time.sleep(0.05)

    def _peers_stopped(self, ranks: list) -> None:
        """Every rank gone left on a stop with nothing to save: this rank ends as they did, exit 0."""
        self._ending = True
        text = (f"rank(s) {ranks} stopped on request at step {self.states[ranks[0]]['step']}, with nothing trained "
                "since the last checkpoint: this rank stops too, with nothing to save")
        if self.on_peer_stopped is not None:
            with contextlib.suppress(Exception):
                self.on_peer_stopped(text)
        log.warning("rank %d: %s. Exit code 0; restart with --resume auto to continue from the last checkpoint",
                    self.rank, text)
        exit_now(EXIT_OK)
