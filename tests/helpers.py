"""Shared helpers: run the trainer as a user would, and make small feature stores."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.zygote import REPO, zygote_for

TRAINER = REPO / "rvq_seamless_gpu_cache_nccl.py"

# A codec small enough that a step takes milliseconds on a CPU.
TINY = ["--latent_dim", "32", "--num_quantizers", "2", "--codebook_size", "32", "--batch_size", "4",
        "--segment_length", "32", "--warmup_steps", "2", "--log_every", "1"]
# Samples for runs whose point is not the k-means init, the refit or the final eval: at their defaults these take
# most of a tiny run's seconds on the demo corpus (the final eval alone scores 40 whole utterances).
QUICK = ["--kmeans_init_frames", "1024", "--eval_frames", "1024", "--refit_frames", "4096"]


def env(**extra) -> dict:
    e = dict(os.environ)
    e.pop("RVQ_FAULT", None)
    e["PYTHONPATH"] = str(REPO)
    e.update({k: str(v) for k, v in extra.items()})
    return e


commands_env = env  # the environment of the tests' commands (start_python's parameter `env` hides the function)


# extra_env that makes a subprocess print its OS threads at the interpreter's exit (tests/exit_probe)
EXIT_PROBE = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "exit_probe")])}


def start_python(argv, *, env: dict, stdout: Path, stderr: Path | None = None, cwd=REPO):
    """`python ARGV` (a script, -m MODULE or -c CODE, and its arguments) as a process of its own with this
    environment and folder, its stdout and its stderr (None: with the stdout) appended to files: forked from this
    worker's zygote where the environment allows (tests/zygote.py), else a fresh interpreter. Returns a
    subprocess.Popen, or what the tests use of one."""
    argv = [str(a) for a in argv]
    for path in (stdout, stderr):  # there when this returns, as subprocess.Popen's files are
        if path is not None:
            Path(path).touch()
    zygote = zygote_for(env, base=commands_env())
    if zygote is not None:
        return zygote.start(argv, env=env, cwd=Path(cwd), stdout=Path(stdout), stderr=stderr and Path(stderr))
    with open(stdout, "a") as out:
        if stderr is None:
            return subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        with open(stderr, "a") as err:
            return subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, env=env, cwd=cwd)


def run_python(argv, *, env: dict, timeout: float, cwd=REPO) -> subprocess.CompletedProcess:
    """What subprocess.run(capture_output=True, text=True, timeout=...) gives for `python ARGV`, started as
    start_python starts it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="python") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        proc = start_python(argv, env=env, stdout=out, stderr=err, cwd=cwd)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            raise
        return subprocess.CompletedProcess([sys.executable, *map(str, argv)], code, out.read_text(), err.read_text())


def run_trainer(args, *, timeout=240, extra_env=None, cwd=None) -> subprocess.CompletedProcess:
    return run_python([TRAINER, *args], env=env(**(extra_env or {})), timeout=timeout, cwd=cwd or REPO)


def trainer_in_process(args, *, extra_env=None, cwd=None) -> subprocess.CompletedProcess:
    """The trainer's `main()` run in this process: the code the command runs, without a second interpreter's 3 s
    start-up. For one-process runs that no signal reaches (a signal would reach the test process); run_trainer
    runs the command itself. Returns what run_trainer returns; the process's environment, folder, signal handlers
    and logging are as they were before it."""
    import logging

    import rvq_seamless_gpu_cache_nccl as trainer

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    saved_logging = (root.handlers[:], root.level)
    try:
        os.environ.pop("RVQ_FAULT", None)
        os.environ.update({k: str(v) for k, v in (extra_env or {}).items()})
        os.chdir(cwd or REPO)
        code, out, err = _captured(trainer.main, [str(a) for a in args])
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:], root.level = saved_logging
    return subprocess.CompletedProcess(["main", *map(str, args)], code, out, err)


def _captured(main, argv) -> tuple[int, str, str]:
    """A command's `main(argv)` called in this process: (exit code, stdout, stderr); argparse's exits (--help, a
    bad flag) are exit codes as the command would return them."""
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, stdout.getvalue(), stderr.getvalue()


def help_in_process(*command: str) -> subprocess.CompletedProcess:
    """What `python COMMAND --help` answers (the trainer's script, or -m MODULE [WORD]), from the command's `main`
    called in this process: the same parser and text, without an interpreter's start-up. help_output runs the
    command itself."""
    import importlib

    if command[0] != "-m":
        return trainer_in_process(["--help"])
    code, out, err = _captured(importlib.import_module(command[1]).main, [*command[2:], "--help"])
    return subprocess.CompletedProcess([*command, "--help"], code, out, err)


def help_output(*command: str) -> subprocess.CompletedProcess:
    """`python COMMAND --help` (the trainer's script, or -m MODULE [WORD]) run as a user runs it."""
    return run_python([*command, "--help"], env=env(), timeout=120)


def run_torchrun(args, *, nproc=2, timeout=240, extra_env=None, launcher="torch.distributed.run"):
    cmd = [sys.executable, "-m", launcher, f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(TRAINER), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(**(extra_env or {})),
                          cwd=REPO)


def free_port() -> int:
    """A port for a rendezvous on 127.0.0.1 that no other test takes before the launcher binds it: below the ports
    the OS gives outgoing connections (gloo opens many; ip_local_port_range), in a band of its own for each
    pytest-xdist worker, taken in turn and each checked free. A port the OS picks (bind to 0) can be handed to
    another process's connection before the launcher binds it."""
    import socket

    for port in _PORTS:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in this worker's band")


def _port_band():
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = 20000 if ephemeral > 22000 else 10000
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0) % workers
    size = (ephemeral - low) // workers
    first = low + worker * size
    start = os.getpid() % size
    return itertools.cycle([first + (start + i) % size for i in range(size)])


_PORTS = _port_band()


def run_gloo_ranks(script: str, world_size: int = 2, timeout: int = 120) -> list[str]:
    """Run a Python script as `world_size` ranks (RANK/WORLD_SIZE/MASTER_* set for init_process_group("gloo")
    over 127.0.0.1); assert every rank exits 0 and return each rank's output."""
    import tempfile
    import time

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gloo_ranks") as folder:
        logs = [Path(folder, f"rank{r}.log") for r in range(world_size)]
        procs = [start_python(["-c", script], stdout=logs[r],
                              env=env(RANK=r, WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
                 for r in range(world_size)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        outs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0] * world_size, outs
    return outs


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    """A run's metrics.jsonl events (of `kind`), read as the tools read them; a line that is no event fails."""
    from training.metrics_log import read_metrics
    from training.run_folder import RunFolder

    found, bad = read_metrics(RunFolder(run_dir).metrics)
    assert not bad, f"{bad} line(s) of {run_dir}/metrics.jsonl are no event"
    return [e for e in found if kind is None or e["event"] == kind]


def tree(folder: Path) -> dict:
    """Every file under `folder` with its size, modification time and a digest of its bytes."""
    import hashlib

    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns,
                                         hashlib.sha1(p.read_bytes()).hexdigest())
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def write_fairseq(folder: Path, split: str, lengths, dim=16, nshard=1, seed=0, dtype=np.float32) -> list[np.ndarray]:
    """A fairseq dump of random utterances; returns the utterances in order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    utts = [rng.standard_normal((n, dim)).astype(dtype) for n in lengths]
    per_shard = np.array_split(np.arange(len(utts)), nshard)
    for k, idx in enumerate(per_shard):
        np.save(folder / f"{split}_{k}_{nshard}.npy", np.concatenate([utts[i] for i in idx]))
        (folder / f"{split}_{k}_{nshard}.len").write_text("".join(f"{lengths[i]}\n" for i in idx))
    return utts


def write_dump(folder: Path, train: int, valid: int, seed: int, dim: int = 16) -> Path:
    """A fairseq dump in `folder`: `train` training utterances of 40-199 frames (lengths and values drawn with
    `seed`) and `valid` held-out ones of 64 frames."""
    lengths = np.random.default_rng(seed).integers(40, 200, size=train).tolist()
    write_fairseq(folder, "train", lengths, dim=dim, seed=seed)
    write_fairseq(folder, "valid", [64] * valid, dim=dim, seed=seed + 1)
    return folder


def run_flags(data, out, *extra) -> list:
    """The trainer's flags for a TINY run on `data` into `out`, then `extra`."""
    return ["--data_dir", data, "--output_dir", out, *TINY, *map(str, extra)]


def newest_checkpoint(run_dir: Path) -> dict:
    """The newest checkpoint in a run's output dir, loaded."""
    from training.checkpoint import list_checkpoints, load_checkpoint
    from training.run_folder import RunFolder

    return load_checkpoint(list_checkpoints(RunFolder(run_dir).checkpoints)[0])


def _stat(path: str) -> list[str] | None:
    """The fields of a /proc stat file after the command name (state first), or None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped), or '' when it cannot be read."""
    fields = _stat(f"/proc/{pid}/stat")
    return fields[0] if fields else ""


def main_thread_cpu(pid: int) -> int | None:
    """The CPU time (clock ticks, user and system) a process's main thread has used; None when it cannot be read."""
    fields = _stat(f"/proc/{pid}/task/{pid}/stat")
    return None if fields is None else int(fields[11]) + int(fields[12])


class Ranks:
    """Two (or more) trainer ranks started as a launcher would, each process observable on its own.

    args: the trainer's flags, or a function of the rank that returns them (ranks with different flags).
    style: "env" (RANK/WORLD_SIZE/LOCAL_RANK, as torchrun and accelerate set them) or "slurm"
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, as srun sets them). Rank 0 hosts the rendezvous store.
    log_dir: where each rank's log is written (rankN.log), a test's own folder.
    """

    def __init__(self, args, *, log_dir, world=2, style="env", extra_env=None):
        import signal as _signal
        import time

        self._signal, self._time = _signal, time
        port = free_port()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs, self.ended, self.stopped = [], {}, {}
        for rank in range(world):
            e = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **(extra_env or {}))
            if style == "slurm":
                e.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank))
            else:
                e.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
                if style == "accelerate":
                    e.update(ACCELERATE_MIXED_PRECISION="no")
            log = self.log_dir / f"rank{rank}.log"
            log.write_text("")
            flags = args(rank) if callable(args) else args
            self.procs.append(start_python([TRAINER, *flags], stdout=log, env=e))

    def wait(self, timeout, ranks=None):
        """Wait until `ranks` (default all) have ended or `timeout` passed; returns every rank's exit code
        (None: still there)."""
        ranks = range(len(self.procs)) if ranks is None else ranks
        deadline = self._time.monotonic() + timeout
        while self._time.monotonic() < deadline and not all(r in self.ended for r in ranks):
            for r, p in enumerate(self.procs):
                if r not in self.ended and p.poll() is not None:
                    self.ended[r] = self._time.monotonic()
                elif r not in self.stopped and _state(p.pid) == "T":
                    self.stopped[r] = self._time.monotonic()
            self._time.sleep(0.2)
        return [p.poll() for p in self.procs]

    def wait_for(self, rank, text, timeout) -> float:
        """When `text` first appeared in `rank`'s log (time.monotonic()); fails after `timeout` s."""
        deadline = self._time.monotonic() + timeout
        while text not in self.output(rank):
            assert self._time.monotonic() < deadline and self.procs[rank].poll() is None, self.output(rank)
            self._time.sleep(0.1)
        return self._time.monotonic()

    def wait_blocked(self, rank, timeout, quiet=1.0) -> None:
        """Wait until `rank`'s main thread has used no CPU for `quiet` seconds (blocked: in a collective that
        waits for a peer, say); fails after `timeout` s."""
        deadline = self._time.monotonic() + timeout
        last, since = None, self._time.monotonic()
        while True:
            used = main_thread_cpu(self.procs[rank].pid)
            assert used is not None and self._time.monotonic() < deadline, self.output(rank)
            if used != last:
                last, since = used, self._time.monotonic()
            elif self._time.monotonic() - since >= quiet:
                return
            self._time.sleep(0.1)

    def output(self, rank) -> str:
        return (self.log_dir / f"rank{rank}.log").read_text()

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(self._signal.SIGCONT)
                p.kill()
                p.wait(timeout=30)


def importing(pid: int) -> bool:
    """Whether a fresh Python process is in its imports: numpy's extension is loaded (the trainer imports numpy,
    then torch and its own modules, seconds in all, before its main() runs)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "_multiarray_umath" in f.read()
    except OSError:
        return False


def signal_while_importing(argv, sig, *, log: Path, env: dict, watched=None, timeout=180) -> int:
    """Start `argv` (a fresh process: a fork of the zygote has done its imports), send it `sig` once
    `watched(pid)` (default: the process itself) names a process in its imports; its exit code, its output in
    `log`."""
    import time

    watched = watched or (lambda pid: [pid])
    with open(log, "w") as out:
        proc = subprocess.Popen([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not any(importing(pid) for pid in watched(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.005)
        proc.send_signal(sig)
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
