"""Errors that reach an operator as one line and an exit code (no traceback without --debug)."""

from __future__ import annotations


class LlmgwError(Exception):
    """Base: the message is shown as is; `exit_code` is the process exit status."""

    exit_code = 1


class UsageError(LlmgwError):
    """Bad input from the operator: a flag, a file, a config."""

    exit_code = 2


class Unreachable(LlmgwError):
    """The server (or another peer) cannot be reached."""

    exit_code = 3
