"""The device cache and the prefetcher serve exactly the batches of the plain host path."""
import numpy as np
import pytest
import torch

from data.batch_plan import BatchPlan
from data.crops import HostBatches
from data.device_cache import DeviceFeatureCache
from data.prefetcher import Prefetcher
from data.stores import open_stores
from tests.helpers import write_fairseq


@pytest.fixture(scope="module")
def store_and_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_fairseq(d, "train", np.random.default_rng(0).integers(40, 300, size=50).tolist(), dim=8)
    write_fairseq(d, "valid", [64, 64], dim=8)
    train, _, _ = open_stores(d, "train", "valid", seed=0)
    plan = BatchPlan(train.lengths, segment_lengths=[32, 64, 128], frames_per_step=512, seed=5)
    return train, plan


def expected(store, plan, steps):
    host = HostBatches(store, plan, torch.device("cpu"))
    return [host.get(s)[1] for s in steps]


@pytest.mark.parametrize("budget_fraction", [1.0, 0.3])
def test_cache_gathers_the_same_crops(store_and_plan, budget_fraction):
    store, plan = store_and_plan
    full_bytes = store.total_frames * store.dim * 4
    cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=budget_fraction * full_bytes,
                               dtype=torch.float32, show_progress=False)
    assert (cache.num_cached == len(store)) == (budget_fraction == 1.0)
    for step, want in zip(range(20), expected(store, plan, range(20))):
        batch, got = cache.get(step)
        assert got.shape == (len(batch.utterances), batch.segment_length, store.dim)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    cache.close()


def test_half_precision_cache_rounds_only(store_and_plan):
    store, plan = store_and_plan
    cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=1e9, dtype=torch.float16,
                               show_progress=False)
    for step, want in zip(range(5), expected(store, plan, range(5))):
        torch.testing.assert_close(cache.get(step)[1], want.half().float(), rtol=0, atol=0)


@pytest.mark.parametrize("workers,persistent", [(1, True), (2, False)])
def test_prefetcher_serves_the_same_batches_in_order(store_and_plan, workers, persistent):
    store, plan = store_and_plan
    steps = range(7, 7 + 2 * plan.steps_per_epoch + 3)  # crosses epoch boundaries (pool rebuilt when not persistent)
    pre = Prefetcher(store, plan, torch.device("cpu"), start_step=7, depth=3, workers=workers,
                     persistent_workers=persistent)
    try:
        for step, want in zip(steps, expected(store, plan, steps)):
            batch, got = pre.get(step)
            assert batch.step == step
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        pre.close()


def test_prefetcher_hands_a_worker_error_to_the_main_loop(store_and_plan):
    store, plan = store_and_plan

    class Broken:
        dim, lengths = store.dim, store.lengths

        def utterance(self, i):
            raise OSError("disk went away")

    pre = Prefetcher(Broken(), plan, torch.device("cpu"), start_step=0, depth=2)
    with pytest.raises(RuntimeError, match="building step 0: OSError\\('disk went away'\\)"):
        pre.get(0)
    pre.close()
