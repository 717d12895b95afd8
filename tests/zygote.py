"""The tests' commands, started as forks of one process that has imported their libraries.

`python rvq_seamless_gpu_cache_nccl.py` spends 3-4 s of CPU importing torch and the quantizer library (which
imports torch's compiler) before its main() runs, and the suite starts a few hundred such processes. So each
pytest worker starts one zygote (`python -m tests.zygote`) that imports the commands' libraries once, and each
command is a fork of it: a process of its own (its pid, signals, environment, folder, stdin, stdout, stderr),
in which this project's modules are imported afresh (none is shared with the zygote) and the command runs as the
interpreter runs it (`python SCRIPT`, `python -m MODULE`, `python -c CODE`), with the exit code the interpreter
would give: 0, SystemExit's, 1 with the traceback, or the signal that ended it.

What a fork cannot give is an interpreter's own start: what a library reads from the environment when it is
imported (OpenMP's thread count, torch's and inductor's settings, PYTHONPATH) is the zygote's. So a command
whose environment differs from the zygote's in anything but the launcher's and the project's own variables
(`FORKABLE`) starts a fresh interpreter, as does every command when RVQ_TESTS_FRESH=1 is set (the suite then
runs as it did with subprocesses alone), or when the zygote cannot start.

The zygote stays single-threaded (it checks), so that its forks hold no lock another thread had; it never
computes anything, so no OpenMP thread pool exists before a fork. It reads one request per line on stdin and
answers on the stdout it was given: `ready`, `started ID PID`, and `exited PID CODE` when a command has ended. It
reaps an ended command only when the tests say they have its code, so that its pid is not given to another
process while a test may still signal it.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the modules whose libraries the zygote imports (this project's own are then dropped, and a command imports them
# afresh): every command the tests start
COMMANDS = ("rvq_seamless_gpu_cache_nccl", "tools.extract", "tools.tokenize", "tools.encode", "tools.evaluate",
            "tools.export", "tools.report", "tools.check", "tools.doctor", "tools.launch")
# what the commands import only when they need it
LIBRARIES = ("soundfile", "soxr", "transformers.models.wav2vec2_bert.modeling_wav2vec2_bert",
             "transformers.models.seamless_m4t.feature_extraction_seamless_m4t")
# environment variables a forked command may have of its own: the launchers' (ranks, rendezvous), the project's,
# and the test pytest names in each; any other difference from the zygote's environment starts a fresh interpreter
FORKABLE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "SLURM_", "RVQ_", "ACCELERATE_", "PYTEST_CURRENT_TEST")


# ---------------------------------------------------------------- the zygote process

def project_module(module) -> bool:
    path = getattr(module, "__file__", None)
    return bool(path) and Path(path).resolve().is_relative_to(REPO) and "site-packages" not in path


def os_threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def serve() -> int:
    import importlib

    # OpenBLAS starts its threads when numpy loads: one thread, so that the zygote has no other (the tools set the
    # same before numpy loads; the trainer leaves BLAS to torch)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    for name in (*COMMANDS, *LIBRARIES):
        importlib.import_module(name)
    for name in [n for n, m in sys.modules.items() if project_module(m) and n != "__main__"]:
        del sys.modules[name]
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # a library's print in the zygote goes nowhere, not into the replies
    if os_threads() != 1:
        reply.write(f"threads {os_threads()}\n")  # a fork would copy another thread's locks: the tests start fresh
        return 1
    reply.write("ready\n")
    requests = sys.stdin.buffer.raw
    pending = b""
    running: set[int] = set()  # forks not yet seen to end
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests.fileno(), 1 << 16)
            if not chunk:
                return 0  # the pytest worker has gone
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "reap" in request:  # the tests have its exit code: its pid may now be given to another process
                    os.waitpid(request["reap"], 0)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    reply.close()
                    run_command(request, devnull)  # never returns
                running.add(pid)
                reply.write(f"started {request['id']} {pid}\n")
        for pid in list(running):
            # seen ended, not reaped: until the tests ask (`reap`), the pid stays this zombie's, so that a signal the
            # tests send it cannot reach another process that was given the pid
            try:
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                running.discard(pid)
                continue
            if ended is not None and ended.si_pid == pid:
                running.discard(pid)
                code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
                reply.write(f"exited {pid} {code}\n")


def run_command(request: dict, devnull: int) -> None:
    """In the fork: the command as the interpreter would run it, then the interpreter's exit."""
    import runpy
    import types

    code = 1
    try:
        os.dup2(devnull, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"] or request["stdout"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        try:
            if argv[0] == "-m":
                sys.argv, sys.path[0] = ["-m", *argv[2:]], request["cwd"]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":
                sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            else:
                sys.argv, sys.path[0] = list(argv), str(Path(argv[0]).resolve().parent)
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = exit_code(stop.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT  # the interpreter ends itself with SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # as the interpreter's exit: wait for the threads that are not daemons, then atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF if code >= 0 else 1)


def exit_code(code) -> int:
    """The exit code of SystemExit(code), as the interpreter gives it (a message is printed, and is 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# ---------------------------------------------------------------- the tests' side

class Forked:
    """A command forked from the zygote: what the tests use of subprocess.Popen (pid, poll, wait, returncode,
    send_signal, kill, terminate)."""

    def __init__(self, zygote: "Zygote", pid: int, args: list[str]):
        self.zygote, self.pid, self.args, self.returncode = zygote, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.zygote.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                if not self.zygote.alive():
                    raise RuntimeError(f"the tests' zygote ended before command {self.pid} did")
                self.zygote.changed.wait(0.5 if left is None else min(left, 0.5))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    def __init__(self, environ: dict):
        self.environ = environ
        self.exit_codes: dict[int, int] = {}
        self.started: dict[int, int] = {}
        self.changed = threading.Condition()
        self.lock = threading.Lock()
        self.sending = threading.Lock()  # requests from a test's thread and reaps from the reader thread
        self.next_id = 0
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=environ, cwd=REPO)
        first = self.proc.stdout.readline().decode().strip()
        if first != "ready":
            self.proc.kill()
            raise RuntimeError(f"the tests' zygote did not start ({first or 'no answer'})")
        threading.Thread(target=self._read, daemon=True, name="zygote replies").start()
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, *fields = line.decode().split()
            with self.changed:
                if kind == "started":
                    self.started[int(fields[0])] = int(fields[1])
                elif kind == "exited":
                    self.exit_codes[int(fields[0])] = int(fields[1])
                self.changed.notify_all()
            if kind == "exited":  # the tests have its code now
                self._send({"reap": int(fields[0])})
        with self.changed:
            self.changed.notify_all()

    def _send(self, request: dict) -> None:
        with self.sending:
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # the zygote has ended (or is closed): nothing to reap
                if "reap" not in request:
                    raise

    def forkable(self, environ: dict) -> bool:
        keys = set(environ) | set(self.environ)
        return all(environ.get(k) == self.environ.get(k) or k.startswith(FORKABLE) for k in keys)

    def start(self, argv: list[str], *, env: dict, cwd: Path, stdout: Path, stderr: Path | None) -> Forked:
        with self.lock:
            self.next_id += 1
            request_id = self.next_id
            self._send({"id": request_id, "argv": [str(a) for a in argv], "env": env, "cwd": str(cwd),
                        "stdout": str(stdout), "stderr": None if stderr is None else str(stderr)})
            with self.changed:
                while request_id not in self.started:
                    if not self.alive():
                        raise RuntimeError("the tests' zygote ended")
                    self.changed.wait(0.5)
                return Forked(self, self.started.pop(request_id), [sys.executable, *argv])

    def close(self) -> None:
        if self.alive():
            with self.sending:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        atexit.unregister(self.close)


_zygote: Zygote | None = None
_failed = False


def zygote_for(environ: dict, base: dict) -> Zygote | None:
    """This worker's zygote, started with the environment `base` (the tests' commands' own), when a command with
    `environ` may be forked from it; else None (start it fresh)."""
    global _zygote, _failed
    if os.environ.get("RVQ_TESTS_FRESH") == "1" or _failed or not hasattr(os, "fork"):
        return None
    base = {k: v for k, v in base.items() if not k.startswith(FORKABLE)}
    if _zygote is None or not _zygote.alive() or _zygote.environ != base:
        # (again when the tests' environment has changed since: a tool imported in a test sets a variable for good)
        if _zygote is not None:
            _zygote.close()
        try:
            _zygote = Zygote(base)
        except (OSError, RuntimeError):
            _failed = True
            return None
    return _zygote if _zygote.forkable(environ) else None


if __name__ == "__main__":
    sys.exit(serve())
