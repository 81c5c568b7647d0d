"""The exception tree of ckptstore.

Every error ckptstore raises on purpose derives from :class:`CkptStoreError`, and where a
builtin fits the error also derives from it (``BarrierTimeout`` is a ``TimeoutError``,
``StepExistsError`` a ``FileExistsError``), so existing ``except`` clauses keep working.
Messages say what happened, where, and what to do. All exceptions pickle with their
attributes: in a distributed job they are sent from the rank that saw them to every other.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BarrierTimeout",
    "CkptStoreError",
    "ClosedError",
    "CommitError",
    "ConfigError",
    "ConfigTypeError",
    "IntegrityError",
    "ManifestError",
    "MissingDependencyError",
    "NoCheckpointError",
    "PathExistsError",
    "PathNotFoundError",
    "ReplicaConfigError",
    "ReplicaError",
    "ReplicaTimeoutError",
    "ReplicaUnavailableError",
    "StateMismatchError",
    "StepExistsError",
    "StepProtectedError",
    "StoreLockedError",
    "StoreUnreachableError",
    "UnsafeCheckpointError",
    "UsageError",
]


class CkptStoreError(Exception):
    """Root of every error ckptstore raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses with extra attributes keep them in __dict__; restoring the dict after
        # construction from the message keeps pickling correct for all of them at once.
        # OSError's own (errno, filename: PathExistsError's) are not in __dict__.
        state = dict(self.__dict__)
        if "__notes__" in state:  # a copy's notes are its own (copy.copy goes through here)
            state["__notes__"] = list(state["__notes__"])
        for base, names in _SLOT_FIELDS:
            if isinstance(self, base):
                for name in names:
                    if getattr(self, name) is not None:
                        state[name] = getattr(self, name)
        return (_rebuild, (type(self), self.message, state))


#: The fields builtin bases keep outside ``__dict__`` (OSError's ``errno`` and
#: ``filename``, ImportError's ``name`` and ``path``).
_SLOT_FIELDS: tuple[tuple[type[BaseException], tuple[str, ...]], ...] = (
    (OSError, ("errno", "strerror", "filename", "filename2")),
    (ImportError, ("name", "path")),
)


def _rebuild(cls: type[CkptStoreError], message: str, state: dict[str, Any]) -> CkptStoreError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    for name, value in state.items():
        setattr(exc, name, value)
    return exc


class CommitError(CkptStoreError, OSError):
    """A checkpoint could not be written or committed; nothing of it is visible."""


class ReplicaError(CommitError):
    """An upload to the replica tier failed; the step is still safe in the local store."""


class StoreUnreachableError(CkptStoreError, OSError):
    """An object store cannot be reached, or refuses us.

    No or bad credentials, access denied, an endpoint that does not answer. The message
    names the store and what to check (the endpoint_url storage option, the network, the
    credentials); the client's own error is the ``__cause__``.
    """


class ReplicaUnavailableError(ReplicaError, StoreUnreachableError):
    """The replica cannot be reached or written.

    A bucket that does not exist, no or bad credentials, access denied, or an endpoint
    that does not answer in time.

    Raised by the manager's constructor (nothing was saved yet), by ``resume``/``restore``
    of a store on an object store, and by ``wait``/``close`` when the replica failed later;
    the message names the URL and what to check, the original error is its ``__cause__``.
    """


class ReplicaConfigError(CkptStoreError, ValueError):
    """``replica=`` cannot be a replica of this store (it is the local store itself)."""


class ReplicaTimeoutError(ReplicaError, TimeoutError):
    """Waiting for the replica's uploads ran out of time; the steps are safe locally."""


class ConfigError(CkptStoreError, ValueError):
    """An argument or option has a value ckptstore cannot use; nothing was done.

    A retention policy, a format or compression, a timeout, a step number, metrics that are
    not numbers, metadata that is not JSON, storage options, a size.
    """


class ConfigTypeError(CkptStoreError, TypeError):
    """An argument of the wrong type (a state that is not a mapping, ``keys="model"``)."""


class UsageError(CkptStoreError, ValueError):
    """A call refused because going ahead would lose work in silence; nothing was done.

    A save of a step older than the newest (training restarted without ``resume()``), a
    save without the metric a ``KeepBest`` ranks by, a prune by a metric no checkpoint has.
    The message says what to do instead.
    """


class ClosedError(CkptStoreError, RuntimeError):
    """An object was used after ``close()`` (a manager, an uploader)."""


class MissingDependencyError(CkptStoreError, ImportError):
    """An optional dependency is not installed; the message names the package to install."""


class PathExistsError(CkptStoreError, FileExistsError):
    """An output path exists and is never overwritten (``export``: pass ``force=True``).

    The message reads ``PATH: why``; ``path`` (and ``filename``) is the path.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.filename = path
        self.errno = errno.EEXIST


class PathNotFoundError(CkptStoreError, FileNotFoundError):
    """An input file, or an output's parent directory, does not exist.

    The message reads ``PATH: why``; ``path`` (and ``filename``) is the path.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.filename = path
        self.errno = errno.ENOENT


class IntegrityError(CkptStoreError, ValueError):
    """A stored file does not match its manifest (checksum, size, header, zip directory)."""


class ManifestError(CkptStoreError, ValueError):
    """A manifest is missing, malformed, hostile, or from a newer format version."""


class NoCheckpointError(CkptStoreError, FileNotFoundError):
    """No checkpoint (or none that verifies) where one was required, or no store at all.

    The second: the path given is a file, a checkpoint directory, or (opened with
    ``create=False``) a directory that holds no store.
    """


class StepExistsError(CkptStoreError, FileExistsError):
    """A checkpoint for this step is already committed; steps are write-once."""


class StepProtectedError(CkptStoreError, PermissionError):
    """A deletion was refused: the step is pinned, or the only one that verifies.

    ``force=True`` (``ckptstore rm --force``) deletes it anyway.
    """


class UnsafeCheckpointError(CkptStoreError, TypeError):
    """The state holds an object that cannot be stored without pickle."""


class StoreLockedError(CkptStoreError, OSError):
    """Another process holds the store's writer lock."""


class StateMismatchError(CkptStoreError, KeyError):
    """The checkpoint does not fit the object it is restored into.

    Attributes:
        missing: keys the target expects that the checkpoint lacks.
        unexpected: keys in the checkpoint the target does not have.
        mismatched: one line per key whose shape or dtype differs.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return self.message


class BarrierTimeout(CkptStoreError, TimeoutError):
    """A distributed wait ran out of time.

    Attributes:
        missing_ranks: the ranks that did not arrive (empty when unknown).
        phase: the protocol phase that waited, e.g. ``"save:commit"``.
        step: the step being saved or restored, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        missing_ranks: Sequence[int] = (),
        phase: str = "",
        step: int | None = None,
    ) -> None:
        super().__init__(message)
        self.missing_ranks = sorted(missing_ranks)
        self.phase = phase
        self.step = step
