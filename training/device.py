"""Which device a process computes on and in which precision: decided here once.

The trainer, the feature extractor and the encoder all ask these functions, so
that "bf16 where the GPU has it" and "this rank's own GPU" mean one thing.
"""
from __future__ import annotations

import inspect
import os

import torch

from data.transfers import dtype_name
from errors import COMMAND_LINE, Asker, BadInputError

# --precision's names: the compute dtype each stands for (fp32: none, autocast off); notes record it by its dtype's
# name (precision_names)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_names(*flags: str) -> dict[str, str]:
    """--precision name -> the name a note records (data/transfers.py dtype_name: fp32 -> float32, bf16 ->
    bfloat16), for `flags` (default: every name)."""
    return {flag: dtype_name(PRECISIONS[flag]) for flag in (flags or PRECISIONS)}


def select_device(flag: str, local_rank: int = 0, *, bind_local_rank: bool = False,
                  asker: Asker = COMMAND_LINE) -> torch.device:
    """The device named by `flag` (auto, cpu, cuda, cuda:N), bound with torch.cuda.set_device; BadInputError, in
    the `asker`'s words, for one that is not there.

    bind_local_rank: one of several processes on a node (ranks of a launcher): a CUDA device is
    this process's own GPU, `cuda:<local_rank % visible GPUs>`, whatever index the flag gave, so
    that no two ranks share cuda:0 by accident. With every GPU visible to every rank (torchrun)
    that is cuda:<local_rank>; with one GPU per task (srun --gpus-per-task=1, where SLURM_LOCALID
    may be 3 and CUDA_VISIBLE_DEVICES holds one GPU) it is the GPU the task sees.
    Called before any CUDA work and before a process group exists.
    """
    given = asker.option("device", flag)
    kinds = "'auto', 'cpu', 'cuda' or 'cuda:N'" if asker.python else "auto, cpu, cuda or cuda:N"
    if flag == "auto":
        flag = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(flag)
    except (RuntimeError, TypeError):
        raise BadInputError(f"{given}: not a device; use {kinds}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise BadInputError(f"{given}: not supported; use {kinds}")
    if not torch.cuda.is_available():
        raise BadInputError(f"{given} was asked for, but no GPU is visible (torch {torch.__version__}); use "
                            + (f"{asker.option('device', 'cpu')} or {asker.option('device', 'auto')}" if asker.python
                               else "--device cpu or auto"))
    count = torch.cuda.device_count()
    index = local_rank % count if bind_local_rank else (device.index or 0)
    if index >= count:
        raise BadInputError(f"{given}: only {count} GPU(s) visible")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def shard_device(flag: str, rank: int) -> torch.device:
    """The device of one of several single-GPU processes on a node (tools.extract's shards):
    `cuda:<rank % visible GPUs>` for auto or cuda, so that N processes spread over the GPUs
    instead of all landing on GPU 0; an explicit cuda:N or cpu is kept."""
    return select_device(flag, rank, bind_local_rank=flag in ("auto", "cuda"))


def bf16_supported(device: torch.device) -> bool:
    """bf16 in hardware (Ampere and later); torch's default also answers yes where it is only emulated,
    which runs slower than fp32. `including_emulation` exists from torch 2.3; older ones check hardware."""
    if device.type != "cuda":
        return False
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.is_bf16_supported()


# cuBLAS needs a fixed workspace for deterministic GEMMs; the value the PyTorch docs give for it
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def make_deterministic() -> None:
    """Deterministic kernels only (--deterministic), set before any CUDA work: cuBLAS reads its
    workspace config when it starts. An op with no deterministic kernel then raises, naming it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def cache_dtype(device: torch.device, stored_float16: bool = False, precision: str = "auto") -> torch.dtype:
    """The type of features kept on `device` by the feature cache: float16 for a float16 dump, kept as stored
    (no rounding, half the memory); fp32 under `--precision fp32` (the features as stored, as the host path gives
    them); else bf16 where the GPU has it, else fp16; fp32 on a CPU, where the cache is RAM and converting half
    precision would cost 4x the gather itself."""
    if stored_float16:
        return torch.float16
    if device.type == "cpu" or precision == "fp32":
        return torch.float32
    return torch.bfloat16 if bf16_supported(device) else torch.float16


def compute_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for --precision (auto: bf16 where the GPU has it, else fp32 = None)."""
    if precision == "auto":
        precision = "bf16" if bf16_supported(device) else "fp32"
    return PRECISIONS[precision]
