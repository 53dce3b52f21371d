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
from typing import Any, Callable, Sequence

from jaxckpt.core._ledger import StepInfo
from jaxckpt.options import CheckpointOptions

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
