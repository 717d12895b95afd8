"""The watchdog's round against a real TCPStore, with several ranks' watchdogs in one process and a clock the
test drives: what the store is asked per round, a silent peer, a peer that never published, a stuck rank."""
import json
import re
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from training.progress import FAILED, STOPPED, Progress
from training.watchdog import PeerWatchdog, stuck_ranks, where

TIMEOUT = 30  # the client's store timeout is a third of it: above a slow reverse lookup as it connects


@pytest.fixture
def store(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    return server


def watchdogs(world, ranks=None):
    return {r: PeerWatchdog(r, world, timeout_s=TIMEOUT, slow_timeout_s=6 * TIMEOUT, progress=Progress(),
                            interval_s=1) for r in (range(world) if ranks is None else ranks)}


class CountedStore:
    """A store client that counts the calls made through it, by method."""

    def __init__(self, store):
        self.store, self.calls = store, {}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.store, name)(*args)
        return call


@pytest.mark.parametrize("world", [2, 24])
def test_a_round_asks_the_store_the_same_whatever_the_world_size(store, world):
    wds = watchdogs(world)
    for wd in wds.values():
        wd.round(time.monotonic())  # the first round also checks that every rank published and reads who is where
    counted = wds[0].store = CountedStore(wds[0].store)
    for _ in range(3):
        assert wds[0].round(time.monotonic()) == ("", [], [])
    assert counted.calls == {"multi_set": 3, "multi_get": 3}


def test_a_peer_whose_beat_stops_is_named_silent_after_the_timeout(store):
    wds, t0 = watchdogs(3), time.monotonic()
    for t in range(TIMEOUT + 5):
        results = {r: wd.round(t0 + t) for r, wd in wds.items() if r != 2 or t < 2}  # rank 2 beats twice, then stops
        for r in (0, 1):  # both last saw rank 2's beat move at t0 + 2
            assert results[r] == ("", [], [2] if t > TIMEOUT + 2 else []), (r, t)


def test_a_peer_that_never_published_is_silent_after_the_timeout_and_nothing_waits_for_it(store):
    wd, t0 = watchdogs(2, ranks=[0])[0], time.monotonic()
    start = time.monotonic()
    assert wd.round(t0 + 1) == ("", [], [])
    assert wd.round(t0 + TIMEOUT + 1) == ("", [], [1])
    assert time.monotonic() - start < 1  # no read waited for the missing rank's keys


def test_a_stuck_rank_gets_one_verdict_that_every_rank_reads(store):
    wds = watchdogs(3)
    for wd in wds.values():
        wd.progress.step, wd.progress.phase = 5, "forward"
    stuck = wds[1].progress
    stuck.phase = "data"  # behind the others, who wait for it in the forward pass
    stuck.since = time.monotonic() - TIMEOUT - 5
    for wd in wds.values():  # the last rank to publish sees every rank's new state and writes the verdict
        wd.round(time.monotonic())
    verdicts = {r: wd.round(time.monotonic())[0] for r, wd in wds.items()}
    assert len(set(verdicts.values())) == 1 and verdicts[0]
    paragraph = wds[0].paragraph(json.loads(verdicts[0]))
    assert paragraph.startswith("rank(s) [1] stuck: rank 1 in data at step 5 for 35s, at ")
    assert "(allowance 30s). The others wait: rank 0 in forward at step 5" in paragraph


def test_a_healthy_rank_reads_no_thread_stack_and_one_half_its_allowance_into_a_phase_does(store, monkeypatch):
    """Reading another thread's stack is not safe in CPython 3.11 while threads start and end: the beats of a main
    thread that moves never read it; once the thread has stayed in its phase for half the phase's allowance (the
    slow allowance for a slow phase) every beat does, so a verdict finds it fresh."""
    import training.watchdog as watchdog

    reads = []
    monkeypatch.setattr(watchdog, "where", lambda thread_id: reads.append(thread_id) or "x.py:1 in f")
    wd = watchdogs(2, ranks=[0])[0]  # its first beat, made as it starts, read nothing
    p = wd.progress
    p.step, p.phase = 5, "forward"
    for _ in range(3):
        wd.round(time.monotonic())
    p.since = time.monotonic() - TIMEOUT / 2 + 1
    wd.round(time.monotonic())
    assert reads == []
    assert wd.store.get(wd.where_keys[0]) == b""
    p.since = time.monotonic() - TIMEOUT / 2
    wd.round(time.monotonic())
    assert reads == [threading.main_thread().ident]
    assert wd.store.get(wd.where_keys[0]) == b"x.py:1 in f"
    p.step, p.phase = 0, "k-means init"  # a slow phase: half of the slow allowance
    p.since = time.monotonic() - 3 * TIMEOUT + 1
    wd.round(time.monotonic())
    assert len(reads) == 1 and wd.store.get(wd.where_keys[0]) == b""


def test_of_ranks_at_one_point_the_one_outside_a_collective_is_the_one_the_others_wait_for():
    def allowance(phase, step):
        return 10

    waiting = {"step": 12, "phase": "train", "for": 30,
               "where": ".../torch/distributed/distributed_c10d.py:3252 in all_reduce, called from x.py:1 in log_step"}
    stalled = {"step": 12, "phase": "train", "for": 30, "where": "training/faults.py:155 in stall"}
    assert stuck_ranks({0: waiting, 1: stalled}, allowance) == ([1], False)
    assert stuck_ranks({0: waiting, 1: dict(waiting)}, allowance) == ([0, 1], True)  # one collective never ends
    assert stuck_ranks({0: stalled, 1: dict(stalled)}, allowance) == ([0, 1], False)  # both stuck, no collective
    assert stuck_ranks({0: waiting, 1: {**stalled, "for": 5}}, allowance) == ([], False)  # not overstayed yet
    assert stuck_ranks({0: {**waiting, "phase": FAILED}, 1: stalled}, allowance) == ([1], False)


def test_a_store_request_that_never_returns_ends_the_rank_after_the_timeout(store, monkeypatch):
    """The clock thread, not the blocked watchdog thread, reports it, naming the store and who hosts it."""
    wd = PeerWatchdog(0, 2, timeout_s=2, slow_timeout_s=12, progress=Progress(), interval_s=0.5)
    failed = []
    monkeypatch.setattr(wd, "round", lambda now: time.sleep(3600))  # as a client reading a stopped host's socket
    monkeypatch.setattr(wd, "_fail", failed.append)
    start = time.monotonic()
    wd.start()
    while not failed and time.monotonic() - start < 10:
        time.sleep(0.1)
    wd._stop.set()  # the clock's loop ends; the blocked thread is a daemon
    assert failed and 2 <= time.monotonic() - start <= 6, failed
    assert failed[0].startswith(f"the rendezvous store at 127.0.0.1:{store.port}, hosted by rank 0, has not answered")


@pytest.mark.timeout(30)
def test_after_an_exception_the_peers_are_judged_by_their_beats(store):
    """Not by the error's text: every peer beating on means the error is this rank's own; a peer whose beats
    stopped is named (here before the watchdog's own timeout would end the process)."""
    wds = {r: PeerWatchdog(r, 2, timeout_s=TIMEOUT, slow_timeout_s=6 * TIMEOUT, progress=Progress(),
                           interval_s=0.3).start() for r in (0, 1)}
    try:
        wds[0].progress.phase = FAILED
        start = time.monotonic()
        assert wds[0].lost_peers(max_wait_s=10) == []
        assert time.monotonic() - start < 5
        wds[1].stop()
        assert wds[0].lost_peers(max_wait_s=2) == [1]
    finally:
        for wd in wds.values():
            wd.stop()


@pytest.mark.parametrize("phase", [STOPPED, "compile"])
def test_a_peer_gone_after_leaving_on_a_stop_ends_this_rank_with_0_else_3(store, monkeypatch, phase):
    """Its state is read again when it is found gone: it may have left after this rank's round read it."""
    wds = watchdogs(2)
    for wd in wds.values():
        wd.round(time.monotonic())
    ended = []
    monkeypatch.setattr(wds[0], "_peers_stopped", lambda ranks: ended.append((0, ranks)))
    monkeypatch.setattr(wds[0], "_fail", lambda what: ended.append((3, what)))
    wds[1].progress.phase = phase
    wds[1].round(time.monotonic())  # rank 1 publishes, then goes
    wds[0]._lost([1], "rank(s) [1] lost: the process is gone")
    assert ended[0] == ((0, [1]) if phase == STOPPED else (3, "rank(s) [1] lost: the process is gone"))


def test_progress_gives_slow_phases_the_slow_timeout_once_however_they_nest():
    import contextlib

    entered = []

    @contextlib.contextmanager
    def slow_timeout():
        entered.append(p.phase)
        yield

    p = Progress(step=5, slow_timeout=slow_timeout)
    with p.phase_of("data"), p.phase_of("sync check"):
        pass
    assert entered == []
    with p.phase_of("eval"), p.phase_of("checkpoint"):  # nested in a slow phase: its timeout already holds
        pass
    with p.phase_of("refit"):
        pass
    assert entered == ["setup", "setup"]  # entered before the phase is: once for eval, once for refit
    p.step = 0  # every phase of the first step may wait for the k-means init
    with p.phase_of("data"):
        pass
    assert len(entered) == 3


def test_every_phase_the_trainer_enters_is_in_the_phase_table():
    import re

    from tests.helpers import TRAINER
    from training.progress import PHASES

    source = TRAINER.read_text()
    named = set(re.findall(r'(?:phase_of|enter)\("([^"]+)"', source))
    named |= {n for pair in re.findall(r'phase_of\("([^"]+)" if \w+ else "([^"]+)"\)', source) for n in pair}
    assert named and named <= set(PHASES), named - set(PHASES)


def test_where_names_the_main_threads_frame_and_its_project_caller_without_its_frame_objects(monkeypatch):
    """The watchdog reads where the main thread is from its own thread, through faulthandler's dump: walking the
    main thread's frame objects (sys._current_frames(), f_back) would let that thread run between steps."""
    monkeypatch.setattr(sys, "_current_frames", lambda: pytest.fail("another thread's frame objects were read"))
    main, seen, inside, done = threading.get_ident(), [], threading.Event(), threading.Event()

    def watch():
        inside.wait(10)
        seen.append(where(main))
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    inside.set()
    line = sys._getframe().f_lineno + 1
    done.wait(10)  # threading.py's wait: a library's frame, called from this test's
    assert len(seen) == 1
    library, _, caller = seen[0].partition(", called from ")
    assert re.fullmatch(r".*/threading\.py:\d+ in wait", library), library
    assert caller == f"tests/test_watchdog.py:{line} in {sys._getframe().f_code.co_name}"
    assert where(-1) == "unknown"


def test_where_is_unknown_when_the_stacks_cannot_be_dumped_and_the_beat_goes_on(monkeypatch):
    import faulthandler

    def no_file(**_):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(faulthandler, "dump_traceback", no_file)
    assert where(threading.get_ident()) == "unknown"


class _Watchdog:
    """The one answer of PeerWatchdog.lost_peers a test gives the trainer."""

    def __init__(self, silent: list[int]):
        self.silent = silent

    def lost_peers(self, max_wait_s=None, beats=3):
        return self.silent


@pytest.mark.parametrize("error, silent, expected", [
    (RuntimeError("compiled graph failed"), [1], "rank 0 stopped at step 6: rank(s) [1] not seen alive for 10s "
                                                 "after RuntimeError: compiled graph failed"),
    (dist.DistError("gloo: connection reset"), [], "rank 0 stopped at step 6: a collective failed with every peer "
                                                    "alive (a network fault or a timeout): gloo: connection reset"),
    (RuntimeError("a bug of this rank"), [], None),
])
def test_the_trainer_judges_an_exception_by_which_peers_are_alive_not_by_its_text(error, silent, expected, caplog):
    """The judgment of the trainer's error path, whichever thread would have seen the lost peer first in a run:
    a compiled step's error names no collective, so a silent peer makes it a lost peer (exit 3); a collective's
    own error with every peer alive is a network fault (exit 3); any other error with every peer alive is this
    rank's own (None: it is raised with its traceback, exit 1)."""
    import rvq_seamless_gpu_cache_nccl as trainer
    from errors import DistributedFailure

    progress = Progress()
    progress.step, progress.phase = 6, "forward"
    judge = SimpleNamespace(progress=progress, ctx=SimpleNamespace(rank=0), watchdog=_Watchdog(silent),
                            cfg=SimpleNamespace(dist=SimpleNamespace(sync_timeout=10)))
    with caplog.at_level("ERROR"):
        lost = trainer.Trainer.lost_peer(judge, error)
    assert f"rank 0 at step 6 (forward): {type(error).__name__}: {error}; asking the watchdog" in caplog.text
    assert progress.phase == FAILED
    if expected is None:
        assert lost is None and "every peer is alive: the error is this rank's own" in caplog.text
    else:
        assert isinstance(lost, DistributedFailure) and str(lost) == expected
