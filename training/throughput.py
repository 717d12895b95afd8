"""Step timing and MFU: how fast training runs, and how much of each step waits for data.

The loop calls `waiting_for_data()` around `batches.get`, `add_frames()` per
micro-batch, and `report()` at log time, which returns the figures of the
window since the last report:

- `frames_per_sec`: frames trained on all ranks per second of wall time.
- `data_wait_frac`: the share of this rank's wall time spent inside `batches.get`.
  This is host time: the prefetcher waiting for a worker, or the device cache
  enqueueing its gather. On CUDA the device cache enqueues the next step's gather
  before the step's host sync (`prepare`), while the device is busy, and that
  time is not counted: in a host-bound step it shows as fewer frames/s instead.
  On CUDA the gather and a prefetched host-to-device copy run on the device,
  asynchronously; their device time counts as step time, not as data wait, and
  a copy that the step has to wait for shows as a slower step.
- `mfu`: model FLOPs per second over the peak of one device, per rank. The peak
  on CUDA comes from a table of dense 16-bit/fp32 figures keyed by the exact
  device name, at the run's precision (a timed GEMM when the name is not in the table); on CPU it is a timed
  fp32 GEMM measured at start-up.

On CUDA the device is synchronised at `report()` only (once per log window),
never per step, so the wall time of a window is the honest time of its steps.
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch

from data.transfers import dtype_name

# Dense (no sparsity) peak FLOP/s, keyed by the exact torch.cuda.get_device_name(): (16-bit tensor, fp32).
# Sources: NVIDIA data sheets (H100 and H200 product pages' spec tables, the A100 data sheet, the
# L40S, L40, L4 and A10 data sheets; the Ada and Ampere GeForce whitepapers for the RTX cards, fp16
# with fp32 accumulate; V100 and T4 data sheets, fp16). Half the sheets' "with sparsity" figures.
# Exact names only: an H200 NVL, an L40 or an A10G is a different part from an H200, an L40S or
# an A10; a name not here gets a timed GEMM instead of a neighbour's figure.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": (989e12, 67e12),  # SXM
    "NVIDIA H100 PCIe": (756e12, 51e12),
    "NVIDIA H100 NVL": (835e12, 60e12),
    "NVIDIA H200": (989e12, 67e12),  # SXM
    "NVIDIA H200 NVL": (835e12, 60e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 19.5e12),
    "NVIDIA A100-SXM4-40GB": (312e12, 19.5e12),
    "NVIDIA A100-PCIE-40GB": (312e12, 19.5e12),
    "NVIDIA A100 80GB PCIe": (312e12, 19.5e12),
    "NVIDIA L40S": (362e12, 91.6e12),
    "NVIDIA L40": (181e12, 90.5e12),
    "NVIDIA L4": (121e12, 30.3e12),
    "NVIDIA A10": (125e12, 31.2e12),
    "NVIDIA GeForce RTX 4090": (165e12, 82.6e12),
    "NVIDIA GeForce RTX 3090": (71e12, 35.6e12),
    "Tesla V100-SXM2-16GB": (125e12, 15.7e12),  # fp16 only: no bf16
    "Tesla V100-SXM2-32GB": (125e12, 15.7e12),
    "Tesla T4": (65e12, 8.1e12),  # fp16 only: no bf16
}


def measured_gemm_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 1024,
                        seconds: float = 0.3) -> float:
    """FLOP/s of a square matmul on `device`, timed for about `seconds`."""
    # a private generator: the global RNG streams must not move, or a resumed run would diverge
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    a @ b  # warm-up: thread pools, kernels
    sync(device)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        runs += 1
        if device.type == "cuda" and runs % 10:
            continue
        sync(device)
    sync(device)
    return 2 * size**3 * runs / (time.perf_counter() - start)


def peak_flops(device: torch.device, amp_dtype: torch.dtype | None) -> tuple[float, str]:
    """(peak FLOP/s of one device at the precision the model computes in, where the figure comes from)."""
    precision = "fp32" if amp_dtype is None else dtype_name(amp_dtype)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if name in PEAK_FLOPS:
            half, single = PEAK_FLOPS[name]
            return (single if amp_dtype is None else half), f"{precision} dense peak from the data sheet of {name}"
        dtype = amp_dtype or torch.float32
        return measured_gemm_flops(device, dtype, size=4096), f"timed {precision} GEMM on {name} (not in the table)"
    return measured_gemm_flops(device), "timed fp32 GEMM on the CPU"


def training_flops_per_frame(model) -> float:
    """Model FLOPs of one training step per input frame (forward and backward), counted once.

    Counted: the encoder and decoder (convolutions, measured by torch's FlopCounterMode
    on a forward and backward pass of a copy, so the model itself is not touched), and for
    each RVQ level, analytically, the distances from every latent frame to every code
    (2 x codebook_dim x codebook_size) and the EMA update's one-hot einsum of the same size,
    plus the in/out projections when codebook_dim differs from the latent dim. Not counted:
    elementwise work (GELU, residual adds, losses, the optimizer), k-means init and dead-code
    expiry. The quantizer is never run here: its training forward has collectives. The count is the
    model's, whatever runs it: the compiled step on a CPU does the EMA einsum as a scatter-add
    (models/one_hot_products.py), so there `mfu` counts work it does not do and reads high.
    """
    from torch.utils.flop_counter import FlopCounterMode

    cfg = model.config
    frames = 64 * cfg.downsample
    device = next(model.parameters()).device
    encoder, decoder = copy.deepcopy(model.encoder), copy.deepcopy(model.decoder)
    x = torch.randn(2, cfg.feature_dim, frames, device=device, generator=torch.Generator(device).manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        latent = encoder(x)
        decoder(latent).square().mean().backward()
    convs = counter.get_total_flops() / (2 * frames)
    code_dim = cfg.codebook_dim or cfg.latent_dim
    per_code = 2 * 2 * code_dim * cfg.codebook_size  # distances + EMA one-hot einsum
    projections = 2 * 2 * cfg.latent_dim * code_dim * 3 if code_dim != cfg.latent_dim else 0  # fwd + bwd
    return convs + cfg.num_quantizers * (per_code + projections) / cfg.downsample


class StepTimer:
    """Wall-time accounting of the training loop between two log lines (see the module docstring)."""

    def __init__(self, device: torch.device, *, flops_per_frame: float, peak: float, world_size: int = 1):
        self.device, self.flops_per_frame, self.peak, self.world_size = device, flops_per_frame, peak, world_size
        self._start = time.perf_counter()
        self._wait = 0.0
        self._frames = 0

    @contextlib.contextmanager
    def waiting_for_data(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._wait += time.perf_counter() - start

    def add_frames(self, frames_all_ranks: int) -> None:
        self._frames += frames_all_ranks

    def report(self) -> dict:
        """The window's figures; starts the next window."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds = max(now - self._start, 1e-9)
        fps = self._frames / seconds
        figures = {
            "frames_per_sec": round(fps, 1),
            "data_wait_frac": round(min(1.0, self._wait / seconds), 4),
            "mfu": round(fps / self.world_size * self.flops_per_frame / self.peak, 6),
        }
        self._start, self._wait, self._frames = now, 0.0, 0
        return figures


def start_step_timer(model, device: torch.device, amp_dtype, world_size: int, log=None) -> StepTimer:
    """The loop's StepTimer: counts the model's FLOPs and finds the device's peak once, at start-up."""
    flops = training_flops_per_frame(model)
    peak, source = peak_flops(device, amp_dtype)
    if log is not None:
        rate = f"{peak / 1e12:.1f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:.0f} GFLOP/s"  # a CPU's: under 1 TFLOP/s
        log.info("MFU: %.1f MFLOPs per frame (forward + backward) against %s (%s)", flops / 1e6, rate, source)
    return StepTimer(device, flops_per_frame=flops, peak=peak, world_size=world_size)
