"""benchmarks/bench_optimizer.py times both optimizers beside the codec's forward and backward and counts what each
step issues: fused AdamW two kernels, Muon more, neither a host sync."""
import argparse

import pytest
import torch


@pytest.mark.timeout(120)
def test_each_optimizer_is_timed_and_counted_beside_the_forward_and_backward():
    from benchmarks.bench_optimizer import bench_codec
    from benchmarks.host_syncs import moves_data

    args = argparse.Namespace(crops=2, frames=32, steps=1, repeats=1)
    row = bench_codec("25 Hz x 8", {"downsample": 2}, args, torch.device("cpu"))
    assert row["forward_backward_ms"] > 0 and row["adamw_step_ms"] > 0 and row["muon_step_ms"] > 0
    assert row["adamw_ops_moving_data_per_step"] == 2  # the step counts' increment and one fused AdamW update
    # Muon: the Newton-Schulz products of three kernel shapes and the momentum, besides AdamW on the biases
    assert 10 < row["muon_ops_moving_data_per_step"] < row["muon_ops_per_step"]
    assert row["adamw_host_syncs_per_step"] == 0 and row["muon_host_syncs_per_step"] == 0
    assert not moves_data(torch.ops.aten.expand.default) and moves_data(torch.ops.aten.bmm.default)
