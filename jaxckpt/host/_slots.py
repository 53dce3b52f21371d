"""The snapshot slot table: which slot holds which step, in which state.

One small pure class (no locks, no memory, no I/O) used by both host stores,
the in-process :class:`jaxckpt.host.store.InProcessStore` and the snapshot agent
(``jaxckpt.agent._server``). Each store wraps it in its own lock and owns the
bytes; the table decides:

- a slot is ``free``, ``writing`` (reserved by one owner for one step) or
  ``committed`` (the readable snapshot of one step);
- a pinned slot (a reader holds it) is never handed out for writing;
- committing step S drops every committed step >= S first (a rolled-back
  timeline: the newer steps are stale), then the oldest beyond ``keep``, never
  the newest, never one *held* for its persist, and never the newest step
  *protected* by parity (``protect``: the one a lost host can still be rebuilt
  to while the newer ones wait for their parity);
- a step due for storage is held from its commit until its persist has ended
  (``commit(..., hold=True)``, then ``release``): held steps stay readable and
  their slots are never handed out, so a later save cannot recycle a slot a
  queued persist still has to read (when every slot is held, ``reserve`` finds
  none free: the store's flow control then skips or waits);
- a lent slot (restored arrays keep views of its buffer) is never written
  again: the store gives it a new buffer on its next reserve;
- an owner's earlier ``writing`` slot is stale once it reserves again (a trainer
  reserves only after its previous save is over), and a dead owner's slots and
  pins are forgotten.

Every method that frees a slot returns what it freed (:class:`Dropped`), so the
store can release what it keeps beside the table (manifests, parity, hashing).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from jaxckpt import errors

FREE, WRITING, COMMITTED = "free", "writing", "committed"


@dataclasses.dataclass
class SlotState:
  """One slot's entry."""

  index: int
  state: str = FREE
  step: int | None = None
  owner: int | None = None      # who writes it (a trainer pid; 0 in-process)
  size: int = 0                 # bytes of memory the store holds for it
  lent: bool = False
  held: bool = False            # committed and due for storage: kept until its persist ends
  protected: bool = False       # its parity is done (the newest such step is kept)
  pins: dict[int, int] = dataclasses.field(default_factory=dict)   # reader -> count

  @property
  def pinned(self) -> bool:
    return bool(self.pins)


@dataclasses.dataclass(frozen=True)
class Dropped:
  """A slot the table freed: its index, the step it held, its former state, and
  whether that step was still held for its persist (its persist must be fenced)."""

  index: int
  step: int | None
  state: str
  held: bool = False


@dataclasses.dataclass(frozen=True)
class Reservation:
  """A slot handed out for writing; ``grow`` is True when the store must give
  it ``nbytes`` of new memory first (too small, or lent to a restore)."""

  index: int
  grow: bool


def check_budget(*, slots: int, nbytes: int, limit_bytes: int, where: str,
                 extra_bytes: int = 0, extra_what: str = "") -> None:
  """Raises HostMemoryBudgetError if ``slots`` x ``nbytes`` (+ ``extra_bytes``)
  exceeds ``limit_bytes``."""
  need = slots * nbytes + extra_bytes
  if need > limit_bytes:
    raise errors.HostMemoryBudgetError(
        f"{where}: {slots} snapshot slots x {nbytes / 2**20:.1f} MiB{extra_what} = "
        f"{need / 2**20:.1f} MiB exceed host_memory_limit_bytes="
        f"{limit_bytes} ({limit_bytes / 2**20:.1f} MiB); lower max_snapshots, "
        "shard the state over more hosts, or raise host_memory_limit_bytes")


class SlotTable:
  """``keep`` committed snapshots at most, in ``count`` slots (``keep + 1``: one
  more for the snapshot being written)."""

  def __init__(self, keep: int, count: int | None = None) -> None:
    if keep < 1:
      raise errors.InvalidArgumentError(f"keep={keep!r}: a slot table keeps at least 1 step")
    self.keep = keep
    self.slots: list[SlotState] = []
    self.grow_to(keep + 1 if count is None else count)

  # -- shape -----------------------------------------------------------------

  def grow_to(self, count: int) -> None:
    """Adds free slots until there are ``count`` (slots are never removed)."""
    while len(self.slots) < count:
      self.slots.append(SlotState(len(self.slots)))

  def __len__(self) -> int:
    return len(self.slots)

  # -- queries ---------------------------------------------------------------

  def steps(self) -> list[int]:
    """Committed steps, oldest first."""
    return sorted(s.step for s in self.slots if s.state == COMMITTED)

  def held_steps(self) -> list[int]:
    """Committed steps held for their persist, oldest first."""
    return sorted(s.step for s in self.slots if s.state == COMMITTED and s.held)

  def committed(self, step: int) -> SlotState | None:
    """The slot holding committed ``step``, or None."""
    return next((s for s in self.slots if s.state == COMMITTED and s.step == step), None)

  def owners(self) -> set[int]:
    """Every writer and reader the table knows of."""
    return ({s.owner for s in self.slots if s.owner is not None}
            | {p for s in self.slots for p in s.pins})

  # -- writing ---------------------------------------------------------------

  def reserve(self, step: int, nbytes: int, owner: int) -> Reservation | None:
    """A free, unpinned slot for ``owner`` to write ``step`` into (None if none
    is free). Prefers a slot already big enough and not lent."""
    free = [s for s in self.slots if s.state == FREE and not s.pinned]
    if not free:
      return None
    s = max(free, key=lambda s: (s.size >= nbytes and not s.lent, -s.index))
    grow = s.size < nbytes or s.lent
    if grow:
      s.size = nbytes
    s.state, s.step, s.owner, s.lent = WRITING, step, owner, False
    return Reservation(s.index, grow)

  def abandon(self, owner: int) -> list[Dropped]:
    """Frees ``owner``'s slots still being written: an owner reserves only once
    its previous save is over, so any slot it still writes is stale."""
    return [self._drop(s) for s in self.slots if s.state == WRITING and s.owner == owner]

  def grow_free(self, nbytes: int) -> list[int]:
    """Free, unpinned slots smaller than ``nbytes`` or lent: sized to ``nbytes``
    now (the store gives each new memory) and returned."""
    out = []
    for s in self.slots:
      if s.state == FREE and not s.pinned and (s.size < nbytes or s.lent):
        s.size, s.lent = nbytes, False
        out.append(s.index)
    return out

  def writing(self, index: int, step: int) -> SlotState:
    """The slot ``index`` if it is being written for ``step``; else CorruptSnapshotError."""
    s = self._at(index)
    if s.state != WRITING or s.step != step:
      raise errors.CorruptSnapshotError(
          f"step {step} written to slot {index}, which is {s.state}"
          f"{'' if s.step is None else f' (step {s.step})'}: the reservation was given up")
    return s

  def commit(self, index: int, step: int, *, hold: bool = False) -> list[Dropped]:
    """Makes slot ``index`` (writing ``step``) the committed snapshot of ``step``,
    held for its persist if ``hold``. Returns the steps dropped: newer or equal
    ones (a rollback, held ones included: their persists belong to the abandoned
    timeline), then the oldest beyond ``keep`` that are not held."""
    s = self.writing(index, step)
    dropped = [self._drop(o) for o in self.slots if o.state == COMMITTED and o.step >= step]
    s.state, s.owner, s.held, s.protected = COMMITTED, None, hold, False
    return dropped + self._trim()

  def protect(self, step: int) -> list[Dropped]:
    """Committed ``step`` is protected (its parity is done): it is kept while it is
    the newest protected step; returns what the keep rule drops now (an older
    protected step, no longer needed). A no-op if ``step`` is not held here."""
    s = self.committed(step)
    if s is None or s.protected:
      return []
    s.protected = True
    return self._trim()

  def protected_step(self) -> int | None:
    """The newest committed step protected by parity, or None."""
    steps = [s.step for s in self.slots if s.state == COMMITTED and s.protected]
    return max(steps) if steps else None

  def release(self, step: int) -> list[Dropped]:
    """Ends the hold of committed ``step`` (its persist ended); returns what the
    keep rule drops now that it may (a no-op if ``step`` is not held)."""
    s = self.committed(step)
    if s is None or not s.held:
      return []
    s.held = False
    return self._trim()

  def _trim(self) -> list[Dropped]:
    """Drops the oldest committed steps beyond ``keep``: never the newest or a held
    one, and not the newest protected one while a slot stays free for the next
    save without it (it must not stall saves until a newer step is protected,
    which may never happen: a peer skipped it, or its parity failed)."""
    committed = sorted((o for o in self.slots if o.state == COMMITTED), key=lambda o: o.step)
    extra = len(committed) - self.keep
    guard = self.protected_step()
    out = []
    for o in committed[:-1]:
      if extra <= 0:
        break
      if not o.held and o.step != guard:
        out.append(self._drop(o))
        extra -= 1
    if guard is not None and not self.free_slots():
      g = self.committed(guard)
      if g is not committed[-1] and not g.held and len(committed) - len(out) > self.keep:
        out.append(self._drop(g))
    return out

  def free_slots(self) -> int:
    """Slots a ``reserve`` could hand out now (free and not pinned)."""
    return sum(s.state == FREE and not s.pinned for s in self.slots)

  def abort(self, index: int) -> Dropped | None:
    """Frees slot ``index`` if it is being written (a no-op otherwise)."""
    s = self._at(index)
    return self._drop(s) if s.state == WRITING else None

  def discard(self, step: int) -> Dropped | None:
    """Frees the committed slot of ``step`` (None if not held)."""
    s = self.committed(step)
    return None if s is None else self._drop(s)

  # -- reading ---------------------------------------------------------------

  def pin(self, step: int, reader: int) -> SlotState | None:
    """Pins committed ``step`` for ``reader`` (None if not held)."""
    s = self.committed(step)
    if s is not None:
      s.pins[reader] = s.pins.get(reader, 0) + 1
    return s

  def unpin(self, index: int, reader: int) -> None:
    s = self._at(index)
    if s.pins.get(reader):
      s.pins[reader] -= 1
      if not s.pins[reader]:
        del s.pins[reader]

  def lend(self, index: int) -> bool:
    """Marks pinned slot ``index`` lent (never written in place again); False if
    it is not pinned."""
    s = self._at(index)
    if not s.pinned:
      return False
    s.lent = True
    return True

  # -- owners ----------------------------------------------------------------

  def forget(self, dead: Iterable[int]) -> list[Dropped]:
    """Forgets owners that are gone: their half-written slots and their pins."""
    dead = set(dead)
    dropped = [self._drop(s) for s in self.slots if s.state == WRITING and s.owner in dead]
    for s in self.slots:
      for p in dead & set(s.pins):
        del s.pins[p]
    return dropped

  def reap(self, alive: Callable[[int], bool], *, never: Iterable[int] = ()) -> list[Dropped]:
    """:meth:`forget` every owner that ``alive`` says is gone (except ``never``)."""
    keep = set(never)
    return self.forget(p for p in self.owners() if p not in keep and not alive(p))

  # -- internals -------------------------------------------------------------

  def _at(self, index: int) -> SlotState:
    if not (isinstance(index, int) and 0 <= index < len(self.slots)):
      raise errors.CorruptSnapshotError(
          f"slot index {index!r} is not one of this store's {len(self.slots)} slots")
    return self.slots[index]

  @staticmethod
  def _drop(s: SlotState) -> Dropped:
    d = Dropped(s.index, s.step, s.state, s.held)
    s.state, s.step, s.owner, s.held, s.protected = FREE, None, None, False, False
    return d
