"""User-facing errors, and how the commands turn any exception into one line and an exit status."""
from __future__ import annotations

import signal

from dspark.extras import install_hint


class DSparkError(Exception):
    """A user-facing error: the message is one actionable line, printed without a traceback."""


class Terminated(BaseException):
    """SIGTERM arrived: raised like KeyboardInterrupt so every `finally`/`except BaseException` cleans up."""


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: what failed and on which file (disk full, read-only file system, ...)."""
    name = e.filename if e.filename is not None else ""
    return f"{e.strerror or type(e).__name__}{': ' + str(name) if name else ''}"


def exit_report(e: BaseException) -> tuple[str, int]:
    """(the one line to print, the exit status) for an exception that ends a command."""
    if isinstance(e, DSparkError):
        return f"error: {e}", 2
    if isinstance(e, OSError):
        return f"error: {describe_os_error(e)}", 2
    if hint := install_hint(e):  # an optional package imported by a command that needs it
        return f"error: {hint}", 2
    if isinstance(e, UnicodeError):
        return f"error: text that is not UTF-8 ({getattr(e, 'reason', e)})", 2
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(e, Terminated):
        return "terminated", 143
    # the last line of defence: every known bad input is refused before this
    return f"error: internal error ({type(e).__name__}: {first_line(e)}); please report it to the dspark project", 2


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut at `limit` characters ('' when it has none)."""
    return (str(e).strip().splitlines() or [""])[0][:limit]


def on_sigterm(handler):
    """Install a SIGTERM handler where Python allows it (the main thread); returns the previous one."""
    try:
        return signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)
    except ValueError:  # not the main thread (e.g. an embedding application)
        return None


def raise_terminated(signum, frame):
    raise Terminated()
