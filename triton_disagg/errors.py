"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """A mistake in input, config or files, with a message naming what is wrong and the fix."""
