"""The step ledger: every fact a trainer knows about each of its steps, in one place.

A step enters the ledger when ``save()`` starts it, or when the manager finds it
on a tier (at start, on ``reload()``). Its record says whether it is being
copied, which persist attempt carries it to storage and whether that persist
has been seen to end, whether it is known committed on storage, its time and
metrics, and whether a rule dropped it (retention, a rollback, a delete) and it
still has to go from some tier. ``stats`` are the ledger's counters: nothing
else writes them.

Everything that answers a question about steps reads the ledger: the listing
(``all_steps()``), the keep policy's candidates (``kept()``), the waits
(which attempts to wait for), the flow control (which due steps still persist),
and the errors already raised (each error reaches the caller once).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import threading
import time
from typing import Any, Iterable

import jax
import numpy as np

from jaxckpt.host import _persist

logger = logging.getLogger("jaxckpt.manager")

EPOCH = datetime.datetime.fromtimestamp(0, tz=datetime.timezone.utc)
TIME_KEY = "jaxckpt.time"         # a step's save time (seconds since the epoch), in its metadata
METRICS_KEY = "jaxckpt.metrics"   # the metrics given to save(metrics=), in its metadata


@dataclasses.dataclass
class SaveStats:
  """Counters of a manager's saves (``mgr.stats``), written by its ledger only."""

  started: int = 0
  committed: int = 0
  skipped_busy: int = 0
  skipped_interval: int = 0
  #: candidate saves the job's plan does not snapshot (``snapshot_every``)
  skipped_plan: int = 0
  last_blocking_secs: float = 0.0
  last_snapshot_secs: float = 0.0      # save() call to committed snapshot
  last_nbytes: int = 0
  #: why saves were skipped (``skipped_busy`` and ``skipped_plan`` in all), by reason
  skip_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
  #: persists queued or running in the store (their slots are held), as of the last commit
  persists_pending: int = 0
  oldest_unpersisted_step: int | None = None
  persist_lag_steps: int = 0           # newest committed step - oldest unpersisted one
  persist_lag_secs: float = 0.0        # how long the oldest unpersisted step has waited
  agent_restarts: int = 0              # dead snapshot agents replaced by a new one
  #: a job of several processes: its plan takes a snapshot every this many save
  #: calls on the save interval and, without ``persist_interval_steps``, persists
  #: every this many snapshots (None: no more, until a persist has been measured)
  snapshot_every: int = 1
  persist_every: int | None = None


@dataclasses.dataclass
class StepInfo:
  """What the keep policy knows of a step (orbax's ``PolicyCheckpointInfo``)."""

  step: int
  time: datetime.datetime
  metrics: Any = None


@dataclasses.dataclass
class StepRecord:
  """One step's facts (see the module docstring)."""

  step: int
  time: datetime.datetime | None = None
  metrics: Any = None
  kept: bool = False                  # a checkpoint the keep policy ranks
  attempt: str | None = None          # this run's newest persist attempt of it
  persisting: bool = False            # due: its persist not yet seen to end
  mark: tuple[float, float] | None = None   # the schedule's mark at its commit (due steps)
  nbytes: int = 0
  dropped: str | None = None          # why it goes from every tier (until it is gone)

  def info(self) -> StepInfo:
    return StepInfo(self.step, self.time or EPOCH, self.metrics)


class Ledger:
  """One manager's steps (see the module docstring).

  Args:
    run_id: the job's run id (the same on every process): persist attempts are
      named by it (:func:`jaxckpt.host._persist.attempt_id`).
    stored: the steps on storage when the manager started.
  """

  def __init__(self, run_id: str | None, stored: Iterable[int] = ()) -> None:
    self.run_id = run_id
    self.stats = SaveStats()
    self._records: dict[int, StepRecord] = {}
    self._counts: dict[int, int] = {}
    self.told: set[str] = set()          # attempts whose failure was raised (or is moot)
    self.stored: set[int] = set(stored)  # steps known committed on storage
    self.listed: set[int] = set()        # stored steps this manager lists (others: reload())
    self.newest: int | None = None       # the newest step this manager committed
    self.restored: int | None = None     # the step this manager restored last
    self.high: int | None = None         # the newest step the run holds or saved (a save of
                                         # one not newer is a rollback)
    self._flight: tuple[int, concurrent.futures.Future] | None = None
    self._error: BaseException | None = None
    self._lock = threading.Lock()
    self._lag_warn_at = 4                # persists pending that get a warning (doubles)
    self.plan_left_out: list[int] = []   # the saves the job's plan left out since its last
                                         # snapshot (a loop that ends here has not these)

  # -- records ------------------------------------------------------------------

  def get(self, step: int) -> StepRecord | None:
    return self._records.get(step)

  def record(self, step: int) -> StepRecord:
    rec = self._records.get(step)
    if rec is None:
      rec = self._records[step] = StepRecord(step)
    return rec

  def forget(self, step: int) -> None:
    """``step`` is gone from every tier: nothing of it is kept."""
    self._records.pop(step, None)
    self.stored.discard(step)
    self.listed.discard(step)

  def prune(self, listed: set[int]) -> None:
    """Forgets the steps no tier holds any more (neither ``listed``, nor dropped and
    still to delete, nor persisting, nor in flight)."""
    keep = listed | self.in_flight()
    for s, r in list(self._records.items()):
      if s not in keep and r.dropped is None and not r.persisting:
        self._records.pop(s, None)

  def found(self, infos: Iterable[StepInfo]) -> None:
    """Steps found on the tiers (at start, ``reload()``): kept, with their time and metrics."""
    for info in infos:
      rec = self.record(info.step)
      if rec.dropped is None:
        rec.kept, rec.time, rec.metrics = True, info.time, info.metrics

  def saving(self, step: int, metadata: dict[str, Any] | None, *, when: datetime.datetime,
             metrics: Any, due: bool, write_metrics: bool = True) -> dict[str, Any]:
    """``step`` is being saved at ``when`` with ``metrics`` (``due``: a checkpoint, saved
    for storage, that the keep policy ranks); returns ``metadata`` with what a relaunch
    ranks it by: its time (a checkpoint's) and metrics."""
    if metrics is not None:              # numpy and jax scalars as Python numbers (JSON)
      metrics = jax.tree.map(lambda x: np.asarray(x).item() if hasattr(x, "dtype") else x,
                             metrics)
    rec = self.record(step)
    rec.time, rec.metrics, rec.kept = when, metrics, due
    out = dict(metadata or {})
    if due:
      out[TIME_KEY] = when.timestamp()
    if metrics is not None and write_metrics:
      out[METRICS_KEY] = metrics
    return out

  def kept(self) -> list[StepInfo]:
    """The checkpoints the keep policy ranks, oldest first (none dropped)."""
    return [r.info() for s, r in sorted(self._records.items()) if r.kept and r.dropped is None]

  def kept_steps(self) -> set[int]:
    return {r.step for r in self._records.values() if r.kept and r.dropped is None}

  def drop(self, steps: Iterable[int], why: str) -> None:
    """``steps`` go from every tier (once nothing still writes them): they leave the
    listing at once."""
    for s in steps:
      self.record(s).dropped = why

  def dropped(self) -> dict[int, str]:
    return {s: r.dropped for s, r in self._records.items() if r.dropped is not None}

  def undrop(self, step: int) -> None:
    rec = self._records.get(step)
    if rec is not None:
      rec.dropped = None

  # -- the snapshot in flight, and errors ---------------------------------------

  def fly(self, step: int, fut: concurrent.futures.Future) -> None:
    self._flight = (step, fut)

  @property
  def flight(self) -> concurrent.futures.Future | None:
    f = self._flight
    return None if f is None else f[1]

  @property
  def flight_step(self) -> int | None:
    f = self._flight
    return None if f is None else f[0]

  def in_flight(self) -> set[int]:
    """The step whose snapshot is being taken, if any."""
    f = self._flight
    return {f[0]} if f is not None and not f[1].done() else set()

  def fail(self, error: BaseException) -> None:
    """A background failure, raised by the next call that asks (:meth:`take_error`)."""
    with self._lock:
      self._error = error

  def take_error(self) -> BaseException | None:
    with self._lock:
      err, self._error = self._error, None
    return err

  # -- persists -----------------------------------------------------------------

  def new_attempt(self, step: int) -> str:
    """This run's next persist attempt of ``step`` (the same on every process)."""
    nth = self._counts.get(step, 0)
    self._counts[step] = nth + 1
    rec = self.record(step)
    rec.attempt = _persist.attempt_id(self.run_id, step, nth)
    return rec.attempt

  def attempts(self) -> dict[int, str]:
    """step -> this run's newest persist attempt, of the steps it saved for storage."""
    return {s: r.attempt for s, r in self._records.items() if r.attempt is not None}

  def unanswered(self) -> dict[int, str]:
    """The attempts whose end (or failure) has not been raised yet."""
    return {s: a for s, a in self.attempts().items() if a not in self.told}

  def persisting(self) -> list[StepRecord]:
    """Due steps whose persist has not been seen to end."""
    return [r for r in self._records.values() if r.persisting]

  def seen_ended(self, step: int) -> bool:
    """Marks ``step``'s persist as seen to end; True the first time only."""
    with self._lock:
      rec = self._records.get(step)
      if rec is None or not rec.persisting:
        return False
      rec.persisting = False
      return True

  def fence(self, step: int) -> bool:
    """``step``'s persist is fenced (deleted, dropped): its failure is moot. True if it
    had one."""
    rec = self._records.get(step)
    if rec is None or rec.attempt is None:
      return False
    self.told.add(rec.attempt)
    rec.attempt, rec.persisting = None, False
    return True

  def on_storage(self, step: int) -> None:
    self.stored.add(step)
    self.listed.add(step)

  # -- the stats' writers -------------------------------------------------------

  def started(self, step: int, blocking_secs: float) -> None:
    self.plan_left_out = []
    self.stats.started += 1
    self.stats.last_blocking_secs = blocking_secs

  def stored_directly(self, step: int, nbytes: int, secs: float) -> None:
    """A storage-only save committed ``step`` itself."""
    st = self.stats
    st.started, st.committed = st.started + 1, st.committed + 1
    st.last_blocking_secs = st.last_snapshot_secs = secs
    st.last_nbytes = nbytes
    self.on_storage(step)

  def committed(self, step: int, nbytes: int, secs: float) -> None:
    st = self.stats
    st.committed += 1
    st.last_snapshot_secs, st.last_nbytes = secs, nbytes
    self.newest = step

  def skipped_interval(self) -> None:
    self.stats.skipped_interval += 1

  def skipped_plan(self, step: int, why: str) -> None:
    """The job's plan left out the save of ``step`` (``why``: the reason, as counted)."""
    st = self.stats
    st.skipped_plan += 1
    st.skip_reasons[why] = st.skip_reasons.get(why, 0) + 1
    self.left_out(step)

  def left_out(self, step: int) -> None:
    """The job's plan leaves out ``step``'s save (``should_save`` said so, or the save)."""
    if step not in self.plan_left_out[-1:]:
      self.plan_left_out.append(step)

  def skipped_busy(self, why: str) -> int:
    """Counts a busy skip; returns how many so far."""
    st = self.stats
    st.skipped_busy += 1
    st.skip_reasons[why] = st.skip_reasons.get(why, 0) + 1
    return st.skipped_busy

  def agent_restarts(self, n: int) -> None:
    self.stats.agent_restarts = n

  def plan(self, snapshot_every: int, persist_every: int | None) -> bool:
    """The job's plan; True if it changed."""
    st = self.stats
    if (snapshot_every, persist_every) == (st.snapshot_every, st.persist_every):
      return False
    st.snapshot_every, st.persist_every = snapshot_every, persist_every
    return True

  def persist_lag(self, status: Any, directory: str | None) -> None:
    """The persist lag as of the newest committed step (``status``: the store's
    persist status); warns when it grows."""
    st, step = self.stats, self.newest
    if step is None:
      return
    st.persists_pending = len(status.pending)
    st.oldest_unpersisted_step = status.pending[0] if status.pending else None
    st.persist_lag_steps = max(0, step - status.pending[0]) if status.pending else 0
    st.persist_lag_secs = (time.time() - status.oldest_since) if status.oldest_since else 0.0
    if st.persists_pending >= self._lag_warn_at:
      self._lag_warn_at *= 2
      logger.warning(
          "storage is slower than the loop: %d persists to %s are queued (oldest step %d, "
          "%.1f s and %d steps behind); while their slots are held, saves not due for storage "
          "are skipped and due ones wait: raise persist_interval_steps, or leave it unset so "
          "that persists follow storage's pace", st.persists_pending, directory,
          st.oldest_unpersisted_step, st.persist_lag_secs, st.persist_lag_steps)
