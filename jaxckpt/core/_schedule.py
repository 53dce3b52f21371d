"""Which save() calls snapshot and which snapshots persist: one decision for the whole job.

Every process of a job must snapshot the same steps (a step the job holds is a
step every host holds: parity, a restore and a persist all need every host's
piece) and persist the same ones. A rule that reads local timing ("is my last
copy done?", "has my last persist ended?") decides differently on each
process, so the job agrees on a *plan* instead, ahead of time, through
jax.distributed's key-value store, and every process applies it to the same
sequence of save() calls:

- ``snapshot_every`` (n): a candidate call (one on the save interval) takes a
  snapshot when at least n candidate calls passed since the last snapshot. n is
  the slowest process's copy time over the fastest loop's time between calls,
  with a margin (``COPY_MARGIN``), so that the previous copy is done when the
  next snapshot starts; ``on_busy="wait"`` keeps n = 1.
- ``persist_every`` (m), when ``persist_interval_steps`` is not set: every m-th
  snapshot is persisted. m is the slowest persist over the time between
  snapshots, with a margin (``PERSIST_MARGIN``), so that a persist has ended
  before the next one is due and the loop never waits for storage. The first
  snapshot is persisted at once; the next one waits for the first measured
  persist. A persist is measured by the loop's own time it ran beside (not the
  time the trainer waited for it in ``wait_until_finished``): storage that
  the loop waits for anyway sets no pace.

Calls are grouped into epochs of ``EPOCH_CALLS``. At the first call of an
epoch each process publishes what it measured; process 0 reads them at the
middle of the epoch and publishes the plan of the next epoch, which every
process reads at its first call. So nobody waits unless a process is half an
epoch behind (in a job whose steps run collectives, processes are never more
than a step apart), and the key-value store sees two requests per process per
epoch. A process that finds its previous copy still running at a planned
snapshot waits for it (it may not skip alone); its measurements make the next
plans sparser. What a process decides depends only on the calls it made, never
on whether its snapshots succeeded: a planned snapshot counts as taken even
where its save raised. ``should_save(step)`` decides its step's call (the call
counts, and ``save(step)`` next takes that decision), so a loop that saves only
when told makes the same plan as one that calls ``save()`` every step.

A one-process job needs no agreement: it skips a snapshot while its previous
copy runs (``on_busy="skip"``), and without ``persist_interval_steps`` it
persists a snapshot once its previous persist has ended (what it knows at once:
a due save never waits) and the loop has run 1.5x as long as that persist ran
beside it since (storage and its CPU busy at most two thirds of the loop).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time
from typing import TYPE_CHECKING, Callable

from jaxckpt import errors

if TYPE_CHECKING:
  from jaxckpt.net._kv import Channel
  from jaxckpt.options import CheckpointOptions

EPOCH_CALLS = 4
COPY_MARGIN = 1.25
PERSIST_MARGIN = 1.5
_WINDOW = 8                      # measurements each figure keeps (the newest)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The agreed intervals of one epoch (``persist_every`` None: no persist until
  one is measured; 0: the persist interval is fixed by the options)."""

  snapshot_every: int = 1
  persist_every: int | None = None

  def to_json(self) -> str:
    return json.dumps([self.snapshot_every, self.persist_every])

  @classmethod
  def from_json(cls, text: str) -> "Plan":
    n, m = json.loads(text)
    return cls(int(n), None if m is None else int(m))


@dataclasses.dataclass(frozen=True)
class Report:
  """What one process measured (seconds; None: nothing measured yet)."""

  copy_secs: float | None = None      # save() to committed snapshot (median of the newest)
  gap_secs: float | None = None       # the loop's time between candidate calls (median)
  persist_secs: float | None = None   # committed snapshot to persisted step (median)

  def to_json(self) -> str:
    return json.dumps(dataclasses.astuple(self))

  @classmethod
  def from_json(cls, text: str) -> "Report":
    return cls(*json.loads(text))


def plan_of(reports: list[Report], *, on_busy: str, auto_persist: bool) -> Plan:
  """The plan the job follows, from every process's report (a pure function).

  >>> plan_of([Report(0.3, 0.1, 2.0), Report(0.2, 0.12, 3.0)], on_busy="skip",
  ...         auto_persist=True)
  Plan(snapshot_every=4, persist_every=12)
  """
  copy = max((r.copy_secs for r in reports if r.copy_secs is not None), default=None)
  gap = min((r.gap_secs for r in reports if r.gap_secs), default=None)
  persist = max((r.persist_secs for r in reports if r.persist_secs is not None), default=None)
  n = 1
  if on_busy == "skip" and copy is not None and gap:
    n = max(1, math.ceil(COPY_MARGIN * copy / gap))
  if not auto_persist:
    return Plan(n, 0)
  if persist is None or not gap:
    return Plan(n, None)
  return Plan(n, max(1, math.ceil(PERSIST_MARGIN * persist / (n * gap))))


class Measure:
  """This process's figures for its reports (thread-safe enough: floats appended
  from the save thread, read on the loop's thread)."""

  def __init__(self) -> None:
    self.copy: collections.deque[float] = collections.deque(maxlen=_WINDOW)
    self.gap: collections.deque[float] = collections.deque(maxlen=_WINDOW)
    self.persist: collections.deque[float] = collections.deque(maxlen=_WINDOW)

  def report(self) -> Report:
    """The medians of the newest few (a first copy into fresh memory, or a first persist
    that made the directory, does not set the pace for long)."""
    return Report(_median(self.copy), _median(self.gap), _median(self.persist))


def _median(xs: collections.deque[float]) -> float | None:
  got = sorted(xs)
  return got[len(got) // 2] if got else None


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the job does at one candidate call: snapshot it, and persist it."""

  snapshot: bool
  due: bool


class Schedule:
  """The plan of one manager's saves, agreed by the processes of its job.

  Args:
    process: (this process's index, the job's process count).
    on_busy: the manager's ``on_busy``.
    persist_interval: ``persist_interval_steps`` (a due step is one divisible by
      it); None with a directory: the interval follows the measurements; 0: the
      manager persists nothing.
    timeout_secs: the longest a process waits for a report or a plan.
    channel: the job's key-value channel (``net._kv.Channel``); None in a
      one-process job.
    clock: seconds, for the loop's time between calls.
  """

  def __init__(self, *, process: tuple[int, int], on_busy: str, persist_interval: int | None,
               timeout_secs: float, channel: Channel | None = None,
               clock: Callable[[], float] = time.perf_counter) -> None:
    self.index, self.count = process
    self.on_busy = on_busy
    self.persist_interval = persist_interval
    self.auto_persist = persist_interval is None
    self.timeout_secs = timeout_secs
    self.channel = channel
    self.clock = clock
    self.measure = Measure()
    self.calls = 0                   # candidate calls decided so far
    self.last_snapshot: int | None = None   # the call index of the newest snapshot
    self.snapshots_since_due: int | None = None
    self.plans: dict[int, Plan] = {0: Plan()}
    self.plan = Plan()
    self._last_call_at: float | None = None
    self._blocked = 0.0              # time save() spent since the last call (waits excluded)
    self.blocked_total = 0.0         # all the time spent inside the manager's saves and waits
    self._due_at: tuple[float, float] | None = None   # (clock, blocked_total) at the last due
    self._asked: tuple[int, int, Decision] | None = None   # (step, call, decision) of peek
    self._decided = 0                # the call index of the last decide

  @property
  def agreed(self) -> bool:
    """Whether the job's processes agree through the key-value store (P > 1)."""
    return self.channel is not None

  # -- the decision -----------------------------------------------------------

  def peek(self, step: int, *, persisting: bool = False) -> Decision:
    """The decision of the next candidate call, of ``step`` (``should_save``). It is
    that call's decision: it counts the call, and a ``decide`` of the same step next
    returns it, so a loop that asks first and saves only when told (``if
    should_save(step): save(step)``) makes the same plan as one that saves every
    step. With agreement the plan of its epoch may be waited for."""
    if self._asked is None or self._asked[0] != step:
      self._asked = (step, *self._count(step, False, persisting))
    return self._asked[2]

  def decide(self, step: int, *, force: bool = False, persisting: bool = False) -> Decision:
    """The decision of the next candidate call, of ``step`` (the one ``peek`` gave, if
    it was asked of this step last; ``force`` still applies); counts the call.
    ``persisting``: a persist this manager started has not ended (a one-process job
    then persists nothing new). In a job of several processes the decision is the
    job's: a planned snapshot counts as taken whether or not this process managed to
    start it (its save raised), so that every process goes on deciding alike; a
    one-process job calls :meth:`took` once its snapshot has started."""
    asked, self._asked = self._asked, None
    if asked is None or asked[0] != step:
      k, d = self._count(step, force, persisting)
    else:
      _, k, d = asked
      if force and not (d.snapshot and d.due):
        forced = self._decide(step, True, self.plan, persisting, k)
        if self.agreed and not d.snapshot:    # (peek's snapshot was counted already)
          self._record(k, forced)
        elif self.agreed and forced.due:
          self.snapshots_since_due = 0
        d = forced
    self._decided = k
    return d

  def _count(self, step: int, force: bool, persisting: bool) -> tuple[int, Decision]:
    """Decides the next candidate call (``step``) and counts it: (its index, decision).
    With agreement a snapshot decided is the job's from here on (see ``decide``)."""
    now = self.clock()
    if self._last_call_at is not None:
      self.measure.gap.append(max(1e-6, now - self._last_call_at - self._blocked))
    self._last_call_at, self._blocked = now, 0.0
    k = self.calls
    self.plan = self._plan_for(k, publish=True)
    d = self._decide(step, force, self.plan, persisting, k)
    self.calls += 1
    if self.agreed and d.snapshot:
      self._record(k, d)
    return k, d

  def took(self, d: Decision) -> None:
    """The snapshot the last ``decide`` decided started: a one-process job counts it
    (it may skip one that is not due while its previous copy runs); in a job of
    several, the decision counted it already."""
    if not self.agreed:
      self._record(self._decided, d)

  def _record(self, k: int, d: Decision) -> None:
    self.last_snapshot = k
    if self.snapshots_since_due is not None:
      self.snapshots_since_due += 1
    if d.due:
      self.snapshots_since_due = 0
      self._due_at = self.mark()

  def blocked(self, secs: float) -> None:
    """The manager held the loop ``secs`` (a save, or a wait): not the loop's own time."""
    self._blocked += secs
    self.blocked_total += secs

  def mark(self) -> tuple[float, float]:
    """Now, for :meth:`loop_secs_since`."""
    return self.clock(), self.blocked_total

  def loop_secs_since(self, mark: tuple[float, float]) -> float:
    """The loop's own time since ``mark``: the time not spent inside the manager."""
    return max(0.0, self.clock() - mark[0] - (self.blocked_total - mark[1]))

  def _decide(self, step: int, force: bool, plan: Plan, persisting: bool, k: int) -> Decision:
    fixed_due = bool(self.persist_interval) and step % self.persist_interval == 0
    snapshot = (force or fixed_due or self.last_snapshot is None
                or k - self.last_snapshot >= plan.snapshot_every)
    if not self.auto_persist or not snapshot:
      return Decision(snapshot, snapshot and fixed_due)
    if force or self.snapshots_since_due is None:   # forced, or the first: persisted at once
      return Decision(True, True)
    if not self.agreed:    # one process: once the last persist has ended, and the loop ran
      p = self.measure.report().persist_secs     # 1.5x as long as a persist ran beside it
      rested = (p is None or self._due_at is None
                or self.loop_secs_since(self._due_at) >= PERSIST_MARGIN * p)
      return Decision(True, not persisting and rested)
    m = plan.persist_every
    return Decision(True, m is not None and self.snapshots_since_due + 1 >= m)

  # -- the plan ---------------------------------------------------------------

  def _plan_for(self, call: int, *, publish: bool) -> Plan:
    if not self.agreed:          # one process: its own measurements, at once; it skips
      plan = plan_of([self.measure.report()], on_busy="wait",   # a busy snapshot itself
                     auto_persist=self.auto_persist)
      return plan
    epoch, offset = divmod(call, EPOCH_CALLS)
    if publish and offset == 0:
      self.channel.set(f"r/{epoch}/{self.index}", self.measure.report().to_json())
    if publish and offset == EPOCH_CALLS // 2 and self.index == 0:
      self._publish_next(epoch)
    if epoch not in self.plans:
      text = self.channel.get(f"p/{epoch}", self.timeout_secs)
      if text is None:
        # Process 0 publishes it once every process reported for the epoch before:
        # name those it still waits for, if any (else process 0 itself is late).
        missing = self.channel.gather(f"r/{epoch - 1}", self.count, timeout_secs=0)
        missing = missing if isinstance(missing, list) else []
        why = (f"it waits for the reports of processes {missing} (they are behind, or gone)"
               if missing and 0 not in missing else "it is that far behind, or gone")
        raise errors.SnapshotTimeoutError(
            f"process {self.index}: process 0 did not publish the job's save plan for calls "
            f"{epoch * EPOCH_CALLS}-{epoch * EPOCH_CALLS + EPOCH_CALLS - 1} within "
            f"{self.timeout_secs} s: {why}")
      self.plans[epoch] = Plan.from_json(text)
      self.plans.pop(epoch - 4, None)
    return self.plans[epoch]

  def _publish_next(self, epoch: int) -> None:
    """Process 0: the next epoch's plan, from this epoch's reports."""
    got = self.channel.gather(f"r/{epoch}", self.count, timeout_secs=self.timeout_secs)
    if isinstance(got, list):
      raise errors.SnapshotTimeoutError(
          f"processes {got} did not report for the job's save plan (call "
          f"{epoch * EPOCH_CALLS}) within {self.timeout_secs} s (they are that far behind, "
          "or gone)")
    plan = plan_of([Report.from_json(v) for v in got.values()], on_busy=self.on_busy,
                   auto_persist=self.auto_persist)
    self.channel.set(f"p/{epoch + 1}", plan.to_json())
    self.channel.delete(f"r/{epoch}")
    if epoch >= 4:
      self.channel.delete(f"p/{epoch - 4}")


def for_manager(options: CheckpointOptions, process: tuple[int, int], *, persists: bool) -> Schedule:
  """The schedule of a manager with ``options`` (``persists``: it has a directory):
  ``persist_interval_steps``, or the measurements' pace (host snapshots) or every
  saved step (storage-only), or nothing to persist; agreed through the job's
  key-value store in a job of several processes."""
  from jaxckpt.net import _kv  # pylint: disable=import-outside-toplevel  (JAX: the trainer's side only; this module's plan runs without it)
  interval = (0 if not persists else options.persist_interval_steps or (
      None if options.host_snapshots else options.save_interval_steps))
  return Schedule(process=process, on_busy=options.on_busy, persist_interval=interval,
                  timeout_secs=options.timeout_secs,
                  channel=None if process[1] == 1 else _kv.Channel(
                      "schedule", timeout_secs=options.timeout_secs))
