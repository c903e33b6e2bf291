"""The kvcm exception hierarchy.

Every error a user can see subclasses :class:`KvcmError`. Messages say what was wrong, with
the offending value, and what is allowed, so that no ``AssertionError``, ``IndexError`` or
``KeyError`` ever reaches an engine.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "ConfigError",
    "CorruptPageError",
    "InvalidArgumentError",
    "InvalidStateError",
    "KvcmError",
    "OutOfPagesError",
    "PluginError",
    "TierIOError",
]


class KvcmError(Exception):
    """Base class of every kvcm error."""


class ConfigError(KvcmError, ValueError):
    """A configuration value breaks a rule.

    Attributes:
        field: dotted path of the offending field (``"levels[1].quota"``).
        value: the offending value.
        rule: the rule it breaks, in words.
    """

    def __init__(self, field: str, value: object, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"{field}={_shown(value)}: {rule}")


def _shown(value: object) -> str:
    """``repr(value)``, or a description where it cannot be printed (an int of more digits
    than ``sys.get_int_max_str_digits()``, or a value holding one)."""
    try:
        return repr(value)
    except ValueError:
        if isinstance(value, int):
            return f"<an int of {value.bit_length()} bits>"
        return f"<a {type(value).__name__} that cannot be printed>"


class PluginError(KvcmError):
    """A plugin failed to load, is duplicated, unknown or unavailable."""


class OutOfPagesError(KvcmError):
    """A level cannot free enough slots, even after evicting everything it may."""


class InvalidStateError(KvcmError):
    """An operation was called in a state that does not allow it (e.g. on a closed cache)."""


class CorruptPageError(KvcmError):
    """A stored page failed its frame check (checksum, length, key, sequence...); it is
    never returned as KV.

    Attributes:
        pages: internal page ids found corrupt (set by the core where known).
        block: ordinal of the first bad block of the request (``resume`` sets it).
        group: cache group of that block.
    """

    def __init__(self, message: str, *, pages: tuple[int, ...] = (), block: int | None = None,
                 group: int | None = None) -> None:
        super().__init__(message)
        self.pages = pages
        self.block = block
        self.group = group


class TierIOError(KvcmError, OSError):
    """A storage tier's read or write failed.

    ``maybe_applied`` (True unless the tier knows better) says whether a failed write may
    have been applied all the same; a tier sets it False where nothing reached the store
    (the call was given up before it was sent, its connection failed to open) or the
    store refused every command with an error reply."""

    maybe_applied: bool = True


class InvalidArgumentError(KvcmError, ValueError):
    """An argument of an API call has a value the call does not allow (the message names
    the argument, the value and the rule)."""


class ArgumentTypeError(KvcmError, TypeError):
    """An argument of an API call has a type the call does not take."""
