"""Launch presets: defined here once.

Read by the launcher (tools/launch.py, behind run_nccl_optimized.sh), whose --help lists
them, and by docs/flags.md (python -m tools.flags_doc).
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
