"""The device cache and the prefetcher serve exactly the batches of the plain host path."""
import numpy as np
import pytest
import torch

from data.batch_plan import BatchPlan
from data.crops import CropReader, HostBatches
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


@pytest.mark.parametrize("budget_fraction,stream", [(1.0, None), (0.3, None), (0.3, {"start_step": 0, "depth": 3}),
                                                    (0.9, {"start_step": 0, "depth": 2})])
def test_cache_gathers_the_same_crops(store_and_plan, budget_fraction, stream):
    """Cached crops are gathered, the others read on the spot or streamed by a prefetcher: the same batches."""
    store, plan = store_and_plan
    full_bytes = store.total_frames * store.dim * 4
    cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=budget_fraction * full_bytes,
                               dtype=torch.float32, show_progress=False, stream=stream)
    assert (cache.num_cached == len(store)) == (budget_fraction == 1.0)
    all_cached = [s for s in range(20) if (plan.batch(s).utterances < cache.num_cached).all()]
    if budget_fraction == 0.9:
        assert 0 < len(all_cached) < 20  # the stream must also step through steps it has nothing for
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


@pytest.mark.parametrize("stream", [None, {"start_step": 0, "depth": 2}])
def test_a_cache_budget_under_one_utterance_caches_nothing_and_says_so(store_and_plan, stream, caplog):
    store, plan = store_and_plan
    with caplog.at_level("WARNING", logger="data.device_cache"):
        cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=1e-6 * 1e9, dtype=torch.float32,
                                   show_progress=False, stream=stream)
    assert cache.num_cached == 0 and "nothing cached" in caplog.text
    try:
        for want, s in zip(expected(store, plan, range(6)), range(6)):
            torch.testing.assert_close(cache.get(s)[1], want, rtol=0, atol=0)
    finally:
        cache.close()


def test_prefetcher_hands_a_worker_error_to_the_main_loop(tmp_path):
    for i in range(4):
        np.save(tmp_path / f"u{i}.npy", np.zeros((64, 8), np.float32))
    store, _, _ = open_stores(tmp_path, "train", "valid", seed=0)
    plan = BatchPlan(store.lengths, segment_lengths=[32], frames_per_step=128, seed=0)
    for path in tmp_path.glob("*.npy"):  # the files go away after the start, as on a lost mount
        path.unlink()
    pre = Prefetcher(store, plan, torch.device("cpu"), start_step=0, depth=2)
    with pytest.raises(RuntimeError, match="building step 0: FileNotFoundError"):
        pre.get(0)
    pre.close()


def loop_crops(store, utterances, starts, length):
    """The obvious per-crop loop, the reference for the vectorised reader."""
    return np.stack([store.utterance(int(u))[int(s) : int(s) + length] for u, s in zip(utterances, starts)]).astype(
        np.float32)  # every reader widens a float16 dump to float32


@pytest.mark.parametrize("layout", ["fairseq, 3 shards", "fairseq float16, 3 shards", "directory"])
def test_crop_reader_and_cache_match_the_per_crop_loop(tmp_path, layout):
    lengths = np.random.default_rng(1).integers(40, 200, size=30).tolist()
    if layout == "directory":
        (tmp_path / "train").mkdir()
        rng = np.random.default_rng(2)
        for i, n in enumerate(lengths):
            np.save(tmp_path / "train" / f"u{i:03d}.npy", rng.standard_normal((n, 8)).astype(np.float32))
    else:
        write_fairseq(tmp_path, "train", lengths, dim=8, nshard=3, dtype=np.float16 if "16" in layout else np.float32)
    write_fairseq(tmp_path, "valid", [64], dim=8)
    store, _, _ = open_stores(tmp_path, "train", "valid", seed=0)
    assert store.dtype == (np.float16 if "16" in layout else np.float32)
    plan = BatchPlan(store.lengths, segment_lengths=[32, 64], frames_per_step=256, seed=3)
    reader = CropReader(store)
    assert reader._arrays == layout.startswith("fairseq")  # the vectorised path, float16 included
    cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=1e9,
                               dtype=torch.float16 if "16" in layout else torch.float32, show_progress=False)
    for step in range(10):
        batch = plan.batch(step)
        want = loop_crops(store, batch.utterances, batch.starts, batch.segment_length)
        np.testing.assert_array_equal(reader.read(batch.utterances, batch.starts, batch.segment_length), want)
        torch.testing.assert_close(cache.get(step)[1], torch.from_numpy(want), rtol=0, atol=0)


def test_prefetcher_reuses_its_host_buffers(store_and_plan):
    store, plan = store_and_plan
    depth, steps = 3, 40
    pre = Prefetcher(store, plan, torch.device("cpu"), start_step=0, depth=depth, workers=1)
    try:
        for step, want in zip(range(steps), expected(store, plan, range(steps))):
            torch.testing.assert_close(pre.get(step)[1], want, rtol=0, atol=0)
        # at most depth + 2 buffers in use at once per segment length (queued, building, lent to the step)
        assert pre.buffers.allocated <= len(plan.segment_lengths) * (depth + 2)
        assert pre.buffers.reused >= steps - pre.buffers.allocated - depth
    finally:
        pre.close()


def test_streamed_crops_of_a_partial_cache_take_a_bounded_set_of_host_buffers(store_and_plan, caplog):
    """Half cached: the streamed part of a batch has a different size at almost every step, yet the host
    buffers stay a fixed few per segment length, sized for the largest batch, and the log states their bytes."""
    store, plan = store_and_plan
    depth, steps = 2, 60
    with caplog.at_level("INFO", logger="data.prefetcher"):
        cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=0.5 * store.total_frames * store.dim * 4,
                                   dtype=torch.float32, show_progress=False, stream={"start_step": 0, "depth": depth})
    try:
        sizes = set()
        for step, want in zip(range(steps), expected(store, plan, range(steps))):
            torch.testing.assert_close(cache.get(step)[1], want, rtol=0, atol=0)
            batch = plan.batch(step)
            sizes.add((batch.segment_length, int((batch.utterances >= cache.num_cached).sum())))
        pool = cache._stream.buffers
        per_length = depth + 1 + 1  # queued, building, lent to the step
        assert len(sizes) > 2 * len(plan.segment_lengths)  # more batch shapes than a per-shape pool would bound
        assert pool.allocated <= per_length * len(plan.segment_lengths)
        bound = per_length * sum(plan.batch_size(L) * L * store.dim * 4 for L in plan.segment_lengths)
        assert f"host buffers of at most {bound / 1e9:.3g} GB" in caplog.text
    finally:
        cache.close()


def test_cache_get_sends_only_crop_positions_to_the_device(store_and_plan, monkeypatch):
    """The features never cross per step: the only host->device transfer is one int64 per crop.

    (bf16 on a CPU takes the device code path; fp32 and fp16 caches on a CPU are gathered by numpy.)"""
    import data.device_cache as device_cache

    store, plan = store_and_plan
    cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=1e9, dtype=torch.bfloat16,
                               show_progress=False)
    sent = []
    real = device_cache.to_device
    monkeypatch.setattr(device_cache, "to_device", lambda a, d: sent.append(a) or real(a, d))
    batch, got = cache.get(3)
    torch.testing.assert_close(got, expected(store, plan, [3])[0].bfloat16().float(), rtol=0, atol=0)
    assert len(sent) == 1 and sent[0].dtype == np.int64 and sent[0].shape == (len(batch.utterances),)


def test_a_prepared_batch_is_the_one_get_would_give(store_and_plan):
    """prepare(step) gathers ahead (on CUDA, before the step's host sync); get(step) then hands that batch over
    without gathering again, and a batch prepared for another step is dropped, not served. The bf16 cache takes
    the device code path on a CPU; `ahead` is what a CUDA cache sets."""
    store, plan = store_and_plan
    cache = DeviceFeatureCache(store, plan, torch.device("cpu"), max_bytes=1e9, dtype=torch.bfloat16,
                               show_progress=False)
    assert not cache.ahead  # on a CPU a gather is host work: nothing to gain by starting it early
    cache.prepare(1)
    assert cache._ready is None
    cache.ahead = True
    want = [w.bfloat16().float() for w in expected(store, plan, range(4))]
    cache.prepare(0)
    prepared = cache._ready[1][1]
    batch, got = cache.get(0)
    assert got is prepared and batch.step == 0  # handed over, not gathered again
    torch.testing.assert_close(got, want[0], rtol=0, atol=0)
    cache.prepare(2)  # prepared, then another step asked for: the right batch, the prepared one dropped
    torch.testing.assert_close(cache.get(1)[1], want[1], rtol=0, atol=0)
    assert cache._ready is None
    torch.testing.assert_close(cache.get(2)[1], want[2], rtol=0, atol=0)
    cache.prepare(3)
    torch.testing.assert_close(cache.get(3)[1], want[3], rtol=0, atol=0)
    cache.close()

