"""The launcher behind run_nccl_optimized.sh: a preset and the environment -> torchrun, or one trainer process.

    bash run_nccl_optimized.sh PRESET [trainer flags...]     # python -m tools.launch PRESET ...
    bash run_nccl_optimized.sh doctor                        # python -m tools.doctor
    bash run_nccl_optimized.sh --help                        # presets, environment, examples

Takes the preset from training/presets.py and the environment in LAUNCH_VARIABLES
(tools/launch_rules.py, whose rules decide the ranks, the nodes and the rendezvous); an
environment that cannot work ends with a message naming every problem and exit 2, before
anything is started or written. Sets the preset's NCCL variables and OMP_NUM_THREADS (not for one CPU rank,
which picks its own) unless you set them (yours are kept, and named). One process: it
becomes the trainer (os.execvpe, as bash's exec: signals reach the trainer directly).
Several ranks: it runs torchrun and passes a stop signal to this node's ranks (see
StopRelay), then exits with torchrun's code, or 3 when a rank was aborted (signal 6:
what NCCL's watchdog does to a rank whose collective timed out) or the ranks that failed
exited 3 (a rank lost, silent, stuck or out of sync, which they named), or 2 when every
rank that failed exited 2 (bad input), which it says.
With DRY_RUN=1 it prints the environment and the command instead, and exits 0.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import unicodedata
import warnings
from pathlib import Path

from errors import EXIT_BAD_INPUT, EXIT_DISTRIBUTED
from tools import doctor
from tools.launch_rules import (LAUNCH_VARIABLES, LOOPBACK_DRILL, LaunchEnvError, LaunchPlan, Nodes, cpu_ranks,
                                env_warnings, is_loopback, plan_launch, reachable_master, resolve, restart_rendezvous)
from training.interfaces import gloo_interface, interface_addresses
from training.nccl_env import FLIGHT_RECORDER_DIR, trainer_nccl_env
from training.presets import PRESETS, Preset
from training.stop_signals import STOP_SIGNALS

SCRIPT = "run_nccl_optimized.sh"
TRAINER = Path(os.path.abspath(__file__)).parent.parent / "rvq_seamless_gpu_cache_nccl.py"
USER_VARIABLE = re.compile(r"(NCCL|TORCH|GLOO)_[A-Za-z0-9_]*")
WORKAROUND_NOTE = ": a workaround from NCCL's troubleshooting guide, not a tuning"


def say(text: str) -> None:
    print(f"[run_nccl_optimized] {text}", file=sys.stderr)


USAGE = (f"usage: bash {SCRIPT} PRESET [trainer flags...]\n"
         f"       bash {SCRIPT} doctor [--env]\n"
         f"       bash {SCRIPT} --help\n"
         "       (python -m tools.launch takes the same arguments)")
EXAMPLES = (
    ("one process, or one rank per visible GPU, on the demo corpus", f"bash {SCRIPT} conservative"),
    ("eight ranks on this node, your features", f"DATA_DIR=feats NPROC_PER_NODE=8 bash {SCRIPT} gpu_cache "
                                                "--multi_length_training"),
    ("node 0 of two (NODE_RANK=1 on the other), a shared output dir",
     f"NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 OUTPUT_DIR=/shared/runs/rvq bash {SCRIPT} basic"),
    ("print the environment and the command, start nothing", f"DRY_RUN=1 NPROC_PER_NODE=2 bash {SCRIPT} basic "
                                                             "--max_steps 100"),
)
WIDTH = 100


def _entries(rows, indent: int = 2) -> list[str]:
    """(name, text) rows as a two-column list, the text wrapped beside the names."""
    column = indent + max(len(name) for name, _ in rows) + 2
    lines = []
    for name, text in rows:
        wrapped = textwrap.wrap(text, WIDTH - column) or [""]
        lines.append(f"{' ' * indent}{name:<{column - indent}}{wrapped[0]}".rstrip())
        lines += [" " * column + line for line in wrapped[1:]]
    return lines


def preset_rows() -> list[tuple[str, str]]:
    """Each preset: what it is, the flags it passes, the workarounds it sets."""
    rows = []
    for name, preset in PRESETS.items():
        text = preset.about + (f"; flags: {' '.join(preset.flags)}" if preset.flags else "; no flags")
        if preset.workarounds:
            text += "; sets " + " ".join(f"{k}={v}" for k, v in preset.workarounds.items()) + \
                    " (workarounds from NCCL's troubleshooting guide)"
        rows.append((name, text))
    return rows


def help_text() -> str:
    """`--help`: the presets, the environment and the trainer's NCCL settings from their definitions, examples."""
    about = ("Launch the RVQ trainer with a preset: one process, or torchrun over GPUs and nodes. Trainer flags "
             "after the preset win over the preset's own (python rvq_seamless_gpu_cache_nccl.py --help lists "
             "them). An environment that cannot work ends with a message and exit 2, before anything is started "
             "or written; doctor says whether a launch would work here, without launching.")
    nccl = trainer_nccl_env("OUTPUT_DIR", environ={})
    lines = [USAGE, "", textwrap.fill(about, WIDTH), "", "presets (training/presets.py):", *_entries(preset_rows()),
             "", "environment (tools/launch_rules.py):",
             *_entries([(name, f"{v.what} (default: {v.default})") for name, v in LAUNCH_VARIABLES.items()]),
             "", "set by the trainer on its NCCL process groups, unless you set them (training/nccl_env.py):",
             *(f"  {name}={value}" for name, value in nccl.items()), "", "examples:"]
    for note, example in EXAMPLES:
        lines += [f"  # {note}", f"  {example}"]
    return "\n".join(lines) + "\n"


def usage() -> None:
    lines = [USAGE, "presets:", *_entries([(name, preset.about) for name, preset in PRESETS.items()]),
             f"bash {SCRIPT} --help: what each preset sets, the environment it reads, examples"]
    print("\n".join(lines), file=sys.stderr)


class Exports:
    """The variables the launcher sets or keeps, in the order it decided them: what DRY_RUN prints as exports.
    os.environ stays as you set it, so your NCCL_*/TORCH_* variables are told from the preset's; the command
    gets both."""

    def __init__(self, environ):
        self.environ = environ
        self.values: dict[str, str] = {}

    def keep(self, name: str, note: str = "") -> None:
        self.values[name] = self.environ[name]
        say(f"keeping {name}={self.values[name]} from your environment{note}")

    def set(self, name: str, value: str, note: str = "") -> None:
        self.values[name] = value
        say(f"setting {name}={value}{note}")


# ---- the environment


def environment(name: str, preset: Preset, run_dir: str, environ, exports: Exports) -> tuple[list[str], dict]:
    """The preset's flags and workarounds, the trainer's NCCL defaults, and your NCCL_*/TORCH_* variables,
    which win over the preset's; returns the flags and what the trainer will set on NCCL groups."""
    say(f"preset {name}: {preset.about}")
    flags = list(preset.flags)
    if "--nccl_timeout" in flags and environ.get("NCCL_TIMEOUT"):
        # your NCCL_TIMEOUT is the trainer's timeout, so it wins over the preset's flag
        exports.keep("NCCL_TIMEOUT", ": the trainer's process-group timeout; the preset's --nccl_timeout is left out")
        at = flags.index("--nccl_timeout")
        del flags[at:at + 2]
    for key, value in preset.workarounds.items():
        if key in environ:
            exports.keep(key, f" (preset: {value})")
        else:
            exports.set(key, value, WORKAROUND_NOTE)
    trainer_env = trainer_nccl_env(run_dir, environ)
    for key in trainer_env:
        if key in environ:
            exports.keep(key, " (the trainer's default otherwise)")
    for key in sorted(filter(USER_VARIABLE.fullmatch, environ)):
        if key not in exports.values:
            exports.keep(key)
    return flags, trainer_env


# ---- ranks on this node


def visible_gpus() -> int:
    # no NVIDIA or AMD device node: no GPU, without paying for a torch import
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):
        return 0
    try:
        with warnings.catch_warnings():  # a warning about the driver is the trainer's to give
            warnings.simplefilter("ignore")
            import torch

            return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken torch install: the trainer will say so
        return 0


def share_the_cores(environ, nproc: int, gpus: int, exports: Exports) -> None:
    """Each rank's share of the cores (NPROC_PER_NODE ranks on this node), so that threads do not oversubscribe."""
    if not gpus and nproc > 1:
        say(cpu_ranks(nproc))
    if environ.get("OMP_NUM_THREADS"):
        exports.keep("OMP_NUM_THREADS")
    elif not gpus and nproc == 1:
        say("OMP_NUM_THREADS left unset: one rank on the CPU picks its threads from the cores it can get "
            "(training/threads.py)")
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        exports.set("OMP_NUM_THREADS", str(max(cores // nproc, 1)), f" ({cores} cores / {nproc} rank(s) on this node)")


# ---- the command


def trainer_args(environ, output_dir: str, flags: list[str], nodes: Nodes, user_args: list[str]) -> list[str]:
    """The output and data dirs, the preset's flags, then yours, which win (the trainer takes the last)."""
    args = ["--output_dir", output_dir]
    if environ.get("DATA_DIR"):
        args += ["--data_dir", environ["DATA_DIR"]]
    args += flags
    if nodes.max_restarts:
        # an elastic restart starts every rank anew: continue from the last checkpoint in the output dir
        args += ["--resume", "auto"]
        user_resume = last_value(user_args, "--resume")
        if user_resume and user_resume != "auto":
            say(f"warning: your --resume {user_resume} wins over --resume auto: every restart starts from it again")
    return args + user_args


def last_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in args."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg[len(flag) + 1:]
    return value


def command(python: str, environ, plan: LaunchPlan, run_dir: str, args: list[str], exports: Exports) -> list[str]:
    """One trainer process, or torchrun for several ranks, several nodes, or restarts."""
    trainer = [str(TRAINER), *args]
    if not plan.torchrun:
        return [python, *trainer]
    nodes = plan.nodes
    restarts = ["--max-restarts", str(nodes.max_restarts)] if nodes.max_restarts else []
    return [python, "-m", "torch.distributed.run", "--nproc_per_node", str(plan.nproc), "--nnodes", nodes.nnodes,
            *rendezvous(environ, plan, run_dir, exports), *restarts, *trainer]


def rendezvous(environ, plan: LaunchPlan, run_dir: str, exports: Exports) -> list[str]:
    """torchrun's arguments for the rendezvous the rules decided (tools/launch_rules.py: decide_rendezvous), once
    its host is known to be reachable; a free port where none was given."""
    rdzv, nodes = plan.rendezvous, plan.nodes
    reachable(environ, rdzv.variable, rdzv.host, nodes)
    port = rdzv.port or free_port()
    if rdzv.backend == "static":
        return ["--node_rank", str(rdzv.node_rank), "--master_addr", rdzv.host, "--master_port", str(port)]
    endpoint = rdzv.endpoint
    if endpoint is None:  # at the master's address, for restarts
        endpoint = f"{rdzv.host}:{port}"
        say(restart_rendezvous(nodes.max_restarts, endpoint))
    if environ.get("NODE_RANK"):
        say(f"NODE_RANK={environ['NODE_RANK']} is not used with a c10d rendezvous: it assigns node ranks itself")
    # torchrun's shared store outlives a restart and keeps the old workers' addresses (pytorch/pytorch#167288);
    # unshared, rank 0 of each attempt starts a store of its own
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
        exports.set("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1",
                    ": each attempt's workers get a store of their own, on a free port of the first node")
    return ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", rendezvous_id(environ, run_dir)]


def reachable(environ, name: str, host: str, nodes: Nodes) -> None:
    """Several nodes need a master every node can reach: a loopback one only in a drill (ALLOW_LOOPBACK_MASTER=1,
    every node on this host). A name that does not resolve here is left to torchrun, which names it."""
    if nodes.max_nodes <= 1:
        return
    addrs, _ = resolve(host)
    if addrs:
        reachable_master(environ, name, host, addrs[0], multi_node=True)
        if is_loopback(addrs[0]):
            say(f"{LOOPBACK_DRILL}={environ[LOOPBACK_DRILL]}: {name}={host} is a loopback address, so every node "
                "must run on this host (a drill)")


def rendezvous_id(environ, run_dir: str) -> str:
    # every node must give the same id; the output dir, shared by the nodes, names the run
    run_name = re.sub(rb"[^A-Za-z0-9]", b"-", os.fsencode(run_dir)).decode()
    return environ.get("RDZV_ID") or environ.get("SLURM_JOB_ID") or f"rvq-{run_name}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---- what it prints


_BACKSLASHED = frozenset(" !\"$&'()*,;<>?[\\]^`{|}")
_ANSI_C = {"\a": "a", "\b": "b", "\x1b": "E", "\f": "f", "\n": "n", "\r": "r", "\t": "t", "\v": "v", "\\": "\\",
           "'": "'"}


def bash_quote(word: str) -> str:
    """`word` as bash's printf %q writes it, so that DRY_RUN's lines paste into a shell."""
    if not word:
        return "''"
    if any(map(_is_control, word)):  # $'...', with escapes
        return "$'" + "".join(map(_ansi_c, word)) + "'"
    return "".join("\\" + ch if ch in _BACKSLASHED or (ch == "#" and i == 0)
                   or (ch == "~" and (i == 0 or word[i - 1] in ":=")) else ch for i, ch in enumerate(word))


def _is_control(ch: str) -> bool:
    return unicodedata.category(ch) in ("Cc", "Cs")  # Cs: a byte that is not UTF-8, as os.environ holds it


def _ansi_c(ch: str) -> str:
    if ch in _ANSI_C:
        return "\\" + _ANSI_C[ch]
    if not _is_control(ch):
        return ch
    return "".join(f"\\{byte:03o}" for byte in ch.encode("utf-8", "surrogateescape"))


def command_line(cmd: list[str]) -> str:
    return " ".join(map(bash_quote, cmd))


def print_dry_run(environ, exports: Exports, trainer_env: dict, gloo_env: dict, cmd: list[str]) -> None:
    say(f"DRY_RUN={environ['DRY_RUN']}: printing the environment and the command; nothing is started")
    shown = {"PYTHONPATH": environ.get("PYTHONPATH", "")}
    if "CUDA_VISIBLE_DEVICES" in environ:
        shown["CUDA_VISIBLE_DEVICES"] = environ["CUDA_VISIBLE_DEVICES"]
    lines = ["# environment set or kept by the launcher"]
    lines += [f"export {key}={bash_quote(value)}" for key, value in {**shown, **exports.values}.items()]
    lines.append("# set by the trainer when it creates an NCCL process group (values you set win)")
    lines += [f"#   {key}={value}" for key, value in trainer_env.items()]
    if gloo_env:
        lines.append("# set by the trainer when its ranks span nodes, before its process groups exist")
        lines += [f"#   {key}={value}" for key, value in gloo_env.items()]
    lines += ["# command", command_line(cmd)]
    print("\n".join(lines))


# ---- the ranks' interface for gloo


def trainer_gloo_env(environ, nodes: Nodes) -> dict:
    """GLOO_SOCKET_IFNAME as the trainer will set it when its ranks span nodes (training/distributed.py, by the
    rule in training/interfaces.py); said here once per node, since ranks other than 0 log only warnings."""
    if nodes.max_nodes <= 1 or "GLOO_SOCKET_IFNAME" in environ:
        return {}
    interface, why = gloo_interface(environ, interface_addresses())
    if interface is None:
        say(f"warning: no interface with an address for gloo ({why}): gloo binds the address this host's name "
            "resolves to; run the doctor")
        return {}
    say(f"ranks on several nodes: the trainer sets GLOO_SOCKET_IFNAME={interface} ({why}), so that gloo binds the "
        "interface NCCL uses")
    return {"GLOO_SOCKET_IFNAME": interface}


# ---- torchrun, and stop signals


# torchrun's failure summary: "rank : 1 (local_rank: 1)" then "exitcode : -6 (pid: ...)" (-6: ended by SIGABRT)
FAILED_RANK = re.compile(rb"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)\b")
TAIL_BYTES = 1 << 16  # the end of torchrun's output that is kept, for its failure summary


def run_torchrun(cmd: list[str], env: dict, run_dir: str, relay: "StopRelay") -> int:
    """Run torchrun in a session of its own; pass a stop signal to the ranks it started (`relay`); return its exit
    code, 3 when a rank was aborted (see aborted_ranks) or the ranks named a distributed failure (distributed_ranks),
    2 when the ranks found bad input (see bad_input_ranks).

    The output of torchrun and its ranks passes through, and its end is read for its failure summary.
    """
    # terminal signals reach the launcher alone; SIGTERM is blocked in torchrun (StopRelay)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        agent = relay.agent = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one that came meanwhile reaches the relay now
    tail = bytearray()
    copier = threading.Thread(target=copy_output, args=(agent.stderr, sys.stderr.buffer, tail), daemon=True)
    copier.start()
    while True:
        try:
            code = agent.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            relay.pass_on()  # a stop that came before any rank could take it
    copier.join(timeout=5)  # a rank left behind may hold the pipe open
    aborted = aborted_ranks(bytes(tail))
    if code != 0 and aborted:
        say(f"rank(s) {aborted} ended by signal 6 (SIGABRT): on NCCL, PyTorch's watchdog aborts a rank whose "
            "collective timed out (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), so this is a distributed failure: a peer "
            "stuck, lost or in another collective. Each rank's last collectives are in "
            f"{run_dir}/{FLIGHT_RECORDER_DIR}/rank_<rank>; read them with: python -m "
            f"torch.distributed.flight_recorder.fr_trace {run_dir}/{FLIGHT_RECORDER_DIR} --prefix rank_. "
            f"Exit code {EXIT_DISTRIBUTED}; restart to resume from the last checkpoint")
        return EXIT_DISTRIBUTED
    if code != 0 and (lost := distributed_ranks(bytes(tail))):
        say(f"rank(s) {lost} exited {EXIT_DISTRIBUTED}: a distributed failure (their message above names the rank "
            f"and the step). Exit code {EXIT_DISTRIBUTED}; restart to resume from the last checkpoint")
        return EXIT_DISTRIBUTED
    if code != 0 and (bad := bad_input_ranks(bytes(tail))):
        say(f"rank(s) {bad} exited {EXIT_BAD_INPUT}: bad input or flags (their message is above); nothing was "
            f"written. Exit code {EXIT_BAD_INPUT}")
        return EXIT_BAD_INPUT
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


class StopRelay:
    """The launcher's stop signals, from before it starts anything (installed before its `running:` line).

    torchrun's own answer to SIGTERM or SIGINT is to end the ranks of its node: it passes the signal on, kills them
    30 s later, and exits 1 without meeting the other nodes' agents, which then wait 300 s at their exit barrier.
    The trainer stops on these signals by itself, every node at one step with a checkpoint, and exits 0. So the
    first SIGTERM, SIGINT, SIGUSR1 or SIGHUP goes to this node's ranks, and every torchrun sees its ranks finish (no
    restart under MAX_RESTARTS: they succeeded). It goes only to ranks that catch it (the trainer does from its
    first line), so that a rank still starting is not killed by it; while none does (torchrun and its ranks
    starting), it waits, and is passed on as soon as one does: those stop before their first step, and their peers
    with them. Any other signal goes to torchrun as SIGINT: after a stop was passed on, torchrun passes it on too,
    and a rank already stopping exits at once; else (a second signal while no rank could take the first, SIGQUIT)
    it ends torchrun in its rendezvous, or its ranks within 30 s.

    torchrun starts with SIGTERM blocked (run_torchrun), and its ranks with it until the trainer's first line takes
    stop signals: SLURM's scancel, or a preemption, sends SIGTERM to every process at once, and torchrun's own
    answer (end the ranks, exit 1) would make the ranks' stop with a checkpoint a failure. Its ranks stop and exit
    0, and so do torchrun and the launcher, as for any other stop with a checkpoint.

    One process: the launcher becomes the trainer (exec), which records a stop from its first line; a stop that
    came before is handed over pending (exec_trainer).
    """

    def __init__(self, torchrun: bool):
        self.torchrun = torchrun
        self.agent: subprocess.Popen | None = None  # torchrun, once started
        self.pending: int | None = None  # a stop signal no rank could take yet
        self.relayed = False
        for caught in (*STOP_SIGNALS, signal.SIGQUIT):
            signal.signal(caught, self.handle)

    def handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if signum in STOP_SIGNALS and not self.relayed and self.pending is None:
            self.pending = signum
            if not self.torchrun:
                say(f"{name}: passed to the trainer as it starts; it stops before its first step")
            elif not self.pass_on():
                say(f"{name}: no rank of this node can take it yet; it is passed to them as they start, and they "
                    "stop before their first step; a second signal ends torchrun")
            return
        self.pending = None
        say(f"{name}: passed to torchrun as SIGINT: " + ("this node's ranks exit at once, without a checkpoint"
                                                        if self.relayed else "it ends this node's part of the job"))
        if self.agent is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.agent.pid, signal.SIGINT)

    def pass_on(self) -> bool:
        """Pass the pending stop to this node's ranks that catch it; True once it is passed."""
        if self.pending is None or self.agent is None:
            return False
        torchrun = command_of(self.agent.pid)
        ranks = [pid for pid in child_processes(self.agent.pid)
                 if command_of(pid) not in (torchrun, None) and catches(pid, self.pending)]
        if not ranks:
            return False
        sig, self.pending, self.relayed = self.pending, None, True
        say(f"{signal.Signals(sig).name}: passed to this node's ranks ({', '.join(map(str, ranks))}); every node's "
            "ranks stop at one step, with a checkpoint; a second signal ends them at once")
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return True

    def exec_trainer(self, cmd: list[str], env: dict):
        """Become the trainer. The stop signals stay blocked through the exec, and one that came is sent again
        while they are: pending, it reaches the trainer once its first line records stops (and unblocks them)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        if self.pending is not None:
            os.kill(os.getpid(), self.pending)
        os.execvpe(cmd[0], cmd, env)


def command_of(pid: int) -> bytes | None:
    """A process's command line, from /proc (a rank's is torchrun's until torchrun's fork of it has run exec);
    None once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc): a Python process starting up has
    none yet, and the signal's default action would end it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):  # gone meanwhile
        return False
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def copy_output(source, target, tail: bytearray) -> None:
    """Copy `source` to `target` as it comes, keeping its last TAIL_BYTES in `tail`."""
    for chunk in iter(lambda: source.read1(TAIL_BYTES), b""):
        with contextlib.suppress(OSError):
            target.write(chunk)
            target.flush()
        tail += chunk
        del tail[:-TAIL_BYTES]


def failed_ranks(output: bytes) -> dict[int, int]:
    """The ranks torchrun's failure summary shows, with their exit codes (a negative one: the signal that ended it)."""
    return {int(rank): int(code) for rank, code in FAILED_RANK.findall(output)}


def aborted_ranks(output: bytes) -> list[int]:
    """The ranks torchrun's failure summary shows as ended by signal 6 (`exitcode : -6`)."""
    return sorted(rank for rank, code in failed_ranks(output).items() if code == -6)


def distributed_ranks(output: bytes) -> list[int]:
    """The ranks of torchrun's failure summary that exited 3 (a distributed failure they named), when every other one
    there was ended by a signal (the stuck or lost rank, or one torchrun ended after them); else []. A rank that
    exited 1 or 2 had an error of its own, which decides the exit code."""
    failed = failed_ranks(output)
    named = sorted(rank for rank, code in failed.items() if code == EXIT_DISTRIBUTED)
    return named if named and all(code == EXIT_DISTRIBUTED or code < 0 for code in failed.values()) else []


def bad_input_ranks(output: bytes) -> list[int]:
    """The ranks of torchrun's failure summary when every one of them exited 2 (bad input or flags); else []."""
    failed = failed_ranks(output)
    return sorted(failed) if failed and set(failed.values()) == {EXIT_BAD_INPUT} else []


def child_processes(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's: the ranks it started), from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if parent == pid:
            children.append(int(entry))
    return children


# ---- the launch


def launch(name: str, user_args: list[str], environ) -> int:
    """Decide the environment and the command; print them (DRY_RUN), or run the command: its exit code."""
    output_dir = environ.get("OUTPUT_DIR") or f"runs/{name}"
    run_dir = last_value(user_args, "--output_dir") or output_dir  # the trainer takes the last --output_dir
    for text in env_warnings(environ):  # your variables that NCCL does not read, or that PyTorch renamed
        say(f"warning: {text}")
    gpus = visible_gpus()
    plan = plan_launch(environ, gpus)  # ranks, nodes, rendezvous: every problem, before anything is set
    exports = Exports(environ)
    flags, trainer_env = environment(name, PRESETS[name], run_dir, environ, exports)
    share_the_cores(environ, plan.nproc, gpus, exports)
    args = trainer_args(environ, output_dir, flags, plan.nodes, user_args)
    cmd = command(environ.get("PYTHON") or sys.executable, environ, plan, run_dir, args, exports)
    torchrun = cmd[1] == "-m"
    if gpus and torchrun:
        say(f"NCCL flight recorder: on a timeout each rank dumps its last collectives to "
            f"{run_dir}/{FLIGHT_RECORDER_DIR}/rank_<rank>")
    gloo_env = trainer_gloo_env(environ, plan.nodes)
    if environ.get("DRY_RUN") not in (None, "", "0"):
        print_dry_run(environ, exports, trainer_env, gloo_env, cmd)
        return 0
    relay = StopRelay(torchrun)  # a stop from here on reaches the ranks, or the trainer, however early it comes
    say(f"running: {command_line(cmd)}")
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**environ, **exports.values}
    if torchrun:
        return run_torchrun(cmd, env, run_dir, relay)
    relay.exec_trainer(cmd, env)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        usage()
        return 2
    if argv[0] in ("-h", "--help"):
        print(help_text(), end="")
        return 0
    if argv[0] == "doctor":
        return doctor.main(argv[1:])
    if argv[0] not in PRESETS:
        say(f"unknown preset '{argv[0]}'")
        usage()
        return 2
    try:
        return launch(argv[0], argv[1:], os.environ)
    except LaunchEnvError as e:  # bad input: exit 2 before anything is started or written
        for problem in e.problems:
            say(problem)
        return 2


if __name__ == "__main__":
    sys.exit(main())
