"""Host-snapshot stores: where captured bytes live between steps.

The manager talks to a store only through :class:`HostStore`, so the
in-process store here and the snapshot agent (``jaxckpt.agent``) are
interchangeable. A store hands out preallocated *slots* (reused across steps:
no allocation per save), makes a step visible only on ``commit``, keeps at most
``max_snapshots`` committed steps (never dropping the newest), and lets readers
pin a step while they read it.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from jaxckpt import errors
from jaxckpt.host import _persist, _slots
from jaxckpt.host._persist import PersistConfig, PersistError, PersistStatus  # noqa: F401  (the store's names)
from jaxckpt.host._persist import PersistStorage
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, aligned_empty

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Slot:
  """A writable buffer reserved for one step's snapshot.

  A store may hand out a slot before its memory is ready (``reserve`` is on the
  save path): ``opener`` then maps it the first time ``buffer`` is read, which
  the background copy does."""

  index: int
  step: int
  _buffer: np.ndarray | None    # writable uint8, at least ``nbytes`` long (memory or a map)
  nbytes: int
  opener: Callable[[], np.ndarray] | None = None

  @property
  def buffer(self) -> np.ndarray:
    if self._buffer is None and self.opener is not None:
      self._buffer, self.opener = self.opener(), None
    return self._buffer


class Piece(Protocol):
  """One saving process's snapshot of a step, as a restore reads it: held here
  (``restore._read.BufferPiece``), by another host's agent (``agent._remote.RemotePiece``,
  ``remote``: read ahead over the network by ``fetch``), or a lost host's, rebuilt
  from the survivors' parity as it is read (``agent._remote.RebuiltPiece``,
  ``rebuilt``: read ahead after the others, whose bytes its rebuild may use)."""

  manifest: SnapshotManifest
  bytes_read: int
  remote: bool
  rebuilt: bool

  def fetch(self, wanted: Sequence[tuple[LeafRecord, ShardRecord]]) -> None: ...
  def shard_array(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray: ...
  def shard_private(self, leaf: LeafRecord, shard: ShardRecord) -> np.ndarray: ...
  def span(self, start: int, nbytes: int, *, read: bool = True) -> np.ndarray | None: ...


class ParityReport(Protocol):
  """What the job's agents say about the parity of one step they protect
  (``agent._parity_recovery.StepParity``)."""

  step: int
  process_count: int
  held: set[int]          # hosts whose agent holds the step's snapshot
  done: set[int]          # hosts whose agent holds all of its parity for the step
  errors: dict[int, str]  # host -> why its parity of the step failed

  @property
  def protected(self) -> bool: ...
  def check(self) -> None: ...


class HostStore(abc.ABC):
  """What the manager needs from a host-memory snapshot store."""

  @abc.abstractmethod
  def reserve(self, step: int, nbytes: int, *, timeout_secs: float | None) -> Slot | None:
    """A free slot of at least ``nbytes``; None if none frees up in time (0 = don't wait)."""

  @abc.abstractmethod
  def commit(self, slot: Slot, manifest: SnapshotManifest, *,
             persist_attempt: str | None = None) -> None:
    """Makes ``slot`` the committed snapshot of ``manifest.step``. With a
    ``persist_attempt`` (the step is due for storage) the store holds the slot
    from this commit until the step's persist, which it runs as that attempt,
    has ended: no later save can recycle it meanwhile."""

  @abc.abstractmethod
  def abort(self, slot: Slot) -> None:
    """Returns an uncommitted slot to the free pool."""

  @abc.abstractmethod
  def steps(self) -> list[int]:
    """Committed steps, oldest first."""

  @abc.abstractmethod
  def read(self, step: int
           ) -> contextlib.AbstractContextManager[tuple[SnapshotManifest, np.ndarray]]:
    """Pins ``step`` and yields its manifest and buffer until the context exits."""

  def lend(self, step: int, buffer: np.ndarray) -> bool:
    """Promises that ``buffer`` (``step``'s, as pinned by ``read``) is never
    written again, so restored arrays may keep views of it (XLA:CPU adopts host
    buffers); False if this store cannot (its slots are reused in place) or
    the buffer is no longer pinned.
    """
    del step, buffer
    return False

  def persist_errors(self, *, ask: bool = True) -> list[PersistError]:
    """Errors of persists this store ran since the last call, each reported once
    (``ask=False``: only those already known here, at no cost)."""
    del ask
    return []

  def persist_status(self, *, ask: bool = True) -> PersistStatus:
    """Which persists are queued or running, and which ended on storage
    (``ask=False``: as last heard, at no cost)."""
    del ask
    return PersistStatus()

  def persisted_steps(self) -> list[int]:
    """Steps this store persisted (its part written, and committed by process 0)."""
    return list(self.persist_status().persisted)

  def has_free_slot(self) -> bool:
    """Whether a ``reserve`` now would find a slot without waiting."""
    return True

  def room_note(self) -> str | None:
    """Why steps held for their persists may take the loop's slots (host memory has
    no room for slots of their own) and what to change, as the last ``reserve``
    found; None when they have room (or nothing is persisted)."""
    return None

  def persist_to(self, config: PersistConfig) -> None:
    """From now on, persists the steps committed with a ``persist_attempt`` as
    ``config`` says (the manager calls it when it has a directory)."""
    raise errors.InvalidArgumentError(
        f"{type(self).__name__} does not persist snapshots, so a CheckpointManager with a "
        "directory cannot use it; implement HostStore.persist_to, or pass directory=None")

  def persist_held(self, step: int, attempt: str) -> bool:
    """Persists committed ``step``, saved without a ``persist_attempt``, as ``attempt``
    (holding its slot until then): a process about to end (SIGTERM's deadline) puts its
    newest snapshot on storage. False if the store does not (a store whose snapshots
    outlive the trainer, as the agent's, need not) or no longer holds ``step``."""
    del step, attempt
    return False

  #: How often this store replaced a dead backing process (the agent).
  restarts: int = 0

  # -- the job: what a store shared by several hosts (the agents) adds ---------

  def complete_steps(self) -> list[int]:
    """Steps for which every saving process's snapshot is held somewhere in the job."""
    return self.steps()

  def holders(self, step: int, *, timeout_secs: float | None = None) -> tuple[set[int], int | None]:
    """The saving processes whose snapshot of ``step`` is held in the job, and how
    many processes saved it (None: no one holds it); the job's agents are asked for
    ``timeout_secs`` at most (None: one request's timeout)."""
    del timeout_secs
    with contextlib.suppress(errors.StepNotFoundError):
      with self.read(step) as (manifest, _):
        return {manifest.process_index}, manifest.process_count
    return set(), None

  def step_manifest(self, step: int) -> SnapshotManifest | None:
    """A manifest of ``step`` from any saving process's snapshot the job holds (or
    the copy kept with parity), for its structure; None if none is found."""
    if step not in self.steps():
      return None
    with self.read(step) as (manifest, _):
      return manifest

  def parity_steps(self, *, timeout_secs: float | None = None) -> dict[int, ParityReport]:
    """What the job's agents say of each step they protect (none here); asked for
    ``timeout_secs`` at most (None: one request's timeout)."""
    del timeout_secs
    return {}

  def unanswered(self) -> list[str]:
    """The job's agents that did not answer the last question asked of them all
    (:meth:`holders`, :meth:`parity_steps`), each named with why; none here."""
    return []

  def other_pieces(self, step: int, local_index: int | None, *, rebuild: bool,
                   have: list[Piece], stack: contextlib.ExitStack) -> list[Piece]:
    """The pieces of ``step`` held elsewhere in the job (each pinned until ``stack``
    closes) and, with ``rebuild``, those of lost hosts rebuilt from parity;
    ``have`` are the pieces found so far. This process's store is the whole story
    here: StepNotFoundError."""
    del local_index, rebuild, have, stack
    raise errors.StepNotFoundError(f"step {step} is not held in this process")

  def discover(self, *, timeout_secs: float) -> None:
    """Learns where the job's other hosts keep their snapshots (a no-op here)."""
    del timeout_secs

  def recover_persists(self, process_index: int, *, run_id: str | None = None) -> None:
    """Writes this process's part of persists that an earlier run of the job (not
    ``run_id``, this one) still waits on and that this store lost (a new agent
    after a lost machine); a no-op here."""
    del process_index, run_id

  #: Whether ``discard`` fences the persists of every host of the job (the agents),
  #: not only this process's: then any process may clear a deleted step from storage.
  fences_job = False

  @abc.abstractmethod
  def discard(self, step: int, *, timeout_secs: float = 60.0) -> bool:
    """Forgets committed ``step`` (a reader holding it keeps its slot until done)
    and fences its persists: a queued one never runs, a running one never
    commits; returns once none of them runs (SnapshotTimeoutError after
    ``timeout_secs``). False if the step was not held (a store shared by the
    job's hosts: nor deleted by another host's delete first)."""

  def rollback(self, rid: str, steps: list[int], *, timeout_secs: float = 60.0) -> None:
    """Rollback ``rid`` (a new timeline): discards ``steps`` as ``discard`` does. A
    store whose memory outlives the trainer (the agents) applies it at once and
    records it, applied once per id; here (this process's memory) each is discarded."""
    del rid
    for step in steps:
      self.discard(step, timeout_secs=timeout_secs)

  def complete_rollbacks(self, *, timeout_secs: float = 60.0) -> None:
    """Applies the rollbacks that some agent of the job recorded on every agent that
    missed them (a trainer killed between them); a no-op here (this process's memory
    records none)."""
    del timeout_secs

  def preallocate(self, nbytes: int) -> None:
    """Allocates and touches every free slot for snapshots of ``nbytes`` now, so
    that no save pays for it (a no-op where slots are sized on reserve)."""
    del nbytes

  def close(self, timeout_secs: float = 300.0) -> None:
    """Waits up to ``timeout_secs`` for the persists this store runs, then
    releases its resources."""


class InProcessStore(HostStore):
  """Snapshots held in this process's memory (lost if the process dies).

  Holds ``max_snapshots + 1`` slots: the committed snapshots plus one being
  written, and a slot more for each step held for its persist while it runs
  (at most ``max_snapshots + 1`` more, as ``host_memory_limit_bytes`` allows;
  ``prepare()`` allocates one of them when it persists). Slots are allocated on
  first use at the snapshot's size and reused.
  A slot lent to a restore (:meth:`lend`) keeps its step readable but is never
  written again: when it frees up, its buffer is released (the restored arrays
  hold it while they live) and the next save allocates a new one. While a
  restored array lives, its whole old slot does too: up to one snapshot of
  memory beyond ``host_memory_limit_bytes`` per lent slot. Which slot holds
  what is decided by the shared :class:`jaxckpt.host._slots.SlotTable`.

  It persists (``persist`` or :meth:`persist_to`) through ``storage``, the
  universal format (``jaxckpt.universal``) that its maker hands in; made without
  it, it holds snapshots only.
  """

  _OWNER = 0          # the one writer (this process)

  def __init__(self, *, max_snapshots: int, host_memory_limit_bytes: int,
               persist: PersistConfig | None = None,
               storage: PersistStorage | None = None) -> None:
    self._storage = storage
    self._limit = host_memory_limit_bytes
    # which slot holds what, and each slot's one record (its step's manifest, its
    # buffer: ``memory``); nothing is kept beside it
    self._table = _slots.SlotTable(max_snapshots)
    self._cv = threading.Condition()
    self._persister = None
    self._note: str | None = None      # why held steps take the loop's slots (room_note)
    self._crowded = 0                  # how often they did
    if persist is not None:
      self.persist_to(persist)

  def persist_to(self, config: PersistConfig) -> None:
    if self._persister is not None and self._persister.config == config:
      return
    if self._persister is not None:
      raise errors.InvalidArgumentError(
          f"this in-process store persists to {self._persister.config.directory!r} already; "
          "one store per manager")
    storage = self._storage
    if storage is None:
      raise errors.InvalidArgumentError(
          f"this in-process store was made without storage, so it cannot persist to "
          f"{config.directory!r}: make it with InProcessStore(..., storage=jaxckpt.universal), "
          "or pass directory=None")
    self._persister = _persist.Persister(config, lambda step, attempt: self.read(step),
                                         self._release, storage=lambda: storage)

  def _check_budget(self, nbytes: int) -> None:
    """Raises HostMemoryBudgetError if the loop's ``max_snapshots + 1`` slots do not
    fit; sets how many more the held steps may take. Called holding the lock."""
    keep = self._table.keep
    _slots.check_budget(keep=keep, nbytes=nbytes, limit_bytes=self._limit,
                        where="in-process snapshot store")
    self._table.spare = _slots.spare_slots(keep=keep, nbytes=nbytes, limit_bytes=self._limit)
    for i in self._table.idle_beyond():      # (no longer within the budget at this size)
      self._table.slots[i].memory = None

  def _check_crowded(self, nbytes: int) -> None:
    """Says (a WARNING at the 1st, 2nd, 4th... time) when steps held for their persists
    took the loop's slots for lack of memory. Called holding the lock."""
    self._note = None
    if self._persister is None or not self._table.crowded():
      return
    self._note = _slots.short_of_room(keep=self._table.keep, spare=self._table.spare,
                                      nbytes=nbytes, limit_bytes=self._limit,
                                      where="in-process snapshot store")
    self._crowded += 1
    logger.log(logging.WARNING if self._crowded & (self._crowded - 1) == 0 else logging.DEBUG,
               "%s", self._note)

  def room_note(self) -> str | None:
    with self._cv:
      return self._note

  def reserve(self, step: int, nbytes: int, *, timeout_secs: float | None) -> Slot | None:
    deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
    with self._cv:
      self._check_budget(nbytes)
      self._check_crowded(nbytes)
      while (r := self._table.reserve(step, nbytes, self._OWNER)) is None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          return None
        self._cv.wait(left)
      s = self._table.slots[r.index]
    buf = s.memory
    if r.grow or buf is None:
      buf = s.memory = aligned_empty((max(nbytes, 1),), np.uint8)   # adoptable
    return Slot(r.index, step, buf, nbytes)

  def preallocate(self, nbytes: int) -> None:
    with self._cv:
      self._check_budget(nbytes)
      if self._persister is not None and self._table.spare:   # a persist's slot too
        self._table.grow_to(max(len(self._table), self._table.keep + 2))
      for i in self._table.grow_free(nbytes):
        buf = self._table.slots[i].memory = aligned_empty((max(nbytes, 1),), np.uint8)
        buf.fill(0)                # first touch here, not in a save (~4 s/GiB on some VMs)

  def commit(self, slot: Slot, manifest: SnapshotManifest, *,
             persist_attempt: str | None = None) -> None:
    persist = persist_attempt is not None and self._persister is not None
    with self._cv:
      self._dropped(self._table.commit(slot.index, manifest.step, hold=persist,
                                       attempt=persist_attempt, manifest=manifest))
      self._cv.notify_all()
    if persist:
      self._persister.submit(manifest.step, persist_attempt)

  def _dropped(self, dropped: list[_slots.Dropped]) -> None:
    for d in dropped:
      if d.state == _slots.COMMITTED and d.held:   # rolled back before it was persisted
        self._persister.fence(d.step)

  def _release(self, step: int, attempt: str | None = None) -> None:
    with self._cv:
      self._dropped(self._table.release(step, attempt))
      self._cv.notify_all()

  def persist_held(self, step: int, attempt: str) -> bool:
    with self._cv:
      s = self._table.committed(step)
      if self._persister is None or s is None or s.held:
        return False
      s.held, s.attempt = True, attempt
    self._persister.submit(step, attempt)
    return True

  def has_free_slot(self) -> bool:
    with self._cv:
      return bool(self._table.room())

  def persist_status(self, *, ask: bool = True) -> PersistStatus:
    del ask
    return PersistStatus() if self._persister is None else self._persister.status()

  def persist_errors(self, *, ask: bool = True) -> list[PersistError]:
    del ask
    return [] if self._persister is None else self._persister.take_errors()

  def abort(self, slot: Slot) -> None:
    with self._cv:
      self._table.abort(slot.index)
      self._cv.notify_all()

  def steps(self) -> list[int]:
    with self._cv:
      return self._table.steps()

  def discard(self, step: int, *, timeout_secs: float = 60.0) -> bool:
    with self._cv:
      d = self._table.discard(step)
      self._cv.notify_all()
    if self._persister is not None:
      self._persister.fence(step)
      if not self._persister.wait_idle(timeout_secs, step=step):
        raise errors.SnapshotTimeoutError(
            f"discard of step {step}: its running persist to "
            f"{self._persister.config.directory!r} did not stop within {timeout_secs} s "
            "(it will not commit)")
    return d is not None

  def lend(self, step: int, buffer: np.ndarray) -> bool:
    with self._cv:
      i = next((s.index for s in self._table.slots if s.memory is buffer), None)
      return i is not None and self._table.lend(i)     # False: the caller copies instead

  @contextlib.contextmanager
  def read(self, step: int) -> Iterator[tuple[SnapshotManifest, np.ndarray]]:
    with self._cv:
      s = self._table.pin(step, self._OWNER)
      if s is None:
        raise errors.StepNotFoundError(
            f"step {step} is not held in host memory (held: {self._table.steps()})")
      manifest, buf = s.parsed(), s.memory
    try:
      yield manifest, buf
    finally:
      with self._cv:
        self._table.unpin(s.index, self._OWNER)
        self._cv.notify_all()

  def close(self, timeout_secs: float | None = None) -> None:
    """Waits for the queued persists (at most ``timeout_secs``, by default the
    persist's own timeout), then frees the slots."""
    try:
      if self._persister is not None:
        self._persister.close(timeout_secs or self._persister.config.timeout_secs)
    finally:
      self._free()

  def _free(self) -> None:
    with self._cv:
      self._table = _slots.SlotTable(self._table.keep, len(self._table))
