"""CheckpointManager: orchestration of the store, codecs, retention and coordination.

The mechanics live elsewhere: the commit protocol in ``storage``, encoding in ``codec``,
loading into modules in ``state``/``modules``, retention planning in ``retention``, waits in
``dist``. This module decides who does what, in which order, and what to tell the user.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch

from .codec import payload as payload_codec
from .codec.tree import TreeDecoder, TreeEncoder, tensor_key
from .dist import Coordinator
from .errors import (
    CkptStoreError,
    CommitError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    StepExistsError,
    UnsafeCheckpointError,
)
from .integrity import VerifyReport
from .layout import STATE_NAME
from .manifest import FORMAT_VERSION, Manifest, utc_now
from .retention import CheckpointInfo, RetentionPolicy, as_policy, plan_deletions
from .staging import BackgroundWriter, SaveHandle, StagingPool
from .state import apply_state, capture, kind_of
from .storage import Storage, open_storage, wait_for_deletions
from .verify import verify_checkpoint

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptstore")

_GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
STATE_FORMAT = 1


def _versions() -> dict[str, str]:
    from . import __version__

    out = {"ckptstore": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        import safetensors

        out["safetensors"] = safetensors.__version__
    return out


def group_name(key: Any, index: int) -> str:
    """The payload group (file stem) of a top-level key.

    The key itself when it is a safe name, else ``_<index>`` (never a valid key name).
    """
    if isinstance(key, str) and _GROUP_RE.fullmatch(key):
        return key
    return f"_{index}"


class CheckpointManager:
    """An atomic, verified checkpoint store for one training run.

    Args:
        root: a local directory, or any fsspec URL (``s3://bucket/run1``, ``memory://x``).
        keep: retention: an int (``KeepLast(n)``), a policy, a list of policies (their
            union), or ``None`` to keep everything.
        format: ``"safetensors"`` (default) or ``"torch"`` (``torch.save`` zip payloads).
        compression: ``None`` or ``"zstd"``.
        async_save: return from ``save`` after one memory copy; write in the background.
        barrier_timeout: seconds for every distributed wait ckptstore makes; it must cover
            the longest save, since other ranks wait while rank 0 writes.
        storage_options: passed to fsspec for URLs.
        allow_pickle: store (and load) objects other than tensors and plain data via
            pickle. Off by default: a pickle can run code when loaded.

    Raises:
        ValueError: an argument is invalid; the message names it.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep: int | RetentionPolicy | Iterable[RetentionPolicy] | None = None,
        *,
        format: str = "safetensors",
        compression: str | None = None,
        async_save: bool = False,
        barrier_timeout: float = 600.0,
        storage_options: Mapping[str, Any] | None = None,
        allow_pickle: bool = False,
    ) -> None:
        if format not in ("safetensors", "torch"):
            msg = f"format must be 'safetensors' or 'torch', got {format!r}"
            raise ValueError(msg)
        if compression not in (None, "zstd"):
            msg = f"compression must be None or 'zstd', got {compression!r}"
            raise ValueError(msg)
        if (
            isinstance(barrier_timeout, bool)
            or not isinstance(barrier_timeout, int | float)
            or not (math.isfinite(barrier_timeout) and barrier_timeout > 0)
        ):
            msg = f"barrier_timeout must be a positive number of seconds, got {barrier_timeout!r}"
            raise ValueError(msg)
        self.policy = as_policy(keep)
        self.format = format
        self.compression = compression
        self.async_save = bool(async_save)
        self.barrier_timeout = float(barrier_timeout)
        self.allow_pickle = bool(allow_pickle)
        self.storage: Storage = open_storage(root, storage_options)
        self.root = self.storage.root
        self.coord = Coordinator(self.barrier_timeout)
        self._lock = self.storage.writer_lock() if self.coord.is_leader else None
        self._closed = False
        self._writer: BackgroundWriter | None = None
        self._staging = StagingPool()
        self._inflight: SaveHandle | None = None
        self._bg_error: BaseException | None = None
        self._mutex = threading.RLock()
        self._known_good: set[int] = set()
        self.last_blocked_s = 0.0

    # ---- small queries ----------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (by number, never as text)."""
        return self.storage.list_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` for an empty store."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest).

        Raises:
            NoCheckpointError: no such committed step.
            ManifestError: the manifest is unreadable or hostile.
        """
        step = self._resolve(step)
        return self.storage.read_manifest(step)

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise NoCheckpointError(f"{self.root}: no committed checkpoint")
            return steps[-1]
        if step not in steps:
            have = f"{steps[0]}..{steps[-1]} ({len(steps)} steps)" if steps else "none"
            raise NoCheckpointError(
                f"{self.storage.describe(step)}: no committed checkpoint (have {have})"
            )
        return step

    # ---- save ------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[Any, Any],
        *,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        sharded: bool = False,
    ) -> SaveHandle:
        """Save ``state`` as checkpoint ``step``; collective under torch.distributed.

        Args:
            step: the training step (an int >= 0); each step is saved at most once.
            state: names -> modules, optimizers, schedulers, EMA, RNGState, plain data.
            metrics: numbers kept in the manifest (``KeepBest`` ranks by them).
            metadata: free JSON-serializable data kept in the manifest.
            sharded: every rank writes its own files (FSDP/ZeRO); else rank 0 writes.

        Returns:
            A :class:`SaveHandle`; for a synchronous save it is already done.

        Raises:
            StepExistsError: ``step`` is already committed.
            UnsafeCheckpointError: ``state`` holds an object that needs pickle.
            CommitError: writing failed (disk full, permissions, ...); nothing is visible
                and the previous checkpoint is intact.
            StoreLockedError: another process writes this store.
            BarrierTimeout: a rank did not join the save in time.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            msg = f"step must be an int >= 0, got {step!r}"
            raise ValueError(msg)
        if not isinstance(state, Mapping):
            msg = f"state must be a mapping of names to objects, got {type(state).__name__}"
            raise TypeError(msg)
        metrics_d = _check_metrics(metrics)
        metadata_d = _check_metadata(metadata)
        self._raise_bg_error()
        self.wait_save()  # at most one save in flight
        t0 = time.perf_counter()
        self.coord.barrier("save:enter", step)
        writes = self.coord.is_leader or sharded
        job = None
        error: BaseException | None = None
        if writes:
            try:
                job = self._prepare(step, state, metrics_d, metadata_d, sharded)
            except BaseException as e:  # reported to every rank below
                error = e
        if not self.async_save or self.coord.enabled:
            # Synchronous path (and, for now, the distributed one): run the job here.
            manifest = self._finish_collective(job, error, step, sharded)
            self.last_blocked_s = time.perf_counter() - t0
            self._log_summary(step, manifest, time.perf_counter() - t0, self.last_blocked_s)
            return SaveHandle(step, result=manifest)
        if error is not None:
            raise error
        assert job is not None
        self.last_blocked_s = time.perf_counter() - t0
        if self._writer is None:
            self._writer = BackgroundWriter()
        blocked = self.last_blocked_s

        def run() -> Manifest:
            try:
                m = self._commit_job(job)
                self._after_commit(step)
                self._log_summary(step, m, time.perf_counter() - t0, blocked)
                return m
            except BaseException as e:
                log.error("async save of step %d failed: %s", step, e)
                self._bg_error = e
                raise

        fut = self._writer.submit(run)
        self._inflight = SaveHandle(step, fut)
        return self._inflight

    def _prepare(
        self,
        step: int,
        state: Mapping[Any, Any],
        metrics: dict[str, float],
        metadata: dict[str, Any],
        sharded: bool,
    ) -> dict[str, Any]:
        """Capture and encode the state (in the caller's thread), stage tensors if async."""
        if self.coord.is_leader and self._lock is not None and not self._lock.is_locked:
            self._lock.acquire()
            # We are now the only writer: leftovers of crashed saves are garbage.
            with contextlib.suppress(OSError):
                for name in self.storage.gc(include_tmp=not sharded or not self.coord.enabled):
                    log.info("removed stale %s", name)
        if self.coord.is_leader and step in set(self.steps()):
            raise StepExistsError(
                f"{self.storage.describe(step)} is already committed; steps are write-once. "
                "Save under a new step, or delete this one first (ckptstore prune / gc)"
            )
        enc = TreeEncoder(allow_pickle=self.allow_pickle)
        keys: list[Any] = []
        vals: list[Any] = []
        kinds: dict[str, str] = {}
        for i, (key, value) in enumerate(state.items()):
            if isinstance(key, bool) or not isinstance(key, str | int):
                msg = f"state keys must be str or int, got {key!r}"
                raise UnsafeCheckpointError(msg)
            kind = kind_of(value)
            data = capture(value)
            group = group_name(key, i)
            node = enc.encode(data, group=group, path=(key,))
            if kind is not None:
                node = {"t": "stateful", "kind": kind, "v": node}
            keys.append(key)
            vals.append(node)
            if kind is not None:
                kinds[str(key)] = kind
        groups = enc.finish(tensor_key, contiguous=not self.async_save)
        if self.async_save:
            self._staging.begin()
            groups = {
                g: {k: self._staging.stage(f"{g}/{k}", t) for k, t in tensors.items()}
                for g, tensors in groups.items()
            }
            self._staging.end()
        tree = {"ckptstore_state": STATE_FORMAT, "root": {"t": "dict", "keys": keys, "vals": vals}}
        return {
            "step": step,
            "groups": groups,
            "tree": json.dumps(tree, separators=(",", ":"), allow_nan=False).encode(),
            "metrics": metrics,
            "metadata": metadata,
            "sharded": sharded,
        }

    def _commit_job(self, job: dict[str, Any]) -> Manifest:
        """Write payloads, state.json and the manifest; commit. Leader only, one process."""
        step = job["step"]
        try:
            pending = self.storage.begin(step)
        except CkptStoreError:
            raise
        except OSError as e:
            raise _commit_error(e, self.storage.describe(step), self._previous(step)) from e
        try:
            rank = 0 if job["sharded"] else None
            for group, tensors in sorted(job["groups"].items()):
                name = payload_codec.payload_name(group, self.format, self.compression, rank)
                payload_codec.write_group(
                    pending, name, tensors, fmt=self.format, compression=self.compression, rank=rank
                )
            pending.write_bytes(STATE_NAME, job["tree"], codec="json")
            manifest = Manifest(
                step=step,
                files=dict(pending.files),
                created=utc_now(),
                format=self.format,
                world_size=self.coord.world_size,
                sharded=job["sharded"],
                metrics=job["metrics"],
                metadata=job["metadata"],
                versions=_versions(),
                format_version=FORMAT_VERSION,
            )
            self.storage.commit(pending, manifest)
        except BaseException as e:
            self.storage.abort(pending)
            if isinstance(e, CkptStoreError):
                raise
            if isinstance(e, OSError):
                raise _commit_error(e, self.storage.describe(step), self._previous(step)) from e
            raise
        self._known_good.add(step)
        return manifest

    def _previous(self, step: int) -> int | None:
        try:
            older = [s for s in self.steps() if s != step]
        except OSError:
            return None
        return older[-1] if older else None

    def _finish_collective(
        self, job: dict[str, Any] | None, error: BaseException | None, step: int, sharded: bool
    ) -> Manifest:
        """Leader commits; the outcome is broadcast so every rank returns or raises alike."""
        outcome: tuple[str, Any]
        if self.coord.is_leader:
            if error is None:
                assert job is not None
                try:
                    manifest = self._commit_job(job)
                    outcome = ("ok", manifest.to_bytes())
                except BaseException as e:
                    outcome = ("error", e)
            else:
                outcome = ("error", error)
        else:
            outcome = ("ok", b"")
        outcome = self.coord.broadcast(outcome, "save:commit", step)
        status, value = outcome
        if status == "error":
            if isinstance(value, BaseException):
                raise value
            raise CommitError(str(value))
        if not isinstance(value, bytes):
            raise CommitError(f"step {step}: rank 0 sent an unexpected outcome {value!r}")
        self._after_commit(step)
        return Manifest.from_bytes(value) if value else self.storage.read_manifest(step)

    def _after_commit(self, step: int) -> None:
        """Retention runs only after a commit; its failure never fails the save."""
        if not self.coord.is_leader:
            return
        try:
            self.prune()
        except CkptStoreError as e:
            log.warning("retention after step %d failed: %s", step, e)
        except OSError as e:
            log.warning("retention after step %d failed: %s", step, e)

    def _log_summary(self, step: int, manifest: Manifest, seconds: float, blocked: float) -> None:
        nbytes = manifest.total_bytes
        log.info(
            "saved step %d: %d bytes in %.3fs (%.2f GB/s), blocked %.1f ms",
            step,
            nbytes,
            seconds,
            nbytes / max(seconds, 1e-9) / 1e9,
            blocked * 1e3,
        )

    # ---- async bookkeeping ----------------------------------------------------------

    def _raise_bg_error(self) -> None:
        err, self._bg_error = self._bg_error, None
        if err is not None:
            if isinstance(err, CkptStoreError):
                raise err
            raise CommitError(f"the previous async save failed: {err}") from err

    def wait_save(self) -> None:
        """Wait for the in-flight async save, if any (its error is raised by :meth:`wait`)."""
        h, self._inflight = self._inflight, None
        if h is not None:
            with contextlib.suppress(BaseException):
                h.wait()

    def wait(self) -> None:
        """Wait for the in-flight save and background deletions; raise a background error.

        Raises:
            CommitError: the last async save failed.
        """
        self.wait_save()
        wait_for_deletions()
        self._raise_bg_error()

    # ---- restore / load ---------------------------------------------------------------

    def _read(self, step: int) -> tuple[Manifest, dict[Any, Any], TreeDecoder]:
        """Manifest, top-level nodes and a decoder for ``step``; nothing trusted unverified."""
        manifest = self.storage.read_manifest(step)
        where = self.storage.describe(step)
        entry = manifest.files.get(STATE_NAME)
        if entry is None:
            raise ManifestError(f"{where}: manifest lists no {STATE_NAME}")
        raw = self.storage.read_file(step, STATE_NAME, entry)
        try:
            tree = json.loads(bytes(raw).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise IntegrityError(f"{where}/{STATE_NAME}: not valid JSON ({e})") from None
        if not isinstance(tree, dict) or tree.get("ckptstore_state") != STATE_FORMAT:
            raise IntegrityError(
                f"{where}/{STATE_NAME}: not a ckptstore state (format {STATE_FORMAT})"
            )
        root = tree.get("root")
        if not isinstance(root, dict) or not isinstance(root.get("keys"), list):
            raise IntegrityError(f"{where}/{STATE_NAME}: malformed root")
        keys, vals = root["keys"], root.get("vals")
        if not isinstance(vals, list) or len(vals) != len(keys):
            raise IntegrityError(f"{where}/{STATE_NAME}: malformed root")
        files_by_group: dict[str, list[str]] = {}
        for name, fe in manifest.files.items():
            if fe.codec != "json":
                files_by_group.setdefault(payload_codec.group_of(name), []).append(name)
        cache: dict[str, dict[str, torch.Tensor]] = {}

        def get_tensor(group: str, key: str) -> torch.Tensor:
            if group not in cache:
                names = files_by_group.get(group)
                if not names:
                    raise IntegrityError(f"{where}: no payload file for group {group!r}")
                merged: dict[str, torch.Tensor] = {}
                for n in sorted(names):
                    merged.update(
                        payload_codec.read_group(self.storage, step, n, manifest.files[n])
                    )
                cache[group] = merged
            t = cache[group].get(key)
            if t is None:
                raise IntegrityError(f"{where}: tensor {key!r} missing from payload {group!r}")
            return t

        dec = TreeDecoder(get_tensor, allow_pickle=self.allow_pickle, where=f"{where}/{STATE_NAME}")
        nodes = {}
        for k, v in zip(keys, vals, strict=True):
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise IntegrityError(f"{where}/{STATE_NAME}: top-level key {k!r} is not str or int")
            nodes[k] = v
        return manifest, nodes, dec

    @staticmethod
    def _unwrap(node: Any) -> tuple[str | None, Any]:
        if isinstance(node, dict) and node.get("t") == "stateful":
            kind = node.get("kind")
            return (kind if isinstance(kind, str) else "stateful"), node.get("v")
        return None, node

    def _decode(
        self, step: int, wanted: Iterable[Any] | None
    ) -> tuple[dict[Any, Any], dict[Any, str | None]]:
        _, nodes, dec = self._read(step)
        out: dict[Any, Any] = {}
        kinds: dict[Any, str | None] = {}
        for k, node in nodes.items():
            if wanted is not None and k not in wanted:
                continue
            kind, inner = self._unwrap(node)
            out[k] = dec.decode(inner, (k,))
            kinds[k] = kind
        return out, kinds

    def _candidates(self, step: int | None) -> list[int]:
        steps = self.steps()
        if step is not None:
            if step not in steps:
                self._resolve(step)  # raises NoCheckpointError with context
            return [step]
        if not steps:
            raise NoCheckpointError(f"{self.root}: no committed checkpoint to restore")
        return list(reversed(steps))

    def _load_first_good(
        self, step: int | None, wanted: Iterable[Any] | None
    ) -> tuple[int, dict[Any, Any], dict[Any, str | None]]:
        """Decode the newest checkpoint that verifies (or exactly ``step``)."""
        skipped: list[str] = []
        for s in self._candidates(step):
            try:
                out, kinds = self._decode(s, wanted)
            except (IntegrityError, ManifestError) as e:
                if step is not None:
                    raise
                log.warning("skipping step %d: %s", s, e)
                skipped.append(f"step {s}: {e}")
                continue
            self._known_good.add(s)
            return s, out, kinds
        raise NoCheckpointError(
            f"{self.root}: no checkpoint verifies; tried newest first: " + " | ".join(skipped)
        )

    def restore(
        self,
        state: MutableMapping[Any, Any],
        step: int | None = None,
        *,
        strict: bool = True,
    ) -> int:
        """Load a checkpoint into ``state`` in place; collective under torch.distributed.

        Every payload is read and checked against its checksum before anything in ``state``
        changes. Without ``step`` the newest checkpoint that verifies is used (corrupt ones
        are skipped and logged); with ``step``, exactly that one.

        Returns:
            The restored step.

        Raises:
            NoCheckpointError: the store is empty, or nothing verifies.
            IntegrityError: the requested ``step`` is corrupt.
            StateMismatchError: the checkpoint does not fit the objects in ``state``.
        """
        self._check_open()
        self._raise_bg_error()
        self.wait_save()
        self.coord.barrier("restore:enter", step)
        keys = list(state.keys())
        # Rank 0 picks the step (newest that verifies) and every rank loads that one.
        chosen: tuple[str, Any] = ("ok", None)
        stored: dict[Any, Any] | None = None
        kinds: dict[Any, str | None] = {}
        if self.coord.is_leader:
            try:
                s, stored, kinds = self._load_first_good(step, keys)
                chosen = ("ok", s)
            except BaseException as e:
                chosen = ("error", e)
        chosen = self.coord.broadcast(chosen, "restore:choose", step)
        if chosen[0] == "error":
            raise chosen[1]
        s = int(chosen[1])
        status: tuple[str, Any] = ("ok", None)
        if stored is None:
            try:
                stored, kinds = self._decode(s, keys)
            except BaseException as e:
                status = ("error", e)
        statuses = self.coord.all_gather(status, "restore:load", s)
        for r, (st, err) in enumerate(statuses):
            if st == "error":
                if r == self.coord.rank or not isinstance(err, BaseException):
                    raise err if isinstance(err, BaseException) else IntegrityError(str(err))
                raise type(err)(f"rank {r}: {err}") if isinstance(err, CkptStoreError) else err
        assert stored is not None
        apply_state(state, stored, kinds, strict=strict, where=self.storage.describe(s))
        return s

    def resume(self, state: MutableMapping[Any, Any], *, strict: bool = True) -> int:
        """Restore the newest good checkpoint if there is one.

        Returns:
            0 on an empty store, else the restored step + 1 (the next step to run).
        """
        self._check_open()
        if not self.steps():
            self.coord.barrier("resume:empty")
            return 0
        return self.restore(state, strict=strict) + 1

    def load(self, step: int | None = None) -> dict[Any, Any]:
        """The stored state as plain data (modules as state dicts, tensors on CPU).

        Raises:
            NoCheckpointError: nothing committed (or nothing that verifies).
            IntegrityError: the requested ``step`` is corrupt.
        """
        return self._load_first_good(step, None)[1]

    # ---- verify / retention -------------------------------------------------------------

    def verify(self, step: int | None = None, *, deep: bool = True) -> VerifyReport:
        """Check a checkpoint (default: the newest committed one).

        ``deep`` computes every file's checksum and every zip member's CRC; otherwise the
        manifest, presence, sizes and headers are checked.
        """
        s = self._resolve(step)
        report = verify_checkpoint(self.storage, s, deep=deep)
        if report.ok:
            self._known_good.add(s)
        return report

    def pin(self, step: int) -> None:
        """Protect ``step`` from retention (a ``pinned`` marker in its directory)."""
        self.storage.set_pinned(self._resolve(step), True)

    def unpin(self, step: int) -> None:
        """Let retention delete ``step`` again."""
        self.storage.set_pinned(self._resolve(step), False)

    def plan_prune(self) -> list[int]:
        """The steps :meth:`prune` would delete now."""
        steps = self.steps()
        if not steps:
            return []
        infos = []
        for s in steps:
            metrics: Mapping[str, float] = {}
            if self.policy.needs_metrics:
                try:
                    metrics = self.storage.read_manifest(s).metrics
                except ManifestError:
                    metrics = {}
            infos.append(CheckpointInfo(s, metrics, self.storage.is_pinned(s)))
        return plan_deletions(infos, self.policy, last_good=self._last_good(steps))

    def _last_good(self, steps: list[int]) -> int | None:
        for s in reversed(steps):
            if s in self._known_good:
                return s
            if verify_checkpoint(self.storage, s, deep=False).ok:
                self._known_good.add(s)
                return s
        return None

    def prune(self) -> list[int]:
        """Apply the retention policy now; returns the deleted steps.

        Deletion renames a checkpoint away atomically and frees its space in the
        background. Never deletes the newest, a pinned one, or the newest that verifies.
        """
        self._check_open()
        with self._mutex:
            if self._lock is not None and not self._lock.is_locked:
                self._lock.acquire()
            doomed = self.plan_prune()
            deleted = []
            for s in doomed:
                try:
                    self.storage.delete(s)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise CommitError(f"could not delete {self.storage.describe(s)}: {e}") from e
                self._known_good.discard(s)
                deleted.append(s)
            if deleted:
                log.info("retention deleted steps %s", deleted)
            return deleted

    def gc(self) -> list[str]:
        """Remove stale ``.tmp-``/``.trash-`` entries and manifest-less step directories."""
        self._check_open()
        if self._lock is not None and not self._lock.is_locked:
            self._lock.acquire()
        removed = self.storage.gc(include_tmp=True)
        wait_for_deletions()
        return removed

    # ---- lifecycle ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            msg = "this CheckpointManager is closed"
            raise RuntimeError(msg)

    def close(self) -> None:
        """Finish the in-flight save, release the writer lock and the process group.

        Raises:
            CommitError: the last async save failed.
        """
        if self._closed:
            return
        try:
            self.wait_save()
            if self._writer is not None:
                self._writer.shutdown()
            self._raise_bg_error()
        finally:
            self._closed = True
            if self._lock is not None:
                self._lock.release()
            self.coord.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, format={self.format!r}, policy={self.policy!r})"


def _commit_error(e: OSError, where: str, previous: int | None) -> CommitError:
    reason = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "the filesystem is read-only",
        errno.EIO: "an I/O error",
    }.get(e.errno or 0, type(e).__name__)
    prev = (
        f"step {previous} is still the newest checkpoint"
        if previous is not None
        else "nothing was committed"
    )
    return CommitError(
        f"saving {where} failed: {reason} ({e}); nothing of it is visible and {prev}"
    )


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            msg = f"metrics keys must be str, got {k!r}"
            raise ValueError(msg)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, int | float):
            try:
                v = float(v)
            except (TypeError, ValueError):
                msg = f"metrics[{k!r}] must be a number, got {type(v).__name__}"
                raise ValueError(msg) from None
        out[k] = float(v)
    return out


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    d = dict(metadata or {})
    try:
        json.dumps(d, allow_nan=False)
    except (TypeError, ValueError) as e:
        msg = f"metadata must be JSON-serializable (no NaN): {e}"
        raise ValueError(msg) from None
    return d
