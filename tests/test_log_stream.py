"""Log lines beside progress bars (training/log_stream.py): never glued to a bar's line, in the moments a stop
signal's line can be written in, in a file as a cluster job's log is."""
import io
import re
import logging
import os
import signal

import pytest
from tqdm import tqdm

from training.log_stream import BarAwareHandler


class Log(io.StringIO):
    """A job's log file: what was written, with a hook called on each write."""

    def __init__(self):
        super().__init__()
        self.on_write = lambda text: None

    def write(self, text):
        n = super().write(text)
        self.on_write(text)
        return n


def logger_on(stream) -> logging.Logger:
    log = logging.getLogger(f"test_log_stream.{id(stream)}")
    log.propagate = False
    log.handlers[:] = [BarAwareHandler(stream)]
    log.handlers[0].setFormatter(logging.Formatter("LOG %(message)s"))
    log.setLevel(logging.INFO)
    return log


def lines_after_bar_clears(text: str) -> list[str]:
    """The file's lines as a terminal ends up showing them: a carriage return starts the line over."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


@pytest.mark.timeout(30)
def test_a_line_written_while_a_bar_is_drawn_but_not_yet_fully_made_is_not_glued_to_it():
    stream = Log()
    log = logger_on(stream)
    bar = tqdm(total=20, desc="k-means init", file=stream, leave=False, mininterval=1.0)
    try:
        del bar.start_t  # the moment between a bar's first draw and the end of its making (tqdm sets it last)
        log.warning("SIGINT received")
    finally:
        bar.start_t = bar.last_print_t
        bar.close()
    assert "LOG SIGINT received" in lines_after_bar_clears(stream.getvalue()), repr(stream.getvalue())


@pytest.mark.timeout(30)
def test_a_signal_handlers_line_during_another_lines_write_comes_after_it_whole():
    stream = Log()
    log = logger_on(stream)
    previous = signal.signal(signal.SIGUSR1, lambda *_: log.warning("SIGUSR1 received"))
    bar = tqdm(total=20, desc="train", file=stream, leave=False, mininterval=1.0)
    try:
        def in_the_middle(text):
            if text.startswith("LOG step"):  # the line is written, its end not yet: the signal comes here
                stream.on_write = lambda text: None
                os.kill(os.getpid(), signal.SIGUSR1)
                sum(range(1000))  # Python code runs: the handler runs here, inside the write

        stream.on_write = in_the_middle
        log.info("step 5")
    finally:
        bar.close()
        signal.signal(signal.SIGUSR1, previous)
    lines = lines_after_bar_clears(stream.getvalue())
    assert lines.index("LOG step 5") + 1 == lines.index("LOG SIGUSR1 received"), repr(stream.getvalue())


@pytest.mark.timeout(120)
def test_a_run_s_last_line_is_its_own_not_a_library_s_at_the_interpreter_s_exit(tmp_path):
    """The trainer's script, in an interpreter of its own (not a test's fork, whose exit skips finalization): its
    last line says what to do next. Left to the interpreter's finalization, Triton's bindings (loaded by torch's
    compiler, imported with the quantizer library) printed 30-40 lines of `nanobind: leaked ...` after it."""
    import subprocess
    import sys

    from tests.helpers import QUICK, REPO, TINY, TRAINER, env

    r = subprocess.run([sys.executable, str(TRAINER), "--output_dir", str(tmp_path / "run"), "--max_steps", "3",
                        "--compile", "off", *TINY, *QUICK], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=100)
    last = r.stderr.rstrip("\n").rsplit("\n", 1)[-1]
    assert r.returncode == 0 and re.search(rf"\[rank0\] INFO next, from {re.escape(str(REPO))}: python -m "
                                           r"tools\.report ", last), r.stderr[-3000:]
    assert "nanobind" not in r.stderr
