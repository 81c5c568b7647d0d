"""The ``ckptstore`` program: the parser of every command, and where errors become exit codes.

This is the one place errors become exit codes and messages (twine's ``__main__.py`` is the
model):

- 0: all is well;
- 1: a problem was found (a checkpoint fails to verify, no store or checkpoint there, a
  corrupt input, any :class:`~ckptstore.errors.CkptStoreError`, an unreadable path, an object
  store that cannot be reached): one line on stderr, ``ckptstore: error: <message>``, never a
  traceback;
- 2: usage errors (unknown options, bad values, missing flags, a metric the store lacks).

With ``--json`` an error is also a JSON object on stdout: ``{"error": kind, "message": line}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

from .._version import __version__
from ..errors import CkptStoreError
from ..ops.stores import is_local, remote_error
from . import (
    completion,
    diff,
    export,
    gc,
    import_,
    inspect,
    ls,
    pin,
    prune,
    replicate,
    rm,
    verify,
)
from ._common import Command, UsageError
from ._output import one_line

__all__ = ["build_parser", "main"]

PROG = "ckptstore"

#: Every command: its name, its help, and the module that parses and runs it.
COMMANDS: list[tuple[str, str, Command]] = [
    (ls.NAME, ls.HELP, ls),
    (verify.NAME, verify.HELP, verify),
    (prune.NAME, prune.HELP, prune),
    (gc.NAME, gc.HELP, gc),
    (rm.NAME, rm.HELP, rm),
    (pin.NAME, pin.HELP, pin),
    ("unpin", "unpin steps: retention may delete them again", pin),
    (inspect.NAME, inspect.HELP, inspect),
    (completion.NAME, completion.HELP, completion),
    (diff.NAME, diff.HELP, diff),
    (import_.NAME, import_.HELP, import_),
    (export.NAME, export.HELP, export),
    (replicate.NAME, replicate.HELP, replicate),
]


class _ParseError(Exception):
    """argparse refused the arguments (raised instead of its exit, so ``--json`` can say so)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ParseError(self, message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ckptstore`` command."""
    # Common options are accepted before or after the command; SUPPRESS keeps a subcommand
    # from resetting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable JSON on stdout (errors too)",
    )
    common.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        default=argparse.SUPPRESS,
        help="fsspec storage option for URL stores (repeatable), e.g. anon=true",
    )
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log what ckptstore does (to stderr)",
    )
    parser: argparse.ArgumentParser = _Parser(
        prog=PROG,
        parents=[common],
        description="Inspect, verify and maintain ckptstore checkpoint stores.",
        epilog="Exit status: 0 all is well, 1 a problem was found, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help, module in COMMANDS:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        module.add_arguments(p)
        # The whole parser rides along: ``completion`` walks it (and so needs no import of
        # this module, which imports every command).
        p.set_defaults(func=module.run, subparser=p, parser=parser)
    return parser


def _error_json(kind: str, message: str) -> None:
    print(json.dumps({"error": kind, "message": message}, indent=2))


def _error(args: argparse.Namespace, kind: str, message: str) -> int:
    line = one_line(message)
    print(f"{PROG}: error: {line}", file=sys.stderr)
    if getattr(args, "json", False):
        _error_json(kind, line)
    return 1


def _os_error_text(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def _remote_root(args: argparse.Namespace) -> str | None:
    """The object-store URL the command works on, if any."""
    for name in ("root", "target"):
        value = getattr(args, name, None)
        if isinstance(value, str) and not is_local(value):
            return value
    return None


@contextlib.contextmanager
def _logging(verbose: bool) -> Iterator[None]:
    """Route the library's log records to stderr for the duration of one command."""
    logger = logging.getLogger("ckptstore")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
    handler.setLevel(logging.INFO if verbose else logging.WARNING)
    old_level = logger.level
    if verbose:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def main(argv: list[str] | None = None) -> int:
    """Run the ``ckptstore`` command line; returns the exit status.

    Args:
        argv: the arguments (without the program name); ``None`` reads ``sys.argv``.

    Returns:
        0 when all is well, 1 when a problem was found, 2 on usage errors.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ParseError as e:
        e.parser.print_usage(sys.stderr)
        print(f"{e.parser.prog}: error: {e.message}", file=sys.stderr)
        if "--json" in argv:
            _error_json("UsageError", e.message)
        return 2
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    try:
        with _logging(bool(getattr(args, "verbose", False))):
            return int(args.func(args))
    except UsageError as e:
        args.subparser.print_usage(sys.stderr)
        print(f"{args.subparser.prog}: error: {e}", file=sys.stderr)
        if getattr(args, "json", False):
            _error_json("UsageError", str(e))
        return 2
    except CkptStoreError as e:
        return _error(args, type(e).__name__, str(e))
    except BrokenPipeError:
        # stdout was closed early (``ckptstore ls ROOT | head``): not an error worth a line.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        return _unexpected(args, e)


def _unexpected(args: argparse.Namespace, e: Exception) -> int:
    """Errors that are not ckptstore's own: a path, a backend, an object store."""
    url = _remote_root(args)
    remote = remote_error(e, url) if url is not None and not isinstance(e, ImportError) else None
    if remote is not None:
        return _error(args, type(remote).__name__, str(remote))
    if isinstance(e, OSError):
        return _error(args, type(e).__name__, _os_error_text(e))
    if isinstance(e, ImportError):  # an fsspec backend that is not installed; it says which
        return _error(args, "ImportError", str(e))
    if isinstance(e, TypeError) and getattr(args, "storage_option", None):
        # fsspec passes unknown options on to the backend's client, which refuses them here.
        return _error(args, "TypeError", f"the storage options were refused by the filesystem: {e}")
    raise e
