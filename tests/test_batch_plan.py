import numpy as np
import pytest

from data.batch_plan import BatchPlan, eval_windows, pick_windows, shard_indices
from errors import BadInputError

LENGTHS = np.random.default_rng(0).integers(60, 700, size=101)  # not divisible by 2 or 4 ranks


def plans(world, **kw):
    args = dict(segment_lengths=[64, 128, 256, 512], frames_per_step=2048, seed=7)
    args.update(kw)
    return [BatchPlan(LENGTHS, rank=r, world_size=world, **args) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_same_length_same_steps_constant_frames(world):
    ps = plans(world)
    assert len({p.steps_per_epoch for p in ps}) == 1
    for step in range(200):
        batches = [p.batch(step) for p in ps]
        assert len({b.segment_length for b in batches}) == 1
        assert all(b.frames == 2048 for b in batches)
    assert {ps[0].segment_length(s) for s in range(200)} == {64, 128, 256, 512}


def test_crops_stay_inside_this_ranks_utterances():
    p = plans(2)[1]
    mine = LENGTHS[shard_indices(len(LENGTHS), 1, 2)]
    for step in range(100):
        b = p.batch(step)
        assert (b.starts >= 0).all() and (b.starts + b.segment_length <= mine[b.utterances]).all()


def test_plan_is_a_pure_function_of_its_inputs():
    a, b = plans(2)[0], plans(2)[0]
    for step in (0, 5, 999):
        x, y = a.batch(step), b.batch(step)
        assert x.segment_length == y.segment_length
        np.testing.assert_array_equal(x.utterances, y.utterances)
        np.testing.assert_array_equal(x.starts, y.starts)


def test_an_exclusion_leaves_the_batches_drawn_so_far_and_only_those():
    """A prefetcher draws steps ahead of the loop: excluding an utterance must not change them."""
    p, fresh = plans(1)[0], plans(1)[0]
    ahead = [p.batch(step) for step in range(6)]  # drawn ahead, as a prefetcher does
    bad = np.unique(np.concatenate([b.utterances for b in ahead]))[:5]
    p.exclude(bad)
    for step, before in enumerate(ahead):  # drawn again (the device cache's part of a streamed batch)
        again = p.batch(step)
        np.testing.assert_array_equal(again.utterances, before.utterances)
        np.testing.assert_array_equal(again.starts, before.starts)
    later = [p.batch(step) for step in range(6, 200)]
    assert not np.isin(np.concatenate([b.utterances for b in later]), bad).any()
    assert all(b.frames == 2048 for b in later)
    fresh.exclude(bad)  # nothing drawn yet: excluded from step 0
    assert not np.isin(np.concatenate([fresh.batch(s).utterances for s in range(6)]), bad).any()


def test_a_length_with_every_utterance_excluded_draws_from_all_again():
    p = BatchPlan([100, 40, 120], segment_lengths=[64], frames_per_step=256, seed=0)
    p.exclude([0, 2])
    assert set(p.batch(0).utterances) <= {0, 2}


def test_lengths_no_rank_can_serve_are_dropped_and_reported():
    p = BatchPlan([100, 300, 120, 110], segment_lengths=[64, 256], frames_per_step=512, seed=0, rank=0, world_size=2)
    assert p.segment_lengths == [64] and p.dropped_lengths == [256]


def test_no_utterance_long_enough_is_bad_input():
    with pytest.raises(BadInputError, match="longest has 50 frames"):
        BatchPlan([50, 40], segment_lengths=[64], frames_per_step=512, seed=0)


def test_eval_windows_cover_whole_windows_only():
    utts, starts, skipped = eval_windows([100, 30, 64], 32)
    assert list(zip(utts, starts)) == [(0, 0), (0, 32), (0, 64), (2, 0), (2, 32)]
    assert skipped == 1


def test_eval_frames_are_shared_among_ranks_and_fixed_by_the_seed():
    picks = [pick_windows(1000, 64 * 100, 64, seed=7, rank=r, world_size=4) for r in range(4)]
    assert [len(p) for p in picks] == [25] * 4  # 100 windows of 64 frames over 4 ranks
    assert all((np.diff(p) > 0).all() and p.max() < 1000 for p in picks)
    np.testing.assert_array_equal(picks[1], pick_windows(1000, 6400, 64, seed=7, rank=1, world_size=4))
    assert not np.array_equal(picks[1], pick_windows(1000, 6400, 64, seed=8, rank=1, world_size=4))
    np.testing.assert_array_equal(pick_windows(10, 6400, 64, seed=7, rank=0, world_size=4), np.arange(10))
    np.testing.assert_array_equal(pick_windows(1000, 0, 64, seed=7, rank=0, world_size=4), np.arange(1000))
