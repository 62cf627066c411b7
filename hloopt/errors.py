"""Errors that reach users.

Every problem caused by input (a malformed module, a missing file, a bad target, a budget below
the floor) is a :class:`UserError`: the CLI prints its one-line message (plus an optional caret
snippet) and exits with status 2, never a traceback. Anything else is a bug in hloopt.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user gave us. ``str(err)`` is one line naming the problem and where."""

    exit_code = 2

    def __init__(self, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: Optional extra lines shown under the message (e.g. a caret snippet).
        self.detail = detail

    def __str__(self) -> str:
        return self.message


class HloParseError(UserError):
    """Malformed HLO text: ``FILE:LINE:COL: expected X, found Y`` with a caret snippet."""

    def __init__(self, message: str, *, filename: str, line: int, col: int, source_line: str) -> None:
        self.filename = filename
        self.line = line
        self.col = col
        self.reason = message
        snippet = source_line.rstrip("\n")
        if len(snippet) > 160:
            # Keep the caret visible on very long lines: show a window around the column.
            start = max(0, col - 80)
            snippet = ("..." if start else "") + snippet[start:start + 160]
            caret_col = col - start + (3 if start else 0)
        else:
            caret_col = col
        detail = snippet.expandtabs(1) + "\n" + " " * max(caret_col - 1, 0) + "^"
        super().__init__(f"{filename}:{line}:{col}: {message}", detail=detail)


class HloVerifyError(UserError):
    """A module that parses but is not well formed (undefined operand, cycle, bad tuple index...).

    ``filename``/``line``/``col`` are set where the verifier knows the offending text (0 when not).
    """

    filename: str = ""
    line: int = 0
    col: int = 0


class InfeasibleBudget(UserError):
    """The budget is below the least peak any policy can reach."""
