"""How every tool starts and ends: INFO logs on stderr tagged with the tool's name; a BadInputError (bad flags
or data, nothing written) logged in one line and returned as exit code 2, a TransientFault (an OS error or
exhausted memory reading a checkpoint: a rerun may succeed) in one line as exit code 1; Ctrl-C (SIGINT) in one
line, the process ending by SIGINT as SIGTERM ends it by SIGTERM (130 and 143 in a shell), never with 0: a tool
stopped has not finished, so `extract && train` goes no further."""
from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable

from errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, BadInputError, TransientFault
from training.log_stream import end_process, log_to_stderr, report_crashes


def bad_input_exits_2(log: logging.Logger) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorates a tool's main(): a BadInputError is logged on `log` and main returns EXIT_BAD_INPUT; a
    TransientFault is logged and main returns its exit code (1)."""
    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except BadInputError as e:
                log.error("%s", e)
                return EXIT_BAD_INPUT
            except TransientFault as e:
                log.error("%s", e)
                return e.exit_code
        return guarded
    return decorate


def run(main: Callable[[], int], name: str, *, resumes: bool = False) -> None:
    """`python -m tools.NAME`: log lines as `HH:MM:SS [name] LEVEL message` on stderr; exit with main()'s code.
    On Ctrl-C, main's clean-up runs as the KeyboardInterrupt unwinds it (the shard writer commits the window it
    holds), one line says the tool stopped (and, for a tool that `resumes` from its commits, that the same command
    goes on from the last one), and the process ends by SIGINT (`interrupted`)."""
    log_to_stderr(name)  # beside the tool's progress bar, never glued to it
    report_crashes()
    try:
        code = main()
    except KeyboardInterrupt:
        logging.getLogger(name).error(
            "stopped by SIGINT (Ctrl-C) before it finished: %s", "the same command resumes from the last commit"
            if resumes else "run the same command again to finish it")
        code = interrupted()
    end_process(code)


def interrupted() -> int:
    """End the process by SIGINT's default action, as Python ends a script that Ctrl-C stopped (bpo-1054041), so
    that the shell running it (a loop over shards) stops too, as after Ctrl-C on any command it waits for; the
    exit code where that fails."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    return EXIT_INTERRUPTED
