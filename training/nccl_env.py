"""The NCCL environment the trainer sets on its process groups: PyTorch's NCCL flight recorder.

Applied by training/distributed.py when it creates an NCCL process group (values the
user set win); shown by the launcher's DRY_RUN and --help. Kept apart from
distributed.py so that the launcher reads it without importing torch.
"""
from __future__ import annotations

import os
from pathlib import Path

# The NCCL flight recorder, documented in PyTorch's "ProcessGroupNCCL Environment Variables"; async error
# handling keeps PyTorch's own default (3: abort the process, since ncclCommAbort can hang). Every preset gets
# them: the trainer sets them when it creates an NCCL process group (values the user set win). The launcher
# shows them but does not export them, because the dump path depends on the output dir, which a later
# --output_dir flag can change.
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

