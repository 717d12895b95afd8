"""Process groups: who this rank is, which device it binds, and the collectives it uses.

Rank, world size and local rank come from the launcher's environment
(torchrun, torch.distributed.launch, accelerate launch, SLURM srun) or from
`--local_rank`; with none, one process. CUDA -> nccl, CPU -> gloo. A second
process group on gloo, the control plane, carries sync checks and barriers so
that they never wait behind queued NCCL kernels. Across nodes, gloo binds the
interface NCCL uses (GLOO_SOCKET_IFNAME).
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training.interfaces import gloo_interface, interface_addresses
from training.nccl_env import FLIGHT_RECORDER_DIR, trainer_nccl_env

log = logging.getLogger(__name__)


@dataclass
class Launch:
    rank: int
    world_size: int
    local_rank: int
    nodes: int = 1  # as the launcher tells (torchrun's GROUP_WORLD_SIZE, srun's SLURM_STEP_NUM_NODES); else 1


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None = None
    control: object | None = None  # the gloo control-plane group
    timeouts: tuple = ()  # (process group, control plane) timeouts in seconds, restored after a slow phase

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def detect_launch(local_rank_flag: int | None = None) -> Launch:
    """Who this process is, from the launcher's environment; one process when there is none."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        local = int(env.get("LOCAL_RANK", local_rank_flag if local_rank_flag is not None else 0))
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), local, int(env.get("GROUP_WORLD_SIZE", 1)))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        launch = Launch(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                        int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1))
        # init_process_group reads these; srun does not set them
        env.setdefault("RANK", str(launch.rank))
        env.setdefault("WORLD_SIZE", str(launch.world_size))
        env.setdefault("LOCAL_RANK", str(launch.local_rank))
        return launch
    return Launch(0, 1, local_rank_flag or 0)


def _set_default_env(name: str, value: str) -> None:
    if name in os.environ:
        log.info("keeping %s=%s from the environment", name, os.environ[name])
    else:
        os.environ[name] = value


def configure_nccl_env(output_dir: Path) -> None:
    """PyTorch's async error handling and NCCL flight recorder, dumping into the output dir.

    Read by PyTorch when the NCCL process group is created; values the user set win. The dump folder is made
    by `make_flight_recorder_dir` once the output dir is this run's.
    """
    # the values live in training/nccl_env.py, which the launcher reads too (DRY_RUN shows them)
    for name, value in trainer_nccl_env(output_dir).items():
        _set_default_env(name, value)


def make_flight_recorder_dir(ctx: DistContext, output_dir: Path) -> None:
    """The folder NCCL's flight recorder dumps into, on NCCL runs: made after the output dir's lock is agreed, so
    that a run refused at start leaves nothing in another run's folder."""
    if ctx.backend == "nccl":
        (Path(output_dir) / FLIGHT_RECORDER_DIR).mkdir(parents=True, exist_ok=True)


def bind_gloo_across_nodes(launch: Launch) -> None:
    """Across nodes, gloo binds the interface NCCL uses: NCCL_SOCKET_IFNAME's, else NCCL's own choice. Without
    GLOO_SOCKET_IFNAME gloo binds the address the host name resolves to, which Debian's /etc/hosts makes
    127.0.1.1: the other nodes' ranks would try to reach it on their own host. Read when a gloo group is
    created; a value the user set wins."""
    if launch.nodes <= 1:
        return
    if "GLOO_SOCKET_IFNAME" in os.environ:
        log.info("keeping GLOO_SOCKET_IFNAME=%s from the environment", os.environ["GLOO_SOCKET_IFNAME"])
        return
    interface, why = gloo_interface(os.environ, interface_addresses())
    if interface is None:
        log.warning("GLOO_SOCKET_IFNAME unset and no interface with an address to set it to (%s): gloo binds "
                    "the address this host's name resolves to; set GLOO_SOCKET_IFNAME if other nodes cannot reach "
                    "it", why)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    log.info("setting GLOO_SOCKET_IFNAME=%s (%s): gloo binds the interface NCCL uses", interface, why)


def init_distributed(launch: Launch, device: torch.device, *, timeout_s: int, control_timeout_s: int,
                     output_dir: Path) -> DistContext:
    ctx = DistContext(launch.rank, launch.world_size, launch.local_rank, device)
    if launch.world_size == 1:
        return ctx
    ctx.backend = "nccl" if device.type == "cuda" else "gloo"
    if ctx.backend == "nccl":
        configure_nccl_env(output_dir)
    bind_gloo_across_nodes(launch)
    dist.init_process_group(
        backend=ctx.backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    ctx.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s))
    ctx.timeouts = (timeout_s, control_timeout_s)
    log.info("process group up: %s, world size %d, timeout %ds; control plane on gloo (%ds)",
             ctx.backend, ctx.world_size, timeout_s, control_timeout_s)
    return ctx


def final_barrier(ctx: DistContext, timeout_s: int) -> None:
    """Every rank waits here before tearing down; monitored_barrier names a rank that never arrives."""
    if ctx.is_distributed:
        dist.monitored_barrier(group=ctx.control, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_destroyed_groups() -> None:
    """After destroy(), the groups (and their transport threads) live on while the run's objects still refer to
    them: the DDP wrapper, reference cycles only the garbage collector breaks. Collecting them here ends those
    threads while the interpreter is whole, rather than in its exit, where a gloo rank was seen to abort (SIGABRT,
    "terminate called without an active exception") as its peer exited. Groups left up on purpose (a lost peer,
    whose teardown can block) are left to the process exit, as before."""
    if not (dist.is_available() and dist.is_initialized()):
        gc.collect()


def all_reduce_sum(ctx: DistContext, tensor: torch.Tensor, chunk_elements: int = 1 << 22) -> torch.Tensor:
    """Sum a tensor over ranks in place, in chunks of at most `chunk_elements`.

    Bounding the chunk bounds the memory NCCL stages and the time any one
    collective runs; the result equals a plain all-reduce element for element.
    """
    if not ctx.is_distributed:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    for start in range(0, flat.numel(), chunk_elements):
        chunk = flat[start : start + chunk_elements]
        if chunk.is_contiguous():
            dist.all_reduce(chunk)
        else:  # pragma: no cover - views of contiguous tensors stay contiguous
            buffer = chunk.contiguous()
            dist.all_reduce(buffer)
            chunk.copy_(buffer)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def exchange(ctx: DistContext, values) -> torch.Tensor:
    """Every rank's numbers, [world_size, len(values)] float64, gathered over the control plane."""
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if not ctx.is_distributed:
        return mine[None]
    table = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(table, mine, group=ctx.control)
    return torch.stack(table)


def agree(ctx: DistContext, mine) -> list:
    """Every rank's `mine` (any picklable value), in rank order, on every rank: what each rank found, for all to
    decide the same from. Every rank calls it, whatever it found, or the others wait."""
    if not ctx.is_distributed:
        return [mine]
    table = [None] * ctx.world_size
    dist.all_gather_object(table, mine, group=ctx.control)
    return table


def rank0_decides(ctx: DistContext, decision):
    """Rank 0's `decision` (any picklable value; other ranks pass anything) on every rank. Every rank calls it."""
    if not ctx.is_distributed:
        return decision
    sent = [decision]
    dist.broadcast_object_list(sent, src=0, group=ctx.control)
    return sent[0]


def raise_together(ctx: DistContext, error: str | None, failure: type[Exception], rank: int = 0) -> None:
    """After agree or rank0_decides: every rank raises `failure` for the `error` rank `rank` found (the others
    naming that rank), or none does."""
    if error:
        raise failure(error if rank == ctx.rank or not ctx.is_distributed else f"rank {rank}: {error}")


def wrap_ddp(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """DDP without per-forward buffer broadcast: the quantizer syncs its codebooks itself.

    Buffers are still made equal once, at construction, from rank 0.
    """
    if not ctx.is_distributed:
        return model
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_forward_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    device_ids = [ctx.device] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **no_forward_sync)


@contextlib.contextmanager
def phase_timeout(ctx: DistContext, seconds: int):
    """Give both process groups a longer timeout for a slow phase (k-means init, eval, refit), then restore them:
    a peer may legitimately be that long before the next exchange, and the watchdog still names a stuck one."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if not ctx.is_distributed or setter is None:
        yield
        return
    setter(timedelta(seconds=seconds))
    setter(timedelta(seconds=seconds), ctx.control)
    try:
        yield
    finally:
        setter(timedelta(seconds=ctx.timeouts[0]))
        setter(timedelta(seconds=ctx.timeouts[1]), ctx.control)


FR_ANALYSER = "python -m torch.distributed.flight_recorder.fr_trace"


def dump_flight_recorder(ctx: DistContext, output_dir: Path) -> str:
    """On NCCL, write this rank's flight recorder (its last collectives) where PyTorch's own timeout dump goes,
    and say where the dumps are and how to read them; on gloo, nothing."""
    if ctx.backend != "nccl":
        return ""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)  # 2.13 / 2.11 names
    if dump is None:
        return ""
    prefix = trainer_nccl_env(output_dir)["TORCH_FR_DUMP_TEMP_FILE"]
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}{ctx.rank}").write_bytes(dump())
    folder = Path(prefix).parent
    return (f". Flight-recorder dumps: {folder}/{Path(prefix).name}<rank>; read them with "
            f"`{FR_ANALYSER} {folder} --prefix {Path(prefix).name}`")
