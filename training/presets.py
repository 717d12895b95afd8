"""Launch presets and the trainer's NCCL debugging defaults: defined here once.

Read by run_nccl_optimized.sh, by the trainer (training/distributed.py) and by
the tests.

`python -m training.presets NAME [--output_dir DIR]` prints the preset as
tab-separated lines for the launcher to read: `about`, `flag`, `env` and
`workaround` rows, then `trainer_env` rows (what ProcessGroupNCCL will read
with DIR as the output dir, and whether the value is yours or the trainer's
default); `python -m training.presets
--list` prints the names with what they are for.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


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

# PyTorch's async error handling and NCCL flight recorder, documented in PyTorch's "ProcessGroupNCCL
# Environment Variables". Every preset gets them: the trainer sets them when it creates an NCCL process
# group (values the user set win). The launcher shows them but does not export them, because the dump
# path depends on the output dir, which a later --output_dir flag can change.
FLIGHT_RECORDER_DIR = "nccl_traces"  # dumps land in OUTPUT_DIR/nccl_traces/rank_<rank>
TRAINER_NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
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


def main(argv) -> int:
    if argv == ["--list"]:
        for name, preset in PRESETS.items():
            print(f"{name}\t{preset.about}")
        return 0
    output_dir = None
    if len(argv) == 3 and argv[1] == "--output_dir":
        argv, output_dir = argv[:1], argv[2]
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
    if output_dir is not None:
        for name, value in trainer_nccl_env(output_dir).items():
            print(f"trainer_env\t{name}\t{value}\t{'yours' if name in os.environ else 'default'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
