"""orbax's ``CheckpointManagerOptions`` as jaxckpt's options plus the rules of an orbax manager.

:func:`translate` is the one place an orbax options object is read. It gives a
:class:`~jaxckpt.CheckpointOptions` (how the tiers work) and :class:`Rules`: which
steps are saved (orbax's save decision policy, as a pure function of the step,
the steps kept so far and, for time-based policies, the clock), which stored steps
are kept (orbax's preservation policy), and the switches of an orbax manager
(read-only, blocking saves, ...). The manager calls the rules as plain functions
and never sees an orbax type.

Every field of ``CheckpointManagerOptions`` has orbax's meaning, except those with
no meaning for jaxckpt's storage format, which are accepted and change nothing:

- ``step_prefix``, ``step_format_fixed_length``, ``step_name_format``: the names of
  orbax's step directories. jaxckpt's universal format names its own
  (``step_NNNNNNNNNN/`` and ``commits/``, docs/format.md).
- ``single_host_load_and_broadcast``, ``file_options``, ``atomicity_options``,
  ``temporary_path_class``, ``num_deletion_threads``, ``todelete_full_path``
  (a GCS path for soft deletion), ``enable_per_process_directory_creation``,
  ``lightweight_initialize``, ``enable_should_save_is_saving_in_progress_check``
  and ``multiprocessing_options``: orbax's file handling and barriers. jaxckpt's
  commit is a marker written last (atomic on every store), process 0 commits and
  deletes, and the job agrees through jax.distributed's key-value store.
- ``async_options``: ``timeout_secs`` is jaxckpt's ``timeout_secs``;
  ``post_finalization_callback`` runs once a save is on storage; the rest are
  orbax's barriers.
- ``enable_background_delete``: jaxckpt always deletes off the training path
  (after the deleted step's persist ended); ``close()`` waits for it either way.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any, Callable, Sequence

from jaxckpt import errors
from jaxckpt.options import CheckpointOptions

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepInfo:
  """What the rules know of a kept step (orbax's ``PolicyCheckpointInfo``)."""

  step: int
  time: datetime.datetime
  metrics: Any = None


@dataclasses.dataclass(frozen=True)
class Rules:
  """How a manager decides which steps to save and keep, beyond its tiers.

  ``orbax`` is False for a manager made with jaxckpt's own options: saves follow
  ``save_interval_steps`` and persisted steps ``max_to_keep``, as jaxckpt's
  options say. With orbax's options (``orbax`` True):

  - ``should_save(step, kept, saving, preempted)``: whether ``step`` is a step to
    save (orbax's save decision policy); ``kept`` are the :class:`StepInfo` of the
    steps held so far, oldest first.
  - ``to_remove(kept)``: the steps of ``kept`` that orbax's preservation policy
    drops (deleted from every tier).
  - ``best_key``: the metric a step ranks by (``best_fn``) and ``best_min``
    whether less is better; None ranks by recency.
  - ``uses_time``: the preservation policy reads the steps' times (so a job's
    processes agree on each step's time, process 0's).
  - ``asks_progress``: the save decision policy reads whether a save is in
    progress (``ContinuousCheckpointingPolicy``, or a policy of the user's own).
  - ``blocking``: ``enable_async_checkpointing=False`` (a save returns once the
    step is on storage).
  """

  orbax: bool = False
  should_save: Callable[[int, Sequence[StepInfo], bool, bool], bool] | None = None
  to_remove: Callable[[Sequence[StepInfo]], list[int]] | None = None
  best_key: Callable[[Any], Any] | None = None
  best_min: bool = False
  uses_time: bool = False
  asks_progress: bool = False
  blocking: bool = False
  read_only: bool = False
  create: bool = True
  cleanup_tmp_directories: bool = False
  todelete_subdir: str | None = None
  save_root_metadata: bool = True
  write_metrics: bool = True
  on_finalized: Callable[[], None] | None = None


def is_orbax_options(options: Any) -> bool:
  """Whether ``options`` is orbax's ``CheckpointManagerOptions`` (checked by name: no import)."""
  t = type(options)
  return t.__name__ == "CheckpointManagerOptions" and t.__module__.startswith("orbax.")


def translate(options: Any, directory: str | None = "", *,
              orbax_form: bool = False) -> tuple[CheckpointOptions, Rules]:
  """jaxckpt's options and the manager's rules for ``options``: a
  ``jaxckpt.CheckpointOptions`` (or None) as it is, or orbax's
  ``CheckpointManagerOptions`` with orbax's meaning (which needs a ``directory``).
  ``orbax_form``: the manager was made as orbax's (``item_names=``,
  ``item_handlers=``): no options means orbax's defaults (every saved step
  written to storage), as orbax's own manager.

  Raises:
    InvalidArgumentError (a ValueError): anything else, or orbax options that
      orbax itself refuses (a ``preservation_policy`` beside ``max_to_keep``,
      ``keep_period`` or ``keep_time_interval``), or orbax's without a directory.
  """
  if options is None and orbax_form and directory:
    try:
      from orbax.checkpoint import CheckpointManagerOptions  # pylint: disable=import-outside-toplevel
    except ImportError:                 # (orbax's names without orbax: its defaults' meaning)
      return CheckpointOptions(persist_interval_steps=1, on_busy="wait"), Rules()
    options = CheckpointManagerOptions()
  if options is None:
    return CheckpointOptions(), Rules()
  if isinstance(options, CheckpointOptions):
    return options, Rules()
  if not is_orbax_options(options):
    raise errors.InvalidArgumentError(
        f"options={options!r} must be a jaxckpt.CheckpointOptions or orbax's "
        "ocp.CheckpointManagerOptions")
  if directory is None:
    raise errors.InvalidArgumentError(
        "CheckpointManager(options=ocp.CheckpointManagerOptions(...)) needs the directory, "
        "as orbax's: CheckpointManager('/path/or/s3://bucket/run', options)")
  return _from_orbax(options)


def _from_orbax(o: Any) -> tuple[CheckpointOptions, Rules]:
  from orbax.checkpoint import checkpoint_managers as cm  # pylint: disable=import-outside-toplevel  (orbax's own objects, only for its users)
  if o.preservation_policy is not None and (o.keep_time_interval or o.max_to_keep
                                            or o.keep_period):
    raise errors.InvalidArgumentError(
        "CheckpointManagerOptions: `preservation_policy` and `delete options` "
        "(max_to_keep, keep_period, keep_time_interval) are mutually exclusive; keep one")
  save_policy = o.save_decision_policy or _default_save_policy(cm, o)
  keep_policy = o.preservation_policy or _default_preservation(cm, o)
  timeout = getattr(o.async_options, "timeout_secs", None)
  jax_options = CheckpointOptions(
      save_interval_steps=1,            # the rules say which steps are saved
      persist_interval_steps=1,         # orbax writes every saved step to storage
      on_busy="wait",                   # ... and a save waits for the one before it
      timeout_secs=float(timeout) if timeout else CheckpointOptions().timeout_secs)
  context_cls = cm.DecisionContext
  preserve_context = cm.PreservationContext()

  def should_save(step: int, kept: Sequence[StepInfo], saving: bool, preempted: bool) -> bool:
    now = StepInfo(step, datetime.datetime.now(tz=datetime.timezone.utc))
    context = context_cls(is_saving_in_progress=saving, reached_preemption=preempted,
                          multiprocessing_options=o.multiprocessing_options)
    return bool(save_policy.should_save(now, previous_steps=list(kept), context=context))

  def to_remove(kept: Sequence[StepInfo]) -> list[int]:
    keep = keep_policy.should_preserve(list(kept), context=preserve_context)
    return [info.step for info, k in zip(kept, keep) if not k]

  callback = getattr(o.async_options, "post_finalization_callback", None)
  rules = Rules(
      orbax=True, should_save=should_save, to_remove=to_remove, best_key=o.best_fn,
      best_min=o.best_mode == "min", uses_time=_uses_time(cm, keep_policy),
      asks_progress=_asks_progress(cm, save_policy),
      blocking=not o.enable_async_checkpointing, read_only=o.read_only, create=o.create,
      cleanup_tmp_directories=o.cleanup_tmp_directories, todelete_subdir=o.todelete_subdir,
      save_root_metadata=o.save_root_metadata, write_metrics=not o.prevent_write_metrics,
      on_finalized=callback)
  return jax_options, rules


def _default_save_policy(cm: Any, o: Any) -> Any:
  """orbax's default decision: ``should_save_fn``, else the interval and ``save_on_steps``;
  then a step at a preemption, and the first step of a manager that holds none."""
  if o.should_save_fn is not None:
    fn = o.should_save_fn
    policies = [_ShouldSaveFn(fn), cm.PreemptionCheckpointingPolicy()]
  else:
    policies = []
    if o.save_interval_steps:         # 0 (read-only): no interval
      policies.append(cm.FixedIntervalPolicy(o.save_interval_steps))
    if o.save_on_steps:
      policies.append(cm.SpecificStepsPolicy(o.save_on_steps))
    policies += [cm.PreemptionCheckpointingPolicy(), cm.InitialSavePolicy()]
  return cm.AnySavePolicy(policies)


@dataclasses.dataclass
class _ShouldSaveFn:
  """orbax's ``should_save_fn(step, latest_step)`` as a save decision policy."""

  fn: Callable[[int, int | None], bool]

  def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
    del context
    return self.fn(step.step, previous_steps[-1].step if previous_steps else None)


def _default_preservation(cm: Any, o: Any) -> Any:
  """orbax's default preservation: ``keep_period``, ``keep_time_interval``, and the best
  ``max_to_keep`` by ``best_fn`` or else the newest ``max_to_keep`` (None: all, 0: none)."""
  policies = []
  if o.keep_period is not None:
    policies.append(cm.EveryNSteps(o.keep_period))
  if o.keep_time_interval is not None:
    policies.append(cm.EveryNSeconds(interval_secs=int(o.keep_time_interval.total_seconds())))
  if o.best_fn is not None:
    policies.append(cm.BestN(get_metric_fn=o.best_fn, reverse=o.best_mode == "min",
                             n=o.max_to_keep,
                             keep_checkpoints_without_metrics=o.keep_checkpoints_without_metrics))
  else:
    policies.append(cm.LatestN(n=o.max_to_keep))
  return cm.AnyPreservationPolicy(policies)


def _flat(cm: Any, policy: Any, any_cls: Any) -> list[Any]:
  if isinstance(policy, any_cls):
    return [p for child in policy.policies for p in _flat(cm, child, any_cls)]
  return [policy]


def _uses_time(cm: Any, policy: Any) -> bool:
  """Whether a preservation policy reads the steps' times (orbax's time-based ones, or one
  of the user's own, which may)."""
  simple = (cm.LatestN, cm.EveryNSteps, cm.EveryNStepsClosest, cm.BestN, cm.CustomSteps,
            cm.preservation_policy.PreserveAll)
  return any(not isinstance(p, simple)
             for p in _flat(cm, policy, cm.AnyPreservationPolicy))


def _asks_progress(cm: Any, policy: Any) -> bool:
  """Whether a save decision policy reads ``is_saving_in_progress`` (orbax's continuous
  checkpointing, or one of the user's own, which may)."""
  simple = (cm.FixedIntervalPolicy, cm.SpecificStepsPolicy, cm.InitialSavePolicy,
            cm.PreemptionCheckpointingPolicy, _ShouldSaveFn)
  return any(not isinstance(p, simple) for p in _flat(cm, policy, cm.AnySavePolicy))
