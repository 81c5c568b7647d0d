"""Bounded collectives for ckptstore's own coordination; no-ops in one process.

When ``torch.distributed`` is initialized with more than one rank, the coordinator creates
its own gloo group whose timeout is ``barrier_timeout``, whatever backend training uses, so
every wait ckptstore makes is bounded and, when it expires, raises :class:`BarrierTimeout`
naming the ranks that did not arrive and the phase. Without a process group every method
returns at once, so the manager is written once and has no ``if distributed:`` branches.

Every data collective is preceded by a barrier (gloo's dissemination barrier: log2(N)
rounds, no rank serves the others one after another). Each rank first marks its arrival in
the job's key-value store (one ``set``); when the barrier fails, rank 0 names the ranks that
never arrived, or died, and publishes the list, so every survivor raises the same, correct
``missing_ranks``. After a timeout gloo closes the group's connections, so the coordinator is
marked broken and every later call fails at once instead of waiting again.

What a non-zero rank sends and receives does not grow with the world size in the
collectives a save or restore uses: :meth:`Coordinator.gather` (one fixed-size slot per rank
to rank 0, a point-to-point send only for a payload larger than the slot),
:meth:`Coordinator.reduce` (a gather whose result rank 0 computes and broadcasts) and
:meth:`Coordinator.broadcast` (gloo's binomial tree), :meth:`Coordinator.scatter` (one
fixed-size slot per rank from rank 0) and :meth:`Coordinator.broadcast_tree` (a small object
to every rank, a larger one point to point down a tree of some ranks only: the node leaders
of node-local roots). No all-gather is left. Every collective is counted in
:attr:`Coordinator.stats`.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import json
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

from ._gc import gc_paused
from .errors import BarrierTimeout, CkptStoreError, CommitError, UsageError

__all__ = ["Call", "CollectiveStats", "Coordinator", "same_call", "told_by"]

T = TypeVar("T")

_RANKS_RE = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
#: How long a survivor waits for rank 0's verdict on who is missing.
_VERDICT_WAIT_S = 10.0
#: What a coordinator's group creation may take beyond ``barrier_timeout`` before this rank
#: gives up on it (:meth:`Coordinator._new_group`): its store rendezvous is bounded by the
#: timeout itself, and a healthy gloo connect takes milliseconds.
_GROUP_MARGIN_S = 1.0
#: Up to this many ranks, a rank other than 0 without torchrun's LOCAL_WORLD_SIZE looks at
#: every rank for a dead process of its host (see ``Coordinator._host_ranks``).
_PROBE_ALL = 64
#: Numbers the enabled coordinators of this process, in construction order. The number names
#: the coordination keys, so it must be the same on every rank: a coordinator that takes part
#: in no collective (``enabled=False``, built on one rank only) never takes one.
_instances = itertools.count()
#: Bytes per rank of :meth:`Coordinator.gather`'s fixed-size slot (8 of them the length). A
#: payload that fits travels in the slot; a larger one follows as one point-to-point send.
SLOT = 512


@dataclass
class CollectiveStats:
    """What this rank's coordinator exchanged: one record per collective it took part in.

    ``records`` holds ``(phase, op, bytes sent, bytes received, torch calls, seconds)``.
    Bytes are the payloads this rank put on the wire and took off it (a slot, a pickled
    object, a tensor), not the transport's framing; ``torch calls`` counts the
    ``torch.distributed`` calls made (the barrier before a data collective is a record of
    its own).
    """

    records: list[tuple[str, str, int, int, int, float]] = field(default_factory=list)

    def add(  # noqa: PLR0917 - one record's fields
        self, phase: str, op: str, sent: int, received: int, calls: int, seconds: float
    ) -> None:
        """Append one collective's record."""
        self.records.append((phase, op, sent, received, calls, seconds))

    def totals(self) -> dict[str, float]:
        """Collectives, torch calls, bytes sent and received, seconds, over every record."""
        return {
            "collectives": len(self.records),
            "calls": sum(r[4] for r in self.records),
            "sent": sum(r[2] for r in self.records),
            "received": sum(r[3] for r in self.records),
            "seconds": sum(r[5] for r in self.records),
        }

    def clear(self) -> None:
        """Forget every record."""
        self.records.clear()


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether a local process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Coordinator:
    """Barrier, broadcast and gather over a private gloo group, bounded by ``timeout``.

    Constructing it is collective when a process group exists (every rank must construct
    it, in the same order, as every rank constructs the manager).
    """

    def __init__(self, timeout: float, *, enabled: bool = True) -> None:
        self.timeout = float(timeout)
        # enabled=False: this process acts alone (rank 0 of 1) even under torch.distributed,
        # for code that runs on one rank only and must not start a collective.
        self.enabled = (
            enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
        self.rank = dist.get_rank() if self.enabled else 0
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.group: Any = None
        self._uid = -1  # no coordination keys without a process group
        self._seq = 0
        self._broken: BarrierTimeout | None = None
        self._t_wait = 0.0  # when the current wait (a barrier, or the data exchange) began
        self._in_barrier = False  # the current wait is a barrier (each rank began at its arrival)
        #: Every collective this coordinator took part in (see :class:`CollectiveStats`).
        self.stats = CollectiveStats()
        if self.enabled:
            self._uid = next(_instances)
            store = _default_store()
            try:
                store.set(self._host_key(self.rank), f"{socket.gethostname()}:{os.getpid()}")
            except Exception:  # no default store (or a broken one): new_group alone decides
                store = None
            if store is not None:
                # new_group waits for every rank too, but a rank that never constructs the
                # manager surfaces from it as a raw DistStoreError that names no one. Wait for
                # the others' keys first, so the error names the missing ranks.
                self._await_ranks(store)
            try:
                self.group = self._new_group()
            except (RuntimeError, TimeoutError) as e:  # DistStoreError and gloo's errors alike
                raise self._init_timeout(store, e) from None

    def _new_group(self) -> Any:
        """The private gloo group, created on a thread of its own and waited for ``timeout``.

        gloo's full-mesh connect does not take the group's timeout: where a rank died inside
        ``new_group`` while another was still coming to it, rank 0 waited 15.8 s for gloo's
        own connect timeout with ``barrier_timeout=3`` (rank 1: 0.8 s, refused), before it
        could name the dead rank (``rank_dies_inside_group_creation``). A creation still
        running after ``timeout`` (and a small margin, for a loaded host) is left to finish
        or fail on its own thread (a daemon; its outcome is dropped) and counts as this
        rank's timeout: the store then says which rank never came or has died.

        Raises:
            TimeoutError: the group was not made within the timeout.
            RuntimeError: ``new_group`` failed (``DistStoreError``, gloo's errors).
        """
        made: dict[str, Any] = {}

        def run() -> None:
            try:
                made["group"] = dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self.timeout)
                )
            except BaseException as e:  # handed to the caller, or dropped once abandoned
                made["error"] = e

        t = threading.Thread(target=run, name="ckptstore-new-group", daemon=True)
        t.start()
        t.join(self.timeout + _GROUP_MARGIN_S)
        if t.is_alive():
            raise TimeoutError(f"the process group was not made within {self.timeout:g}s")
        error = made.get("error")
        if error is not None:
            raise error
        return made["group"]

    def _host_key(self, rank: int) -> str:
        return f"ckptstore/{self._uid}/host/{rank}"

    def _await_ranks(self, store: Any) -> None:
        """Wait until every rank has constructed this coordinator (its host key is set)."""
        # Polled with check(), not store.wait(): after a wait times out, the TCPStore client
        # may fail the next requests, and naming the missing ranks needs them.
        keys = [self._host_key(r) for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout
        pause = 0.01
        while True:
            try:
                if store.check(keys):
                    return
            except Exception as e:  # the store is gone: new_group would fail the same way
                raise self._init_timeout(store, e) from None
            if time.monotonic() >= deadline:
                raise self._init_timeout(store, TimeoutError("waiting for the other ranks"))
            time.sleep(pause)
            pause = min(pause * 2, 0.2)  # a few requests a second per rank, at most

    def _init_timeout(self, store: Any, e: BaseException) -> BarrierTimeout:
        missing: list[int] = []
        if store is not None:
            with contextlib.suppress(Exception):  # alive, and failed too (see _dead_ranks)
                store.set(self._failed_key(self.rank), "1")
            came: set[int] = set()
            for r in range(self.world_size):
                with contextlib.suppress(Exception):
                    if store.check([self._host_key(r)]):
                        came.add(r)
                    else:
                        missing.append(r)
            # A rank that came (its key is set) and died in the group's creation: gloo's
            # error names no rank, and rank 0 must not wait for it to look at the verdict.
            here = [r for r in self._host_ranks() if r in came]
            missing = sorted({*missing, *self._dead_ranks(store, here)})
            acks = f"ckptstore/{self._uid}/init/acks"
            if self.rank == 0:
                # The store usually lives in this process, which is about to raise and may
                # exit: wait (bounded) until the other ranks that came have looked too. One
                # may give up on its group only the timeout and the margin after it started
                # (_new_group), where this rank's own creation failed at once (refused).
                others = self.world_size - 1 - len(missing)
                wait = min(_VERDICT_WAIT_S, self.timeout + 2 * _GROUP_MARGIN_S)
                deadline = time.monotonic() + wait
                with contextlib.suppress(Exception):
                    while store.add(acks, 0) < others and time.monotonic() < deadline:
                        time.sleep(0.02)
            else:
                with contextlib.suppress(Exception):
                    store.add(acks, 1)
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "some rank"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        msg = (
            f"rank {self.rank}: {who} did not construct the CheckpointManager ('init') within "
            f"{self.timeout:g}s. Constructing it is collective under torch.distributed: build "
            "it on every rank, in the same order, or pass distributed=False where it is used "
            f"on one rank only; check the logs of {who}. ({first})"
        )
        exc = BarrierTimeout(msg, missing_ranks=missing, phase="init")
        self._broken = exc
        return exc

    @property
    def is_leader(self) -> bool:
        """Rank 0 (or the only process)."""
        return self.rank == 0

    # The verdict and the failure reports are one per coordinator, not one per collective: a
    # coordinator breaks at its first failure (every later call raises), and the ranks may
    # fail one collective apart. A gather's senders have done their part when rank 0 finds a
    # rank missing, and they fail at the next collective: they must find rank 0's verdict,
    # and rank 0 must see that they are alive.
    def _key(self) -> str:
        return f"ckptstore/{self._uid}/missing"

    def _verdict(self, text: str) -> list[int]:
        """The missing ranks: parsed on rank 0, fetched from rank 0's verdict elsewhere."""
        m = _RANKS_RE.search(text)
        store = _default_store()
        key = self._key()
        if self.rank == 0:
            with contextlib.suppress(Exception):  # "deciding": the survivors wait for it
                if store is not None:
                    store.set(self._failed_key(0), "1")
            if m:
                missing = sorted({int(x) for x in re.findall(r"\d+", m.group(1))})
            else:  # "connection closed by peer": gloo names an address, not a rank
                missing = self._probe_missing(store)
            if store is not None:
                # Publish, then wait until every survivor has read it: the store usually
                # lives in this process, which is about to raise and may exit.
                survivors = self.world_size - 1 - len(missing)
                # A survivor that reached the barrier learns of the failure only when its
                # own wait for rank 0 times out (gloo does not tell it sooner): keep the
                # verdict for that long, and the usual verdict wait beyond.
                deadline = time.monotonic() + self.timeout + min(_VERDICT_WAIT_S, self.timeout)
                with contextlib.suppress(Exception):
                    store.set(key, json.dumps(missing))
                    while store.add(key + "/acks", 0) < survivors and time.monotonic() < deadline:
                        time.sleep(0.02)
            return missing
        if store is None:
            return [0]
        half = min(_VERDICT_WAIT_S, self.timeout) / 2
        # How long to wait for the verdict: the usual wait, or, once rank 0 is seen deciding
        # (it failed too, and is looking for the silent ranks), as long as its decision may
        # take from then: the arrivals (half), then the silent ranks (at most a timeout after
        # their arrival, plus half). A rank that arrived long before rank 0 needs this.
        until = [time.monotonic() + 2 * half]
        dead: list[int] = []  # ranks of this host whose process exited (when no verdict came)

        def fetch() -> list[int] | None:
            with contextlib.suppress(Exception):  # "I am alive and failed too" (_probe_missing)
                store.set(self._failed_key(self.rank), "1")
            deciding = False
            while time.monotonic() < until[0]:
                try:
                    if store.check([key]):
                        missing = [int(r) for r in json.loads(store.get(key))]
                        store.add(key + "/acks", 1)
                        return missing
                    if not deciding and store.check([self._failed_key(0)]):
                        deciding = True
                        until[0] = time.monotonic() + self.timeout + 2 * half + 1.0
                except Exception:
                    return None  # the store lived in rank 0's process: rank 0 is gone
                time.sleep(0.02)
            # No verdict: rank 0 is alive but decides no failure of this wait (it is at
            # another one: still finishing an async save's commit, say). It is named, and so
            # is any rank of this host whose process has exited (the one that broke it).
            with contextlib.suppress(Exception):
                dead.extend(self._dead_ranks(store, self._host_ranks()))
            return None

        # A store call to a rank 0 that is alive but frozen (SIGSTOP, swapping, a hung
        # filesystem) blocks for the store's own timeout (30 min by default), not ours:
        # ask from a helper thread and give up on it a second after the verdict wait.
        found: list[list[int] | None] = []
        helper = threading.Thread(
            target=lambda: found.append(fetch()), name="ckptstore-verdict", daemon=True
        )
        helper.start()
        while helper.is_alive() and time.monotonic() < until[0] + 1.0:
            helper.join(0.05)
        if found and found[0] is not None:
            return found[0]
        return sorted({0, *dead})

    def _probe_missing(self, store: Any) -> list[int]:
        """Which ranks are gone.

        Dead processes on this host, ranks that never arrived at this wait, and ranks that
        arrived but went silent in it (frozen inside the barrier or the data exchange).
        """
        if store is None:
            return []
        missing = self._dead_ranks(store, range(self.world_size))
        # Half the verdict wait, so the survivors are still waiting for the verdict.
        half = min(_VERDICT_WAIT_S, self.timeout) / 2
        deadline = time.monotonic() + half
        # When each rank began this wait, on this rank's clock (for the silent ranks below).
        began: dict[int, float] = {}

        def arrived(r: int) -> bool:
            if store.check([self._failed_key(r)]):
                return True  # it failed here too: it was here
            key = self._arrival_key(r)
            if not store.check([key]):
                return False
            seq, wall = _parse_arrival(store.get(key))
            if seq < self._seq:
                return False
            now = time.monotonic()
            # Its own clock's word for when it arrived, never later than now (when this rank
            # saw it); clocks that differ by less than half a verdict wait are absorbed below.
            began[r] = min(now, now - (time.time() - wall)) if seq == self._seq else now
            return True

        def poll(ranks: list[int], there: Any, until: Any) -> list[int]:
            # Looks at least once: a deadline may have passed while an earlier poll waited
            # (it named a live rank that had reported its failure).
            while ranks:
                with contextlib.suppress(Exception):
                    ranks = [r for r in ranks if not there(r)]
                now = time.monotonic()
                if all(now >= until(r) for r in ranks):
                    break
                time.sleep(0.02)
            return ranks

        # A dead peer breaks a wait at once ("connection closed"), while a survivor may
        # still be on its way to it (reading its part of a checkpoint, say): a rank is
        # missing only if it has not arrived by the deadline.
        absent = [r for r in range(self.world_size) if r != self.rank and r not in missing]
        missing += poll(absent, arrived, lambda r: deadline)

        # A rank that arrived but hung inside the barrier or the data exchange (frozen,
        # deadlocked, or dead on another host) is told apart from the survivors by silence:
        # every survivor reports its own failure of this wait (_fail) by the time its own
        # wait times out, at most ``timeout`` after it began. This rank may fail much sooner
        # (a dead peer's connection closes at once, while a survivor waiting on *this* rank
        # learns nothing until its timeout): wait for the survivors that long, or it would
        # name them too, and the survivors, finding no verdict, would blame this rank. In a
        # barrier each rank began at its own arrival (a rank that arrived late times out
        # late); every rank began a data exchange when the barrier before it let them all go.
        def until(r: int) -> float:
            start = began.get(r, self._t_wait) if self._in_barrier else self._t_wait
            return max(deadline, start + self.timeout + half)

        # A rank already at a later wait (a gather's sender waits at the next collective)
        # is alive too.
        def alive(r: int) -> bool:
            if store.check([self._failed_key(r)]):
                return True
            key = self._arrival_key(r)
            return bool(store.check([key])) and _parse_arrival(store.get(key))[0] > self._seq

        silent = [r for r in range(self.world_size) if r != self.rank and r not in missing]
        missing += poll(silent, alive, until)
        return sorted(missing)

    def _dead_ranks(self, store: Any, ranks: Iterable[int]) -> list[int]:
        """The other ``ranks`` whose process, on this host, has exited (by their host keys).

        Every one of ``ranks`` must have set its host key: ``get`` of a key never set waits
        for it (the store's timeout: 30 min).
        """
        dead = []
        host = socket.gethostname()
        for r in ranks:
            if r == self.rank:
                continue
            try:
                where = store.get(self._host_key(r)).decode()
            except Exception:
                continue
            rhost, _, pid = where.rpartition(":")
            if rhost == host and pid.isdigit() and not _alive(int(pid)):
                # A survivor that reported failing this wait may have exited since: not the
                # rank that broke it.
                with contextlib.suppress(Exception):
                    if store.check([self._failed_key(r)]):
                        continue
                dead.append(r)
        return dead

    def _host_ranks(self) -> range:
        """The ranks that may run on this host, for a rank other than 0 to look at.

        torchrun's block of ``LOCAL_WORLD_SIZE`` ranks around this one; without it, every
        rank of a job of at most :data:`_PROBE_ALL` ranks, else none: a rank's failure must
        not cost it (and the store) a request per rank of a large job.
        """
        try:
            local = int(os.environ["LOCAL_RANK"])
            size = int(os.environ["LOCAL_WORLD_SIZE"])
        except (KeyError, ValueError):
            return range(self.world_size if self.world_size <= _PROBE_ALL else 0)
        start = self.rank - local
        if not 0 <= local < size or start < 0:
            return range(0)
        return range(start, min(start + size, self.world_size))

    def _failed_key(self, rank: int) -> str:
        return f"ckptstore/{self._uid}/failed/{rank}"

    def _arrival_key(self, rank: int) -> str:
        # One key a rank, overwritten by each collective with its number: the store holds
        # N keys however many collectives the job makes, not N per collective.
        return f"ckptstore/{self._uid}/in/{rank}"

    def _arrive(self) -> None:
        store = _default_store()
        if store is not None:
            with contextlib.suppress(Exception):
                # Its number, and when it arrived (rank 0 waits for it to time out from then).
                store.set(self._arrival_key(self.rank), f"{self._seq} {time.time():.3f}")

    def _fail(self, e: BaseException, phase: str, step: int | None) -> BarrierTimeout:
        text = str(e)
        missing = self._verdict(text)
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "some rank"
        at = f" of step {step}" if step is not None else ""
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        if self.rank in missing:
            # A verdict naming this rank, which is here: rank 0 gave up on it at an earlier
            # exchange (a save under `if rank == 0`) and no longer takes part; this rank came
            # to its next one alone. It blamed itself ("rank(s) 1 did not arrive"; found by
            # review).
            msg = (
                f"rank {self.rank}: no other rank came to '{phase}'{at} within "
                f"{self.timeout:g}s: rank 0 had already given up on {who} at an earlier "
                "exchange (this rank came too late, or to another call), and ckptstore's "
                "group is broken. Every rank must make the same ckptstore calls (look for "
                f"one under `if rank == 0`); restart the job. (gloo: {first})"
            )
        else:
            msg = (
                f"rank {self.rank}: {who} did not arrive at '{phase}'{at} within "
                f"{self.timeout:g}s. Every rank must call save/restore (not only rank 0) and "
                f"none may have died; check the logs of {who}. (gloo: {first})"
            )
        exc = BarrierTimeout(msg, missing_ranks=missing, phase=phase, step=step)
        self._broken = exc
        return exc

    def _check(self, phase: str, step: int | None) -> None:
        if self._broken is not None:
            b = self._broken
            msg = (
                f"rank {self.rank}: cannot run '{phase}': ckptstore's process group broke at "
                f"'{b.phase}' when rank(s) {b.missing_ranks or '?'} did not arrive; restart the job"
            )
            raise BarrierTimeout(msg, missing_ranks=b.missing_ranks, phase=phase, step=step)

    def barrier(self, phase: str, step: int | None = None) -> None:
        """Wait for every rank; on timeout raise BarrierTimeout naming the absent ranks."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self._barrier(phase, step)
        self.stats.add(phase, "barrier", 0, 0, 1, time.perf_counter() - t0)

    def _barrier(self, phase: str, step: int | None) -> None:
        self._check(phase, step)
        self._seq += 1
        self._arrive()
        self._t_wait = time.monotonic()
        self._in_barrier = True
        try:
            # gloo's dissemination barrier: log2(N) rounds of one empty message a rank, where
            # monitored_barrier had rank 0 answer every rank in turn. Who is missing comes
            # from the arrival keys when it fails (_probe_missing).
            dist.barrier(group=self.group)
        except RuntimeError as e:
            raise self._fail(e, phase, step) from None
        finally:
            self._in_barrier = False

    def _collective(self, phase: str, step: int | None, fn: Any) -> Any:
        self.barrier(phase, step)
        self._t_wait = time.monotonic()
        try:
            with gc_paused():  # unpickling every rank's save plan: many small objects
                return fn()
        except RuntimeError as e:  # a rank died between the barrier and the data
            raise self._fail(e, phase, step) from None

    def broadcast(self, obj: Any, phase: str, step: int | None = None, src: int = 0) -> Any:
        """Send a small picklable object from ``src`` to every rank; returns it everywhere."""
        if not self.enabled:
            return obj
        t0 = time.perf_counter()
        data, exact = _packed(obj, phase, self.rank) if self.rank == src else (b"", True)
        got = self._collective(phase, step, lambda: self._broadcast_bytes(data, src))
        # The sender too returns what the others got: a stand-in where obj could not travel.
        out = obj if self.rank == src and exact else _loads(got)
        sent, received = (len(data), 0) if self.rank == src else (0, len(got))
        self.stats.add(phase, "broadcast", sent, received, 2, time.perf_counter() - t0)
        return out

    def leader_value(self, fn: Callable[[], T], phase: str, step: int | None = None) -> T:
        """``fn()`` run on rank 0, its value on every rank; its error raised on every rank.

        Rank 0 answers even when ``fn`` raised: its exception travels in the broadcast, and
        every rank raises it (rank 0 its own; the others as :func:`told_by` words it). A
        rank 0 that raised before its broadcast (a store it could not list) left the others
        waiting in it for ``barrier_timeout`` while it went on, or until it died.
        """
        answer: tuple[str, Any] = ("ok", None)
        mine: BaseException | None = None
        if self.is_leader:
            try:
                value = fn()
                if self.enabled and self.world_size > 1:
                    try:
                        _dumps(value)  # a value that cannot travel is an error, not a value
                    except Exception as e:
                        msg = f"rank 0's answer in {phase} cannot be sent to the other ranks: {e}"
                        raise CkptStoreError(msg) from e
                answer = ("ok", value)
            except BaseException as e:
                mine = e
                answer = ("error", e)
        try:
            status, value = self.broadcast(answer, phase, step)
        except BaseException as e:
            if mine is None or e is mine:
                raise
            # A peer died in the broadcast: its BarrierTimeout, with rank 0's own error as
            # its cause (the reason rank 0 had nothing to send).
            raise e from mine
        if status == "error":
            if mine is not None:
                raise mine
            raise told_by(0, value)
        return value

    def _broadcast_bytes(self, data: bytes, src: int) -> bytes:
        """``data`` from ``src`` on every rank: its length, then its bytes, each down a tree."""
        import torch

        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, src=src, group=self.group)
        size = int(n.item())
        if self.rank == src:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else None
        else:
            buf = torch.empty(size, dtype=torch.uint8) if size else None
        if buf is not None:
            dist.broadcast(buf, src=src, group=self.group)
        return data if self.rank == src else (buf.numpy().tobytes() if buf is not None else b"")

    def gather(
        self, obj: Any, phase: str, step: int | None = None, dst: int = 0
    ) -> list[Any] | None:
        """Collect one small object per rank on ``dst`` (a list by rank); ``None`` elsewhere.

        A rank sends one fixed-size slot (:data:`SLOT` bytes) holding its pickled object,
        or, when that does not fit, its length, followed by one point-to-point send of the
        object: what a rank sends is its own object, never a size that depends on the
        others (``gather_object`` first all-gathers every rank's size).
        """
        if not self.enabled:
            return [obj]
        t0 = time.perf_counter()
        data, exact = _packed(obj, phase, self.rank)
        got = self._collective(phase, step, lambda: self._gather_bytes(data, dst))
        if got is None:
            self.stats.add(phase, "gather", _wire(data), 0, 1 + (len(data) > _INLINE), _since(t0))
            return None
        # Its own object as the others' arrive: a stand-in where it could not travel.
        out = [obj if r == self.rank and exact else _loads(b) for r, b in enumerate(got)]
        received = sum(_wire(b) for r, b in enumerate(got) if r != self.rank)
        calls = 1 + sum(len(b) > _INLINE for r, b in enumerate(got) if r != self.rank)
        self.stats.add(phase, "gather", 0, received, calls, _since(t0))
        return out

    def _gather_bytes(self, data: bytes, dst: int) -> list[bytes] | None:
        """Every rank's ``data`` on ``dst`` (by rank), ``None`` elsewhere."""
        import torch

        slot = torch.zeros(SLOT, dtype=torch.uint8)
        head = len(data).to_bytes(8, "little")
        fits = len(data) <= _INLINE
        body = head + (data if fits else b"")
        slot[: len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        slots = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.gather(slot, slots if self.rank == dst else None, dst=dst, group=self.group)
        if self.rank != dst:
            if not fits:
                big = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                dist.send(big, dst=dst, group=self.group)
            return None
        out: list[bytes] = []
        for r, got in enumerate(slots):
            if r == self.rank:
                out.append(data)
                continue
            raw = got.numpy().tobytes()
            n = int.from_bytes(raw[:8], "little")
            if n <= _INLINE:
                out.append(raw[8 : 8 + n])
                continue
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src=r, group=self.group)
            out.append(buf.numpy().tobytes())
        return out

    def reduce(
        self,
        obj: Any,
        fn: Callable[[list[Any]], Any],
        phase: str,
        step: int | None = None,
    ) -> Any:
        """``fn`` of every rank's object, computed on rank 0, returned on every rank.

        What a non-zero rank sends is its own object and what it receives is ``fn``'s result
        (keep it small): the replacement for an all-gather whose every rank reduces the
        whole list to the same verdict. An exception ``fn`` raises on rank 0 is raised on
        every rank.
        """
        if not self.enabled:
            return fn([obj])
        t0 = time.perf_counter()
        data, _ = _packed(obj, phase, self.rank)

        def run() -> bytes:
            got = self._gather_bytes(data, 0)
            verdict = b""
            if got is not None:
                try:
                    result: tuple[str, Any] = ("ok", fn([_loads(b) for b in got]))
                except BaseException as e:
                    result = ("raise", e)
                verdict, _ = _packed(result, phase, self.rank)
            return self._broadcast_bytes(verdict, 0)

        verdict = self._collective(phase, step, run)
        status, value = _loads(verdict)
        n = self.world_size - 1
        if self.is_leader:
            sent, received, calls = len(verdict), n * SLOT, 3
        else:
            sent, received, calls = _wire(data), len(verdict), 3 + (len(data) > _INLINE)
        self.stats.add(phase, "reduce", sent, received, calls, _since(t0))
        if status == "raise":
            raise value
        return value

    def scatter(self, objs: Sequence[Any] | None, phase: str, step: int | None = None) -> Any:
        """Rank 0's ``objs[r]`` on each rank ``r`` (``objs``: rank 0's list, None elsewhere).

        Each object travels in one fixed-size slot (:data:`SLOT` bytes), so what a rank
        receives does not grow with the world size.

        Raises:
            ValueError: on rank 0, before any rank is waited for, where an object does not
                fit its slot.
        """
        if not self.enabled:
            assert objs is not None
            return objs[0]
        import torch

        t0 = time.perf_counter()
        slots: list[Any] | None = None
        if self.is_leader:
            assert objs is not None
            if len(objs) != self.world_size:
                raise ValueError(f"{phase}: {len(objs)} objects for {self.world_size} ranks")
            slots = []
            for r, obj in enumerate(objs):
                data = _dumps(obj)
                if len(data) > _INLINE:
                    raise ValueError(f"{phase}: rank {r}'s object takes {len(data)} bytes")
                slot = torch.zeros(SLOT, dtype=torch.uint8)
                body = len(data).to_bytes(8, "little") + data
                slot[: len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
                slots.append(slot)
        out = torch.empty(SLOT, dtype=torch.uint8)

        def run() -> bytes:
            dist.scatter(out, slots, src=0, group=self.group)
            raw = out.numpy().tobytes()
            return raw[8 : 8 + int.from_bytes(raw[:8], "little")]

        got = self._collective(phase, step, run)
        sent, received = ((self.world_size - 1) * SLOT, 0) if self.is_leader else (0, SLOT)
        self.stats.add(phase, "scatter", sent, received, 1, _since(t0))
        return _loads(got)

    def broadcast_tree(
        self,
        obj: Any,
        big: Any,
        links: tuple[int | None, tuple[int, ...]] | None,
        phase: str,
        step: int | None = None,
    ) -> tuple[Any, Any]:
        """``obj`` from rank 0 to every rank, and ``big`` to the members of a tree only.

        ``links``: this rank's parent and children in a tree of some ranks rooted at rank 0
        (:func:`ckptstore.tiers.nodes.leader_links`), or None where this rank is not in it.
        ``obj`` goes down gloo's broadcast; then each member receives ``big`` from its
        parent (point to point) and sends it on to its children, so a rank outside the
        tree receives only ``obj``, and a member sends ``big`` at most once per child.
        One barrier first, as every collective here: a missing rank is named.

        Returns:
            ``(obj, big)`` on the members, ``(obj, None)`` on the other ranks.
        """
        if not self.enabled:
            return obj, big
        import torch

        t0 = time.perf_counter()
        data, exact = _packed(obj, phase, self.rank) if self.is_leader else (b"", True)
        payload, whole = _packed(big, phase, self.rank) if self.is_leader else (b"", True)

        def run() -> tuple[bytes, bytes | None]:
            got = self._broadcast_bytes(data, 0)
            if links is None:
                return got, None
            parent, children = links
            body = payload
            if parent is not None:
                n = torch.zeros(1, dtype=torch.int64)
                dist.recv(n, src=parent, group=self.group)
                buf = torch.empty(int(n.item()), dtype=torch.uint8)
                if buf.numel():
                    dist.recv(buf, src=parent, group=self.group)
                body = buf.numpy().tobytes()
            if children:
                n = torch.tensor([len(body)], dtype=torch.int64)
                t = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else None
                for child in children:
                    dist.send(n, dst=child, group=self.group)
                    if t is not None:
                        dist.send(t, dst=child, group=self.group)
            return got, body

        got, body = self._collective(phase, step, run)
        out = obj if self.is_leader and exact else _loads(got)
        tree = None if body is None else (big if self.is_leader and whole else _loads(body))
        kids = len(links[1]) if links is not None else 0
        sent = (len(data) if self.is_leader else 0) + kids * len(body or b"")
        received = 0 if self.is_leader else len(got) + (len(body) if links else 0)
        self.stats.add(phase, "broadcast_tree", sent, received, 2 + 2 * kids, _since(t0))
        return out, tree

    def broadcast_bytes(
        self, blobs: dict[str, bytearray] | None, phase: str, step: int | None = None
    ) -> dict[str, bytearray]:
        """Send named byte buffers from rank 0 to every rank as uint8 tensors."""
        if not self.enabled:
            return blobs or {}
        import torch

        sizes = self.broadcast(
            {k: len(v) for k, v in (blobs or {}).items()} if self.is_leader else None, phase, step
        )
        out: dict[str, bytearray] = {}
        for name, n in sizes.items():
            if self.is_leader:
                assert blobs is not None
                buf = blobs[name]
            else:
                buf = bytearray(n)
            if n:
                t0 = time.perf_counter()
                t = torch.frombuffer(buf, dtype=torch.uint8)
                self._t_wait = time.monotonic()
                try:
                    dist.broadcast(t, src=0, group=self.group)
                except RuntimeError as e:
                    raise self._fail(e, phase, step) from None
                sent, received = (n, 0) if self.is_leader else (0, n)
                self.stats.add(phase, "broadcast", sent, received, 1, _since(t0))
            out[name] = buf
        return out

    @property
    def seq(self) -> int:
        """How many collectives this coordinator has made: the same number on every rank."""
        return self._seq

    def post(self, tag: str, value: str) -> None:
        """Leave ``value`` under ``tag`` in the job's key-value store for another rank to read.

        For what one rank tells a few others (a node's leader its node's ranks), where a
        collective would carry it to every rank. Bounded: nothing here waits.
        """
        store = _default_store() if self.enabled else None
        if store is not None:
            store.set(f"ckptstore/{self._uid}/post/{tag}", value)

    def read_post(self, tag: str) -> str | None:
        """What :meth:`post` left under ``tag``, or ``None`` if nothing is there (yet)."""
        store = _default_store() if self.enabled else None
        key = f"ckptstore/{self._uid}/post/{tag}"
        if store is None or not store.check([key]):
            return None
        return bytes(store.get(key)).decode()

    def close(self) -> None:
        """Release the private group."""
        if self.enabled and self.group is not None:
            with contextlib.suppress(RuntimeError, ValueError, AssertionError):
                dist.destroy_process_group(self.group)
            self.group = None


#: The most a pickled object may take to travel inside a gather's slot.
_INLINE = SLOT - 8


def _parse_arrival(value: bytes) -> tuple[int, float]:
    """An arrival key's value: the collective's number, and the wall time of the arrival."""
    seq, _, wall = value.decode().partition(" ")
    return int(seq), float(wall) if wall else 0.0


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _loads(data: bytes) -> Any:
    return pickle.loads(data)


def _packed(obj: Any, phase: str, rank: int) -> tuple[bytes, bool]:
    """``obj`` pickled (and True), or what :func:`_sendable` puts in its place (and False).

    ``obj`` is pickled once where it travels as it is.
    """
    try:
        data = _dumps(obj)
    except Exception:
        return _dumps(_sendable(obj, phase, rank)), False
    if any(_pickle_failure(e) for e in _exceptions_in(obj)):
        return _dumps(_sendable(obj, phase, rank)), False
    return data, True


def _wire(data: bytes) -> int:
    """The bytes a rank's gather payload takes on the wire: its slot, plus a send if larger."""
    return SLOT + (len(data) if len(data) > _INLINE else 0)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _sendable(obj: Any, phase: str, rank: int) -> Any:
    """``obj`` if it survives a pickle round trip, else a copy that does.

    Every rank must leave a collective the same way: an object that fails to pickle on the
    sender (an exception holding a lock) or to unpickle on the receivers (an exception
    whose ``__init__`` needs more arguments than it keeps) would raise on one side only and
    leave the others waiting for the timeout. Exceptions are replaced by a
    :class:`CkptStoreError` (a :class:`CommitError` in a save) carrying the original type
    name and message; containers are rebuilt around their sendable parts; any other
    unsendable value becomes such an error too, so the failure at least reaches every rank.
    """
    why = _pickle_failure(obj, round_trip=False)
    if why is None and not any(_pickle_failure(e) for e in _exceptions_in(obj)):
        return obj
    why = why or _pickle_failure(obj)
    if why is None:  # pragma: no cover - an exception in it failed, so obj fails too
        return obj
    if isinstance(obj, BaseException):
        return _stand_in(obj, phase, rank, why)
    if isinstance(obj, tuple | list) and type(obj) in (tuple, list):
        rebuilt: Any = type(obj)(_sendable(x, phase, rank) for x in obj)
    elif type(obj) is dict:
        rebuilt = {k: _sendable(v, phase, rank) for k, v in obj.items()}
    else:
        rebuilt = None
    if rebuilt is not None and _pickle_failure(rebuilt) is None:
        return rebuilt
    return _stand_in(obj, phase, rank, why)


def _pickle_failure(obj: Any, *, round_trip: bool = True) -> str | None:
    """Why ``obj`` cannot make a pickle round trip (or be pickled), or ``None``."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if round_trip:
            pickle.loads(data)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _exceptions_in(obj: Any, depth: int = 0) -> list[BaseException]:
    """The exceptions in ``obj`` and its tuples, lists and dicts (as ckptstore sends them).

    Only they can fail to unpickle on the receivers (an ``__init__`` that needs more
    arguments than it keeps); the rest of what ckptstore sends (plans, file tables,
    manifests) is plain data, so it is pickled once to check the sender's side, not
    unpickled again: a large DTensor save plan would cost as much again.
    """
    if isinstance(obj, BaseException):
        return [obj]
    if depth > 4:
        return []
    if type(obj) in (tuple, list):
        return [e for x in obj for e in _exceptions_in(x, depth + 1)]
    if type(obj) is dict:
        return [e for x in obj.values() for e in _exceptions_in(x, depth + 1)]
    return []


def _stand_in(obj: Any, phase: str, rank: int, why: str) -> CkptStoreError:
    """A picklable error standing in for ``obj``, which could not be sent to the other ranks."""
    cls = CommitError if phase.startswith("save") else CkptStoreError
    if isinstance(obj, BaseException):
        try:
            text = str(obj)
        except Exception:
            text = object.__repr__(obj)
        msg = (
            f"{type(obj).__name__}: {text} [raised on rank {rank} at '{phase}'; it cannot be "
            f"pickled ({why}), so every rank raises it as {cls.__name__}; the traceback on "
            f"rank {rank} shows the original]"
        )
    else:
        msg = (
            f"rank {rank} could not send a {type(obj).__name__} to the other ranks at "
            f"'{phase}' ({why}); this is a bug in ckptstore or in a state_dict(), please "
            "report it"
        )
    err = cls(msg)
    if isinstance(obj, BaseException):
        err.__cause__ = obj  # the sender's traceback shows the original; never pickled
    return err


#: A rank's collective call as the first exchange of a save or restore carries it: its name
#: and the arguments every rank must pass alike (``("save", (("step", 7), ...))``).
Call = tuple[str, tuple[tuple[str, Any], ...]]
#: How many ranks' differing calls the refusal names.
_CALLS_SHOWN = 4


def _spell(call: Any) -> str:
    if isinstance(call, tuple) and len(call) == 5 and isinstance(call[3], tuple):
        call = call[3]  # what save:enter sends: (..., its Call)
    if (
        isinstance(call, tuple)
        and len(call) == 2
        and isinstance(call[0], str)
        and isinstance(call[1], tuple)
    ):
        args = ", ".join(f"{k}={v!r}" for k, v in call[1])
        return f"{call[0]}({args})"
    return "another ckptstore call"  # a rank in another collective of the manager


def told_by(rank: int, err: BaseException) -> BaseException:
    """``err``, raised on rank ``rank``, as the other ranks raise it once rank 0 told them.

    ``err`` is the other ranks' own copy (it came in an exchange). ckptstore's own errors
    keep their type and attributes (``missing``, ``missing_ranks``, ``path``: a caller that
    reads them sees rank ``rank``'s) and their message starts with ``rank N:``; anything
    else (an interrupt, an ``OSError`` of the store, a user's exception from a state's hook)
    keeps its type and message and gets a note ``raised on rank N`` (``__notes__``, printed
    under its traceback).
    """
    if isinstance(err, CkptStoreError):
        told = copy.copy(err)  # CkptStoreError.__reduce__: the type and every attribute
        prefix = f"rank {rank}: "
        if not err.message.startswith(prefix):  # told once more: not "rank 0: rank 0: ..."
            told.message = prefix + err.message
        told.args = (told.message,)
        return told
    note = f"raised on rank {rank}"
    if note not in getattr(err, "__notes__", ()):
        err.add_note(note)
    return err


def same_call(calls: list[Any]) -> None:
    """Refuse (on rank 0, raised on every rank by ``reduce``) calls that differ from rank 0's.

    ``calls``: each rank's :data:`Call`, or whatever a rank in another collective sent in
    its place. Collectives pair by order, not by name: a save whose step differs between
    ranks (uneven batches counted per rank) committed rank 0's step with the other ranks'
    state in it, a ``restore(step=...)`` of another step on one rank returned rank 0's step
    there, and a save on one rank paired with a restore on another.

    Raises:
        UsageError: naming the first ranks whose call differs, and rank 0's.
    """
    ref = calls[0]
    odd = [r for r, c in enumerate(calls) if c != ref]
    if not odd:
        return
    shown = ", ".join(f"rank {r}: {_spell(calls[r])}" for r in odd[:_CALLS_SHOWN])
    more = f" and {len(odd) - _CALLS_SHOWN} more" if len(odd) > _CALLS_SHOWN else ""
    raise UsageError(
        f"the ranks made different calls: rank 0: {_spell(ref)}; {shown}{more}. Every rank "
        "must make the same ckptstore call with the same step and options (count steps "
        "alike on every rank, and save or restore on every rank, never under `if rank == "
        "0`); nothing was saved or restored"
    )
