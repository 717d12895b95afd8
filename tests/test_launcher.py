"""run_nccl_optimized.sh: presets read from training/presets.py, flags forwarded, one process without GPUs."""
import subprocess

import pytest

from tests.helpers import REPO, TINY, env, events
from training.presets import PRESETS


def launch(*args, timeout=240, **extra_env):
    return subprocess.run(["bash", str(REPO / "run_nccl_optimized.sh"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env(**extra_env), cwd=REPO)


@pytest.mark.parametrize("args", [[], ["turbo"]])
def test_no_or_unknown_preset_prints_usage_and_exits_2(args):
    r = launch(*args)
    assert r.returncode == 2
    assert "usage: bash run_nccl_optimized.sh PRESET" in r.stderr
    for name in PRESETS:
        assert name in r.stderr


def test_preset_flags_come_first_and_user_flags_win(tmp_path):
    out = tmp_path / "run"
    r = launch("conservative", *TINY, "--max_steps", "3", "--batch_size", "2", OUTPUT_DIR=out)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    config = json.loads((out / "config.json").read_text())
    assert config["batch_size"] == 2  # the user's, after the preset's 16
    assert config["nccl_timeout"] == 3600 and config["pin_memory"] is False
    assert "NCCL_IB_DISABLE=1: a workaround" in r.stderr
    assert "torch.distributed.run" not in r.stderr  # one process without GPUs
    assert events(out, "stop")[-1]["step"] == 3


def test_user_environment_wins_over_preset(tmp_path):
    r = launch("conservative", *TINY, "--max_steps", "1", OUTPUT_DIR=tmp_path / "run", NCCL_P2P_DISABLE="0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "keeping NCCL_P2P_DISABLE=0 from your environment" in r.stderr


def test_data_dir_and_default_output_dir(tmp_path):
    from tests.helpers import write_fairseq

    write_fairseq(tmp_path / "data", "train", [100] * 20)
    r = subprocess.run(["bash", str(REPO / "run_nccl_optimized.sh"), "basic", *TINY, "--max_steps", "2"],
                       capture_output=True, text=True, timeout=200, cwd=tmp_path,
                       env=env(DATA_DIR=tmp_path / "data"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert events(tmp_path / "runs" / "basic", "stop")[-1]["step"] == 2
