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

import logging
from typing import Any

from jaxckpt import errors
from jaxckpt.core._policy import DirectoryRules
from jaxckpt.options import CheckpointOptions

logger = logging.getLogger(__name__)


def is_orbax_options(options: Any) -> bool:
  """Whether ``options`` is orbax's ``CheckpointManagerOptions`` (checked by name: no import)."""
  t = type(options)
  return t.__name__ == "CheckpointManagerOptions" and t.__module__.startswith("orbax.")


def translate(options: Any, directory: str | None = "", *,
              orbax_form: bool = False) -> tuple[CheckpointOptions, DirectoryRules]:
  """jaxckpt's options and the directory's rules for ``options``: a
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
    from orbax.checkpoint import CheckpointManagerOptions  # pylint: disable=import-outside-toplevel
    options = CheckpointManagerOptions()
  if options is None:
    return CheckpointOptions(), DirectoryRules()
  if isinstance(options, CheckpointOptions):
    return options, DirectoryRules()
  if not is_orbax_options(options):
    raise errors.InvalidArgumentError(
        f"options={options!r} must be a jaxckpt.CheckpointOptions or orbax's "
        "ocp.CheckpointManagerOptions")
  if directory is None:
    raise errors.InvalidArgumentError(
        "CheckpointManager(options=ocp.CheckpointManagerOptions(...)) needs the directory, "
        "as orbax's: CheckpointManager('/path/or/s3://bucket/run', options)")
  return _from_orbax(options)


def _from_orbax(o: Any) -> tuple[CheckpointOptions, DirectoryRules]:
  from orbax.checkpoint import checkpoint_managers as cm  # pylint: disable=import-outside-toplevel  (orbax's own objects, only for its users)
  from jaxckpt.orbax import _policies  # pylint: disable=import-outside-toplevel  (it imports the manager's core)
  if o.preservation_policy is not None and (o.keep_time_interval or o.max_to_keep
                                            or o.keep_period):
    raise errors.InvalidArgumentError(
        "CheckpointManagerOptions: `preservation_policy` and `delete options` "
        "(max_to_keep, keep_period, keep_time_interval) are mutually exclusive; keep one")
  keep = o.preservation_policy or _policies.preservation(
      cm, max_to_keep=o.max_to_keep, keep_period=o.keep_period,
      keep_time_interval=o.keep_time_interval, best_fn=o.best_fn, best_mode=o.best_mode,
      keep_checkpoints_without_metrics=o.keep_checkpoints_without_metrics)
  timeout = getattr(o.async_options, "timeout_secs", None)
  options = CheckpointOptions(
      save_interval_steps=1,            # the policy says which steps are saved
      persist_interval_steps=1,         # orbax writes every saved step to storage
      on_busy="wait",                   # ... and a save waits for the one before it
      timeout_secs=float(timeout) if timeout else CheckpointOptions().timeout_secs,
      save_decision_policy=_policies.orbax_save_policy(cm, o), preservation_policy=keep,
      best_fn=o.best_fn, best_mode=o.best_mode)
  rules = DirectoryRules(
      read_only=o.read_only, create=o.create, blocking=not o.enable_async_checkpointing,
      cleanup_tmp_directories=o.cleanup_tmp_directories, todelete_subdir=o.todelete_subdir,
      save_root_metadata=o.save_root_metadata, write_metrics=not o.prevent_write_metrics,
      on_finalized=getattr(o.async_options, "post_finalization_callback", None))
  return options, rules
