"""Errors that are the user's to fix: the CLI prints them as one line, without a traceback."""


class PipelineError(Exception):
    """A mistake in input, configuration or environment that the user can correct.

    The message must say what is wrong (naming the file, line or key) and what to do.
    """

    exit_code = 2


class ConfigError(PipelineError):
    """A configuration key, value or combination is invalid."""


class InputError(PipelineError):
    """An input file is missing, unreadable or malformed (``--strict``), or an output would be clobbered."""
