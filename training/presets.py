"""Launch presets: defined here once, read by run_nccl_optimized.sh and by the tests.

`python -m training.presets NAME` prints the preset as tab-separated lines
(`about`, `flag`, `env` and `workaround` rows) for the launcher to read;
`python -m training.presets --list` prints the names with what they are for.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    about: str
    flags: tuple = ()
    env: dict = field(default_factory=dict)  # documented settings
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


def main(argv) -> int:
    if argv == ["--list"]:
        for name, preset in PRESETS.items():
            print(f"{name}\t{preset.about}")
        return 0
    if len(argv) != 1 or argv[0] not in PRESETS:
        print(f"unknown preset {' '.join(argv)!r}; presets: {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    preset = PRESETS[argv[0]]
    print(f"about\t{preset.about}")
    for flag in preset.flags:
        print(f"flag\t{flag}")
    for name, value in preset.env.items():
        print(f"env\t{name}\t{value}")
    for name, value in preset.workarounds.items():
        print(f"workaround\t{name}\t{value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
