"""Errors the CLI reports as one `error: ...` line with exit code 2 (no traceback unless --debug)."""


class UsageError(Exception):
    """A mistake in the user's input: a flag, an environment variable, a config file, a data file.

    The message is one line that names the place, e.g. `x.toml: [sampling].top_p: must be in (0, 1], got 2`.
    """


class RunError(Exception):
    """A run that cannot go on for a reason outside the user's input (e.g. a tensor-parallel rank
    died): one `error: ...` line and exit code 1."""
