"""The watchdog's round against a real TCPStore, with several ranks' watchdogs in one process and a clock the
test drives: what the store is asked per round, a silent peer, a peer that never published, a stuck rank."""
import json
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from training.progress import Progress
from training.watchdog import PeerWatchdog

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
