"""The fixes a GPU run needs, checked on the CPU: device and precision choice, the MFU peak table,
fp16 scaler overflows, resume across precisions, mixed-precision shards, host syncs per step."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.host_syncs import count_host_syncs, one_step_syncs
from data.stores import open_stores
from models.codec import CodecConfig, RVQCodec
from training import device as device_mod
from training import throughput
from training.checkpoint import restore_scaler
from training.step_guard import MIN_SCALE, StepOutcome, guarded_step
from tests.helpers import write_fairseq


def fake_gpus(monkeypatch, count: int, *, bf16_native: bool = True, name: str = "NVIDIA H100 80GB HBM3"):
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)

    def is_bf16_supported(including_emulation: bool = True):
        return bf16_native or including_emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    return bound


@pytest.mark.parametrize("rank, expected", [(0, 0), (3, 3), (5, 1), (8, 0)])
def test_extraction_shards_spread_over_the_gpus_of_a_node(monkeypatch, rank, expected):
    bound = fake_gpus(monkeypatch, 4)
    assert device_mod.shard_device("auto", rank) == torch.device("cuda", expected)
    assert bound == [torch.device("cuda", expected)]
    assert device_mod.shard_device("cuda:2", rank) == torch.device("cuda", 2)  # an explicit GPU is kept


@pytest.mark.parametrize("local_id, visible, expected", [
    ("3", 1, 0),  # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds this task's GPU alone
    ("3", 2, 1),  # --gpus-per-task=2: the task's GPUs, shared out by local rank
    ("3", 4, 3),  # every GPU of the node visible to every task
])
def test_a_slurm_task_binds_a_gpu_it_sees(monkeypatch, local_id, visible, expected):
    from training.distributed import detect_launch

    bound = fake_gpus(monkeypatch, visible)
    monkeypatch.setattr(os, "environ", {"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": local_id})
    launch = detect_launch()
    assert launch.local_rank == 3
    device = device_mod.select_device("auto", launch.local_rank, bind_local_rank=launch.world_size > 1)
    assert device == torch.device("cuda", expected) and bound == [device]


def test_bf16_only_where_the_gpu_has_it_natively(monkeypatch):
    gpu = torch.device("cuda", 0)
    fake_gpus(monkeypatch, 1, bf16_native=False)  # e.g. a V100 or T4: bf16 only emulated
    assert device_mod.compute_dtype("auto", gpu) is None and device_mod.cache_dtype(gpu) == torch.float16
    fake_gpus(monkeypatch, 1, bf16_native=True)
    assert device_mod.compute_dtype("auto", gpu) == torch.bfloat16 and device_mod.cache_dtype(gpu) == torch.bfloat16
    # --precision fp32 keeps the features as the host path gives them; a float16 dump stays float16
    assert device_mod.cache_dtype(gpu, precision="fp32") == torch.float32
    assert device_mod.cache_dtype(gpu, stored_float16=True, precision="fp32") == torch.float16
    assert device_mod.compute_dtype("auto", torch.device("cpu")) is None


@pytest.mark.parametrize("name, amp, figure", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H200 NVL", torch.bfloat16, "NVIDIA H200 NVL"),
    ("NVIDIA L40", None, "NVIDIA L40"),
    ("NVIDIA A10", torch.float16, "NVIDIA A10"),
])
def test_mfu_peak_is_the_exact_devices_at_the_runs_precision(monkeypatch, name, amp, figure):
    fake_gpus(monkeypatch, 1, name=name)
    peak, source = throughput.peak_flops(torch.device("cuda", 0), amp)
    half, single = throughput.PEAK_FLOPS[figure]
    assert peak == (single if amp is None else half)
    assert name in source and ("fp32" if amp is None else str(amp).split(".")[1]) in source


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA H200 SOMETHING NEW", "NVIDIA L4X"])
def test_a_device_not_in_the_table_is_timed_not_given_a_neighbours_peak(monkeypatch, name):
    fake_gpus(monkeypatch, 1, name=name)
    timed = []
    monkeypatch.setattr(throughput, "measured_gemm_flops", lambda device, dtype, size: timed.append(dtype) or 1e12)
    peak, source = throughput.peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == 1e12 and timed == [torch.bfloat16] and "timed bfloat16" in source


class FakeScaler:
    """A GradScaler's interface, enabled as under fp16, without CUDA."""
    def __init__(self, scale: float):
        self.scale, self.steps = scale, 0

    def is_enabled(self):
        return True

    def get_scale(self):
        return self.scale

    def step(self, optimizer):
        self.steps += 1

    def update(self):
        pass


def test_fp16_overflow_steps_are_not_bad_steps_but_a_broken_loss_is():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    inf, ok = torch.tensor(float("inf")), torch.tensor(1.0)
    assert guarded_step(FakeScaler(2.0**16), optimizer, inf) is StepOutcome.SCALER_OVERFLOW
    assert guarded_step(FakeScaler(MIN_SCALE / 2), optimizer, inf) is StepOutcome.BAD  # no overflow left to blame
    scaler = FakeScaler(2.0**16)
    assert guarded_step(scaler, optimizer, ok) is StepOutcome.APPLIED and scaler.steps == 1
    no_scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp32 and bf16
    assert guarded_step(no_scaler, optimizer, torch.tensor(float("nan"))) is StepOutcome.BAD


def test_a_bf16_checkpoint_resumes_under_fp16_and_back():
    fp16 = torch.amp.GradScaler("cpu", enabled=True, init_scale=128.0)
    bf16 = torch.amp.GradScaler("cpu", enabled=False)
    restore_scaler(fp16, bf16.state_dict())  # a bf16 run saved an empty state: a fresh scaler
    assert fp16.get_scale() == 128.0
    restore_scaler(bf16, fp16.state_dict())  # the fp16 state is dropped by a disabled scaler
    saved = torch.amp.GradScaler("cpu", enabled=True, init_scale=32.0).state_dict()
    restore_scaler(fp16, saved)
    assert fp16.get_scale() == 32.0


def test_shards_extracted_at_different_precisions_are_named_in_a_warning(tmp_path, caplog):
    write_fairseq(tmp_path, "train", [40, 50, 60, 70], nshard=2)
    write_fairseq(tmp_path, "valid", [40, 40])
    for rank, precision in [(0, "bfloat16"), (1, "float32")]:
        (tmp_path / f"train_{rank}_2.json").write_text(json.dumps({"precision": precision}))
    with caplog.at_level(logging.WARNING):
        open_stores(tmp_path, "train", "valid", seed=0)
    warning = [r.getMessage() for r in caplog.records if "precisions" in r.getMessage()]
    assert len(warning) == 1 and "bfloat16: train_0_2.npy" in warning[0] and "float32: train_1_2.npy" in warning[0]
    caplog.clear()
    (tmp_path / "train_1_2.json").write_text(json.dumps({"precision": "bfloat16"}))
    with caplog.at_level(logging.WARNING):
        open_stores(tmp_path, "train", "valid", seed=0)
    assert not [r for r in caplog.records if "precisions" in r.getMessage()]


@pytest.mark.slow
def test_deterministic_flag_sets_cublas_workspace_before_cuda_and_deterministic_kernels():
    code = ("import os, torch; from training.config import parse_args; from training.device import make_deterministic\n"
            "cfg = parse_args(['--data_dir', 'x', '--deterministic'])\n"
            "assert cfg.optim.deterministic\n"
            "make_deterministic()\n"
            "print(os.environ['CUBLAS_WORKSPACE_CONFIG'], torch.are_deterministic_algorithms_enabled())")
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [device_mod.CUBLAS_DETERMINISTIC_WORKSPACE, "True"]


def test_encoding_with_a_trained_codec_reads_nothing_back_from_the_device():
    """tools.encode and tools.tokenize queue a pass's encode behind the work before it: the codec loaded from a
    checkpoint reads its levels' init flags once, in its first encode, and no more (the library read each level's
    flag on the host in every call). What the counter still sees are F.one_hot's bound checks, which PyTorch makes
    on a CPU only (on CUDA the scatter checks on the device)."""
    torch.manual_seed(0)
    trained = RVQCodec(CodecConfig(feature_dim=16, latent_dim=16, num_quantizers=3, codebook_size=32))
    trained(torch.randn(2, 64, 16))  # the k-means init
    model = RVQCodec(trained.config)
    model.load_state_dict(trained.state_dict())
    model.eval()
    x, lengths = torch.randn(2, 40, 16), torch.tensor([40, 23])
    calls = []
    for beam in (1, 4, 1, 4):
        with count_host_syncs() as syncs:
            model.encode(x, lengths=lengths, beam_size=beam)
        calls.append({where.split(" ")[-1]: n for where, n in syncs.by_caller.items()})
    assert calls[0].pop("_settle_init") == 1  # the one read, in the first encode
    assert all(set(call) == {"gumbel_sample"} for call in calls), calls  # F.one_hot's, counted, not hidden


def test_the_trainers_step_decision_syncs_the_host_once_per_step():
    torch.manual_seed(0)
    model = RVQCodec(CodecConfig(feature_dim=16, latent_dim=16, num_quantizers=2, codebook_size=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x = torch.randn(2, 64, 16)
    for _ in range(3):  # past the k-means init (first step) and the one read that finds it done (second)
        model_syncs, step_syncs, _ = one_step_syncs(model, x, optimizer, scaler)
    assert step_syncs.total == 1 and all("step_guard" in where for where in step_syncs.by_caller)
    assert model_syncs.total > 0  # the library's own reads are counted, not hidden
    # the forward, dropped-crop check included, adds none of its own: every one is the library's
    assert all(where.startswith("vector_quantize_pytorch/") for where in model_syncs.by_caller), model_syncs.by_caller
    with count_host_syncs() as none:
        torch.randn(3) + 1
    assert none.total == 0
    # every op dispatched, by owner: the host work of a step
    model_ops, step_ops, _ = one_step_syncs(model, x, optimizer, scaler, count_ops=True)
    assert model_ops.total == model_syncs.total and step_ops.total == 1  # counting ops changes no sync count
    assert set(model_ops.ops_by_owner) == {"vector-quantize-pytorch (forward)", "this repo (forward, step decision)",
                                           "autograd (backward)"}, model_ops.ops_by_owner
    assert set(step_ops.ops_by_owner) == {"torch.optim and clip_grad_norm_", "this repo (forward, step decision)"}, \
        step_ops.ops_by_owner
    assert model_ops.ops_by_owner["vector-quantize-pytorch (forward)"] > model_ops.ops_by_owner[
        "this repo (forward, step decision)"]
