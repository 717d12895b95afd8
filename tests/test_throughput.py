"""Step timing and MFU: the `train` events carry data_wait_frac and mfu, in sane ranges."""
import pytest
import torch

from models.codec import CodecConfig, RVQCodec
from tests.helpers import QUICK, TINY, events, trainer_in_process
from training.throughput import StepTimer, training_flops_per_frame

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)


@pytest.mark.parametrize("source", [["--use_gpu_cache"], ["--prefetch", "--prefetch_depth", "2"]])
def test_train_events_report_data_wait_and_mfu(tmp_path, source):
    run = trainer_in_process([*TINY, *QUICK, "--max_steps", "4", "--eval_every", "100", "--output_dir", tmp_path,
                              *source])
    assert run.returncode == 0, run.stderr[-2000:]
    train = events(tmp_path, "train")
    assert len(train) == 4
    for e in train:
        assert 0 <= e["data_wait_frac"] <= 1
        assert e["mfu"] > 0 and e["frames_per_sec"] > 0
    assert "MFU:" in run.stderr
    said = next(line for line in run.stderr.splitlines() if "MFU:" in line)  # a CPU's peak: in GFLOP/s, never 0.0
    assert " GFLOP/s (timed fp32 GEMM on the CPU)" in said and "against 0 " not in said, said


def test_flops_per_frame_counts_convs_and_codebook_distances():
    cfg = CodecConfig(feature_dim=8, latent_dim=16, num_quantizers=2, codebook_size=32, encoder_blocks=1)
    flops = training_flops_per_frame(RVQCodec(cfg))
    d, c = 8, 16
    conv_forward = (2 * d * c * 3 + 2 * c * c * 3 + 2 * c * c + 2 * c * c  # encoder: in, block, 1x1
                    + 2 * c * c * 3 + 2 * c * c * 3 + 2 * c * c + 2 * c * d * 3)  # decoder: in, block, out
    first_conv_input_grad = 2 * d * c * 3  # autograd skips it: the features need no gradient
    rvq = 2 * (2 * 2 * c * 32)  # per level: distances + EMA one-hot einsum
    assert flops == pytest.approx(3 * conv_forward - first_conv_input_grad + rvq, rel=1e-6)


def test_step_timer_window():
    timer = StepTimer(torch.device("cpu"), flops_per_frame=10.0, peak=1e3)
    with timer.waiting_for_data():
        pass
    timer.add_frames(100)
    figures = timer.report()
    assert 0 <= figures["data_wait_frac"] <= 1 and figures["frames_per_sec"] > 0 and figures["mfu"] > 0
    assert timer.report()["frames_per_sec"] == 0  # a new window


def test_startup_measurements_leave_the_global_rng_alone():
    """A resumed run must draw what an unbroken one would: counting FLOPs and timing a GEMM use no global RNG."""
    from training.throughput import peak_flops

    model = RVQCodec(CodecConfig(feature_dim=8, latent_dim=16, num_quantizers=2, codebook_size=32))
    torch.manual_seed(3)
    before = torch.get_rng_state()
    training_flops_per_frame(model)
    peak_flops(torch.device("cpu"), None)
    assert torch.equal(before, torch.get_rng_state())
