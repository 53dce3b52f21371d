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
import threading
import time
from typing import Any, Iterator

import numpy as np

from jaxckpt import _slots, errors
from jaxckpt.snapshot import ShardRecord, SnapshotManifest, aligned_empty


@dataclasses.dataclass(eq=False)
class Slot:
  """A writable buffer reserved for one step's snapshot."""

  index: int
  step: int
  buffer: Any          # writable, at least ``nbytes`` long (np.uint8 array or mmap)
  nbytes: int


@dataclasses.dataclass(frozen=True)
class PersistError:
  """A failed persist: which step and attempt, and the error (its jaxckpt type and errno kept)."""

  step: int
  attempt: str
  type: str
  message: str
  errno: int | None = None

  def to_obj(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def of(cls, step: int, attempt: str, e: BaseException) -> "PersistError":
    if not isinstance(e, errors.JaxckptError):
      e = errors.StorageError(*((e.errno, f"{type(e).__name__}: {e.strerror}")
                                if isinstance(e, OSError) and e.errno else
                                (f"{type(e).__name__}: {e}",)))
    return cls(step, attempt, type(e).__name__,
               e.strerror if isinstance(e, OSError) and e.errno else str(e),
               e.errno if isinstance(e, OSError) else None)

  def exception(self, where: str) -> BaseException:
    """The error to raise in the trainer: the same jaxckpt class, errno and message."""
    cls = getattr(errors, self.type, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.JaxckptError)):
      cls = errors.StorageError
    msg = f"persisting step {self.step} ({where}) failed: {self.message}"
    if self.errno and issubclass(cls, OSError):
      return cls(self.errno, msg)
    return cls(msg)


class HostStore(abc.ABC):
  """What the manager needs from a host-memory snapshot store."""

  @abc.abstractmethod
  def reserve(self, step: int, nbytes: int, *, timeout_secs: float | None) -> Slot | None:
    """A free slot of at least ``nbytes``; None if none frees up in time (0 = don't wait)."""

  @abc.abstractmethod
  def commit(self, slot: Slot, manifest: SnapshotManifest, *,
             persist_attempt: str | None = None) -> None:
    """Makes ``slot`` the committed snapshot of ``manifest.step``; a store that
    persists by itself (the agent) persists it as ``persist_attempt`` if due."""

  @abc.abstractmethod
  def abort(self, slot: Slot) -> None:
    """Returns an uncommitted slot to the free pool."""

  @abc.abstractmethod
  def steps(self) -> list[int]:
    """Committed steps, oldest first."""

  @abc.abstractmethod
  def read(self, step: int) -> contextlib.AbstractContextManager[tuple[SnapshotManifest, Any]]:
    """Pins ``step`` and yields its manifest and buffer until the context exits."""

  #: ``written`` is worth calling after about this many bytes (None: never call it).
  progress_bytes: int | None = None

  def written(self, slot: Slot, shards: list[ShardRecord]) -> None:
    """``shards`` of ``slot`` are fully written (the store may verify them early)."""
    del slot, shards

  def lend(self, step: int, buffer: Any) -> bool:
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

  def persisted_steps(self) -> list[int]:
    """Steps this store persisted (its part written, and committed by process 0)."""
    return []

  @abc.abstractmethod
  def discard(self, step: int) -> bool:
    """Forgets committed ``step`` (a reader holding it keeps its slot until done);
    False if it was not held."""

  def preallocate(self, nbytes: int) -> None:
    """Allocates and touches every free slot for snapshots of ``nbytes`` now, so
    that no save pays for it (a no-op where slots are sized on reserve)."""
    del nbytes

  def close(self) -> None:
    """Releases the store's resources (a no-op by default)."""


class InProcessStore(HostStore):
  """Snapshots held in this process's memory (lost if the process dies).

  Holds ``max_snapshots + 1`` slots: the committed snapshots plus one being
  written. Slots are allocated on first use at the snapshot's size and reused.
  A slot lent to a restore (:meth:`lend`) keeps its step readable but is never
  written again: when it frees up, its buffer is released (the restored arrays
  hold it while they live) and the next save allocates a new one. While a
  restored array lives, its whole old slot does too: up to one snapshot of
  memory beyond ``host_memory_limit_bytes`` per lent slot. Which slot holds
  what is decided by the shared :class:`jaxckpt._slots.SlotTable`.
  """

  _OWNER = 0          # the one writer (this process)

  def __init__(self, *, max_snapshots: int, host_memory_limit_bytes: int) -> None:
    self._limit = host_memory_limit_bytes
    self._table = _slots.SlotTable(max_snapshots)
    self._buffers: list[np.ndarray | None] = [None] * len(self._table)
    self._manifests: dict[int, SnapshotManifest] = {}
    self._cv = threading.Condition()

  def _check_budget(self, nbytes: int) -> None:
    _slots.check_budget(slots=len(self._table), nbytes=nbytes, limit_bytes=self._limit,
                        where="in-process snapshot store")

  def reserve(self, step: int, nbytes: int, *, timeout_secs: float | None) -> Slot | None:
    self._check_budget(nbytes)
    deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
    with self._cv:
      while (r := self._table.reserve(step, nbytes, self._OWNER)) is None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          return None
        self._cv.wait(left)
    buf = self._buffers[r.index]
    if r.grow or buf is None:
      buf = self._buffers[r.index] = aligned_empty((max(nbytes, 1),), np.uint8)   # adoptable
    return Slot(r.index, step, buf, nbytes)

  def preallocate(self, nbytes: int) -> None:
    self._check_budget(nbytes)
    with self._cv:
      for i in self._table.grow_free(nbytes):
        buf = self._buffers[i] = aligned_empty((max(nbytes, 1),), np.uint8)
        buf.fill(0)                # first touch here, not in a save (~4 s/GiB on some VMs)

  def commit(self, slot: Slot, manifest: SnapshotManifest, *,
             persist_attempt: str | None = None) -> None:
    del persist_attempt          # the manager persists what this store holds
    with self._cv:
      dropped = self._table.commit(slot.index, manifest.step)
      for d in dropped:
        self._manifests.pop(d.step, None)
      self._manifests[manifest.step] = manifest
      self._cv.notify_all()

  def abort(self, slot: Slot) -> None:
    with self._cv:
      self._table.abort(slot.index)
      self._cv.notify_all()

  def steps(self) -> list[int]:
    with self._cv:
      return self._table.steps()

  def discard(self, step: int) -> bool:
    with self._cv:
      d = self._table.discard(step)
      self._manifests.pop(step, None)
      self._cv.notify_all()
      return d is not None

  def lend(self, step: int, buffer: Any) -> bool:
    with self._cv:
      i = next((i for i, b in enumerate(self._buffers) if b is buffer), None)
      return i is not None and self._table.lend(i)     # False: the caller copies instead

  @contextlib.contextmanager
  def read(self, step: int) -> Iterator[tuple[SnapshotManifest, Any]]:
    with self._cv:
      s = self._table.pin(step, self._OWNER)
      if s is None:
        raise errors.StepNotFoundError(
            f"step {step} is not held in host memory (held: {self._table.steps()})")
      manifest, buf = self._manifests[step], self._buffers[s.index]
    try:
      yield manifest, buf
    finally:
      with self._cv:
        self._table.unpin(s.index, self._OWNER)
        self._cv.notify_all()

  def close(self) -> None:
    with self._cv:
      self._buffers = [None] * len(self._buffers)
      self._table = _slots.SlotTable(self._table.keep, len(self._table))
      self._manifests.clear()
