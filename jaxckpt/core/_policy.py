"""Which steps a manager saves and which it keeps: one policy, whichever options built it.

:func:`jaxckpt.orbax._policies.from_options` reads a :class:`~jaxckpt.CheckpointOptions`
(the façade builds the policy and hands it to the core). jaxckpt's own fields give the
plain rules (:func:`plain`) (a step on ``save_interval_steps`` is saved; the newest
``max_to_keep`` steps on storage are kept); orbax's retention and save-decision
fields, which ``CheckpointOptions`` takes under orbax's names and with orbax's
meaning (``save_on_steps``, ``should_save_fn``, ``save_decision_policy``,
``keep_period``, ``keep_time_interval``, ``best_fn``, ``best_mode``,
``keep_checkpoints_without_metrics``, ``preservation_policy``), are built into
orbax's own policy objects (:mod:`jaxckpt.orbax._policies`), so each keeps
exactly orbax's meaning. orbax's ``CheckpointManagerOptions`` are first turned
into such a ``CheckpointOptions`` (:mod:`jaxckpt.orbax._options`): the manager sees
one policy shape either way.

The policy is a pure function of the step, the kept steps (their time and
metrics) and, for a save decision that asks, whether a save is in progress and
whether a preemption was reached: every process of a job holds the same kept
steps (the same saves, the same metrics, process 0's times), so every process
decides the same.

:class:`DirectoryRules` are how a manager treats its directory (orbax's
``read_only``, ``create``, ...); jaxckpt's options leave them at their defaults.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from jaxckpt import errors
from jaxckpt.core._ledger import StepInfo
from jaxckpt.options import CheckpointOptions

if TYPE_CHECKING:
  from jaxckpt.net._kv import Channel

logger = logging.getLogger("jaxckpt.manager")

#: (step, the kept steps oldest first, a save is in progress, a preemption was reached)
SaveRule = Callable[[int, Sequence[StepInfo], bool, bool], bool]
KeepRule = Callable[[Sequence[StepInfo]], list[int]]


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which steps are saved and which are kept.

  - ``should_save(step, kept, saving, preempted)``: whether ``step`` is a step to
    save (the job's plan then spaces snapshots: ``jaxckpt.core._schedule``).
  - ``to_remove(kept)``: the kept steps the keep policy drops (deleted from every
    tier); None keeps every step.
  - ``best_key`` ranks steps by their metrics (``best_fn``), ``best_min`` when less
    is better; None ranks by recency.
  - ``uses_time``: the keep policy reads the steps' times (a job's processes then
    agree on each step's time, process 0's); ``asks_progress``: the save decision
    reads whether a save is in progress.
  - ``records``: a step saved carries its time and metrics in its metadata (a keep
    policy ranks it, now or after a relaunch).
  - ``forced(step)``: a step this policy asks to have on storage whatever the
    persist interval (orbax's ``save_on_steps``).
  - ``asks_preemption``, ``reads_kept``: what ``should_save`` reads (a plain
    interval reads neither, so a save does not compute them).
  - ``rollback``: a save of a step older than the run's newest, after a restore of
    an older one, starts a new timeline (jaxckpt's); orbax's manager saves only
    newer steps, so it never rolls back.
  - ``decided_by``: None where ``should_save`` reads only what the job's processes
    agree on (the options' digest, the step, the kept steps): every process decides
    alike. Else the option whose decision runs code of the user's (``should_save_fn``,
    a ``save_decision_policy`` of its own: a bound method's object and the globals it
    reads, which no digest sees) or reads what one process sees (the time, a save in
    progress): a job of several processes then follows process 0's decisions
    (:class:`JobDecisions`).
  """

  should_save: SaveRule
  to_remove: KeepRule | None = None
  best_key: Callable[[Any], Any] | None = None
  best_min: bool = False
  uses_time: bool = False
  asks_progress: bool = False
  records: bool = False
  forced: Callable[[int], bool] = lambda step: False
  asks_preemption: bool = False
  reads_kept: bool = False
  rollback: bool = True
  decided_by: str | None = None

  def best(self, kept: Sequence[StepInfo]) -> int | None:
    """The best of ``kept`` by ``best_key`` (None if none has metrics)."""
    with_metrics = [i for i in kept if i.metrics is not None]
    if not with_metrics:
      return None
    ranked = sorted(with_metrics, key=lambda i: self.best_key(i.metrics), reverse=self.best_min)
    return ranked[-1].step


@dataclasses.dataclass(frozen=True)
class DirectoryRules:
  """How a manager treats its directory (orbax's switches; jaxckpt's defaults).

  ``read_only``: nothing is written or deleted there; ``create``: a missing local
  directory is created; ``blocking``: a save returns once its step is on storage
  (orbax's ``enable_async_checkpointing=False``); ``cleanup_tmp_directories``:
  what crashed saves left is removed at start; ``todelete_subdir``: deleted steps
  are moved there instead; ``save_root_metadata``, ``write_metrics``: what a step
  and the directory carry; ``on_finalized``: called once every save so far has
  ended on storage.
  """

  read_only: bool = False
  create: bool = True
  blocking: bool = False
  cleanup_tmp_directories: bool = False
  todelete_subdir: str | None = None
  save_root_metadata: bool = True
  write_metrics: bool = True
  on_finalized: Callable[[], None] | None = None


def orbax_fields(o: CheckpointOptions) -> bool:
  """Whether ``o`` asks for any of orbax's save-decision or retention fields (whose
  policy :mod:`jaxckpt.orbax._policies` builds); else :func:`plain` is its policy."""
  return any(x is not None for x in (
      o.save_on_steps, o.should_save_fn, o.save_decision_policy, o.keep_period,
      o.keep_time_interval, o.best_fn, o.preservation_policy))


def plain(o: CheckpointOptions) -> Policy:
  """jaxckpt's own rules: the save interval, and the newest ``max_to_keep``."""
  interval = o.save_interval_steps

  def should_save(step: int, kept: Sequence[StepInfo], saving: bool, preempted: bool) -> bool:
    del kept, saving, preempted
    return step % interval == 0

  n = o.max_to_keep
  if n is None:
    return Policy(should_save)
  return Policy(should_save, to_remove=lambda kept: [i.step for i in kept[:-n]] if n else
                [i.step for i in kept], records=True)


class JobDecisions:
  """The save decisions of a job whose policy does not decide alike on every process
  (``Policy.decided_by``): process 0's are the job's. Process 0 publishes its
  decision of a step through the job's key-value store the first time it decides
  it, keyed by the step and the timeline, and never waits; another process reads
  the decision of its call's step (at once when process 0 is ahead; else until
  process 0 makes it: no barrier, process 0 never waits for them). Keyed by step, a
  call only some processes make (a ``should_save()`` retried on one, a forced save
  on one) shifts no later decision. A process whose own decision differs says so at
  WARNING (once), naming the option, the step, both decisions and the processes,
  and follows process 0's. A ``should_save(step)`` and the ``save(step)`` after it
  are one decision (as is any later call of a step already decided in the timeline).

  A ``save(step, force=True)`` (:meth:`forced`) on process 0 publishes True for the
  step: a process that did not force it follows process 0 and saves it too (force is
  meant to be given on every process alike; given on process 0 only, the job still
  takes the step together). Forced on another process only, that process saves it
  whatever process 0 decides (it cannot wait for process 0 to change its mind).

  Timelines: after a ``restore()`` (:meth:`restored`, on every process alike), the
  first call of a step not newer than the newest one decided starts a new timeline
  (a rollback: its step numbers repeat the abandoned one's), whose decisions are
  keyed apart; every process advances it at the same call, as the ledger does.

  Args:
    process: (this process's index, the job's process count).
    channel: the job's key-value channel of this manager's decisions.
    what: the option that decides (``should_save_fn``, ``save_decision_policy``).
    compare: whether a process's own decision is compared (not for a policy that
      reads the time or a save in progress: those differ by nature).
    timeout_secs: the longest a process waits for process 0's decision.
  """

  #: Decisions kept published (a process this many steps behind process 0 is lost).
  KEPT = 4096

  def __init__(self, *, process: tuple[int, int], channel: "Channel", what: str,
               compare: bool, timeout_secs: float) -> None:
    self.index, self.count = process
    self.channel, self.what, self.compare, self.timeout = channel, what, compare, timeout_secs
    self.timeline = 0                 # the rollbacks so far (every process alike)
    self._top: int | None = None      # the newest step decided in this timeline
    self._restored = False            # a restore() since: an older step rolls back
    self._known: dict[str, bool] = {}  # key -> decision, the newest KEPT (in order)
    self._warned = False

  def restored(self) -> None:
    """A ``restore()`` was made: the next call of a step not newer than the newest
    decided starts a new timeline."""
    self._restored = True

  def _key(self, step: int) -> str:
    if self._top is None or step > self._top:
      self._top, self._restored = step, False
    elif self._restored:
      self.timeline, self._top, self._restored = self.timeline + 1, step, False
    return f"d/{self.timeline}/{step}"

  def _remember(self, key: str, d: bool) -> None:
    self._known[key] = d
    if len(self._known) > self.KEPT:
      old = next(iter(self._known))
      del self._known[old]
      if self.index == 0:
        self.channel.delete(old)

  def forced(self, step: int) -> None:
    """``save(step, force=True)``: the step is saved whatever the policy says; on
    process 0 the job's decision of it is True."""
    key = self._key(step)
    if self.index == 0 and self._known.get(key) is not True:
      self.channel.set(key, json.dumps([step, True]))
      self._known.pop(key, None)
      self._remember(key, True)

  def decide(self, step: int, own: Callable[[], bool]) -> bool:
    """The job's decision of ``step`` (``own()``: this process's)."""
    key = self._key(step)
    if key in self._known:
      return self._known[key]
    if self.index == 0:
      d = bool(own())
      self.channel.set(key, json.dumps([step, d]))
      self._remember(key, d)
      return d
    text = self.channel.get(key, self.timeout)
    if text is None:
      raise errors.SnapshotTimeoutError(
          f"process {self.index}: process 0 did not publish its save decision of step {step} "
          f"(timeline {self.timeline}) within {self.timeout} s ({self.what} decides there: "
          "it is that far behind, or gone, or its loop never calls save()/should_save() "
          "with this step; every process must make the same calls)")
    d = bool(json.loads(text)[1])
    if self.compare and not self._warned:
      mine = bool(own())
      if mine != d:
        self._warned = True
        logger.warning(
            "process %d: %s decides %s for step %d where process 0 decides %s: the job's "
            "processes were given save schedules that differ (a per-host setting the function "
            "reads, or the object a bound method belongs to); the %d processes follow process "
            "0's decisions", self.index, self.what, mine, step, d, self.count)
    self._remember(key, d)
    return d
