"""What the commands share: usage errors, argument types, storage options, common flags."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from ..errors import CkptStoreError
from ..ops.stores import is_local

__all__ = [
    "Command",
    "UsageError",
    "add_root",
    "as_json",
    "parse_storage_options",
    "positive_arg",
    "step_arg",
    "storage_options",
    "usage_errors",
]

_INT_RE = re.compile(r"-?\d+")
_FLOAT_RE = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_JSON_WORDS: dict[str, Any] = {"true": True, "false": False, "null": None}


class UsageError(Exception):
    """Arguments that parse but make no sense together; exit code 2."""


class Command(Protocol):
    """A command module: its name, one line of help, its arguments, and what it does."""

    NAME: str
    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's own arguments."""

    def run(self, args: argparse.Namespace) -> int:
        """Parse done: call one library function, print its result, return the exit code."""


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """A library function's ``ValueError`` for a bad argument is a usage error (exit 2).

    Its data errors (``IntegrityError``, ``ManifestError``) are ``ValueError``s too, and
    ``CkptStoreError``s: those stay what they are (exit 1).
    """
    try:
        yield
    except CkptStoreError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None


def step_arg(text: str) -> int:
    """An argparse type: a step, an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer step: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is >= 0, got {value}")
    return value


def positive_arg(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_root(parser: argparse.ArgumentParser, help: str = "store directory or fsspec URL") -> None:
    """The ``ROOT`` positional argument."""
    parser.add_argument("root", metavar="ROOT", help=help)


def add_steps(parser: argparse.ArgumentParser, help: str) -> None:
    """A required, repeatable ``--step N``."""
    parser.add_argument(
        "--step", type=step_arg, action="append", required=True, metavar="N", help=help
    )


def as_json(args: argparse.Namespace) -> bool:
    """Whether ``--json`` was given (before or after the command)."""
    return bool(getattr(args, "json", False))


def parse_storage_options(items: Sequence[str] | None) -> dict[str, Any]:
    """``["anon=true", "client_kwargs.region_name=eu-west-1"]`` -> fsspec storage options.

    Values ``true``/``false``/``null`` and numbers become JSON values, a value that is a JSON
    string or object is parsed (``secret='"0123"'`` stays the string ``0123``), anything
    else stays a string. Dots in a key nest it: ``client_kwargs.region_name=x`` gives
    ``{"client_kwargs": {"region_name": "x"}}``.

    Raises:
        UsageError: an item is not ``KEY=VALUE``, or a key is both a value and a parent.
    """
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise UsageError(f"--storage-option expects KEY=VALUE, got {item!r}")
        value: Any
        if text in _JSON_WORDS:
            value = _JSON_WORDS[text]
        elif _INT_RE.fullmatch(text):
            value = int(text)
        elif _FLOAT_RE.fullmatch(text):
            value = float(text)
        elif text[:1] in ('"', "{"):
            try:
                value = json.loads(text)
            except ValueError:
                raise UsageError(f"--storage-option {key}: invalid JSON {text!r}") from None
        else:
            value = text
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise UsageError(f"--storage-option {key}: {p!r} already has a value")
            node = child
        node[leaf] = value
    return out


def storage_options(args: argparse.Namespace, *roots: str) -> dict[str, Any]:
    """The ``--storage-option`` values, checked against the roots they are for.

    Raises:
        UsageError: malformed options, or options given while every root is a local path.
    """
    opts = parse_storage_options(getattr(args, "storage_option", None))
    if opts and roots and all(is_local(r) for r in roots):
        raise UsageError("storage options are for fsspec URLs; a local path takes none")
    return opts
