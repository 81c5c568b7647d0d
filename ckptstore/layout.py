"""Names of the entries in a store's root: committed steps, saves in flight, trash.

Steps are ordered by the number parsed from the name, never as text: ``step-9`` sorts before
``step-10`` even if someone created the directories by hand without padding.
"""

from __future__ import annotations

import re
import uuid

from .errors import ConfigError, ConfigTypeError

__all__ = [
    "INDEX_NAME",
    "LOCAL_RANKS_NAME",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "PIN_NAME",
    "REPLICATED_NAME",
    "REPLICA_NAME",
    "STATE_NAME",
    "is_garbage_name",
    "is_store_entry",
    "old_dirname",
    "parse_old_dirname",
    "parse_step_dirname",
    "state_file",
    "step_dirname",
    "tmp_dirname",
    "trash_dirname",
]

MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.json"
PIN_NAME = "pinned"
#: Marker in a local step: its upload to the replica committed and verified.
REPLICATED_NAME = "replicated"
#: Marker in a local step on node-local roots: the ranks whose files this node holds.
LOCAL_RANKS_NAME = "local-ranks"
#: The replica a local store uploads to (its URL), for ``ckptstore ls``.
REPLICA_NAME = ".ckptstore.replica"
LOCK_NAME = ".ckptstore.lock"
#: The listing cache of a local store (see storage/local.py); never part of a checkpoint.
INDEX_NAME = ".ckptstore.index"

# [0-9], not \d: \d also matches other scripts' digits ("step-١٢"), which int() accepts.
_STEP_RE = re.compile(r"step-([0-9]{1,30})")
_TMP_RE = re.compile(r"\.tmp-step-[0-9]+-[0-9a-f]{32}(?:-r[0-9]+)?")
_TRASH_RE = re.compile(r"\.trash-step-[0-9]+-[0-9a-f]{32}")
_OLD_RE = re.compile(r"\.old-step-([0-9]{1,30})-[0-9a-f]{32}")
_INDEX_TMP_RE = re.compile(r"\.ckptstore\.index-[0-9a-f]{32}\.tmp")
#: Largest step we accept: 12 digits pad every realistic run; more is allowed, to 30.
MAX_STEP = 10**30 - 1


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        msg = f"step must be an int, got {type(step).__name__}"
        raise ConfigTypeError(msg)
    if not 0 <= step <= MAX_STEP:
        msg = f"step must be between 0 and {MAX_STEP}, got {step}"
        raise ConfigError(msg)
    return step


def step_dirname(step: int) -> str:
    """Name of the directory of a committed checkpoint: ``step-`` and 12 digits or more."""
    return f"step-{_check_step(step):012d}"


def parse_step_dirname(name: str) -> int | None:
    """The step a directory name stands for, or ``None`` if it is not a step directory.

    Only the canonical spelling counts (``step-`` and the step zero-padded to 12 digits,
    more digits only when needed): a hand-made ``step-9`` beside ``step-000000000009`` would
    otherwise be listed twice and read through the wrong name.
    """
    m = _STEP_RE.fullmatch(name)
    if not m:
        return None
    step = int(m.group(1))
    return step if name == f"step-{step:012d}" else None


def tmp_dirname(step: int) -> str:
    """A fresh, unique name for the directory of a save in flight."""
    return f".tmp-step-{_check_step(step):012d}-{uuid.uuid4().hex}"


def trash_dirname(step: int) -> str:
    """A fresh, unique name under which a checkpoint being deleted vanishes at once."""
    return f".trash-step-{_check_step(step):012d}-{uuid.uuid4().hex}"


def old_dirname(step: int) -> str:
    """Where a corrupt committed checkpoint waits while its replacement is renamed into place.

    Only on filesystems that cannot exchange two directories atomically (see
    ``Storage.commit``): if the process dies between the two renames, the next writer's
    ``gc`` renames it back to ``step-N``. Neither a step nor garbage to the loader.
    """
    return f".old-step-{_check_step(step):012d}-{uuid.uuid4().hex}"


def parse_old_dirname(name: str) -> int | None:
    """The step of an :func:`old_dirname` entry, or ``None`` if ``name`` is not one."""
    m = _OLD_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def is_tmp_name(name: str) -> bool:
    """Whether ``name`` is the directory of a save in flight (or one that crashed)."""
    return _TMP_RE.fullmatch(name) is not None


def is_trash_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint that was being deleted."""
    return _TRASH_RE.fullmatch(name) is not None


def is_garbage_name(name: str) -> bool:
    """Whether ``name`` is a tmp or trash entry (``gc`` removes those that are stale)."""
    return is_tmp_name(name) or is_trash_name(name) or _INDEX_TMP_RE.fullmatch(name) is not None


def is_store_entry(name: str) -> bool:
    """Whether ``name`` is an entry only ckptstore makes in a store's root.

    A step directory (also one not spelled canonically, ``step-9``), a save in flight, a
    checkpoint being deleted or replaced, or one of the store's own files (``.ckptstore.*``):
    a directory holding one of them is a store; one holding none is not.
    """
    return (
        _STEP_RE.fullmatch(name) is not None
        or is_garbage_name(name)
        or _OLD_RE.fullmatch(name) is not None
        or name.startswith(".ckptstore.")
    )


def state_file(rank: int | None) -> str:
    """The name of the state tree file (per rank in a sharded checkpoint)."""
    return STATE_NAME if rank is None else f"state.rank{rank:05d}.json"


def index_tmp_name() -> str:
    """A fresh name for the listing cache while it is written (garbage if left behind)."""
    return f"{INDEX_NAME}-{uuid.uuid4().hex}.tmp"
