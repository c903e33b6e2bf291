"""Terminal output shared by the ``kvcm`` commands: consoles that never wrap or cut a
table when the output is piped, and a clean end when the reader of a pipe goes away; and
the argparse ``type=`` of their whole-number options (:func:`int_at_least`).

On a terminal a console takes the terminal's width. Piped into a file or another program
(``kvcm simulate > out.txt``, ``kvcm plugins | grep cuda``) there is no width to respect:
rich would otherwise assume 80 columns and wrap or cut table cells, so the console gets
room enough for every table row to stay on one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console

__all__ = ["PIPE_WIDTH", "int_at_least", "make_console", "silence_stdout"]

#: Columns a console gets when its output is not a terminal: wider than any table kvcm
#: prints, so no row wraps (lines are not padded to it).
PIPE_WIDTH = 1000


class _Console(Console):
    """A rich console that lets a broken pipe end the command the way ``kvcm`` ends it
    everywhere (exit status 141, as a process killed by SIGPIPE): rich's own handling
    exits 1, the status a failed verification has."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(32, "the reader of the output went away")


def make_console(stderr: bool = False, **kwargs: Any) -> Console:
    """A rich console for stdout (or stderr): the terminal's width on a terminal, else
    :data:`PIPE_WIDTH` columns."""
    console = _Console(stderr=stderr, **kwargs)
    if console.is_terminal:
        return console
    return _Console(stderr=stderr, width=PIPE_WIDTH, **kwargs)


def silence_stdout() -> None:
    """After a ``BrokenPipeError`` (the reader of our stdout went away, as ``| head``
    does): point stdout at the null device so that the interpreter's final flush does not
    raise again and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (e.g. captured output)
        pass


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=``: a whole number ``>= low``. Anything else is a usage error (exit
    status 2) naming the option (argparse adds it), the value and the rule, before any
    work: ``argument --reps: 0: must be an int >= 1``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: must be an int >= {low}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: must be an int >= {low}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse
