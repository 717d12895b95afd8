"""Exit codes, the exceptions that map to them, and who a message answers: the ground floor every package imports.

The README's "When a run fails" table lists the same codes for users.
"""
from __future__ import annotations

from pathlib import PurePath

EXIT_OK = 0  # done, or stopped on request with a checkpoint written
EXIT_FAILURE = 1  # anything else
EXIT_BAD_INPUT = 2  # bad flags or data; nothing written
EXIT_DISTRIBUTED = 3  # peer lost, timeout or desync; the rank is named
EXIT_INTERRUPTED = 130  # ended by Ctrl-C (SIGINT) before it finished: 128 + SIGINT, as a shell reports it

# what a BadInputError says to run when a library for corpora as shipped (tar, parquet, Lhotse) or for parquet codes
# cannot be imported: those libraries are optional
SOURCES_INSTALL = "pip install -r requirements-sources.txt"


class BadInputError(Exception):
    """A problem the user can fix in their flags or data: exit code 2, nothing written."""

    exit_code = EXIT_BAD_INPUT


class DistributedFailure(Exception):
    """A rank was lost, timed out or diverged: exit code 3."""

    exit_code = EXIT_DISTRIBUTED


class TransientFault(Exception):
    """A fault of the machine, not of the user's input nor of a file: an OS error (EIO, ESTALE, disk full) or
    exhausted memory while reading or writing the run's files. Exit code 1 with one line; every file is kept, and
    a restart may succeed."""

    exit_code = EXIT_FAILURE


class RanksDiverged(DistributedFailure):
    """Every rank found the same mismatch in one exchange (a sync check): the process groups are still intact."""


class Asker:
    """Who asked, and so how a message names an option: the command line (`--checkpoint RUN`, `--device cuda`) or
    Python (`source='RUN'`, `device='cuda'`). The messages the commands and rvq_tokenizer share (a codec's file, the
    device, the codes and the features asked for) take their words from the Asker they are given."""

    # a command-line flag -> the keyword rvq_tokenizer takes for it, where the two names differ
    KEYWORDS = {"checkpoint": "source", "num_quantizers": "levels"}

    def __init__(self, python: bool, positional: tuple[str, ...] = ()):
        self.python = python
        self.positional = positional  # options a command takes as positional arguments: named as `name value`

    def option(self, name: str, value=None) -> str:
        """Option `name` (a flag's name, without dashes) with `value`, as the asker types it: `--name value`, or
        `keyword=value` in Python (a string or path quoted); `name value` for one the command takes as a
        positional argument."""
        if not self.python:
            flag = name if name in self.positional else f"--{name}"
            return flag if value is None else f"{flag} {value}"
        keyword = self.KEYWORDS.get(name, name)
        if value is None:
            return f"{keyword}="
        return f"{keyword}={str(value)!r}" if isinstance(value, (str, PurePath)) else f"{keyword}={value!r}"


COMMAND_LINE = Asker(python=False)
PYTHON = Asker(python=True)
