"""Two ranks on gloo over 127.0.0.1: the launchers, and a run that ends cleanly."""
import pytest

from tests.helpers import TINY, events, run_torchrun


def test_torchrun_two_ranks_demo_corpus(tmp_path):
    """The README's smoke path: torchrun --nproc_per_node=2 rvq_seamless_gpu_cache_nccl.py --max_steps 20."""
    out = tmp_path / "run"
    r = run_torchrun(["--max_steps", "20", "--output_dir", out], timeout=290)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "world size 2" in r.stderr
    assert events(out, "stop")[-1]["step"] == 20
    assert events(out, "eval")[-1]["step"] == 20
    assert [e["step"] for e in events(out, "checkpoint")] == [20]


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
