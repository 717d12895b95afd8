"""How many threads a CPU run computes with: the cores it can actually get, decided once at start-up.

A compiled CPU step is many small OpenMP kernels, each ending at a barrier: with one thread more than the
cores that are free, every kernel waits for the thread that has lost its core (benchmarks/README.md, "Threads
on a shared machine"). So a CPU run takes, in this order:

1. `--threads N`;
2. OMP_NUM_THREADS from the environment (the user's, or a launcher's share of the node);
3. a resumed run, the count the run it resumes computed with (its checkpoint's "threads"): a sum over other
   threads rounds otherwise, and the resumed run would not match an unbroken one;
4. else the cores it can get: those of its CPU affinity, capped by the cgroup's CPU quota (v2 cpu.max,
   v1 cpu.cfs_quota_us / cpu.cfs_period_us), shared with the other ranks on this node (`local_ranks`:
   LOCAL_WORLD_SIZE, else SLURM's tasks on this node for ranks srun started), less what other processes keep
   busy on them over a short /proc/stat sample, and never more than torch's own default. A core counts as free
   when others use less than FREE_SHARE of it.

Every function takes its inputs (file contents, the environment) so that tests can feed fake ones;
`choose_threads` reads the real machine and `set_torch_threads` sets torch's count.
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
PROC_STAT = Path("/proc/stat")
SAMPLE_S = 0.5  # the /proc/stat sample: long enough to see a neighbour that keeps a core busy
# free cores are counted to the nearest FREE_SHARE below: a core other processes use 30% of still counts
# as ours (noise, a data worker's bursts), one they use half of does not (a thread there stalls every barrier)
FREE_SHARE = 0.7


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str


def omp_threads(environ) -> int | None:
    """OMP_NUM_THREADS's count (its first level, as in "4,2"), None when unset or not a positive number."""
    text = (environ.get("OMP_NUM_THREADS") or "").split(",")[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def affinity_cpus(getaffinity=getattr(os, "sched_getaffinity", None)) -> set[int] | None:
    """The CPUs this process may run on; None where the OS does not say (macOS, Windows)."""
    return set(getaffinity(0)) if getaffinity is not None else None


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 cpu.max ("150000 100000", or "max 100000"): the quota in cores, None when unlimited."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return int(fields[0]) / int(fields[1])


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 cpu.cfs_quota_us and cpu.cfs_period_us: the quota in cores, None when unlimited (-1)."""
    quota, period = int(quota_text), int(period_text)
    return quota / period if quota > 0 and period > 0 else None


def quota_cores(root: Path = CGROUP) -> float | None:
    """The cgroup's CPU quota in cores (v2, else v1), None when there is none or no cgroup can be read."""
    try:
        return parse_cpu_max((root / "cpu.max").read_text())
    except (OSError, ValueError):
        pass
    for folder in ("cpu", "cpu,cpuacct", "."):
        try:
            return parse_cfs((root / folder / "cpu.cfs_quota_us").read_text(),
                             (root / folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
    return None


def cpu_times(stat_text: str, cpus: set[int] | None) -> tuple[int, int, int]:
    """(busy, total, CPUs counted) jiffies of `cpus` from /proc/stat's per-CPU lines (all of them for None).
    Busy is all but idle and iowait; steal counts as busy (the hypervisor gave the time to someone else)."""
    busy = total = counted = 0
    for line in stat_text.splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal (guest is in user)
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
        counted += 1
    return busy, total, counted


def busy_cores(before: str, after: str, cpus: set[int] | None) -> float | None:
    """Cores kept busy between two /proc/stat readings, on `cpus`; None when they say nothing."""
    b0, t0, n = cpu_times(before, cpus)
    b1, t1, _ = cpu_times(after, cpus)
    if not n or t1 <= t0:
        return None
    return n * (b1 - b0) / (t1 - t0)


def sample_busy(cpus: set[int] | None, seconds: float = SAMPLE_S, stat: Path = PROC_STAT) -> float | None:
    """Cores other processes keep busy now (this one sleeps while it looks); None without /proc/stat."""
    try:
        before = stat.read_text()
        time.sleep(seconds)
        return busy_cores(before, stat.read_text(), cpus)
    except OSError:
        return None


def slurm_task_counts(text: str) -> list[int]:
    """SLURM's tasks per node ("2(x3),1": 2 on each of three nodes, then 1) as one count per node; [] for a text
    of another form."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def local_ranks(environ) -> tuple[int, str]:
    """(ranks on this node, the variable that says so): LOCAL_WORLD_SIZE (torchrun, accelerate); else, for one of
    several tasks srun started (SLURM_PROCID, SLURM_NTASKS > 1: training/distributed.py detect_launch), this
    node's count in SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE (at SLURM_NODEID), or
    SLURM_NTASKS_PER_NODE, or the tasks spread over the step's nodes; else (1, "")."""
    if environ.get("LOCAL_WORLD_SIZE"):
        return max(1, int(environ["LOCAL_WORLD_SIZE"])), "LOCAL_WORLD_SIZE"
    if "SLURM_PROCID" not in environ or int(environ.get("SLURM_NTASKS") or 1) <= 1:
        return 1, ""
    node = int(environ.get("SLURM_NODEID") or 0)
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = slurm_task_counts(environ.get(name) or "")
        if node < len(counts):
            return max(1, counts[node]), name
    if (environ.get("SLURM_NTASKS_PER_NODE") or "").isdigit():
        return max(1, int(environ["SLURM_NTASKS_PER_NODE"])), "SLURM_NTASKS_PER_NODE"
    nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    return math.ceil(int(environ["SLURM_NTASKS"]) / max(1, nodes)), "SLURM_NTASKS over the nodes"


def decide(*, flag: int | None, environ, cpus: int, quota: float | None, busy: float | None,
           local_ranks: int = 1, default: int | None = None, recorded: int | None = None,
           ranks_from: str = "") -> ThreadChoice:
    """The thread count and its reason, from the inputs alone (see the module's docstring for the order).
    cpus: CPUs of the affinity; quota: the cgroup's cores or None; busy: cores other processes used in the
    sample (None: not measured); local_ranks: ranks on this node (ranks_from: the variable that says so);
    default: torch's own count, the ceiling; recorded: the count of the run this one resumes."""
    if flag is not None:
        return ThreadChoice(flag, f"--threads {flag}")
    env = omp_threads(environ)
    if env is not None:
        return ThreadChoice(env, f"OMP_NUM_THREADS={env} from the environment")
    if recorded is not None:
        return ThreadChoice(recorded, "the count the run it resumes computed with, from its checkpoint, so that "
                                      "it computes alike; --threads or OMP_NUM_THREADS to change it")
    reasons = [f"{cpus} CPU(s) in this process's affinity"]
    cores = float(cpus)
    if quota is not None and quota < cores:
        cores = quota
        reasons.append(f"a cgroup quota of {quota:g} cores")
    if local_ranks > 1:
        cores /= local_ranks
        reasons.append(f"shared by {local_ranks} ranks on this node" + (f" ({ranks_from})" if ranks_from else ""))
    own = max(1, math.ceil(cores - 1e-9))
    if busy is not None:
        free = cpus - busy  # other processes' load falls on the affinity's CPUs; a quota throttles all threads alike
        threads = max(1, min(own, math.floor(free + 1 - FREE_SHARE + 1e-9)))
        reasons.append(f"other processes kept {busy:.1f} of them busy (about {max(free, 0):.1f} free)")
    else:
        threads = own
        reasons.append("their load unknown")
    if default is not None and threads > default:
        threads = default
        reasons.append(f"torch's default of {default}")
    return ThreadChoice(threads, "; ".join(reasons))


def choose_threads(flag: int | None, environ=os.environ, *, default: int | None = None, recorded: int | None = None,
                   cgroup: Path = CGROUP, stat: Path = PROC_STAT) -> ThreadChoice:
    """The choice for this process on this machine now (`recorded`: the count of the run it resumes). The load is
    sampled only when the choice is the machine's and this is the node's only rank (its peers start up beside
    it)."""
    ranks, ranks_from = local_ranks(environ)
    if flag is not None or omp_threads(environ) is not None or recorded is not None:
        return decide(flag=flag, environ=environ, cpus=1, quota=None, busy=None, recorded=recorded)
    cpus = affinity_cpus()
    count = len(cpus) if cpus else (os.cpu_count() or 1)
    busy = sample_busy(cpus, stat=stat) if ranks == 1 else None
    return decide(flag=None, environ=environ, cpus=count, quota=quota_cores(cgroup), busy=busy,
                  local_ranks=ranks, default=default, ranks_from=ranks_from)


def set_torch_threads(choice: ThreadChoice) -> None:
    """torch's intra-op threads for the rest of the process (a compiled step's kernels take this count)."""
    import torch

    torch.set_num_threads(choice.threads)


def set_cpu_threads(device, log, flag: int | None = None, recorded: int | None = None) -> ThreadChoice | None:
    """On a CPU `device` (or with a `flag`), choose_threads and set it, said on `log`; on a GPU without a flag, torch's
    default is kept and None returned. The trainer and the commands that compute on a CPU (tools.encode, its decode,
    tools.evaluate) start with it."""
    import torch

    if device.type != "cpu" and flag is None:
        return None
    choice = choose_threads(flag, default=torch.get_num_threads(), recorded=recorded)
    set_torch_threads(choice)
    log.info("threads: %d (%s)", choice.threads, choice.why)
    return choice
