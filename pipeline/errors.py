"""Errors that are the user's to fix: the CLI prints them as one line, without a traceback."""

import sys


class PipelineError(Exception):
    """A mistake in input, configuration or environment that the user can correct.

    The message must say what is wrong (naming the file, line or key) and what to do.
    """

    exit_code = 2


class ConfigError(PipelineError):
    """A configuration key, value or combination is invalid."""


class InputError(PipelineError):
    """An input file is missing, unreadable or malformed (``--strict``), or an output would be clobbered."""


def write_error_line(message: object) -> None:
    """``error: MESSAGE`` and its newline on stderr in one write, flushed.

    ``print`` writes the text and the newline separately: with several ranks on one stderr (a launcher
    joins them) and stderr unbuffered, another rank's line could land between the two, and two error
    lines ran together into one. One write keeps each rank's line whole.
    """
    sys.stderr.flush()  # anything pending (a progress bar) first
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
