"""How every tool starts and ends: INFO logs on stderr tagged with the tool's name; a BadInputError (bad flags
or data, nothing written) logged in one line and returned as exit code 2, a TransientFault (an OS error or
exhausted memory reading a checkpoint: a rerun may succeed) in one line as exit code 1."""
from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

from errors import EXIT_BAD_INPUT, BadInputError, TransientFault
from training.log_stream import log_to_stderr, report_crashes


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


def run(main: Callable[[], int], name: str) -> None:
    """`python -m tools.NAME`: log lines as `HH:MM:SS [name] LEVEL message` on stderr; exit with main()'s code."""
    log_to_stderr(name)  # beside the tool's progress bar, never glued to it
    report_crashes()
    sys.exit(main())
