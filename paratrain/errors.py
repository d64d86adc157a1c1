"""Errors a user can fix. The CLI prints their message alone, without a traceback, and exits 2."""

EXIT_USER_ERROR = 2  # the documented exit code for bad input


class ConfigError(ValueError):
    """Bad input found before training starts: the message names the key, the value and the fix."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or loaded: the message names the file and what to do."""
