"""Copies between the host and the device that do not make the host wait.

On a GPU a plain host-to-device copy from pageable memory waits for every kernel already queued, and a copy
back waits for the result: each such copy between two passes stalls the pipeline. Here a host tensor goes to
the device from pinned memory without blocking (PyTorch's caching host allocator keeps the pinned block until
the copy that reads it is done, so it is safe to return at once), and a result comes back into pinned memory
with an event to wait on where the host needs it. On a CPU both are plain (no copy where none is needed)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def torch_dtype(dtype: np.dtype | str) -> torch.dtype:
    """The torch dtype of a numpy dtype (float16 -> torch.float16, int16 -> torch.int16, ...)."""
    return torch.from_numpy(np.zeros(0, dtype)).dtype


def dtype_name(dtype: torch.dtype | None) -> str:
    """How settings, notes and logs name a torch dtype: float32, bfloat16, float16 (None, no autocast: float32)."""
    return str(dtype or torch.float32).replace("torch.", "")


def to_device(data: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """`data` (a tensor, or a host array) on `device`; from the host to a GPU through pinned memory, not blocking."""
    tensor = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(data))
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def host_copy(tensor: torch.Tensor) -> Callable[[], np.ndarray]:
    """`tensor` on its way to the host: from a GPU into pinned memory without waiting (the function returned
    waits, on whichever thread calls it, and gives the array), so the host waits where it needs the values, not
    at each pass; elsewhere the array at once (no copy)."""
    if tensor.device.type != "cuda":
        array = tensor.numpy()
        return lambda: array
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> np.ndarray:
        copied.synchronize()
        return host.numpy()

    return wait
