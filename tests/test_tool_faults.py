"""The audio tools under the faults of the field: the main process SIGKILLed with its decoding workers alive, file
names a .tsv cannot hold, a manifest with a byte-order mark, a full file system, a file-size limit. Each ends in a
listed skip or a resumable exit, never a traceback, an orphan or a held lock; each resume writes the bytes of a run
never stopped."""
import json
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from rvq_tokenizer.pipeline_settings import default_workers
from tests.audio_helpers import CORPUS, write_corpus
from tests.helpers import REPO, _state, env
from tools import extract

pytestmark = pytest.mark.slow  # end to end: processes, ranks or compiles (pytest.ini)

SHARD = "train_0_1"
# longer than the tool reads ahead (files the window thread, the writer's queue and the workers hold: about 20 at
# --commit_files 2), so that a stop at an early commit finds the workers still decoding
LONG_CORPUS = [(f"r{copy}/{rel}", *rest) for copy in range(4) for rel, *rest in CORPUS]
DUMP = (".npy", ".len", ".tsv", ".skipped", ".json")


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO)


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tool_faults") / "audio"
    write_corpus(folder, LONG_CORPUS)
    return folder


@pytest.fixture(scope="module")
def unbroken(audio, tmp_path_factory) -> Path:
    """The dump of a run never stopped."""
    out = tmp_path_factory.mktemp("unbroken")
    assert extract.main([audio, "train", 1, 0, out, "--commit_files", 2, "--num_workers", 0]) == 0
    return out


def dump_bytes(folder: Path) -> dict:
    return {ext: (folder / (SHARD + ext)).read_bytes() for ext in DUMP}


def tool(args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tools.extract", *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def gone(pid: int) -> bool:
    return _state(pid) in ("", "Z")  # a zombie has ended: its parent (init here) has yet to reap it


def stopped_before_its_second_commit(args: list, out: Path) -> tuple[subprocess.Popen, list[int]]:
    """(tools.extract stopped (SIGSTOP) by RVQ_FAULT's hang before its second commit, its 2 decoding workers busy,
    their pids). The caller ends every one of them."""
    main = tool(args, env=env(RVQ_FAULT="hang:step=2"))
    deadline = time.monotonic() + 90
    while _state(main.pid) != "T":
        if main.poll() is not None or time.monotonic() >= deadline:
            main.kill()
            pytest.fail(main.communicate(timeout=30)[1][-3000:])
        time.sleep(0.1)
    workers = children(main.pid)
    committed = json.loads((out / f"{SHARD}.progress").read_text())
    if len(workers) != 2 or any(gone(w) for w in workers) or committed["done"] != 2:
        # the stop lands before the writer thread's commit (faults.stop_this_process)
        end(main.pid, *workers)
        pytest.fail(f"stopped with workers {workers} and {committed} committed; its log: "
                    f"{main.communicate(timeout=30)[1][-3000:]}")
    return main, workers


def end(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_gone(workers: list[int]) -> None:
    deadline = time.monotonic() + 3  # a kernel signal: no worker waits for torch's own 5-s check
    while not all(gone(w) for w in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their main process"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_sigkilled_main_process_leaves_no_worker_and_the_same_command_resumes(audio, unbroken, tmp_path):
    """The OOM killer's SIGKILL on the main process alone, its 2 decoding workers busy: they end with it, hold no
    lock, and the same command resumes to the bytes of a run never stopped."""
    out = tmp_path / "feats"
    args = [audio, "train", 1, 0, out, "--commit_files", 2, "--num_workers", 2]
    main, workers = stopped_before_its_second_commit(args, out)
    try:
        main.kill()
        main.wait(10)
        wait_gone(workers)
    finally:
        end(main.pid, *(w for w in workers if not gone(w)))
    again = tool(args, env=env())
    _, err = again.communicate(timeout=90)
    assert again.returncode == 0, err[-3000:]
    assert f"resuming at file 2 of {len(LONG_CORPUS)}" in err
    assert dump_bytes(out) == dump_bytes(unbroken)


@pytest.mark.timeout(120)
def test_ctrl_c_ends_a_tool_in_one_line_by_sigint_and_the_same_command_resumes(audio, unbroken, tmp_path):
    """Ctrl-C (SIGINT) on the main process, its writer about to commit and its 2 decoding workers busy: one line
    instead of a traceback, the process ended by SIGINT (130 in a shell: not done, so `extract && train` stops),
    no worker left, and the same command resumes to the bytes of a run never stopped."""
    out = tmp_path / "feats"
    args = [audio, "train", 1, 0, out, "--commit_files", 2, "--num_workers", 2]
    main, workers = stopped_before_its_second_commit(args, out)
    try:
        main.send_signal(signal.SIGINT)
        main.send_signal(signal.SIGCONT)  # the SIGINT is taken as it goes on
        _, err = main.communicate(timeout=60)
        wait_gone(workers)
    finally:
        end(main.pid, *(w for w in workers if not gone(w)))
    assert main.returncode == -signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert re.search(r"\n\d\d:\d\d:\d\d \[extract\] ERROR stopped by SIGINT \(Ctrl-C\) before it finished: the same "
                     r"command resumes from the last commit\n$", err), err[-3000:]
    again = tool(args, env=env())
    _, err = again.communicate(timeout=90)
    assert again.returncode == 0, err[-3000:]
    resumed = re.search(rf"resuming at file (\d+) of {len(LONG_CORPUS)}", err)
    assert resumed and int(resumed[1]) >= 4, err[-3000:]  # the window the writer held was committed as it ended
    assert dump_bytes(out) == dump_bytes(unbroken)


@pytest.mark.timeout(120)
def test_a_crash_in_native_code_leaves_every_threads_stack_and_the_same_command_resumes(audio, unbroken, tmp_path):
    """A segmentation fault on the writer thread as it commits: the log holds each thread's Python stack (the
    crashing one's first named current), and the same command resumes to the bytes of a run never stopped."""
    out = tmp_path / "feats"
    args = [audio, "train", 1, 0, out, "--commit_files", 2, "--num_workers", 0]
    crashed = tool(args, env=env(RVQ_FAULT="kill:step=2:sig=SEGV"))
    _, err = crashed.communicate(timeout=90)
    assert crashed.returncode == -signal.SIGSEGV, err[-3000:]
    crash = err[err.index("Fatal Python error: Segmentation fault"):]
    assert re.search(r"Current thread 0x[0-9a-f]+ \(most recent call first\):\n\s+File \".*training/faults\.py\", "
                     r"line \d+ in kill_this_process\n\s+File \".*training/faults\.py\", line \d+ in before_commit",
                     crash), crash
    assert re.search(r"\nThread 0x[0-9a-f]+ \(most recent call first\):\n(\s+File .*\n)*?"
                     r"\s+File \".*tools/extract\.py\", line \d+ in main\n", crash), crash  # the main thread's
    again = tool(args, env=env())
    _, err = again.communicate(timeout=90)
    assert again.returncode == 0, err[-3000:]
    assert f"resuming at file 2 of {len(LONG_CORPUS)}" in err
    assert dump_bytes(out) == dump_bytes(unbroken)


HANG_ON_A_THREAD = """
import os, sys, threading, time
from tests.helpers import _state
from training.faults import FaultInjector

went_on = 0
for attempt in range(int(sys.argv[1])):
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the tool's shape: a writer thread hits the fault, the main thread waits on it
        os.close(read)
        faults = FaultInjector(0, "hang:step=1")

        def writer():
            faults.before_commit(1)
            os.write(write, b"committed")  # what the stop must come before

        threading.Thread(target=writer).start()
        time.sleep(60)
        os._exit(0)
    os.close(write)
    while _state(child) != "T":
        time.sleep(0.01)
    time.sleep(0.1)  # time enough for a thread left running to write
    os.set_blocking(read, False)
    try:
        went_on += bool(os.read(read, 64))
    except BlockingIOError:
        pass
    os.kill(child, 9)
    os.waitpid(child, 0)
    os.close(read)
print(went_on)
"""


@pytest.mark.timeout(60)
def test_a_hang_fired_on_a_writer_thread_stops_the_process_before_that_thread_goes_on():
    """The tools fire RVQ_FAULT's hang on their writer thread, between writing a chunk and committing it. The
    stop must land before that thread's next line: sent to the process, it could be taken by the main thread
    while the writer went on to commit the chunk (seen in about one try in two)."""
    from tests.helpers import run_python

    job = run_python(["-c", HANG_ON_A_THREAD, "20"], env=env(), timeout=50)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.split()[-1] == "0", f"{job.stdout.split()[-1]} of 20 stopped processes committed first"


@pytest.mark.timeout(60)
def test_a_forked_child_does_not_hold_its_parents_lock(tmp_path):
    """A child forked while a lock is held (as a DataLoader forks its workers) outlives its SIGKILLed parent: the
    lock is free all the same."""
    from data.writer_lock import WriterLock

    script = ("import os, signal, sys, time\nfrom data.writer_lock import WriterLock\n"
              "lock = WriterLock(sys.argv[1], 'the shard').acquire()\n"
              "child = os.fork()\n"
              "if child == 0:\n    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n    os.dup2(1, 2)\n"
              "    time.sleep(60)\n    os._exit(0)\n"
              "print(child, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    parent = subprocess.run([sys.executable, "-c", script, str(tmp_path / ".lock")], cwd=REPO, env=env(),
                            capture_output=True, text=True, timeout=30)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    child = int(parent.stdout.split()[0])
    try:
        assert not gone(child)
        with WriterLock(tmp_path / ".lock", "the shard") as lock:
            assert lock.held
    finally:
        os.kill(child, signal.SIGKILL)


NAMES = {  # name on disk -> the reason it is skipped (None: kept)
    b"caf\xe9.wav": "is not UTF-8",
    b"two\nlines.wav": "a line break or a tab",
    b"tab\tbed.wav": "a line break or a tab",
    "form\x0cfeed \u2028sep.wav".encode(): None,  # str.splitlines() would cut these; a .tsv line holds them
    b"plain.wav": None,
}


def named_corpus(folder: Path) -> None:
    import soundfile as sf

    from tests.audio_helpers import voice_like

    folder.mkdir(parents=True)
    for k, name in enumerate(NAMES):
        sf.write(os.fsencode(folder) + b"/" + name, voice_like(1.0, 16000, k), 16000, subtype="PCM_16")
    assert len(os.listdir(os.fsencode(folder))) == len(NAMES)  # every name made it onto the disk


def shown(name: bytes) -> str:
    return name.decode("utf-8", "backslashreplace").replace("\n", "\\n").replace("\t", "\\t")


@pytest.mark.timeout(60)
def test_names_a_tsv_cannot_hold_are_skipped_and_listed(tmp_path, caplog):
    """A folder holding a non-UTF-8 name, a newline and a tab: those three skipped, each listed on one line with
    its reason; every other file kept, its .tsv line by line as the audio."""
    folder = tmp_path / "audio"
    named_corpus(folder)
    out = tmp_path / "feats"
    assert extract.main([folder, "train", 1, 0, out, "--num_workers", 0]) == 0
    skipped = dict(line.split("\t") for line in (out / f"{SHARD}.skipped").read_text("utf-8").split("\n") if line)
    expected = {shown(name): why for name, why in NAMES.items() if why}
    assert set(skipped) == set(expected)
    assert all(why in skipped[name] for name, why in expected.items()), skipped
    kept = [n.decode() for n, why in NAMES.items() if why is None]
    tsv = (out / f"{SHARD}.tsv").read_text("utf-8").split("\n")
    assert [line.split("\t")[0] for line in tsv[1:] if line] == sorted(kept)
    assert len((out / f"{SHARD}.len").read_text().split()) == len(kept)
    assert "skipped caf\\xe9.wav: its name is not UTF-8" in caplog.text


@pytest.mark.timeout(60)
def test_a_manifest_with_a_bom_and_a_non_utf8_name_is_read(tmp_path, caplog):
    folder = tmp_path / "audio"
    named_corpus(folder)
    manifest = tmp_path / "train.tsv"
    lines = [b"plain.wav\t16000", b"caf\xe9.wav\t16000"]
    manifest.write_bytes("\ufeff".encode() + os.fsencode(folder) + b"\n" + b"\n".join(lines) + b"\n")
    out = tmp_path / "feats"
    assert extract.main([manifest, "train", 1, 0, out, "--num_workers", 0]) == 0
    assert (out / f"{SHARD}.tsv").read_text("utf-8") == f"{folder}\nplain.wav\t16000\n"
    assert (out / f"{SHARD}.skipped").read_text("utf-8").startswith("caf\\xe9.wav\tits name is not UTF-8")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real file system of its own, mounted on a folder (root only), that the test can grow."""
    folder = tmp_path / "small"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root); the file-size limit case covers a full disk")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def resize(folder: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True, capture_output=True)


def limited(size: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return preexec


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limit", ["full file system", "file-size limit"])
def test_a_full_disk_ends_in_one_line_exit_1_and_the_same_command_resumes(limit, audio, unbroken, request,
                                                                          tmp_path, caplog):
    size = (unbroken / f"{SHARD}.npy").stat().st_size // 2 // 4096 * 4096  # room for some commits, not all
    args = [audio, "train", 1, 0, None, "--commit_files", 2, "--num_workers", 0]
    if limit == "full file system":
        out = request.getfixturevalue("small_tmpfs")
        resize(out, size)
        args[4] = out
        assert extract.main(args) == 1
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    else:
        out = args[4] = tmp_path / "feats"
        proc = tool(args, env=env(), preexec_fn=limited(size))
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 1, err[-3000:]
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if "ERROR" in line]
    assert len(lines) == 1, lines
    assert f"writing shard {SHARD} in {out}" in lines[0] and " free there;" in lines[0]
    assert "its array needs about" in lines[0] and "run the same command again" in lines[0]
    assert ("ulimit -f" in lines[0]) == (limit == "file-size limit")
    committed = json.loads((out / f"{SHARD}.progress").read_text())["done"]
    assert 2 <= committed < len(LONG_CORPUS) and not (out / f"{SHARD}.npy").exists()
    if limit == "full file system":
        resize(out, 16 * size)  # space freed
    caplog.clear()
    assert extract.main(args) == 0
    assert f"resuming at file {committed} of {len(LONG_CORPUS)}" in caplog.text
    assert dump_bytes(out) == dump_bytes(unbroken)


def test_num_workers_defaults_to_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_workers() == 1  # one left for the model
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's 4 processes on this node share them
    assert default_workers() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_workers() == 0
    assert extract.parse_args(["x", "train", 1, 0, "o"]).pipeline.num_workers == 0
    assert extract.parse_args(["x", "train", 1, 0, "o", "--num_workers", 2]).pipeline.num_workers == 2


@pytest.mark.timeout(60)
def test_the_default_workers_draw_no_warning_from_torch(audio, tmp_path, caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert extract.main([audio, "train", 2, 0, tmp_path / "feats"]) == 0
    assert not [w for w in caught if "worker" in str(w.message)], [str(w.message) for w in caught]
    assert f"(--num_workers {default_workers()})" in caplog.text


def test_a_shard_begun_before_a_stream_was_added_goes_on_from_its_commit(tmp_path):
    """A shard begun by an earlier version of a tool that now writes one stream more (encode's .codes.skipped)
    resumes from its last commit, the new stream beginning empty there, not from the start."""
    import numpy as np

    from data.resumable_shard import ShardWriter
    from data.shard_layout import FEATURE_DUMP

    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    writer = ShardWriter(tmp_path, "train_0_1", FEATURE_DUMP, {"a": 1}, width=3, dtype="float32",
                         streams={".len": ""})
    writer.write(rows[:2])
    writer.append(".len", "1\n1\n")
    writer.commit(2)
    writer.close()
    writer = ShardWriter(tmp_path, "train_0_1", FEATURE_DUMP, {"a": 1}, width=3, dtype="float32",
                         streams={".len": "", ".skipped": ""})
    assert (writer.done, writer.rows) == (2, 2)
    writer.append(".skipped", "3\tnot finite\n")
    assert writer.text(".len") == "1\n1\n" and writer.text(".skipped") == "3\tnot finite\n"
    writer.close()
