"""A manager's flow of saves: the job's decision per call, and the persists it waits on.

:class:`SaveFlow` is what the manager asks at each save (:mod:`jaxckpt.core._schedule`
decides; this keeps what the decision needs): whether a persist this manager
started has not ended, which saves may not be skipped and why, the persists
that ended (measured by the loop's own time they ran beside: the plan's input),
and ``stats`` kept current with the plan and the persist lag.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Callable

from jaxckpt import errors
from jaxckpt.core import _schedule
from jaxckpt.core._ledger import Ledger

if TYPE_CHECKING:
  from jaxckpt.host.store import HostStore, PersistStatus
  from jaxckpt.options import CheckpointOptions

# on_busy="skip" in a one-process job waits this fraction of the loop's time since the last
# save (at most SKIP_GRACE_MAX_SECS) for a copy that is nearly done before it skips a save.
SKIP_GRACE_FRACTION = 0.1
SKIP_GRACE_MAX_SECS = 0.05

logger = logging.getLogger("jaxckpt.manager")

# skip_reasons' key of a save skipped while the previous snapshot's copy runs.
COPY_BUSY = "the previous snapshot is still being copied"
# skip_reasons' key of the saves a job's plan leaves out (``snapshot_every`` > 1).
PLAN_SKIP = "not in the job's save plan (copies are slower than the loop's step)"


class SaveFlow:
  """One manager's saves against its store.

  Args:
    schedule: the job's plan (:class:`jaxckpt.core._schedule.Schedule`).
    store: the manager's HostStore (its persist status is read, never asked).
    ledger: the manager's ledger (due steps, what is on storage, ``stats``).
    directory: where it persists (None: nowhere).
    options: the manager's ``CheckpointOptions``.
    where: the store, as messages name it.
    log_entry: the manager's ``logger=`` sink, ``(event, step, t0, **figures)``.
  """

  def __init__(self, schedule: _schedule.Schedule, store: HostStore, ledger: Ledger,
               directory: str | None, *, options: CheckpointOptions, where: str,
               log_entry: Callable[..., None]) -> None:
    self.schedule, self.store, self.ledger = schedule, store, ledger
    self.directory, self.where = directory, where
    self.options, self.log_entry = options, log_entry
    self.on_busy, self.agent = options.on_busy, options.agent is not None
    self.last_save_at = time.perf_counter()
    self._asked_store = False          # persisting() asked the store once
    # Why the next save waits for the copy in flight: a save was skipped while a copy ran
    # and fewer than two snapshots started since (on_busy="skip" never skips a run of
    # saves, nor two saves apart by one: a kill loses each save skipped and the snapshot
    # being copied, so a copy that outlasts the loop's steps sets the loop's pace instead
    # of costing more than two steps); None: it may skip.
    self.copy_skipped: str | None = None
    self._since_skip = 0               # snapshots started since copy_skipped was set

  # -- the decision -----------------------------------------------------------

  def decide(self, step: int, force: bool) -> _schedule.Decision:
    d = self.schedule.decide(step, force=force, persisting=self.persisting())
    self._note_plan()
    return d

  def peek(self, step: int) -> _schedule.Decision:
    return self.schedule.peek(step, persisting=self.persisting())

  def persisting(self) -> bool:
    """Whether a persist has not ended, as the store last said: one this manager started
    (a due save whose commit is not answered yet counts), or another in the store's one
    queue (an earlier trainer's, in its agent: a persist added now would wait behind it,
    its step holding a slot meanwhile, and relaunches while storage lags would pile them
    up). The store is asked at the first decision; its replies keep it current after."""
    due = self.ledger.persisting()
    if self.directory is None:
      return any(r.step not in self.ledger.stored for r in due)
    status = self.store.persist_status(ask=not self._asked_store)
    self._asked_store = True
    if due:
      self.ended(status)
      due = self.ledger.persisting()
    return bool(status.pending) or any(r.step not in self.ledger.stored for r in due)

  def never_skipped(self, d: _schedule.Decision) -> str | None:
    """Why a save that was decided may not be skipped (None: it may)."""
    if d.due:
      return "due for storage"
    if self.schedule.agreed:
      return "in the job's save plan: every process snapshots it"
    return "on_busy='wait'" if self.on_busy == "wait" else None

  def reserve_timeout(self, must: str | None) -> float:
    """How long a save waits for the previous copy and a slot: 0 if it may skip."""
    if not must:
      return 0.0
    o = self.options
    return o.busy_timeout_secs if o.on_busy == "wait" else o.timeout_secs

  def done_within_grace(self, pending: concurrent.futures.Future) -> bool:
    """Waits for a copy that is nearly done, at most a tenth of the time the loop
    took since the last save (a loaded machine's jitter, not a stall)."""
    grace = min(SKIP_GRACE_FRACTION * (time.perf_counter() - self.last_save_at),
                SKIP_GRACE_MAX_SECS)
    done, _ = concurrent.futures.wait([pending], timeout=max(grace, 0.0))
    return bool(done)

  def skip_busy(self, step: int, why: str, detail: str = "") -> None:
    if why == COPY_BUSY:
      self.copy_skipped = (f"the save of step {step} was skipped while a copy ran: "
                           "on_busy='skip' skips no save of the next two")
      self._since_skip = 0
    n = self.ledger.skipped_busy(why)   # a WARNING at the 1st, 2nd, 4th, 8th... skip, not each
    st = self.ledger.stats
    logger.log(logging.WARNING if n & (n - 1) == 0 else logging.DEBUG,
               "step %d: save skipped: %s (%d of %d saves skipped so far; saves due for "
               "storage, and the two saves after a skipped one, wait instead; on_busy='wait' "
               "waits)", step, detail or why, n,
               st.started + n)

  def no_slot(self, step: int, must: str | None) -> None:
    """A save found no free slot: skipped if it may be, else raises."""
    status = self.store.persist_status()
    if status.pending:
      age = time.time() - status.oldest_since if status.oldest_since else 0.0
      held = (f"every slot is held: persists of steps {list(status.pending)} to "
              f"{self.directory!r} have not ended (the oldest was committed {age:.1f} s ago)")
      note = self.store.room_note()
      if note:                       # (their slots are the loop's: memory has no room)
        held += f"; {note}"
    else:
      held = ("every slot is held by a committed step: one a restore still reads, or the "
              "newest step protected by parity, kept until a newer one is protected")
    if must:
      raise errors.SnapshotTimeoutError(
          f"save(step={step}) ({must}: never skipped): no slot of {self.where} freed up "
          f"within {self.reserve_timeout(must)} s: {held}; storage is slower than the loop: "
          "persist less often (persist_interval_steps), keep more snapshots (max_snapshots) "
          "or wait longer (timeout_secs)")
    self.skip_busy(step, "no snapshot slot is free (persists in flight)" if status.pending
                   else "no snapshot slot is free", detail=held)

  def left_out(self, where: str) -> None:
    """``where`` (a wait, a close) follows saves the job's plan left out since its last
    snapshot: a loop that ends here does not hold them, so it is said at WARNING, with
    why and what holds the last one (``force=True``). Once per such run of saves."""
    steps, self.ledger.plan_left_out = self.ledger.plan_left_out, []
    if not steps:
      return
    p, r = self.schedule.plan, self.schedule.measure.report()
    pace = "" if r.copy_secs is None or not r.gap_secs else (
        f"; this process's copy takes {r.copy_secs:.3f} s, its loop {r.gap_secs:.3f} s "
        "between saves")
    newest = self.ledger.newest if self.ledger.flight_step is None else self.ledger.flight_step
    logger.warning(
        "%s after saves the job's plan left out: steps %s are not snapshotted (the job "
        "snapshots every %d save calls, so that each copy ends before the next one "
        "starts%s); the newest step snapshotted is %s. Save the last step with "
        "force=True to hold it, or use on_busy='wait'", where, _steps(steps),
        p.snapshot_every, pace, newest)

  def _note_plan(self) -> None:
    """Keeps ``stats`` current with the job's plan (several processes); says when it
    changes."""
    if not self.schedule.agreed:
      return
    p = self.schedule.plan
    if self.ledger.plan(p.snapshot_every, p.persist_every):
      logger.info("the job now snapshots every %d save calls%s", p.snapshot_every,
                  "" if not self.schedule.auto_persist else
                  " and persists no more snapshots until a persist is measured"
                  if p.persist_every is None else
                  f" and persists every {p.persist_every} snapshots")

  # -- the snapshot and its persist --------------------------------------------

  def started(self, step: int, d: _schedule.Decision, nbytes: int, t0: float) -> None:
    """``step``'s snapshot started at ``t0`` (``d.due``: its persist follows its commit)."""
    self.last_save_at = t0
    self._since_skip += 1
    if self._since_skip >= 2:
      self.copy_skipped = None
    self.schedule.took(d)
    if d.due:
      self.ledger.persisting_from(step, nbytes)

  def committed(self, step: int, due: bool, nbytes: int, copy_secs: float) -> None:
    """``step``'s snapshot committed after ``copy_secs`` (the background thread)."""
    if due:
      self.ledger.marked(step, self.schedule.mark())
    self.schedule.measure.copy.append(copy_secs)
    self.ledger.committed(step, nbytes, copy_secs)
    self.note_lag()

  def forget(self, step: int) -> None:
    """``step``'s snapshot failed, or the step was deleted."""
    self.ledger.not_persisting(step)

  def note_lag(self) -> None:
    """Measures the persists that ended and updates ``stats``' persist lag as of the
    newest committed step, as the store last said (a wait that returns calls it too)."""
    if self.directory is None or self.ledger.newest is None:
      return
    status = self.store.persist_status(ask=False)
    self.ended(status)
    self.ledger.persist_lag(status, self.directory)

  def ended(self, status: PersistStatus) -> None:
    """Forgets the due steps whose persist ended (persisted, failed or fenced), measuring
    each by the loop's own time it ran beside (a persist the loop mostly waited for,
    in ``wait_until_*``, sets no pace); a trainer with an agent says when its step is
    on storage (the agent's log has the details)."""
    sch = self.schedule
    for rec in self.ledger.persisting():
      s, mark, nbytes = rec.step, rec.mark, rec.nbytes
      if mark is None or s in status.pending or not self.ledger.seen_ended(s):
        continue                         # (seen_ended: once, whichever thread sees it)
      secs, beside = sch.clock() - mark[0], sch.loop_secs_since(mark)
      sch.measure.persist.append(beside if beside >= secs / 2 else 0.0)
      rate = nbytes / max(secs, 1e-9) / 1e9
      self.log_entry("persist", s, mark[0], persisted=s in status.persisted,
                     persist_secs=secs, nbytes=nbytes, persist_GBps=rate)
      if s in status.persisted and self.agent:
        logger.info("step %d is on storage: %.1f MiB persisted by the snapshot agent within "
                    "%.2f s of its snapshot (%.3g GB/s)", s, nbytes / 2**20, secs, rate)


def _steps(steps: list[int]) -> str:
  """``[9, 10]``, or ``9-40 (32 saves)`` for a long run."""
  if len(steps) <= 6:
    return str(steps)
  return f"{steps[0]}-{steps[-1]} ({len(steps)} saves)"
