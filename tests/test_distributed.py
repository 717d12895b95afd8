"""Two ranks on gloo over 127.0.0.1: the launchers, and a run that ends cleanly."""
import pytest

from tests.helpers import TINY, events, run_torchrun

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)


@pytest.mark.long
def test_torchrun_two_ranks_demo_corpus(tmp_path):
    """torchrun --nproc_per_node=2 rvq_seamless_gpu_cache_nccl.py: the default codec on the demo corpus (small
    samples for the k-means init and the final eval, whose beam search on 8 levels of 1024 codes takes seconds)."""
    out = tmp_path / "run"
    r = run_torchrun(["--max_steps", "8", "--output_dir", out, "--kmeans_init_frames", "2048", "--eval_frames", "1024",
                      "--refit_iters", "0"], timeout=290)  # the refit on two ranks: tests/test_refit_ranks.py
    assert r.returncode == 0, r.stderr[-4000:]
    assert "world size 2" in r.stderr
    assert events(out, "stop")[-1]["step"] == 8
    assert events(out, "eval")[-1]["step"] == 8
    assert [e["step"] for e in events(out, "checkpoint")] == [8]


@pytest.mark.parametrize("launcher", ["torch.distributed.launch", "torch.distributed.run"])
def test_launchers_with_multi_length_and_uneven_shards(tmp_path, launcher):
    """torch.distributed.launch passes --local-rank; shards of 61 utterances do not split evenly."""
    from tests.helpers import write_fairseq
    import numpy as np

    data = tmp_path / "data"
    write_fairseq(data, "train", np.random.default_rng(0).integers(40, 200, size=61).tolist())
    out = tmp_path / "run"
    r = run_torchrun(["--data_dir", data, *TINY, "--max_steps", "12", "--multi_length_training", "--segment_lengths",
                      "16,32,64", "--sync_check_every", "3", "--eval_every", "6", "--output_dir", out],
                     launcher=launcher, timeout=200)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "holding out 1 of 61" in r.stderr
    assert [e["step"] for e in events(out, "eval")] == [6, 12]
    assert events(out, "stop")[-1] == {**events(out, "stop")[-1], "step": 12, "reason": "max_steps"}


@pytest.mark.parametrize("valid,codes", [([20, 24, 30], [2, 2]), ([100, 24], [0, 0])])
def test_held_out_windows_on_no_rank_end_every_rank_at_start_and_on_one_rank_are_evaluated(tmp_path, valid, codes):
    """Windows of 32 frames: held-out utterances [20, 24, 30] give none on any rank, [100, 24] three on rank 0
    and none on rank 1, whose eval adds nothing to the sums; the final eval scores both utterances whole."""
    import numpy as np

    from tests.helpers import Ranks, write_fairseq

    data = tmp_path / "data"
    write_fairseq(data, "train", np.random.default_rng(0).integers(40, 200, size=40).tolist())
    write_fairseq(data, "valid", valid, seed=1)
    out = tmp_path / "run"
    job = Ranks(["--data_dir", data, "--output_dir", out, *TINY, "--max_steps", "4", "--eval_every", "2",
                 "--refit_iters", "0", "--sync_timeout", "30"], log_dir=tmp_path / "logs")
    try:
        assert job.wait(timeout=150) == codes, job.output(0) + job.output(1)
    finally:
        job.close()
    if codes == [2, 2]:
        for rank in (0, 1):
            assert "no held-out window to evaluate" in job.output(rank) and "has 30 frames" in job.output(rank)
        assert not out.exists()
    else:
        assert [(e["step"], e["frames"], e["scored"]) for e in events(out, "eval")] == [
            (2, 96, "32-frame windows"), (4, 124, "whole utterances")]
        assert not events(out, "eval_failed")
