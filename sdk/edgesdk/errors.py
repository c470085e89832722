"""Errors a user can act on.

Every failure that reaches the command line is an `EdgeSDKError`: a stable code
(`legalize.unsupported-op`), a lowercase message saying what is wrong and where,
and a hint saying what to do. The CLI prints `error: ...` and `hint: ...` and
exits with the error's exit code; a traceback is shown only with `--debug`.
"""

from __future__ import annotations

# Exit codes, as uv and ruff use them.
EXIT_OK = 0
EXIT_USER = 1  # the model, the bundle or the data is at fault
EXIT_USAGE = 2  # a wrong invocation or a bad target/config file
EXIT_INTERNAL = 3  # a bug in edgesdk
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT (128 + 2)


class EdgeSDKError(Exception):
    """A failure with a stable code, a message naming what and where, and a hint."""

    exit_code = EXIT_USER

    def __init__(self, code: str, message: str, hint: str = "", *, notes: list[str] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint
        self.notes = list(notes or [])

    def __str__(self) -> str:
        return f"{self.message} [{self.code}]"


class UserError(EdgeSDKError):
    """The model, bundle or data the user gave is at fault (exit 1)."""

    exit_code = EXIT_USER


class UsageError(EdgeSDKError):
    """A wrong invocation, or a target/config file that does not validate (exit 2)."""

    exit_code = EXIT_USAGE
