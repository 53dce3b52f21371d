"""orbax's save-decision and preservation policies as jaxckpt's :class:`~jaxckpt.core._policy.Policy`.

The one place orbax's policy objects are built and called: a ``CheckpointOptions``
with orbax's fields (``save_on_steps``, ``should_save_fn``, ``keep_period``,
``best_fn``, ...; or the policies themselves) gets the objects orbax's own
manager would build from the same fields, so each field keeps exactly orbax's
meaning. orbax's ``CheckpointManagerOptions`` arrive here already translated
(:mod:`jaxckpt.orbax._options`), their policies given whole.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Callable, Sequence

from jaxckpt.core._ledger import StepInfo
from jaxckpt.core import _policy
from jaxckpt.core._policy import Policy
from jaxckpt.options import CheckpointOptions


def from_options(o: CheckpointOptions) -> Policy:
  """The policy ``o`` asks for: jaxckpt's plain rules, or those of its orbax fields."""
  return build(o) if _policy.orbax_fields(o) else _policy.plain(o)


def build(o: CheckpointOptions) -> Policy:
  """The policy of ``o``'s orbax fields (and its interval and ``max_to_keep``)."""
  from orbax.checkpoint import checkpoint_managers as cm  # pylint: disable=import-outside-toplevel  (orbax's objects, only where asked for)
  save_policy = o.save_decision_policy or jaxckpt_save_policy(cm, o)
  keep_policy = o.preservation_policy or (
      preservation(cm, max_to_keep=o.max_to_keep, keep_period=o.keep_period,
                   keep_time_interval=o.keep_time_interval, best_fn=o.best_fn,
                   best_mode=o.best_mode,
                   keep_checkpoints_without_metrics=o.keep_checkpoints_without_metrics)
      if _retains(o) else None)
  context = cm.PreservationContext()
  processes = getattr(save_policy, "multiprocessing_options", None) or _default_processes()

  def should_save(step: int, kept: Sequence[StepInfo], saving: bool, preempted: bool) -> bool:
    now = StepInfo(step, datetime.datetime.now(tz=datetime.timezone.utc))
    decision = cm.DecisionContext(is_saving_in_progress=saving, reached_preemption=preempted,
                                  multiprocessing_options=processes)
    return bool(save_policy.should_save(now, previous_steps=list(kept), context=decision))

  def to_remove(kept: Sequence[StepInfo]) -> list[int]:
    keep = keep_policy.should_preserve(list(kept), context=context)
    return [info.step for info, k in zip(kept, keep) if not k]
  on_steps = frozenset(o.save_on_steps or ())
  return Policy(should_save, to_remove=None if keep_policy is None else to_remove,
                best_key=o.best_fn,
                best_min=o.best_mode == "min",
                uses_time=keep_policy is not None and _uses_time(cm, keep_policy),
                asks_progress=_asks_progress(cm, save_policy),
                records=keep_policy is not None or o.best_fn is not None,
                forced=on_steps.__contains__, asks_preemption=True, reads_kept=True,
                rollback=not isinstance(save_policy, NewerOnly),
                decided_by=_decided_by(cm, save_policy))


def _retains(o: CheckpointOptions) -> bool:
  return any(x is not None for x in (o.max_to_keep, o.keep_period, o.keep_time_interval,
                                     o.best_fn))


def jaxckpt_save_policy(cm: Any, o: CheckpointOptions) -> Any:
  """A ``CheckpointOptions``' save decision with orbax's fields: ``should_save_fn``,
  else the interval or ``save_on_steps`` (no initial save: the first step of a
  jaxckpt manager is on the interval like any other)."""
  if o.should_save_fn is not None:
    return ShouldSaveFn(o.should_save_fn)
  policies = [cm.FixedIntervalPolicy(o.save_interval_steps)]
  if o.save_on_steps:
    policies.append(cm.SpecificStepsPolicy(o.save_on_steps))
  return cm.AnySavePolicy(policies)


def _default_processes() -> Any:
  from orbax.checkpoint import options as ocp_options  # pylint: disable=import-outside-toplevel
  return ocp_options.MultiprocessingOptions()


def orbax_save_policy(cm: Any, o: Any) -> Any:
  """orbax's manager's decision for its ``CheckpointManagerOptions`` ``o``:
  ``should_save_fn``, else the interval and ``save_on_steps``; then a step at a
  preemption, and the first step of a manager that holds none; and never a step
  not newer than the newest kept one (orbax's ``should_save``)."""
  processes = o.multiprocessing_options
  if o.save_decision_policy is not None:
    return NewerOnly(o.save_decision_policy, processes)
  if o.should_save_fn is not None:
    policies = [ShouldSaveFn(o.should_save_fn), cm.PreemptionCheckpointingPolicy()]
  else:
    policies = []
    if o.save_interval_steps:         # 0 (read-only): no interval
      policies.append(cm.FixedIntervalPolicy(o.save_interval_steps))
    if o.save_on_steps:
      policies.append(cm.SpecificStepsPolicy(o.save_on_steps))
    policies += [cm.PreemptionCheckpointingPolicy(), cm.InitialSavePolicy()]
  return NewerOnly(cm.AnySavePolicy(policies), processes)


@dataclasses.dataclass
class NewerOnly:
  """orbax's manager saves no step that is not newer than its newest kept one."""

  policy: Any
  multiprocessing_options: Any = None

  def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
    if previous_steps and previous_steps[-1].step >= step.step:
      return False
    return self.policy.should_save(step, previous_steps=previous_steps, context=context)


@dataclasses.dataclass
class ShouldSaveFn:
  """orbax's ``should_save_fn(step, latest_step)`` as a save decision policy."""

  fn: Callable[[int, int | None], bool]

  def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
    del context
    return self.fn(step.step, previous_steps[-1].step if previous_steps else None)


def preservation(cm: Any, *, max_to_keep: int | None, keep_period: int | None,
                 keep_time_interval: datetime.timedelta | None, best_fn: Any,
                 best_mode: str, keep_checkpoints_without_metrics: bool) -> Any:
  """orbax's default preservation: ``keep_period``, ``keep_time_interval``, and the best
  ``max_to_keep`` by ``best_fn`` or else the newest ``max_to_keep`` (None: all, 0: none)."""
  policies = []
  if keep_period is not None:
    policies.append(cm.EveryNSteps(keep_period))
  if keep_time_interval is not None:
    policies.append(cm.EveryNSeconds(interval_secs=int(keep_time_interval.total_seconds())))
  if best_fn is not None:
    policies.append(cm.BestN(get_metric_fn=best_fn, reverse=best_mode == "min", n=max_to_keep,
                             keep_checkpoints_without_metrics=keep_checkpoints_without_metrics))
  else:
    policies.append(cm.LatestN(n=max_to_keep))
  return cm.AnyPreservationPolicy(policies)


def _flat(policy: Any, any_cls: Any) -> list[Any]:
  if isinstance(policy, any_cls):
    return [p for child in policy.policies for p in _flat(child, any_cls)]
  return [policy]


def _uses_time(cm: Any, policy: Any) -> bool:
  """Whether a preservation policy reads the steps' times (orbax's time-based ones, or one
  of the user's own, which may)."""
  simple = (cm.LatestN, cm.EveryNSteps, cm.EveryNStepsClosest, cm.BestN, cm.CustomSteps,
            cm.preservation_policy.PreserveAll)
  return any(not isinstance(p, simple) for p in _flat(policy, cm.AnyPreservationPolicy))


def _asks_progress(cm: Any, policy: Any) -> bool:
  """Whether a save decision policy reads ``is_saving_in_progress`` (orbax's continuous
  checkpointing, or one of the user's own, which may)."""
  simple = (cm.FixedIntervalPolicy, cm.SpecificStepsPolicy, cm.InitialSavePolicy,
            cm.PreemptionCheckpointingPolicy, ShouldSaveFn)
  flat = _flat(policy.policy if isinstance(policy, NewerOnly) else policy, cm.AnySavePolicy)
  return any(not isinstance(p, simple) for p in flat)


def _decided_by(cm: Any, policy: Any) -> str | None:
  """None where a save decision policy is orbax's own rules of the step and the kept
  steps only (an interval, given steps, the first step, a preemption): every process
  given the same options decides alike. Else the option that may decide otherwise on
  each process (see ``Policy.decided_by``): ``should_save_fn`` (given as such, or in
  orbax's options), or ``save_decision_policy`` (one of the user's, or one that reads
  the time or a save in progress)."""
  alike = (cm.FixedIntervalPolicy, cm.SpecificStepsPolicy, cm.InitialSavePolicy,
           cm.PreemptionCheckpointingPolicy)
  flat = _flat(policy.policy if isinstance(policy, NewerOnly) else policy, cm.AnySavePolicy)
  if all(isinstance(p, alike) for p in flat):
    return None
  return "should_save_fn" if any(isinstance(p, ShouldSaveFn) for p in flat) else (
      "save_decision_policy")
