"""Errors a user can fix. Every surface prints them as one line and exits 2."""


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""

    exit_code = 2


class RuntimeFailure(Exception):
    """Something failed that the user did not cause (exit code 1)."""

    exit_code = 1
