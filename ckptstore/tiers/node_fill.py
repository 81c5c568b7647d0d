"""Complete a node's partial copy of a step with the other ranks' files from the replica.

A step committed on node-local roots holds, on each node, that node's ranks' files (see
:mod:`ckptstore.tiers.nodes`). A read that needs another node's files (a restore on a different
layout, one process reading everything) takes them from the replica. Fetching the whole
step would move every byte again, the node's own files included; :func:`fill` fetches only
the files of the ranks this copy lacks, each checked against the manifest as it streams in
(:func:`ckptstore.tiers.copy.copy_files`), and makes a complete local copy with the local
commit protocol: a new tmp directory holding hard links to the node's own files (checked
first: a link to a corrupt file would keep it) and the fetched ones, committed in place of
the partial copy (an atomic exchange). A crash at any point leaves the partial copy or the
complete one, never a mix.
"""

from __future__ import annotations

import dataclasses

from .._log import logger as log
from ..errors import IntegrityError
from ..layout import step_dirname
from ..manifest import FileEntry
from ..storage import Storage
from .copy import DEFAULT_THREADS, copy_files
from .nodes import local_ranks
from .safety import mark_replicated

__all__ = ["Filled", "fill"]


@dataclasses.dataclass(frozen=True)
class Filled:
    """What :func:`fill` did to a node's copy of a step."""

    #: The ranks whose files the copy lacked (now present).
    ranks: list[int]
    #: The files fetched from the replica, by name (the lacking ranks' files, and any file of
    #: the node's own that did not verify locally).
    fetched: dict[str, FileEntry]
    #: The files kept from the local copy (linked, not read from the replica).
    kept: list[str]

    @property
    def fetched_bytes(self) -> int:
        """Bytes read from the replica (payloads; the manifest is not counted)."""
        return sum(e.bytes for e in self.fetched.values())


def fill(
    local: Storage, replica: Storage, step: int, *, threads: int = DEFAULT_THREADS
) -> Filled | None:
    """Make the local partial copy of ``step`` complete, fetching only what it lacks.

    Returns ``None`` (nothing done; the caller fetches the whole step) when the local copy
    is not a node's partial copy, is not the save the replica holds (another manifest), or
    the store has no rename.

    Raises:
        IntegrityError, ManifestError: the replica's copy is unreadable or does not match
            its manifest (nothing local changed).
        OSError: the local disk refused the files; the partial copy is left as it was.
    """
    try:
        present = local_ranks(local, step)
    except IntegrityError as e:  # a damaged marker: trust no rank's files to be here
        log.warning("%s; taking every rank's files from the replica", e)
        present = []
    if present is None or not local.atomic_rename:
        return None
    manifest = replica.read_manifest(step)
    try:
        same = local.read_manifest(step).to_bytes() == manifest.to_bytes()
    except Exception:  # unreadable locally: the replica's whole copy replaces it
        same = False
    if not same:
        return None
    lacking = sorted({e.rank for e in manifest.files.values() if e.rank is not None} - set(present))
    d = step_dirname(step)
    kept: list[str] = []
    fetch: dict[str, FileEntry] = {}
    for name, entry in manifest.files.items():
        if entry.rank is not None and entry.rank not in present:
            fetch[name] = entry
            continue
        try:
            local.stream_file(step, name, entry)
            kept.append(name)
        except IntegrityError as e:
            log.warning("%s: %s; taking it from the replica", local.describe(step), e)
            fetch[name] = entry
    pending = local.begin(step, replace=True)
    try:
        for name in kept:
            local._link(f"{d}/{name}", f"{pending.dirname}/{name}")
            pending.files[name] = manifest.files[name]
        copy_files(replica, local, step, manifest, threads=threads, only=fetch, into=pending)
        local.commit(pending, manifest)  # no local-ranks marker: the copy holds every rank's
    except BaseException:
        local.abort(pending)
        raise
    mark_replicated(local, step, replica, manifest)
    done = Filled(ranks=lacking, fetched=fetch, kept=sorted(kept))
    log.info(
        "%s: fetched rank(s) %s's files (%d file(s), %d bytes) from the replica %s; kept %d "
        "local file(s)",
        local.describe(step),
        lacking,
        len(fetch),
        done.fetched_bytes,
        replica.root,
        len(kept),
    )
    return done
