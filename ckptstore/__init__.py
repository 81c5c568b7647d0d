"""ckptstore: an atomic, verified, distributed checkpoint store for PyTorch training."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    BarrierTimeout,
    CkptStoreError,
    ClosedError,
    CommitError,
    ConfigError,
    ConfigTypeError,
    IntegrityError,
    ManifestError,
    MissingDependencyError,
    NoCheckpointError,
    PathExistsError,
    PathNotFoundError,
    ReplicaConfigError,
    ReplicaError,
    ReplicaTimeoutError,
    ReplicaUnavailableError,
    StateMismatchError,
    StepExistsError,
    StepProtectedError,
    StoreLockedError,
    StoreUnreachableError,
    UnsafeCheckpointError,
    UsageError,
)
from .integrity import VerifyReport
from .manifest import FileEntry, Manifest
from .ops.inspect import inspect_step
from .ops.listing import list_store, list_stores
from .ops.steps import delete_steps, gc_store, pin_steps, prune_store
from .ops.verify import verify_file, verify_path
from .retention import KeepBest, KeepEvery, KeepLast, RetentionPolicy

# Names whose module imports torch are loaded on first use (PEP 562), so that `import
# ckptstore` and the commands that only read JSON and bytes (`ckptstore ls`, `verify --quick`,
# `prune --dry-run`) start without torch's 1.5-2 s import (issue 12). Type checkers see them
# through the TYPE_CHECKING imports below.
_LAZY = {
    "EMA": ".state.modules",
    "RNGState": ".state.modules",
    "CheckpointManager": ".manager",
    "SaveHandle": ".save.staging",
    "atomic_save": ".ops.single",
    "diff_steps": ".ops.diff",
    "export_dcp_step": ".ops.export",
    "export_hf_step": ".ops.export",
    "export_step": ".ops.export",
    "import_file": ".ops.importers",
}

if TYPE_CHECKING:
    from .manager import CheckpointManager
    from .ops.diff import diff_steps
    from .ops.export import export_dcp_step, export_hf_step, export_step
    from .ops.importers import import_file
    from .ops.single import atomic_save
    from .save.staging import SaveHandle
    from .state.modules import EMA, RNGState

__all__ = [
    "EMA",
    "BarrierTimeout",
    "CheckpointManager",
    "CkptStoreError",
    "ClosedError",
    "CommitError",
    "ConfigError",
    "ConfigTypeError",
    "FileEntry",
    "IntegrityError",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "Manifest",
    "ManifestError",
    "MissingDependencyError",
    "NoCheckpointError",
    "PathExistsError",
    "PathNotFoundError",
    "RNGState",
    "ReplicaConfigError",
    "ReplicaError",
    "ReplicaTimeoutError",
    "ReplicaUnavailableError",
    "RetentionPolicy",
    "SaveHandle",
    "StateMismatchError",
    "StepExistsError",
    "StepProtectedError",
    "StoreLockedError",
    "StoreUnreachableError",
    "UnsafeCheckpointError",
    "UsageError",
    "VerifyReport",
    "__version__",
    "atomic_save",
    "delete_steps",
    "diff_steps",
    "export_dcp_step",
    "export_hf_step",
    "export_step",
    "gc_store",
    "import_file",
    "inspect_step",
    "list_store",
    "list_stores",
    "pin_steps",
    "prune_store",
    "verify_file",
    "verify_path",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
