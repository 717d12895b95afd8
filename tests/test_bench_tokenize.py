"""benchmarks/bench_tokenize.py counts the FLOPs and replays the model alone on the passes of the windows whose
audio it counts."""
import pytest

from tests.helpers import REPO


@pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)
@pytest.mark.timeout(240)
def test_the_steady_state_counts_the_flops_and_the_passes_of_the_audio_it_counts(tmp_path):
    """5-s files make 250-frame chunks alone, so the FLOPs per audio second of the steady state are the model's
    at 5 s, exactly, whichever windows the clock spans: a pass counted from another window than its audio (the
    writer thread commits a window while the next one's passes run) would move them by a window's share."""
    from benchmarks.bench_tokenize import run_benchmark

    info = run_benchmark(device="cpu", model="small", mixes=("5s",), modes=("extract", "model"), audio_minutes=0.5,
                         base_minutes=0.5, commit_seconds=10, repeats=1, repos={"this tree": str(REPO)},
                         timeout=200, scratch_root=str(tmp_path), profile=1, say=lambda line: None)
    row = info["runs"]["this tree"]["5s"]["extract"]
    assert "error" not in row, row
    assert row["commits"] >= 3 and not row["stopped_early"]  # the last window's passes end the run: none after it
    assert row["gflop_per_audio_s"] == pytest.approx(info["gflop_per_audio_s"]["5 s chunks"], rel=0.01)
    # the model alone replayed the steady windows' passes: 10 s windows of 5-s files, 2 files a window, each file a
    # pass of its own on a CPU
    windows = row["commits"] - 1
    assert row["model"]["passes"] == 2 * windows
    # the tool's own account of the steady state: each stage a share of it; the model's thread's add up to at most
    # the whole and the window it computes ahead of the writer's last commit
    stages = row["stages"]
    thread = [name for name in stages if name not in ("waiting for the copy back", "writing")]
    ahead = row["commits"] / (row["commits"] - 1)
    assert stages["passes"] > 0.05 and 0 < sum(stages[name] for name in thread) <= 1.01 * ahead, stages
    # --profile: one of those passes again under the profiler; the op time adds up to no more than the wall clock
    # (one thread) and most of it is the matmuls'
    prof = row["model"]["profile"]
    assert prof["passes"] == 1 and prof["time"] == "CPU (ops)"
    assert sum(prof["kinds"].values()) == pytest.approx(1, abs=1e-3)
    assert 0.3 < prof["busy_share"] <= 1.05 and prof["kinds"]["matmul"] > 0.3
    assert prof["top"][0]["name"] == "aten::addmm"


@pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)
@pytest.mark.timeout(240)
def test_the_tool_itself_is_profiled_after_its_timed_steady_state(tmp_path):
    """--profile_tool: once --work_seconds of steady state are timed, the run goes on for the profiled windows,
    which the figures leave out; the profile counts the tool's ops (on a CPU, no wait for a device)."""
    from benchmarks.bench_tokenize import run_benchmark

    info = run_benchmark(device="cpu", model="small", mixes=("5s",), modes=("extract",), audio_minutes=1.0,
                         base_minutes=0.5, commit_seconds=10, repeats=1, repos={"this tree": str(REPO)},
                         work_seconds=0.01, profile_tool=1, timeout=200, scratch_root=str(tmp_path),
                         say=lambda line: None)
    row = info["runs"]["this tree"]["5s"]["extract"]
    assert "error" not in row, row
    assert row["stopped_early"] and row["commits"] == 2  # the timed steady state: one window, then profiling
    prof = row["tool_profile"]
    assert prof["time"] == "CPU (ops)" and prof["passes"] == 2 and prof["host_syncs"] == {}
    assert sum(prof["kinds"].values()) == pytest.approx(1, abs=1e-3) and prof["kinds"]["matmul"] > 0.1


@pytest.mark.slow  # a process that loads the model
@pytest.mark.timeout(120)
def test_the_stock_loop_counts_its_batches_audio_and_flops(tmp_path):
    """The user's alternative: transformers' own model over fixed 10-s batches; its FLOPs per audio second are the
    model's at 10 s, and its audio is its batches' (rows x 10 s a pass)."""
    from benchmarks.bench_tokenize import flops_per_audio_second, run_benchmark

    info = run_benchmark(device="cpu", model="small", mixes=("5s",), modes=("loop",), audio_minutes=0.1,
                         base_minutes=0.1, repeats=1, work_seconds=1.0, loop_rows=2, timeout=100,
                         scratch_root=str(tmp_path), say=lambda line: None)
    loop = info["stock_loop"]
    assert "error" not in loop, loop
    assert loop["rows"] == 2 and loop["passes"] >= 1 and loop["seconds"] >= 1.0
    # the figures are kept to 4 significant digits or 1 decimal
    assert loop["audio_s_per_s"] == pytest.approx(loop["passes"] * 2 * 10 / loop["seconds"], rel=5e-3)
    cfg = {**info["config"], "output_hidden_size": info["config"]["hidden_size"]}
    assert loop["gflop_per_s"] / loop["audio_s_per_s"] == pytest.approx(
        flops_per_audio_second(cfg, info["layer"], 10) / 1e9, rel=5e-3)
    assert info["runs"] == {}  # no tool ran


def test_kernels_are_sorted_into_kinds_by_name():
    from benchmarks.bench_tokenize import kernel_kind

    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert kernel_kind("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_kind("triton_tem_fused_flex_attention_0") == "attention"
    assert kernel_kind("void at::native::conv_depthwise2d_forward_kernel<c10::BFloat16>") == "convolution"
    assert kernel_kind("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>") == "normalization"
    assert kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_kind("void at::native::elementwise_kernel<128, 2>") == "other"


def test_a_gpu_profile_counts_the_kernels_and_not_the_host_ops_that_launch_them():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.bench_tokenize import profile_summary

    def event(key, device_type, device_us, cpu_us=0):
        return SimpleNamespace(key=key, count=2, device_type=device_type, self_device_time_total=device_us,
                               self_cpu_time_total=cpu_us)

    events = [event("aten::mm", DeviceType.CPU, 600, 50), event("nvjet_hsh_256x128", DeviceType.CUDA, 600),
              event("triton_tem_fused_flex_attention_0", DeviceType.CPU, 300, 20),
              event("triton_tem_fused_flex_attention_0", DeviceType.CUDA, 300),
              event("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 100)]
    prof = profile_summary(events, True, wall=0.002, passes=2)
    assert prof["busy_s"] == pytest.approx(0.001) and prof["busy_share"] == pytest.approx(0.5)
    assert prof["kinds"] == {"matmul": 0.6, "attention": 0.3, "copy": 0.1}
    assert [t["name"] for t in prof["top"]] == ["nvjet_hsh_256x128", "triton_tem_fused_flex_attention_0",
                                                "Memcpy DtoD (Device -> Device)"]
    on_cpu = profile_summary(events, False, wall=0.0001, passes=2)
    assert on_cpu["busy_s"] == pytest.approx(70e-6) and set(on_cpu["kinds"]) == {"matmul", "attention"}
