"""w2v-BERT's forward passes: little padding, large passes, each chunk in one pass, the same passes on a resume."""
import itertools

import numpy as np
import pytest

from benchmarks.bench_padding import MIXES, file_seconds, measure, window_chunks
from data.audio.features import FRAME_RATE, SAMPLE_RATE
from data.audio.pipeline import AudioFile, cut_windows
from data.audio.pass_plan import DEVICE_DEFAULTS, least_cost_passes, length_sorted_batches, w2v_passes
from tools import extract, tokenize

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("device", sorted(DEVICE_DEFAULTS))
@pytest.mark.parametrize("mix", MIXES)
def test_passes_pad_at_most_a_tenth_and_stay_large_at_each_device_default(mix, device):
    defaults = DEVICE_DEFAULTS[device]
    windows = window_chunks(file_seconds(mix, 1000, seed=1), defaults.commit_seconds)
    m = measure(windows, w2v_passes(defaults.batch_seconds, alone=defaults.chunks_alone))  # each chunk in one pass
    if defaults.chunks_alone:  # a CPU's: each chunk a pass of its own
        assert m["padding"] == 0 and m["passes"] == sum(len(window) for window in windows), m
        return
    assert m["padding"] <= 0.10, m
    assert m["largest_pass_padded_seconds"] <= DEVICE_DEFAULTS[device].batch_seconds, m
    assert m["pass_seconds_mean"] >= 0.5 * DEVICE_DEFAULTS[device].batch_seconds, m


def cost(lengths: np.ndarray, passes: list[np.ndarray], pass_frames: int) -> int:
    return sum(len(p) * int(lengths[p].max()) + pass_frames for p in passes)


def test_every_chunk_is_in_one_pass_in_length_order_within_the_budget():
    rng = np.random.default_rng(0)
    for budget, pass_frames in ((3000, 150), (30000, 1500), (500, 0), (500, 10**6)):
        lengths = rng.integers(1, 1600, size=300)  # some longer than the smallest budget: alone
        passes = least_cost_passes(lengths, budget, pass_frames)
        assert sorted(np.concatenate(passes).tolist()) == list(range(len(lengths)))
        for p in passes:
            assert len(p) == 1 or len(p) * lengths[p].max() <= budget
        for shorter, longer in itertools.pairwise(passes):
            assert lengths[shorter].max() <= lengths[longer].min()
    assert least_cost_passes(np.zeros(0, np.int64), 100, 5) == []


def test_the_passes_cost_least_of_every_cut():
    rng = np.random.default_rng(1)
    for _ in range(40):
        n = int(rng.integers(1, 9))
        lengths = rng.integers(1, 50, size=n)
        budget, pass_frames = int(rng.integers(40, 200)), int(rng.integers(0, 60))
        order = np.argsort(lengths, kind="stable")
        cheapest = None
        for cuts in itertools.product((False, True), repeat=n - 1):  # every cut of the sorted lengths
            bounds = [0, *(k + 1 for k, cut in enumerate(cuts) if cut), n]
            passes = [order[a:b] for a, b in itertools.pairwise(bounds)]
            if all(len(p) == 1 or len(p) * lengths[p].max() <= budget for p in passes):
                c = cost(lengths, passes, pass_frames)
                cheapest = c if cheapest is None else min(cheapest, c)
        found = least_cost_passes(lengths, budget, pass_frames)
        assert cost(lengths, found, pass_frames) == cheapest
        assert cheapest <= cost(lengths, length_sorted_batches(lengths, budget), pass_frames)


def test_a_resumed_shard_meets_the_windows_and_passes_of_a_run_never_stopped():
    seconds = file_seconds("2-20 s", 400, seed=2)
    files = [AudioFile(i, f"{i}.wav", samples=int(s * SAMPLE_RATE)) for i, s in enumerate(seconds)]
    files[7].skipped, files[7].samples = "unreadable", 0
    passes = w2v_passes(DEVICE_DEFAULTS["cuda"].batch_seconds)

    def chunk_passes(window):
        lengths = np.array([f.samples * FRAME_RATE // SAMPLE_RATE for f in window.files], dtype=np.int64)
        return [p.tolist() for p in passes(lengths)]

    unbroken = list(cut_windows(files, 1000, 600.0))
    assert len(unbroken) > 4
    whole = [(w.first, w.end, chunk_passes(w)) for w in unbroken]
    for k in (1, 3):  # killed before window k's commit: the resume starts at its first file
        resumed = list(cut_windows(files[unbroken[k].first :], 1000, 600.0))
        met = {w.first: (w.first, w.end, chunk_passes(w)) for w in reversed(resumed)}  # other windows' passes first
        assert [met[first] for first in sorted(met)] == whole[k:]


@pytest.mark.parametrize("tool", [extract, tokenize])
def test_commit_seconds_default_follows_the_device_and_a_given_one_is_kept(tool, tmp_path):
    flags = ["src", "train", 1, 0, tmp_path, *(["--checkpoint", tmp_path] if tool is tokenize else [])]
    for device in ("cpu", "cuda", "cuda:1"):
        kind = "cpu" if device == "cpu" else "cuda"
        assert tool.parse_args([*flags, "--device", device]).pipeline.commit_seconds == DEVICE_DEFAULTS[kind].commit_seconds
    assert tool.parse_args([*flags, "--device", "cuda", "--commit_seconds", 90]).pipeline.commit_seconds == 90
    assert f"{DEVICE_DEFAULTS['cuda'].commit_seconds:g} on cuda" in " ".join(tool.build_parser().format_help().split())
