"""Network interfaces: the one NCCL picks, and the one gloo binds when ranks span nodes.

Read by the trainer (training/distributed.py sets GLOO_SOCKET_IFNAME before its process
groups exist), by the doctor (tools/doctor.py) and by the launcher's DRY_RUN.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess

NCCL_DEFAULT_RULE = ("NCCL_SOCKET_IFNAME unset: NCCL skips lo and docker*, prefers ib*, else takes the first "
                     "other interface with an address (lo or docker* only when nothing else has one)")


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> addresses (CIDR), in the kernel's order; from `ip -o addr` when there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
    addrs = {name: [] for name in names}
    if shutil.which("ip"):
        try:
            text = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("inet", "inet6"):
                addrs.setdefault(parts[1].split("@")[0], []).append(parts[3])
        return addrs
    for name in names:  # no `ip`: IPv4 addresses through the SIOCGIFADDR ioctl
        address = _ipv4_by_ioctl(name)
        if address:
            addrs[name].append(address)
    return addrs


def _ipv4_by_ioctl(name: str) -> str | None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def usable(addresses: list[str]) -> list[str]:
    """Addresses NCCL could bind: not IPv6 link-local."""
    return [a for a in addresses if not ipaddress.ip_interface(a).ip.is_link_local]


def _matches(name: str, token: str) -> bool:
    return name == token[1:] if token.startswith("=") else name.startswith(token)


def nccl_interfaces(addrs: dict[str, list[str]], ifname: str | None) -> list[str]:
    """The interfaces NCCL would use, following its documented selection (NCCL_SOCKET_IFNAME or the default)."""
    candidates = [name for name, a in addrs.items() if usable(a)]
    if ifname:
        exclude = ifname.startswith("^")
        tokens = [t for t in ifname.lstrip("^").split(",") if t]
        return [n for n in candidates if any(_matches(n, t) for t in tokens) != exclude]
    for pick in (lambda n: n.startswith("ib"), lambda n: not (n == "lo" or n.startswith("docker")),
                 lambda n: n.startswith("docker"), lambda n: n == "lo"):
        chosen = [n for n in candidates if pick(n)]
        if chosen:
            return chosen[:1]
    return []


def gloo_interface(environ, addrs: dict[str, list[str]]) -> tuple[str | None, str]:
    """(interface, why): what GLOO_SOCKET_IFNAME becomes when ranks span nodes and it is unset, so that the
    control plane binds the interface NCCL uses: NCCL_SOCKET_IFNAME's first match, else NCCL's own choice.
    None when no interface qualifies; gloo then binds the address this host's name resolves to."""
    ifname = environ.get("NCCL_SOCKET_IFNAME")
    chosen = nccl_interfaces(addrs, ifname)
    why = f"NCCL_SOCKET_IFNAME={ifname}" if ifname else "the interface NCCL picks by default"
    return (chosen[0] if chosen else None), why
