"""The snapshot slot table: which slot holds which step, in which state.

One small pure class (no locks, no memory, no I/O) used by both host stores,
the in-process :class:`jaxckpt.host.store.InProcessStore` and the snapshot agent
(``jaxckpt.agent.server._server``). Each store wraps it in its own lock and owns the
bytes; the table decides:

- a slot is ``free``, ``writing`` (reserved by one owner for one step) or
  ``committed`` (the readable snapshot of one step);
- a pinned slot (a reader holds it) is never handed out for writing;
- committing step S drops every committed step >= S first (a rolled-back
  timeline: the newer steps are stale), then every step older than the newest
  ``keep``, except one *held* for its persist and the newest step *protected*
  by parity (``protect``: the one a lost host can still be rebuilt to while the
  newer ones wait for their parity; it counts as one of the ``keep``, and is
  kept beside them only while a slot stays free);
- a step due for storage is held from its commit until its persist has ended
  (``commit(..., hold=True)``, then ``release``): held steps stay readable and
  their slots are never handed out, so a later save cannot recycle a slot a
  queued persist still has to read. Held steps are counted apart from
  ``keep``: the table adds a slot for each held step older than the newest
  ``keep`` (up to ``spare`` of them, as host memory allows: the store sets
  it), so a persist, however slow, takes no slot from the loop;
- a slot for the next save comes first: where none is free and none may be
  added (``spare`` used up), the oldest of the newest ``keep`` steps, then
  the protected step go (never the newest, never a held one), so the loop
  keeps snapshotting with only the newest step and the held ones kept; when
  even then no slot is free (every other slot held), ``reserve`` finds none:
  the store's flow control then skips or waits;
- in a job of several hosts (``job_wide``) a host keeps the newest step it knows
  *whole* (every host of the job holds it: ``whole``, from its peers) and every step
  newer than it, whatever ``keep`` says: a step the job holds is one every host
  holds, so a host drops a step only once a newer one is whole, never by its own
  timing alone (a host one step ahead of a slower one, or whose parity was
  superseded, would otherwise drop the one step they still share). Where that
  leaves no slot free, ``reserve`` finds none until a slower host catches up and a
  newer step is whole (the trainer waits, as for its previous copy);
- a lent slot (restored arrays keep views of its buffer) is never written
  again: the store gives it a new buffer on its next reserve;
- an owner's earlier ``writing`` slot is stale once it reserves again (a trainer
  reserves only after its previous save is over), and a dead owner's slots and
  pins are forgotten;
- a new run of the job (``new_run``) sees none of the earlier run's steps: those
  held for their persists become *foreign* (invisible to every query and rule by
  step, found only by their persist ``attempt``, freed when it ends, and never
  dropped as a rolled back step of the new run, whatever its step numbers); the
  others are freed. A run that comes back takes its own foreign steps back.

Each slot's entry (:class:`SlotState`) is the one record of everything known of
the slot and the step it holds: its state and step, the manifest (as sent, and
parsed once), the saving process, the run that committed it, the persist attempt
it is held for, and the store's memory for its bytes. A store keeps no map of its
own by step or slot beside the table. Every method that frees a slot returns what
it freed (:class:`Dropped`), so the store can tell those who keep facts of a *step*
(the persister's fences, the parity of a step).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable

from jaxckpt import errors

if TYPE_CHECKING:
  from jaxckpt.host.snapshot import SnapshotManifest

FREE, WRITING, COMMITTED = "free", "writing", "committed"


@dataclasses.dataclass
class _Run:
  """The table's current run, shared by its slots (a record is foreign against it)."""

  run: str | None = None


@dataclasses.dataclass(eq=False)
class SlotState:
  """One slot's record: everything known of the slot and of the step it holds."""

  index: int
  state: str = FREE
  step: int | None = None
  owner: int | None = None      # who writes it (a trainer pid; 0 in-process)
  size: int = 0                 # bytes of memory the store holds for it
  lent: bool = False
  held: bool = False            # committed and due for storage: kept until its persist ends
  protected: bool = False       # its parity is done (the newest such step is kept)
  attempt: str | None = None    # the persist attempt a held step is held for
  run: str | None = None        # the run that committed it (the table's run then)
  manifest: str | None = None   # the committed step's manifest as its writer sent it (JSON)
  process: tuple[int, int] | None = None   # (the saving process, of how many)
  pins: dict[int, int] = dataclasses.field(default_factory=dict)   # reader -> count
  # The store's memory for the slot's bytes (the agent's file record, the in-process
  # store's buffer): it outlives the steps the slot holds, so a drop keeps it.
  memory: Any = None
  _parsed: tuple[str | None, SnapshotManifest] | None = dataclasses.field(default=None, repr=False)
  _now: _Run = dataclasses.field(default_factory=_Run, repr=False)

  @property
  def pinned(self) -> bool:
    return bool(self.pins)

  @property
  def foreign(self) -> bool:
    """An earlier run's committed step, held only until its persist ends: its run is
    not the table's."""
    return self.state == COMMITTED and self.run != self._now.run

  def parsed(self) -> SnapshotManifest:
    """The committed step's manifest, parsed once (by whichever thread asks first; the
    text is not parsed again while the slot holds the step). CorruptSnapshotError if
    the slot holds none."""
    text, got = self.manifest, self._parsed
    if got is not None and got[0] is text:
      return got[1]
    if text is None:
      raise errors.CorruptSnapshotError(
          f"slot {self.index} ({self.state}, step {self.step}) holds no manifest")
    from jaxckpt.host.snapshot import SnapshotManifest  # pylint: disable=import-outside-toplevel
    manifest = SnapshotManifest.from_json(text)
    if self.manifest is text:       # (still the same commit: kept for the next reader)
      self._parsed = (text, manifest)
    return manifest

  def _hold_manifest(self, manifest: str | SnapshotManifest | None) -> None:
    """The committed step's manifest: its text (parsed on first use), or parsed already."""
    if manifest is None or isinstance(manifest, str):
      self.manifest, self._parsed = manifest, None
    else:
      self.manifest = None
      self._parsed = (None, manifest)


@dataclasses.dataclass(frozen=True)
class Dropped:
  """A slot the table freed: its index, the step it held, its former state, and
  whether that step was still held for its persist (its persist must be fenced)."""

  index: int
  step: int | None
  state: str
  held: bool = False
  foreign: bool = False         # an earlier run's step whose persist ended


@dataclasses.dataclass(frozen=True)
class Reservation:
  """A slot handed out for writing; ``grow`` is True when the store must give
  it ``nbytes`` of new memory first (too small, or lent to a restore)."""

  index: int
  grow: bool


def loop_slots(keep: int) -> str:
  """The loop's slots as a budget error says them: the ``max_snapshots`` (``keep``) it keeps
  and the one a save writes into, so the count a user reads is the one they set.

  >>> loop_slots(1000)
  '1000 snapshots kept (max_snapshots=1000) + 1 being saved: 1001 slots'
  """
  return f"{keep} snapshots kept (max_snapshots={keep}) + 1 being saved: {keep + 1} slots"


def check_budget(*, keep: int, nbytes: int, limit_bytes: int, where: str,
                 extra_bytes: int = 0, extra_what: str = "") -> None:
  """Raises HostMemoryBudgetError if the loop's ``keep + 1`` slots x ``nbytes``
  (+ ``extra_bytes``) exceed ``limit_bytes``."""
  need = (keep + 1) * nbytes + extra_bytes
  if need > limit_bytes:
    raise errors.HostMemoryBudgetError(
        f"{where}: {loop_slots(keep)} x {nbytes / 2**20:.1f} MiB{extra_what} = "
        f"{need / 2**20:.1f} MiB exceed host_memory_limit_bytes="
        f"{limit_bytes} ({limit_bytes / 2**20:.1f} MiB); lower max_snapshots, "
        "shard the state over more hosts, or raise host_memory_limit_bytes")


def spare_slots(*, keep: int, nbytes: int, limit_bytes: int,
                room_bytes: int | None = None) -> int:
  """How many slots beyond ``keep + 1`` host memory has room for, at ``nbytes``
  each (a slot and what goes with it), within ``limit_bytes`` and, where given,
  ``room_bytes`` (what the run root could hold: its free space and what the
  slots hold already): at most ``keep + 1`` (a held step per slot of the loop's).

  >>> spare_slots(keep=2, nbytes=10, limit_bytes=45)
  1
  >>> spare_slots(keep=2, nbytes=10, limit_bytes=1000, room_bytes=35)
  0
  """
  base = keep + 1
  fits = min(limit_bytes, limit_bytes if room_bytes is None else room_bytes) // max(nbytes, 1)
  return max(0, min(base, fits - base))


def short_of_room(*, keep: int, spare: int, nbytes: int, limit_bytes: int, where: str,
                  room_bytes: int | None = None, run_root: str | None = None) -> str:
  """Why steps held for their persists take the loop's slots: host memory has
  room for ``spare`` slots of their own, not more; what to change (a WARNING's
  text)."""
  need = (keep + 2 + spare) * nbytes
  room = "" if room_bytes is None or room_bytes >= limit_bytes else (
      f"; {run_root} can hold {room_bytes / 2**20:.1f} MiB of them")
  beside = "no snapshot slot" if not spare else f"only {spare} snapshot slots"
  return (f"{where}: host memory has room for {beside} beside the loop's {keep + 1} "
          f"({nbytes / 2**20:.1f} MiB each; host_memory_limit_bytes={limit_bytes}{room}), so "
          "steps held for their persists take the loop's: while those persists run, fewer steps "
          "are kept and saves may be skipped, and a crash then loses more than one step; raise "
          f"host_memory_limit_bytes to at least {need} ({need / 2**20:.1f} MiB), free memory"
          f"{' in ' + run_root if run_root else ''}, persist less often (persist_interval_steps) "
          "or lower max_snapshots")


class SlotTable:
  """``keep`` committed snapshots at most, in ``count`` slots (``keep + 1``: one
  more for the snapshot being written), and up to ``spare`` slots more for
  steps held for their persist (the store sets ``spare`` from host memory)."""

  def __init__(self, keep: int, count: int | None = None) -> None:
    if keep < 1:
      raise errors.InvalidArgumentError(f"keep={keep!r}: a slot table keeps at least 1 step")
    self.keep = keep
    self.base = keep + 1 if count is None else count    # the loop's slots
    self.spare = 0
    self._now = _Run()         # the run whose steps are this table's own (``run``)
    self._squeezed = False     # a kept step went to free a slot a held one took (crowded)
    self.job_wide = False      # a job of several hosts: drops follow ``whole`` (see above)
    self.whole: int | None = None   # the newest step every host of the job holds, as known
    self.slots: list[SlotState] = []
    self.grow_to(self.base)

  # -- shape -----------------------------------------------------------------

  @property
  def run(self) -> str | None:
    """The run whose steps are this table's own (:meth:`new_run` changes it)."""
    return self._now.run

  def grow_to(self, count: int) -> None:
    """Adds free slots until there are ``count`` (slots are never removed)."""
    while len(self.slots) < count:
      self.slots.append(SlotState(len(self.slots), _now=self._now))

  def __len__(self) -> int:
    return len(self.slots)

  # -- queries ---------------------------------------------------------------

  def _own(self) -> list[SlotState]:
    """This run's committed slots (not an earlier run's foreign ones)."""
    return [s for s in self.slots if s.state == COMMITTED and not s.foreign]

  def steps(self) -> list[int]:
    """Committed steps, oldest first."""
    return sorted(s.step for s in self._own())

  def committed_slots(self) -> list[SlotState]:
    """This run's committed slots, oldest step first."""
    return sorted(self._own(), key=lambda s: s.step)

  def held_steps(self) -> list[int]:
    """Committed steps held for their persist, oldest first."""
    return sorted(s.step for s in self._own() if s.held)

  def committed(self, step: int) -> SlotState | None:
    """The slot holding committed ``step``, or None."""
    return next((s for s in self._own() if s.step == step), None)

  def of_attempt(self, attempt: str) -> SlotState | None:
    """The committed slot (this run's or a foreign one) held for persist ``attempt``."""
    return next((s for s in self.slots if s.state == COMMITTED and s.held
                 and s.attempt == attempt), None)

  def foreign_steps(self) -> list[int]:
    """The earlier runs' steps still held for their persists."""
    return sorted(s.step for s in self.slots if s.state == COMMITTED and s.foreign)

  def held_apart(self) -> int:
    """Held steps older than the newest ``keep``, and the foreign ones: each may take
    a slot of its own."""
    committed = self.steps()
    newest = set(committed[-self.keep:])
    return (sum(1 for s in self.held_steps() if s not in newest)
            + sum(1 for s in self.slots if s.state == COMMITTED and s.foreign))

  def capacity(self) -> int:
    """The slots the table may have now: the loop's (``keep + 1``), and one per step
    held apart (at most ``spare``)."""
    return self.base + min(self.spare, self.held_apart())

  def crowded(self) -> bool:
    """Whether steps held for their persists take the loop's slots for lack of
    memory (``spare`` short of ``base``): a kept step went to free a slot since the
    last call, or none is free now. Each call starts afresh."""
    squeezed, self._squeezed = self._squeezed, False
    return (self.spare < self.base and bool(self.held_steps())
            and (squeezed or not self.room()))

  def usable(self) -> int:
    """How many slots (the first ones) may be handed out: the loop's and ``spare``; those
    beyond (memory no longer has room for them) are never written again, and the
    store may give back their memory once they are free (:meth:`idle_beyond`)."""
    return self.base + self.spare

  def idle_beyond(self) -> list[int]:
    """Free, unpinned slots beyond :meth:`usable` that still have memory: forgotten
    here (size 0), for the store to release."""
    out = []
    for s in self.slots[self.usable():]:
      if s.state == FREE and not s.pinned and s.size:
        s.size, s.lent = 0, False
        out.append(s.index)
    return out

  def room(self) -> int:
    """Slots a ``reserve`` could hand out now: free and unpinned ones, and those it
    may add for the held steps."""
    return self.free_slots() + max(0, self.capacity() - len(self.slots))

  def owners(self) -> set[int]:
    """Every writer and reader the table knows of."""
    return ({s.owner for s in self.slots if s.owner is not None}
            | {p for s in self.slots for p in s.pins})

  # -- writing ---------------------------------------------------------------

  def reserve(self, step: int, nbytes: int, owner: int) -> Reservation | None:
    """A free, unpinned slot for ``owner`` to write ``step`` into (None if none
    is free, nor may be added for held steps). Prefers a slot already big enough
    and not lent."""
    free = self._free()
    if not free and len(self.slots) < self.capacity():
      self.grow_to(len(self.slots) + 1)       # a held step's: the loop's slots stay free
      free = [self.slots[-1]]
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
    """Free, unpinned, usable slots smaller than ``nbytes`` or lent: sized to
    ``nbytes`` now (the store gives each new memory) and returned."""
    out = []
    for s in self._free():
      if s.size < nbytes or s.lent:
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

  def commit(self, index: int, step: int, *, hold: bool = False,
             attempt: str | None = None, manifest: str | SnapshotManifest | None = None,
             process: tuple[int, int] | None = None) -> list[Dropped]:
    """Makes slot ``index`` (writing ``step``) the committed snapshot of ``step``,
    held for its persist (``attempt``) if ``hold``, with its ``manifest`` (the JSON
    its writer sent, parsed on first use, or parsed already) and saving ``process``.
    Returns the steps dropped: newer or equal ones of this run (a rollback, held ones
    included: their persists belong to the abandoned timeline), then those the keep
    rule drops (:meth:`_trim`)."""
    s = self.writing(index, step)
    dropped = [self._drop(o) for o in self._own() if o.step >= step]
    if self.whole is not None and self.whole >= step:
      self.whole = None            # rolled back past it: the job agrees anew
    s.state, s.owner, s.held, s.protected = COMMITTED, None, hold, False
    s.attempt, s.run, s.process = (attempt if hold else None), self.run, process
    s._hold_manifest(manifest)  # pylint: disable=protected-access
    return dropped + self._trim()

  def new_run(self, run: str | None) -> list[Dropped]:
    """Run ``run`` follows: this run's steps held for their persists become foreign
    (their run is no longer the table's: see the module docstring), the others are
    freed (returned), and the foreign steps ``run`` itself committed (it comes back)
    are its own again. A table that knew no run yet (a writer that named none) takes
    its steps as ``run``'s."""
    if run == self.run:
      return []
    if self.run is None:
      for o in self._own():
        o.run = run
      self._now.run = run
      return []
    out = []
    for o in self._own():
      if o.held:
        o.protected = False
      else:
        out.append(self._drop(o))
    self._now.run, self.whole = run, None
    return out

  def protect(self, step: int) -> list[Dropped]:
    """Committed ``step`` is protected (its parity is done): it is kept while it is
    the newest protected step; returns what the keep rule drops now (an older
    protected step, no longer needed). A no-op if ``step`` is not held here."""
    s = self.committed(step)
    if s is None or s.protected:
      return []
    s.protected = True
    return self._trim()

  def agree(self, whole: int | None, *, job_wide: bool = True) -> list[Dropped]:
    """Step ``whole`` is the newest that every host of the job holds (None: none known);
    ``job_wide``: the job has several hosts, so drops follow it (see the module
    docstring). Returns what the keep rule drops now that it may."""
    self.job_wide, self.whole = job_wide, whole
    return self._trim()

  def _droppable(self, step: int) -> bool:
    """Whether the keep rule may drop committed ``step`` (in a job of several hosts:
    only one older than the newest step every host holds)."""
    return not self.job_wide or (self.whole is not None and step < self.whole)

  def protected_step(self) -> int | None:
    """The newest committed step protected by parity, or None."""
    steps = [s.step for s in self._own() if s.protected]
    return max(steps) if steps else None

  def release(self, step: int, attempt: str | None = None) -> list[Dropped]:
    """Ends the hold of committed ``step`` (its persist ``attempt`` ended: then the
    slot held for that attempt, a foreign one included, which is freed); returns what
    the keep rule drops now that it may (a no-op if ``step`` is not held)."""
    s = self.of_attempt(attempt) if attempt is not None else self.committed(step)
    if s is None or not s.held:
      return []
    if s.foreign:
      return [self._drop(s)]
    s.held = False
    return self._trim()

  def _trim(self) -> list[Dropped]:
    """Keeps the newest ``keep`` committed steps (the newest one protected by parity
    takes the place of the oldest of them) and every held step; drops the others,
    except the protected one, kept beside them while a slot stays free for the next
    save. Then, while no slot is free for it nor may be added, drops the oldest
    kept ones and, last, the protected one (it must not stall saves until a newer
    one is protected, which may never happen: a peer skipped it, or its parity
    failed): never the newest, a held one or one a reader pins (that frees no
    slot)."""
    committed = sorted(self._own(), key=lambda o: o.step)
    if not committed:
      return []
    guard = self.protected_step()
    keepers = committed[-self.keep:]
    if self.keep > 1 and guard is not None and guard < keepers[0].step:
      keepers = committed[-(self.keep - 1):]
    kept = {o.step for o in keepers}
    out = [self._drop(o) for o in committed[:-1]
           if o.step not in kept and not o.held and o.step != guard and self._droppable(o.step)]
    for o in [o for o in keepers if o.step != guard] + [o for o in committed if o.step == guard]:
      if self.room():
        break
      if (o is not committed[-1] and o.state == COMMITTED and not o.held and not o.pinned
          and self._droppable(o.step)):
        out.append(self._drop(o))
        self._squeezed |= bool(self.held_steps())
    return out

  def free_slots(self) -> int:
    """Slots a ``reserve`` could hand out now (free, not pinned, and usable)."""
    return len(self._free())

  def _free(self) -> list[SlotState]:
    return [s for s in self.slots[:self.usable()] if s.state == FREE and not s.pinned]

  def abort(self, index: int) -> Dropped | None:
    """Frees slot ``index`` if it is being written (a no-op otherwise)."""
    s = self._at(index)
    return self._drop(s) if s.state == WRITING else None

  def discard(self, step: int) -> Dropped | None:
    """Frees the committed slot of ``step`` (None if not held)."""
    s = self.committed(step)
    if s is not None and s.step == self.whole:
      self.whole = None
    return None if s is None else self._drop(s)

  # -- reading ---------------------------------------------------------------

  def pin(self, step: int, reader: int, attempt: str | None = None) -> SlotState | None:
    """Pins committed ``step`` for ``reader`` (None if not held); with ``attempt``, the
    slot held for that persist attempt (a foreign one too), or None: never another
    slot of the same step number."""
    s = self.of_attempt(attempt) if attempt is not None else self.committed(step)
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
    d = Dropped(s.index, s.step, s.state, s.held, s.foreign)
    s.state, s.step, s.owner, s.held, s.protected = FREE, None, None, False, False
    s.attempt, s.run, s.process = None, None, None
    s._hold_manifest(None)  # pylint: disable=protected-access
    return d
