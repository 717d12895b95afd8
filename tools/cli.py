"""How every tool starts and ends: INFO logs on stderr tagged with the tool's name, and a BadInputError
(bad flags or data, nothing written) logged as an error and returned as exit code 2; and how its --help
shows each flag's default."""
from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

from errors import EXIT_BAD_INPUT, BadInputError


def bad_input_exits_2(log: logging.Logger) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorates a tool's main(): a BadInputError is logged on `log` and main returns EXIT_BAD_INPUT."""
    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except BadInputError as e:
                log.error("%s", e)
                return EXIT_BAD_INPUT
        return guarded
    return decorate


def run(main: Callable[[], int], name: str) -> None:
    """`python -m tools.NAME`: log lines as `HH:MM:SS [name] LEVEL message` on stderr; exit with main()'s code."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{name}] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    sys.exit(main())
