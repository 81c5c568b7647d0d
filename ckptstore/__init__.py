"""ckptstore: an atomic, verified, distributed checkpoint store for PyTorch training."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
    BarrierTimeout,
    CkptStoreError,
    CommitError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    StateMismatchError,
    StepExistsError,
    StepProtectedError,
    StoreLockedError,
    UnsafeCheckpointError,
)
from .integrity import VerifyReport
from .manager import CheckpointManager
from .manifest import FileEntry, Manifest
from .modules import EMA, RNGState
from .retention import KeepBest, KeepEvery, KeepLast, RetentionPolicy
from .single import atomic_save
from .staging import SaveHandle
from .verify import verify_file

__all__ = [
    "EMA",
    "BarrierTimeout",
    "CheckpointManager",
    "CkptStoreError",
    "CommitError",
    "FileEntry",
    "IntegrityError",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "Manifest",
    "ManifestError",
    "NoCheckpointError",
    "RNGState",
    "RetentionPolicy",
    "SaveHandle",
    "StateMismatchError",
    "StepExistsError",
    "StepProtectedError",
    "StoreLockedError",
    "UnsafeCheckpointError",
    "VerifyReport",
    "__version__",
    "atomic_save",
    "verify_file",
]
