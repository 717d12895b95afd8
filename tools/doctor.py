"""Doctor: would a launch work on this host? Run it before a long job, and after a failed one.

    python -m tools.doctor                 # or: bash run_nccl_optimized.sh doctor
    python -m tools.doctor --env           # only the warnings about NCCL_*/TORCH_* variables

Prints torch, CUDA and NCCL versions; the GPUs and their topology; the network
interfaces, the one NCCL would pick and the address gloo would bind; variables
NCCL does not read or that PyTorch renamed; whether MASTER_ADDR:MASTER_PORT (or
RDZV_ENDPOINT) can be used. It reads the launcher's environment and judges it by
the launcher's own rules (tools/launch_rules.py).

It only looks: it binds a port for a moment to see whether it is free, and
tries one TCP connection to a remote master; it never scans.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

from tools.launch_rules import (LAUNCH_VARIABLES, LOOPBACK_DRILL, RENAMED, Problems, cpu_ranks, env_warnings,
                                is_loopback, loopback_drill, master_port, node_count, plan_launch, reachable_master,
                                resolve, restart_rendezvous, LaunchEnvError)
from training.flag_help import FlagHelpFormatter
from training.interfaces import NCCL_DEFAULT_RULE, gloo_interface, interface_addresses, nccl_interfaces, usable

# the launcher's variables the doctor reads, and the others it looks at
READS = (*(name for name in LAUNCH_VARIABLES if name not in ("RDZV_ID", "OMP_NUM_THREADS", "DRY_RUN", "PYTHON",
                                                               "NCCL_*, TORCH_*, GLOO_*")),
         "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_*", "TORCH_*")
CONNECT_TIMEOUT_S = 3


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


# ---- network interfaces


def operstate(name: str) -> str:
    try:
        with open(f"/sys/class/net/{name}/operstate") as f:
            return f.read().strip()
    except OSError:
        return "?"


# ---- addresses and ports


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


# ---- the launch as the launcher would run it


def check_launch(environ, report: Report, *, cuda: bool, gpus: int) -> None:
    """What run_nccl_optimized.sh would do with this environment, by its own rules, and whether it can work here."""
    gpus = gpus if cuda else 0
    problems = Problems()
    plan = plan_launch(environ, gpus, problems)
    for text in problems.found:
        report.fail(text)
    nproc, nodes, rdzv = plan.nproc, plan.nodes, plan.rendezvous
    if not environ.get("NPROC_PER_NODE"):
        print(f"  NPROC_PER_NODE unset: {nproc} rank(s) on this node (the visible GPUs; one process without)")
    if not gpus and nproc > 1:
        print(f"  {cpu_ranks(nproc)}")
    multi_node = nodes.max_nodes > 1
    # the host whose address the endpoint names hosts the store; on one node that is this one
    c10d_host_here = None if multi_node else True

    if not plan.torchrun:
        print("  one process, no torchrun: MASTER_ADDR and MASTER_PORT are not used")
        if environ.get("MASTER_ADDR"):  # checked anyway, for the launch you are preparing; not fatal here
            try:
                port = master_port(environ, nodes.max_nodes)
            except LaunchEnvError as e:
                report.warn(str(e))
                port = None
            check_endpoint(environ, "MASTER_ADDR", environ["MASTER_ADDR"], port, report, multi_node=False,
                           hosts_here=True, fatal=False)
        return
    if rdzv is None:  # reported above
        return
    if rdzv.variable == "RDZV_ENDPOINT":
        print(f"  c10d rendezvous at {rdzv.host}:{rdzv.port} (RDZV_ENDPOINT), up to {nodes.max_nodes} node(s); "
              "node ranks are assigned by the rendezvous")
        check_endpoint(environ, "RDZV_ENDPOINT", rdzv.host, rdzv.port, report, multi_node=multi_node,
                       hosts_here=c10d_host_here)
        return
    if rdzv.port is None:
        print(f"  master {rdzv.host}, MASTER_PORT unset: the launcher picks a free port")
        check_endpoint(environ, "MASTER_ADDR", rdzv.host, None, report, multi_node=False, hosts_here=True)
        return
    if rdzv.backend == "c10d":
        print(f"  {restart_rendezvous(nodes.max_restarts, f'{rdzv.host}:{rdzv.port}')}")
        check_endpoint(environ, "MASTER_ADDR", rdzv.host, rdzv.port, report, multi_node=multi_node,
                       hosts_here=c10d_host_here)
        return
    rank = rdzv.node_rank
    print(f"  master {rdzv.host}:{rdzv.port}, node rank {rank} of {nodes.max_nodes}"
          + (" (this node hosts the rendezvous store)" if rank == 0 else ""))
    check_endpoint(environ, "MASTER_ADDR", rdzv.host, rdzv.port, report, multi_node=multi_node,
                   hosts_here=rank == 0)


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


def parse_args(argv=None) -> argparse.Namespace:
    reads = textwrap.fill("variables read: " + ", ".join(READS) + " (bash run_nccl_optimized.sh --help says what "
                          "the launcher's do)", 80)
    p = argparse.ArgumentParser(
        prog="python -m tools.doctor", formatter_class=FlagHelpFormatter, description=__doc__ + "\n" + reads,
        epilog="exit codes: 0 nothing found that would stop a launch (warnings may be printed); 1 a launch\n"
               "would fail, with the reasons; 2 a bad option")
    p.add_argument("--env", action="store_true",
                   help="print only the warnings about your NCCL_*/TORCH_* variables (those NCCL does not read, "
                        "those PyTorch renamed, workarounds left on), one a line, and exit 0")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    environ = os.environ
    if args.env:
        for line in env_warnings(environ):
            print(line)
        return 0
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
