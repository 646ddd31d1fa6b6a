"""Errors that reach an operator as one line and an exit code (no traceback without --debug)."""

from __future__ import annotations

from typing import TypeVar


class LlmgwError(Exception):
    """Base: the message is shown as is; `exit_code` is the process exit status."""

    exit_code = 1


class UsageError(LlmgwError):
    """Bad input from the operator: a flag, a file, a config."""

    exit_code = 2


class Unreachable(LlmgwError):
    """The server (or another peer) cannot be reached."""

    exit_code = 3


# ---- exception groups ------------------------------------------------------------------------
# An error raised inside a trio nursery arrives wrapped in an exception group (nested when nurseries
# nest); these are the one place that looks inside one.

E = TypeVar("E", bound=BaseException)


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside a (nested) exception group, depth first; an exception alone is its own leaf."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves(sub)]
    return [exc]


def first_leaf(group: BaseExceptionGroup, kind: type[E]) -> E:
    """The first leaf of `kind`, as in `except* kind as group: first_leaf(group, kind)`."""
    for leaf in leaves(group):
        if isinstance(leaf, kind):
            return leaf
    raise LookupError(f"no {kind.__name__} in {group!r}")


def unwrap(group: BaseExceptionGroup) -> BaseException:
    """When every leaf is an operator-facing error (or Ctrl-C), the first of them, to be reported
    as if it had been raised alone; otherwise the group itself."""
    found = leaves(group)
    for kind in (KeyboardInterrupt, LlmgwError):
        if all(isinstance(leaf, kind) for leaf in found):
            return found[0]
    return group
