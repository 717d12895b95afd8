"""The rules of a launch environment, in one place: the launcher enforces them, the doctor reports them.

The launcher (tools/launch.py, behind run_nccl_optimized.sh) reads the variables in
LAUNCH_VARIABLES; `plan_launch` turns them into how many ranks this node runs, how
many nodes the job has, and how the ranks meet (`decide_rendezvous`: one process, a
static master, or a c10d rendezvous). A variable no launch can work with is a
LaunchEnvError naming every problem found: the launcher says them and exits 2, the
doctor (tools/doctor.py) lists them and checks the addresses further. `env_warnings`
names the NCCL_*/TORCH_* variables NCCL does not read, that PyTorch renamed, or that
are workarounds left on; both print them.
"""
from __future__ import annotations

import ipaddress
import re
import socket
import threading
from dataclasses import dataclass

DEFAULT_MASTER_ADDR = "127.0.0.1"  # one node: the master is this host
DEFAULT_MULTI_NODE_PORT = 29500  # torchrun's; the launcher uses it when several nodes must agree on one
DEFAULT_RDZV_PORT = 29400  # torchrun's default port for --rdzv_endpoint without one
LOOPBACK_DRILL = "ALLOW_LOOPBACK_MASTER"  # =1: every node on this host; see loopback_drill()
RESOLVE_TIMEOUT_S = 10


@dataclass(frozen=True)
class Variable:
    what: str
    default: str


# The environment the launcher reads: `bash run_nccl_optimized.sh --help` and docs/flags.md show this table.
LAUNCH_VARIABLES = {
    "DATA_DIR": Variable("the feature store, passed to the trainer as --data_dir", "the built-in demo corpus"),
    "OUTPUT_DIR": Variable("the run's folder, passed as --output_dir (a --output_dir flag after the preset wins)",
                           "runs/PRESET"),
    "NPROC_PER_NODE": Variable("ranks on this node, each with a GPU of its own (without a GPU: gloo ranks on the "
                               "CPU)", "every visible GPU; none visible: one process"),
    "NNODES": Variable("nodes in the job: N, or MIN:MAX (elastic, with RDZV_ENDPOINT)", "1"),
    "NODE_RANK": Variable("this node's rank under a static master: 0 on the master node; a c10d rendezvous "
                          "assigns node ranks itself", "0 on one node; required on several"),
    "MASTER_ADDR": Variable("node 0's address, which every node can reach (the static master, or with "
                            "MAX_RESTARTS the c10d rendezvous)", f"{DEFAULT_MASTER_ADDR} on one node; required on "
                                                                 "several"),
    "MASTER_PORT": Variable("the master's port", f"a free port on one node, {DEFAULT_MULTI_NODE_PORT} on several"),
    "RDZV_ENDPOINT": Variable(f"HOST[:PORT] of a c10d rendezvous instead of a static master (port "
                              f"{DEFAULT_RDZV_PORT} when none is given)", "unset: a static master"),
    "RDZV_ID": Variable("the c10d rendezvous id, the same on every node", "$SLURM_JOB_ID, else rvq-<output dir>"),
    "MAX_RESTARTS": Variable("times torchrun restarts this node's ranks after a failure, each restart resuming from "
                             "the last checkpoint (a c10d rendezvous, so that each starts afresh)", "0"),
    LOOPBACK_DRILL: Variable("1: every node of the job runs on this host (a drill), so a loopback master is "
                             "accepted", "0"),
    "OMP_NUM_THREADS": Variable("threads per rank", "this node's cores / its ranks; unset for one rank on a CPU, "
                                                    "whose trainer picks from the cores it can get"),
    "DRY_RUN": Variable("1: print the environment and the command, start nothing", "0"),
    "PYTHON": Variable("the Python that runs the trainer (and torchrun)", "the one running the launcher"),
    "NCCL_*, TORCH_*, GLOO_*": Variable("yours are kept and win over the preset's and the trainer's; NCCL_TIMEOUT "
                                        "is the trainer's process-group timeout, in place of a preset's "
                                        "--nccl_timeout", "unset"),
}

# Renamed by PyTorch 2.2 (pytorch/pytorch#114077): the old names still work, with a deprecation warning.
# None of them was ever read by NCCL itself.
RENAMED = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "ENABLE_NCCL_HEALTH_CHECK": "TORCH_ENABLE_NCCL_HEALTH_CHECK",
    "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
}
NOT_READ = {
    "NCCL_TIMEOUT": "NCCL does not read NCCL_TIMEOUT; the trainer uses it as the process-group timeout "
                    "(the default of --nccl_timeout, in seconds), and --nccl_timeout on the command line wins",
    "NCCL_RINGS": "NCCL_RINGS is not an NCCL setting any more: NCCL documented it up to 2.3, and since 2.4 "
                  "builds its rings and trees from the detected topology; remove it",
}
# Settings NCCL's troubleshooting guide offers as workarounds; they cost speed when left on.
WORKAROUNDS = ("NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_BUFFSIZE", "NCCL_NTHREADS")


def env_warnings(environ) -> list[str]:
    """Variables NCCL does not read, PyTorch's renamed ones, and workarounds left on."""
    out = []
    for name, why in NOT_READ.items():
        if name in environ:
            out.append(f"{name}={environ[name]}: {why}")
    for old, new in RENAMED.items():
        if old not in environ:
            continue
        text = (f"{old}={environ[old]}: PyTorch renamed it to {new} (PyTorch 2.2; the old name still works, with "
                f"a deprecation warning, and NCCL itself never read it): set {new} instead")
        if new in environ and environ[new] != environ[old]:
            text += f"; both are set, to different values ({new}={environ[new]}): remove {old}"
        out.append(text)
    for name in WORKAROUNDS:
        if environ.get(name, "0") != "0" and not (name.endswith("_DISABLE") and environ[name] == ""):
            out.append(f"{name}={environ[name]} is a workaround from NCCL's troubleshooting guide, not a tuning: it "
                       "costs bandwidth; unset it once the problem it worked around is solved")
    return out


# ---- each variable's rule


class LaunchEnvError(ValueError):
    """An environment no launch can work with; each problem names the variable and what to do."""

    def __init__(self, *problems: str):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class Problems:
    """The problems found so far, so that every one is told at once: `ruled` applies a rule, and on a
    LaunchEnvError keeps its problems and returns `default`."""

    def __init__(self):
        self.found: list[str] = []

    def ruled(self, rule, *args, default=None):
        try:
            return rule(*args)
        except LaunchEnvError as e:
            self.found += e.problems
            return default

    def raise_any(self) -> None:
        if self.found:
            raise LaunchEnvError(*self.found)


def whole_number(name: str, text: str, minimum: int) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) < minimum:
        raise LaunchEnvError(f"{name}={text}: expected a whole number >= {minimum}")
    return int(text)


def ranks_per_node(environ, gpus: int) -> int:
    """NPROC_PER_NODE, each rank with a GPU of its own; unset: every visible GPU, or one process without."""
    text = environ.get("NPROC_PER_NODE")
    if not text:
        return max(gpus, 1)
    nproc = whole_number("NPROC_PER_NODE", text, 1)
    if 0 < gpus < nproc:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        raise LaunchEnvError(f"NPROC_PER_NODE={text} but only {gpus} GPU(s) are visible"
                             + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                             + ": each rank needs its own GPU; lower NPROC_PER_NODE, or unset it to use every "
                             "visible GPU")
    return nproc


def cpu_ranks(nproc: int) -> str:
    return f"no GPU visible: {nproc} ranks on the CPU, with gloo"


def max_restarts(environ) -> int:
    """MAX_RESTARTS: how many times torchrun restarts the ranks of a node; none by default."""
    return whole_number("MAX_RESTARTS", environ.get("MAX_RESTARTS") or "0", 0)


def node_count(environ) -> tuple[str, int]:
    """NNODES as torchrun takes it (N; or MIN:MAX, elastic, with RDZV_ENDPOINT) and the most nodes it allows."""
    text = environ.get("NNODES") or "1"
    if not environ.get("RDZV_ENDPOINT"):
        return text, whole_number("NNODES", text, 1)
    match = re.fullmatch(r"([1-9][0-9]*)(?::([1-9][0-9]*))?", text)
    if not match:
        raise LaunchEnvError(f"NNODES={text}: expected N or MIN:MAX (elastic, with RDZV_ENDPOINT)")
    low, high = int(match[1]), int(match[2] or match[1])
    if low > high:
        raise LaunchEnvError(f"NNODES={text}: MIN is larger than MAX")
    return text, high


def master_addr(environ, nnodes: str, max_nodes: int) -> str:
    """MASTER_ADDR of a static master; unset: this host, which only one node can use."""
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if max_nodes > 1:
        raise LaunchEnvError(f"NNODES={nnodes} needs MASTER_ADDR: node 0's address, reachable from every node "
                             "(or set RDZV_ENDPOINT for a c10d rendezvous)")
    return DEFAULT_MASTER_ADDR


def master_port(environ, max_nodes: int) -> int | None:
    """MASTER_PORT; unset: torchrun's default on several nodes, which must all name one port; None on one node,
    where the launcher picks a free port."""
    text = environ.get("MASTER_PORT")
    if not text:
        return DEFAULT_MULTI_NODE_PORT if max_nodes > 1 else None
    port = whole_number("MASTER_PORT", text, 1)
    if port > 65535:
        raise LaunchEnvError(f"MASTER_PORT={text}: a port is at most 65535")
    return port


def node_rank(environ, nnodes: str, max_nodes: int) -> int:
    """NODE_RANK under a static master: required on several nodes, below NNODES; 0 by default on one."""
    text = environ.get("NODE_RANK")
    if not text and max_nodes > 1:
        raise LaunchEnvError(f"NNODES={nnodes} needs NODE_RANK: 0 on the master node, 1..{max_nodes - 1} on the "
                             "others")
    rank = whole_number("NODE_RANK", text or "0", 0)
    if rank >= max_nodes:
        raise LaunchEnvError(f"NODE_RANK={text} but NNODES={nnodes}: node ranks run from 0 to {max_nodes - 1}")
    return rank


def rdzv_endpoint(environ) -> tuple[str, int]:
    """RDZV_ENDPOINT as (host, port): HOST:PORT, [IPv6]:PORT, or HOST alone for torchrun's default port."""
    text = environ["RDZV_ENDPOINT"]
    host, _, port_text = text.rpartition(":") if ":" in text else (text, "", str(DEFAULT_RDZV_PORT))
    if not host or not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise LaunchEnvError(f"RDZV_ENDPOINT={text}: expected HOST:PORT")
    return host.strip("[]"), int(port_text)


def loopback_drill(environ) -> bool:
    """ALLOW_LOOPBACK_MASTER=1: every node of the job runs on this host (a drill), so a loopback master works."""
    return environ.get(LOOPBACK_DRILL, "") not in ("", "0")


def reachable_master(environ, name: str, host: str, address: str, *, multi_node: bool) -> None:
    """Several nodes meet at an address each of them can reach: a loopback address reaches only the node
    itself, unless every node runs on this host."""
    if multi_node and is_loopback(address) and not loopback_drill(environ):
        raise LaunchEnvError(f"{name}={host} is a loopback address ({address}): the other nodes cannot reach it; "
                             "use this node's address on the network the nodes share (or, when every node runs on "
                             f"this host, as in a drill, set {LOOPBACK_DRILL}=1)")


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT_S) -> tuple[list[str], str | None]:
    """(addresses, error): getaddrinfo in a thread, so that a dead resolver cannot hang the caller."""
    result: dict = {}

    def lookup():
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            result["addrs"] = list(dict.fromkeys(info[4][0] for info in infos))
        except OSError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return [], f"no answer from the resolver within {timeout:.0f} s"
    return result.get("addrs", []), result.get("error")


# ---- the launch they decide


@dataclass(frozen=True)
class Nodes:
    nnodes: str  # as torchrun takes it: N, or MIN:MAX (elastic)
    max_nodes: int
    max_restarts: int
    rdzv_endpoint: str  # empty: a static master


@dataclass(frozen=True)
class Rendezvous:
    """How the ranks meet under torchrun."""
    backend: str  # "static": a master at host:port, each node told its rank; "c10d": the rendezvous assigns them
    variable: str  # the variable that names the host: MASTER_ADDR or RDZV_ENDPOINT
    host: str
    port: int | None  # None: one node, and the launcher picks a free port
    node_rank: int | None = None  # static only
    endpoint: str | None = None  # c10d at RDZV_ENDPOINT: the value as given, which torchrun takes


@dataclass(frozen=True)
class LaunchPlan:
    nproc: int  # ranks on this node
    nodes: Nodes
    rendezvous: Rendezvous | None  # None: one process without torchrun (or, with problems, undecided)

    @property
    def torchrun(self) -> bool:
        """Several ranks, several nodes, restarts or a rendezvous endpoint need torchrun; else one process."""
        return (self.nproc > 1 or self.nodes.max_nodes > 1 or bool(self.nodes.max_restarts)
                or bool(self.nodes.rdzv_endpoint))


def decide_rendezvous(environ, nodes: Nodes) -> Rendezvous:
    """A c10d rendezvous at RDZV_ENDPOINT; with restarts, a c10d rendezvous at the master's address (a static
    master keeps one store for every attempt, and a restarted group would read the previous attempt's addresses
    from it); else a static master, MASTER_ADDR:MASTER_PORT, and this node's NODE_RANK."""
    if nodes.rdzv_endpoint:
        host, port = rdzv_endpoint(environ)
        return Rendezvous("c10d", "RDZV_ENDPOINT", host, port, endpoint=nodes.rdzv_endpoint)
    problems = Problems()
    host = problems.ruled(master_addr, environ, nodes.nnodes, nodes.max_nodes)
    port = problems.ruled(master_port, environ, nodes.max_nodes)
    rank = None if nodes.max_restarts else problems.ruled(node_rank, environ, nodes.nnodes, nodes.max_nodes)
    problems.raise_any()
    if nodes.max_restarts:
        return Rendezvous("c10d", "MASTER_ADDR", host, port)
    return Rendezvous("static", "MASTER_ADDR", host, port, node_rank=rank)


def restart_rendezvous(restarts: int, endpoint: str) -> str:
    return (f"MAX_RESTARTS={restarts}: c10d rendezvous at {endpoint} (MASTER_ADDR:MASTER_PORT), so that each "
            "restart starts afresh")


def plan_launch(environ, gpus: int, problems: Problems | None = None) -> LaunchPlan:
    """This node's ranks, the job's nodes and restarts, and how the ranks meet, from the environment.

    Every problem found is raised as one LaunchEnvError; given `problems`, they are kept there instead, and the
    plan holds what could be decided (this rank count or one node where the variable is bad; no rendezvous)."""
    collect = problems if problems is not None else Problems()
    nproc = collect.ruled(ranks_per_node, environ, gpus, default=max(gpus, 1))
    restarts = collect.ruled(max_restarts, environ, default=0)
    nnodes, max_nodes = collect.ruled(node_count, environ, default=(environ.get("NNODES") or "1", 1))
    nodes = Nodes(nnodes, max_nodes, restarts, environ.get("RDZV_ENDPOINT") or "")
    plan = LaunchPlan(nproc, nodes, None)
    if plan.torchrun:
        plan = LaunchPlan(nproc, nodes, collect.ruled(decide_rendezvous, environ, nodes))
    if problems is None:
        collect.raise_any()
    return plan
