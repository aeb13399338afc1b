"""The builders' error type: one line, starting with the offending file."""

from triton_disagg.errors import UserError


class CheckpointError(UserError):
    """A checkpoint directory that is missing, unsupported or corrupt."""


def one_line(exc: Exception) -> str:
    """An exception's message folded onto one line, for error messages that quote it."""
    return " ".join(str(exc).split())
