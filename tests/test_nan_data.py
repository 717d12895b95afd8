"""Non-finite values: a step whose loss is NaN is skipped and counted; an utterance with NaN frames is dropped,
named once, and never drawn again, by every batch source."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import TINY, events, newest_checkpoint, trainer_in_process, write_fairseq


def test_nan_loss_step_is_skipped_and_counted(tmp_path, small_data):
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", small_data, *TINY, "--max_steps", "8", "--output_dir", out],
                           extra_env={"RVQ_FAULT": "nan:step=3"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["step"] for e in events(out, "skipped_step")] == [4]
    assert events(out, "train")[-1]["bad_steps"] == 1


@pytest.mark.slow
def test_a_nan_frame_in_the_data_is_dropped_named_once_and_never_used_again(tmp_path):
    data = tmp_path / "data"
    for split, n, bad_row in (("train", 8, 3 * 40 + 20), ("valid", 4, 64 + 10)):
        utts = write_fairseq(data, split, [40] * n if split == "train" else [64] * n)
        arr = np.concatenate(utts)
        arr[bad_row, 5] = np.nan  # every 32-frame crop of train utterance 3 covers its frame 20
        np.save(data / f"{split}_0_1.npy", arr)
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", data, *TINY, "--max_steps", "12", "--eval_every", "6", "--output_dir", out])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("train_0_1.npy utterance 3 (rows 120-160)") == 1
    train = events(out, "train")
    found = next(k for k, e in enumerate(train) if e["bad_utterances"] == 1)
    assert train[found]["dropped_crops"] >= 1 and train[-1]["bad_utterances"] == 1
    assert {e["dropped_crops"] for e in train[found:]} == {train[found]["dropped_crops"]}  # never drawn again
    assert all(math.isfinite(e["loss"]) for e in train) and not events(out, "skipped_step")
    assert all(math.isfinite(e["rel_mse"]) for e in events(out, "eval"))
    final = newest_checkpoint(out)["model"]
    assert all(torch.isfinite(v).all() for k, v in final.items() if "rvq" in k and v.is_floating_point())


@pytest.mark.parametrize("source", [
    ["--use_gpu_cache", "--gpu_cache_gb", "0.0001", "--prefetch"],  # part cached, the rest prefetched
    ["--prefetch"],
    ["--use_gpu_cache", "--gpu_cache_gb", "0.0001", "--prefetch", "--multi_length_training", "--segment_lengths",
     "16,32"],
], ids=["partial_cache_prefetch", "prefetch", "multi_length_partial_prefetch"])
@pytest.mark.slow
def test_utterances_with_nan_rows_are_dropped_and_named_once_by_every_batch_source(tmp_path, source):
    """A folder of utterances, every second one with NaN rows: bad utterances are found while batches ahead of
    the step are already planned (prefetched, or partly cached and partly streamed)."""
    data = tmp_path / "data"
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("valid", 2)):
        (data / split).mkdir(parents=True)
        for i in range(n):
            u = rng.standard_normal((int(rng.integers(40, 120)), 16)).astype(np.float32)
            if split == "train" and i % 2:
                u[5:-5, 0] = np.nan  # every 32-frame crop of it has a NaN frame
            np.save(data / split / f"u{i:03d}.npy", u)
    out = tmp_path / "run"
    r = trainer_in_process(["--data_dir", data, *TINY, "--max_steps", "24", "--output_dir", out, *source])
    assert r.returncode == 0, r.stderr[-3000:]
    named = [line.split(" in ", 1)[1].split(":", 1)[0] for line in r.stderr.splitlines()
             if "non-finite values (NaN or Inf) in" in line]
    assert named and len(named) == len(set(named))  # each bad utterance named once
    assert all(int(Path(n).stem[1:]) % 2 for n in named)
    train = events(out, "train")
    assert train[-1]["bad_utterances"] == len(named) and train[-1]["dropped_crops"] >= len(named)
