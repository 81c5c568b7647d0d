"""ckptstore.errors: one tree, builtin bases, and every exception survives pickling."""

from __future__ import annotations

import copy
import errno
import pickle
from typing import Any

import pytest

import ckptstore
from ckptstore import errors
from ckptstore.errors import (
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

BASES: dict[type[CkptStoreError], tuple[type[BaseException], ...]] = {
    CkptStoreError: (Exception,),
    CommitError: (OSError,),
    ReplicaError: (CommitError, OSError),
    ReplicaUnavailableError: (ReplicaError, StoreUnreachableError, CommitError, OSError),
    StoreUnreachableError: (OSError,),
    ReplicaConfigError: (ValueError,),
    IntegrityError: (ValueError,),
    ManifestError: (ValueError,),
    NoCheckpointError: (FileNotFoundError, OSError),
    StepExistsError: (FileExistsError, OSError),
    StepProtectedError: (PermissionError, OSError),
    UnsafeCheckpointError: (TypeError,),
    StoreLockedError: (OSError,),
    StateMismatchError: (KeyError, LookupError),
    BarrierTimeout: (TimeoutError, OSError),
    ReplicaTimeoutError: (ReplicaError, TimeoutError, CommitError, OSError),
    ConfigError: (ValueError,),
    ConfigTypeError: (TypeError,),
    UsageError: (ValueError,),
    ClosedError: (RuntimeError,),
    MissingDependencyError: (ImportError,),
    PathExistsError: (FileExistsError, OSError),
    PathNotFoundError: (FileNotFoundError, OSError),
}


def test_the_tree_is_complete_and_public() -> None:
    assert set(BASES) == {getattr(errors, n) for n in errors.__all__}
    for cls in BASES:
        assert getattr(ckptstore, cls.__name__) is cls
        assert cls.__module__ == "ckptstore.errors"


@pytest.mark.parametrize("cls", list(BASES), ids=lambda c: c.__name__)
def test_builtin_bases(cls: type[CkptStoreError]) -> None:
    exc = cls("something happened at /x; do y")
    assert isinstance(exc, CkptStoreError)
    for base in BASES[cls]:
        assert isinstance(exc, base), base
    with pytest.raises(BASES[cls][0]):
        raise exc


@pytest.mark.parametrize("cls", list(BASES), ids=lambda c: c.__name__)
def test_pickle_keeps_type_and_message(cls: type[CkptStoreError]) -> None:
    exc = cls("step 5: the file 'a b' is \u00e9 corrupt; run ckptstore verify")
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(exc, protocol=proto))
        assert type(back) is cls
        assert str(back) == "step 5: the file 'a b' is \u00e9 corrupt; run ckptstore verify"
        assert back.message == exc.message
        assert back.args == (exc.message,)
    assert str(copy.deepcopy(exc)) == str(exc)


def test_messages_are_not_quoted() -> None:
    # KeyError would print repr(message); the state mismatch message reads as written.
    assert str(StateMismatchError("model has no key 'w'")) == "model has no key 'w'"
    assert str(NoCheckpointError("empty")) == "empty"
    assert str(CommitError("disk full")) == "disk full"


def test_barrier_timeout_attributes_survive_pickle() -> None:
    exc = BarrierTimeout(
        "save:commit of step 7 timed out after 5.0s; ranks [3, 1] never arrived",
        missing_ranks=[3, 1],
        phase="save:commit",
        step=7,
    )
    assert exc.missing_ranks == [1, 3]
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is BarrierTimeout
    assert isinstance(back, TimeoutError)
    assert back.missing_ranks == [1, 3]
    assert back.phase == "save:commit"
    assert back.step == 7
    assert str(back) == str(exc)
    default = pickle.loads(pickle.dumps(BarrierTimeout("t")))
    assert (default.missing_ranks, default.phase, default.step) == ([], "", None)


def test_state_mismatch_attributes_survive_pickle() -> None:
    exc = StateMismatchError(
        "checkpoint does not fit the model",
        missing=("a.weight",),
        unexpected=["b.bias", "c"],
        mismatched=["d.weight: checkpoint [2, 3] float32, model [3, 2] float32"],
    )
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is StateMismatchError
    assert back.missing == ["a.weight"]
    assert back.unexpected == ["b.bias", "c"]
    assert back.mismatched == ["d.weight: checkpoint [2, 3] float32, model [3, 2] float32"]
    assert str(back) == "checkpoint does not fit the model"
    empty = pickle.loads(pickle.dumps(StateMismatchError("x")))
    assert (empty.missing, empty.unexpected, empty.mismatched) == ([], [], [])


def test_extra_attributes_of_any_subclass_survive_pickle() -> None:
    exc = IntegrityError("bad")
    exc.path = "/x/y"  # type: ignore[attr-defined]
    back: Any = pickle.loads(pickle.dumps(exc))
    assert back.path == "/x/y"


def test_the_os_error_fields_of_a_path_error_survive_pickle() -> None:
    # errno and filename live in OSError's slots, not in __dict__: pickling dropped them.
    exc = PathNotFoundError("/out: no such directory", path="/out")
    back = pickle.loads(pickle.dumps(exc))
    assert (back.path, back.filename, back.errno, str(back)) == (
        "/out",
        "/out",
        errno.ENOENT,
        "/out: no such directory",
    )


def test_chained_cause_is_not_required_to_pickle() -> None:
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise CommitError("saving step 3 failed: the disk is full") from e
    except CommitError as exc:
        back = pickle.loads(pickle.dumps(exc))
    assert str(back) == "saving step 3 failed: the disk is full"
    assert isinstance(back, OSError)


def test_an_error_told_by_another_rank_keeps_its_attributes_and_names_the_rank() -> None:
    """``dist.told_by``: how the other ranks raise rank 0's error (it dropped ``missing``,
    ``missing_ranks``, ``path``: rebuilt from the message alone)."""
    from ckptstore.dist import told_by

    sent = BarrierTimeout("step 7: ranks [3] never arrived", missing_ranks=[3], phase="s", step=7)
    got = told_by(0, pickle.loads(pickle.dumps(sent)))
    assert type(got) is BarrierTimeout
    assert str(got) == got.message == got.args[0] == "rank 0: step 7: ranks [3] never arrived"
    assert (got.missing_ranks, got.phase, got.step) == ([3], "s", 7)
    assert str(sent) == "step 7: ranks [3] never arrived"  # the original is not changed
    assert str(told_by(0, got)) == str(got)  # told again: one prefix, not "rank 0: rank 0:"
    assert str(told_by(1, got)) == "rank 1: " + str(got)  # relayed: who told whom
    path = told_by(2, PathExistsError("/out/m.safetensors: exists", path="/out/m.safetensors"))
    assert (type(path), path.filename, str(path)) == (
        PathExistsError,
        "/out/m.safetensors",
        "rank 2: /out/m.safetensors: exists",
    )
    foreign = told_by(1, PermissionError(13, "Permission denied", "/ckpt"))
    assert (type(foreign), str(foreign)) == (
        PermissionError,
        "[Errno 13] Permission denied: '/ckpt'",
    )
    assert foreign.__notes__ == ["raised on rank 1"]
    assert told_by(1, foreign).__notes__ == ["raised on rank 1"]  # told twice, noted once
    noted = IntegrityError("bad block")
    noted.add_note("while restoring step 3")
    told = told_by(1, noted)
    told.add_note("in the manager's exit")
    assert noted.__notes__ == ["while restoring step 3"]  # the copy's notes are its own
    assert told.__notes__ == ["while restoring step 3", "in the manager's exit"]


def test_the_import_error_fields_of_a_missing_dependency_survive_pickle() -> None:
    exc = MissingDependencyError("s3:// needs s3fs: pip install s3fs")
    exc.name = "s3fs"
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), back.name, str(back)) == (
        MissingDependencyError,
        "s3fs",
        "s3:// needs s3fs: pip install s3fs",
    )
