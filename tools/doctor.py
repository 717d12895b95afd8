"""Doctor: would a launch work on this host? Run it before a long job, and after a failed one.

    python -m tools.doctor                 # or: bash run_nccl_optimized.sh doctor
    python -m tools.doctor --env           # only the warnings about NCCL_*/TORCH_* variables

Prints torch, CUDA and NCCL versions; the GPUs and their topology; the network
interfaces, the one NCCL would pick and the address gloo would bind; variables
NCCL does not read or that PyTorch renamed; whether MASTER_ADDR:MASTER_PORT (or
RDZV_ENDPOINT) can be used. Reads the launcher's environment: NPROC_PER_NODE,
NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, RDZV_ENDPOINT, MAX_RESTARTS,
ALLOW_LOOPBACK_MASTER, CUDA_VISIBLE_DEVICES, NCCL_SOCKET_IFNAME,
GLOO_SOCKET_IFNAME, DATA_DIR, OUTPUT_DIR. Exit 0: nothing found that would stop
a launch (warnings may be printed); 1: a launch would fail, with the reasons.

It only looks: it binds a port for a moment to see whether it is free, and
tries one TCP connection to a remote master; it never scans. The rules a launch
environment must follow are defined here, and the launcher (tools/launch.py)
enforces the same ones.
"""
from __future__ import annotations

import ipaddress
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from training.interfaces import NCCL_DEFAULT_RULE, gloo_interface, interface_addresses, nccl_interfaces, usable

DEFAULT_MASTER_ADDR = "127.0.0.1"  # one node: the master is this host
DEFAULT_MULTI_NODE_PORT = 29500  # torchrun's; the launcher uses it when several nodes must agree on one
DEFAULT_RDZV_PORT = 29400  # torchrun's default port for --rdzv_endpoint without one
LOOPBACK_DRILL = "ALLOW_LOOPBACK_MASTER"  # =1: every node on this host; see loopback_drill()
RESOLVE_TIMEOUT_S = 10
CONNECT_TIMEOUT_S = 3

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

@dataclass
class Report:
    problems: list = field(default_factory=list)  # a launch would fail
    warnings: list = field(default_factory=list)

    def fail(self, text: str) -> None:
        self.problems.append(text)
        print(f"  FAIL: {text}")

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        print(f"  warning: {text}")


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


# ---- network interfaces


def operstate(name: str) -> str:
    try:
        with open(f"/sys/class/net/{name}/operstate") as f:
            return f.read().strip()
    except OSError:
        return "?"


# ---- addresses and ports


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT_S) -> tuple[list[str], str | None]:
    """(addresses, error): getaddrinfo in a thread, so that a dead resolver cannot hang the doctor."""
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


def _family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def is_local(address: str) -> bool:
    """An address of this host: binding to it works only here."""
    with socket.socket(_family(address), socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
            return True
        except OSError:
            return False


def port_in_use(address: str, port: int) -> str | None:
    """Why the port cannot be listened on at this local address, or None when it is free."""
    with socket.socket(_family(address), socket.SOCK_STREAM) as s:
        # as TCPStore does: a port left in TIME_WAIT by an earlier run is free to reuse
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
            s.listen(1)
            return None
        except OSError as e:
            return e.strerror or str(e)


def try_connect(address: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> str:
    """One TCP connection attempt: 'open', 'refused', 'timeout' or the error."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except (socket.timeout, TimeoutError):
        return "timeout"
    except OSError as e:
        return e.strerror or str(e)


def route_source(address: str) -> str | None:
    """The local address the kernel would send from to reach `address` (a UDP connect sends nothing)."""
    with socket.socket(_family(address), socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
            return s.getsockname()[0]
        except OSError:
            return None


# ---- a launch's environment: the rules the launcher enforces (exit 2) and the doctor reports


class LaunchEnvError(ValueError):
    """An environment no launch can work with; the message names the variable and what to do."""


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


def restart_rendezvous(restarts: int, endpoint: str) -> str:
    return (f"MAX_RESTARTS={restarts}: c10d rendezvous at {endpoint} (MASTER_ADDR:MASTER_PORT), so that each "
            "restart starts afresh")


# ---- the launch as the launcher would run it


def check_launch(environ, report: Report, *, cuda: bool, gpus: int) -> None:
    """What run_nccl_optimized.sh would do with this environment, by its own rules, and whether it can work here."""

    def ruled(rule, *args, default=None):
        try:
            return rule(*args)
        except LaunchEnvError as e:
            report.fail(str(e))
            return default

    gpus = gpus if cuda else 0
    nproc = ruled(ranks_per_node, environ, gpus, default=max(gpus, 1))
    restarts = ruled(max_restarts, environ, default=0)
    nnodes, max_nodes = ruled(node_count, environ, default=(None, 1))
    port = ruled(master_port, environ, max_nodes)

    if not environ.get("NPROC_PER_NODE"):
        print(f"  NPROC_PER_NODE unset: {nproc} rank(s) on this node (the visible GPUs; one process without)")
    if not gpus and nproc > 1:
        print(f"  {cpu_ranks(nproc)}")
    multi_node = max_nodes > 1
    # the host whose address the endpoint names hosts the store; on one node that is this one
    c10d_host_here = None if multi_node else True

    if environ.get("RDZV_ENDPOINT"):
        host, rdzv_port = ruled(rdzv_endpoint, environ, default=(None, None))
        if host is None:  # reported above
            return
        print(f"  c10d rendezvous at {host}:{rdzv_port} (RDZV_ENDPOINT), up to {max_nodes} node(s); "
              "node ranks are assigned by the rendezvous")
        check_endpoint(environ, "RDZV_ENDPOINT", host, rdzv_port, report, multi_node=multi_node,
                       hosts_here=c10d_host_here)
        return

    if not multi_node and nproc <= 1 and not restarts:
        print("  one process, no torchrun: MASTER_ADDR and MASTER_PORT are not used")
        if environ.get("MASTER_ADDR"):  # checked anyway, for the launch you are preparing; not fatal here
            check_endpoint(environ, "MASTER_ADDR", environ["MASTER_ADDR"], port, report, multi_node=False,
                           hosts_here=True, fatal=False)
        return
    host = ruled(master_addr, environ, nnodes, max_nodes)
    if host is None or (port is None and multi_node):  # reported above
        return
    if port is None:
        print(f"  master {host}, MASTER_PORT unset: the launcher picks a free port")
        check_endpoint(environ, "MASTER_ADDR", host, None, report, multi_node=False, hosts_here=True)
        return
    if restarts:
        print(f"  {restart_rendezvous(restarts, f'{host}:{port}')}")
        check_endpoint(environ, "MASTER_ADDR", host, port, report, multi_node=multi_node, hosts_here=c10d_host_here)
        return
    rank = ruled(node_rank, environ, nnodes, max_nodes)
    if rank is None:
        return
    print(f"  master {host}:{port}, node rank {rank} of {max_nodes}"
          + (" (this node hosts the rendezvous store)" if rank == 0 else ""))
    check_endpoint(environ, "MASTER_ADDR", host, port, report, multi_node=multi_node, hosts_here=rank == 0)


def check_endpoint(environ, name: str, host: str, port: int | None, report: Report, *, multi_node: bool,
                   hosts_here: bool | None, fatal: bool = True) -> None:
    """Resolve; when the address is this host's, see that the port is free; else try one connection."""
    fail = report.fail if fatal else report.warn
    addrs, error = resolve(host)
    if not addrs:
        fail(f"{name}={host} does not resolve ({error}): use the master's IP address, or a name every node "
             "resolves")
        return
    address = addrs[0]
    local = is_local(address)
    print(f"  {name}={host} resolves to {', '.join(addrs)}; {'an address of this host' if local else 'another host'}")
    try:
        reachable_master(environ, name, host, address, multi_node=multi_node)
    except LaunchEnvError as e:
        fail(str(e))
        return
    if multi_node and is_loopback(address):
        print(f"  {LOOPBACK_DRILL}=1: a loopback master, for a drill with every node on this host")
    if local:
        if port is None:
            return
        why = port_in_use(address, port)
        if why is None:
            print(f"  port {port} is free on {address}")
        elif hosts_here is False:
            report.warn(f"port {port} is taken on {address} ({why}): fine if the master runs on this host too")
        elif hosts_here is None:
            report.warn(f"port {port} is taken on {address} ({why}): fine if another node's agent on this host "
                        "already hosts the rendezvous; else pick another port")
        else:
            fail(f"port {port} is in use on {address} ({why}): an earlier run may still hold it; pick another "
                        "MASTER_PORT" + ("" if multi_node else ", or unset it for a free one"))
        return
    if hosts_here:
        report.warn(f"NODE_RANK 0 hosts the rendezvous store, but {name}={host} ({address}) is not an address of "
                    "this host: run node rank 0 on the master, or point MASTER_ADDR at this node")
    source = route_source(address)
    if source:
        print(f"  this host reaches {address} from {source}")
    if port is None:
        return
    state = try_connect(address, port)
    if state == "open":
        print(f"  {address}:{port} accepts connections (the master's torchrun, if it has started)")
    elif state == "refused":
        report.warn(f"nothing listens at {address}:{port} yet: fine if the master has not started; else check "
                    "the port and the master's firewall")
    elif state == "timeout":
        report.warn(f"no answer from {address}:{port} within {CONNECT_TIMEOUT_S} s: a firewall may drop traffic to "
                    "this port")
    else:
        report.warn(f"cannot connect to {address}:{port}: {state}")


def check_gloo(environ, addrs: dict[str, list[str]], report: Report) -> None:
    """The address gloo binds (the control plane; every collective on CPUs): GLOO_SOCKET_IFNAME's interfaces;
    across nodes without it, the one the trainer sets (training/interfaces.py); else the address this host's
    name resolves to, which Debian's /etc/hosts makes 127.0.1.1, a loopback address other nodes cannot reach."""
    try:
        multi_node = node_count(environ)[1] > 1
    except LaunchEnvError:  # reported with the launch
        multi_node = False
    across_nodes = multi_node and not loopback_drill(environ)
    host = socket.gethostname()
    host_addrs, _ = resolve(host)
    resolved = f"{host} -> {', '.join(host_addrs) or 'nothing'}"
    loopback_name = bool(host_addrs) and is_loopback(host_addrs[0])
    names, source = [n for n in environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n], "GLOO_SOCKET_IFNAME"
    by_trainer = not names and multi_node
    if by_trainer:
        chosen, why = gloo_interface(environ, addrs)
        names, source = [chosen] if chosen else [], f"set by the trainer when its ranks span nodes: {why}"
    if names:
        missing = [n for n in names if not usable(addrs.get(n, []))]
        if missing:
            report.fail(f"GLOO_SOCKET_IFNAME={environ['GLOO_SOCKET_IFNAME']}: no interface {', '.join(missing)} "
                        "with an address on this host: gloo cannot start; name an interface listed above")
            return
        print(f"  gloo binds {', '.join(names)} ({source})")
        if across_nodes and all(is_loopback(a.split("/")[0]) for n in names for a in usable(addrs[n])):
            report.fail(f"gloo would bind {', '.join(names)}, a loopback interface: the other nodes cannot reach "
                        "it; set GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) to the interface the nodes share")
        elif across_nodes and loopback_name and by_trainer:
            print(f"  note: {resolved} is a loopback address; ranks started without torchrun or srun (RANK and "
                  "WORLD_SIZE set by hand) bind it unless GLOO_SOCKET_IFNAME is set")
        return
    print(f"  gloo binds the address this host's name resolves to: {resolved}")
    if across_nodes and loopback_name:
        report.fail(f"{resolved}, a loopback address (Debian's /etc/hosts maps the host name to 127.0.1.1): "
                    "gloo binds it and the other nodes cannot reach it; set GLOO_SOCKET_IFNAME (or "
                    f"NCCL_SOCKET_IFNAME, which the trainer follows) to the interface the nodes share, or map {host} "
                    "to that interface's address in /etc/hosts")


def check_paths(environ, report: Report) -> None:
    data_dir = environ.get("DATA_DIR")
    if data_dir:
        if os.path.isdir(data_dir):
            print(f"  DATA_DIR={data_dir} exists")
        else:
            report.fail(f"DATA_DIR={data_dir} is not a directory")
    output_dir = environ.get("OUTPUT_DIR")
    if output_dir:
        existing = os.path.abspath(output_dir)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK):
            print(f"  OUTPUT_DIR={output_dir} is writable")
        else:
            report.fail(f"OUTPUT_DIR={output_dir} cannot be written ({existing} is not a writable directory)")


# ---- the report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ
    if argv == ["--env"]:
        for line in env_warnings(environ):
            print(line)
        return 0
    if argv:
        print("usage: python -m tools.doctor [--env]", file=sys.stderr)
        return 2
    report = Report()

    print("== versions")
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    except Exception:  # noqa: BLE001 - a build without NCCL
        nccl = None
    cuda_version = torch.version.cuda or "none (a CPU build)"
    print(f"  python {platform.python_version()}, torch {torch.__version__}, CUDA {cuda_version}, "
          f"NCCL {nccl or 'none'}; host {socket.gethostname()}")
    print(f"  backends: nccl {'yes' if dist.is_available() and dist.is_nccl_available() else 'no'}, "
          f"gloo {'yes' if dist.is_available() and dist.is_gloo_available() else 'no'}")

    print("== GPUs")
    gpus = torch.cuda.device_count() if cuda else 0
    if "CUDA_VISIBLE_DEVICES" in environ:
        print(f"  CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}")
    if not gpus:
        print("  none visible: ranks run on the CPU, with gloo")
    for i in range(gpus):
        props = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
              f"{props.major}.{props.minor}")
    if gpus and shutil.which("nvidia-smi"):
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
            print("  nvidia-smi topo -m:")
            print("\n".join("    " + line for line in topo.rstrip().splitlines()))
        except (OSError, subprocess.SubprocessError) as e:
            report.warn(f"nvidia-smi topo -m failed: {e}")

    print("== network interfaces")
    addrs = interface_addresses()
    for name, a in addrs.items():
        print(f"  {name:<12} {operstate(name):<8} {' '.join(a) or '(no address)'}")
    ifname = environ.get("NCCL_SOCKET_IFNAME")
    chosen = nccl_interfaces(addrs, ifname)
    rule = f"NCCL_SOCKET_IFNAME={ifname}" if ifname else NCCL_DEFAULT_RULE
    if chosen:
        print(f"  NCCL would use: {', '.join(chosen)} ({rule})")
    elif cuda:
        report.fail(f"no interface with an address matches ({rule}): NCCL cannot bootstrap; fix NCCL_SOCKET_IFNAME")
    else:
        report.warn(f"no interface with an address matches ({rule}); NCCL is not used on this CPU-only host")
    check_gloo(environ, addrs, report)

    print("== NCCL and TORCH variables")
    shown = sorted(k for k in environ if k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "TORCH_DISTRIBUTED_"))
                   or k in RENAMED)
    for name in shown:
        print(f"  {name}={environ[name]}")
    warnings = env_warnings(environ)
    for text in warnings:
        report.warn(text)
    if not shown:
        print("  none set")
    elif not warnings:
        print("  none that NCCL ignores or that PyTorch renamed")

    print("== launch")
    check_launch(environ, report, cuda=cuda, gpus=gpus)
    check_paths(environ, report)

    print("== verdict")
    if report.problems:
        print(f"  a launch would fail ({len(report.problems)} problem(s)):")
        for text in report.problems:
            print(f"  - {text}")
        return 1
    print(f"  ok: nothing found that would stop a launch ({len(report.warnings)} warning(s) above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
