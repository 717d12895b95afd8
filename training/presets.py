"""Launch presets and the trainer's NCCL debugging defaults: defined here once.

Read by the launcher (tools/launch.py, behind run_nccl_optimized.sh), by the
trainer (training/distributed.py) and by the tests.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    about: str
    flags: tuple = ()
    workarounds: dict = field(default_factory=dict)  # troubleshooting-guide workarounds, announced when set


PRESETS = {
    "basic": Preset(
        "sensible defaults: real process-group timeouts, async error handling and the NCCL flight recorder "
        "(set by the trainer), batches assembled on the main thread",
    ),
    "gpu_cache": Preset(
        "basic plus the device feature cache: this rank's features packed in one tensor on the device",
        flags=("--use_gpu_cache",),
    ),
    "prefetch": Preset(
        "basic plus the prefetcher: worker threads and pinned memory assemble the next batches ahead",
        flags=("--prefetch", "--pin_memory", "true", "--num_workers", "2", "--persistent_workers", "true"),
    ),
    "conservative": Preset(
        "the least resource use, for first tries: no workers, no pinned memory, a smaller batch, longer "
        "timeouts, and NCCL's troubleshooting workarounds (no InfiniBand, no peer-to-peer)",
        flags=("--batch_size", "16", "--num_workers", "0", "--pin_memory", "false", "--persistent_workers",
               "false", "--nccl_timeout", "3600", "--sync_timeout", "600"),
        workarounds={"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1"},
    ),
}

# The NCCL flight recorder, documented in PyTorch's "ProcessGroupNCCL Environment Variables"; async error
# handling keeps PyTorch's own default (3: abort the process, since ncclCommAbort can hang). Every preset gets them: the trainer sets them when it creates an NCCL process
# group (values the user set win). The launcher shows them but does not export them, because the dump
# path depends on the output dir, which a later --output_dir flag can change.
FLIGHT_RECORDER_DIR = "nccl_traces"  # dumps land in OUTPUT_DIR/nccl_traces/rank_<rank>
TRAINER_NCCL_ENV = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None,  # OUTPUT_DIR/nccl_traces/rank_
}
# Newer PyTorch reads the flight recorder's settings under these names; each follows its older twin.
TRAINER_NCCL_ENV_NEWER_NAMES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}


def trainer_nccl_env(output_dir, environ=None) -> dict[str, str]:
    """The values ProcessGroupNCCL will read: the user's where set, else the trainer's defaults."""
    environ = os.environ if environ is None else environ
    dump_prefix = str(Path(output_dir) / FLIGHT_RECORDER_DIR / "rank_")
    values = {name: environ.get(name, default if default is not None else dump_prefix)
              for name, default in TRAINER_NCCL_ENV.items()}
    for newer, older in TRAINER_NCCL_ENV_NEWER_NAMES.items():
        values[newer] = environ.get(newer, values[older])
    return values

