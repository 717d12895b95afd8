"""Exit codes and the exceptions that map to them: the ground floor every package imports.

The README's "When a run fails" table lists the same codes for users.
"""

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
