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
import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from kvcm_core.errors import KvcmError

__all__ = ["PIPE_WIDTH", "OutputError", "atomic_output", "int_at_least", "make_console",
           "silence_stdout"]


class OutputError(KvcmError, OSError):
    """A result file (a report, a plot, a benchmark's JSON) could not be written: the
    message names the file and the system's reason. Whatever was there before is left as
    it was (:func:`atomic_output`)."""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], *, overwrite: bool = True,
                  what: str = "--out") -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write to; when the block ends without an
    error it becomes ``path`` in one step (``os.replace``; with ``overwrite=False`` it is
    linked in place and an existing ``path`` is refused), else it is removed, so that a
    failed write (disk full, a folder in the way) never leaves a cut-off file nor replaces
    a good one.

    Raises:
        OutputError: the temporary file cannot be made, written or put in place (naming
            ``what``, the file and the reason); the previous ``path`` is untouched.
    """
    # A link is followed (its target is what gets written, as open() would); a file that
    # exists keeps its mode.
    path = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = 0o666 & ~_umask()  # as open() would make it, not mkstemp's 0600
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.",
                                        suffix=".tmp")
        os.close(fd)
        os.chmod(tmp_name, mode)
    except OSError as exc:
        raise OutputError(f"{what}: cannot write {path}: {exc.strerror or exc}") from None
    tmp = Path(tmp_name)
    try:
        yield tmp
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if path exists: never overwrite
            except FileExistsError:
                raise
            except OSError:  # no hard links on this file system
                if os.path.lexists(path):
                    raise FileExistsError(17, "File exists", str(path)) from None
                os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"{what}: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()

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
