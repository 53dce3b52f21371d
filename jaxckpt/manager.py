"""CheckpointManager: jaxckpt's manager, with orbax's surface translated at the edge.

The manager is a façade over :class:`jaxckpt.core._manager.CoreManager`, which
handles the tiers around one step ledger and one policy. What orbax's manager
adds is translated here, at the boundary, and never reaches the core: orbax's
options (:mod:`jaxckpt.orbax._options`: one ``CheckpointOptions`` and the
directory's rules), its ``args=`` forms (:mod:`jaxckpt.orbax._items`: one tree,
and a restore target built from the step's metadata), its root metadata, its
loggers and its errors.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
from etils import epath

from jaxckpt import errors, tree, universal
from jaxckpt.core._ledger import METRICS_KEY, SaveStats  # noqa: F401  (SaveStats: a public name)
from jaxckpt.core._manager import CoreManager
from jaxckpt.host.store import HostStore
from jaxckpt.options import check_step
from jaxckpt.orbax import _errors, _items, _options, _policies, _root
from jaxckpt.restore import _read, _tiers

logger = logging.getLogger(__name__)


class CheckpointManager:
  """Snapshots a training state every step and restores it from the fastest tier.

  >>> import jax.numpy as jnp, jaxckpt as jc
  >>> with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as mgr:
  ...   mgr.save(1, {"w": jnp.ones(4)})
  ...   mgr.wait_until_finished()
  ...   mgr.restore(target={"w": jnp.zeros(4)})["w"].tolist()
  True
  [1.0, 1.0, 1.0, 1.0]

  ``save()`` returns once the device-to-host copies are dispatched; a background
  thread completes them into a host slot, a checksum per shard, and commits the
  step. ``restore()`` verifies every checksum first and says what it did in
  ``last_restore``. orbax's arguments are taken too: ``options`` may be orbax's
  ``CheckpointManagerOptions`` (:mod:`jaxckpt.orbax._options`), and ``metadata``,
  ``item_names``, ``item_handlers``, ``logger`` and ``handler_registry`` are orbax's.

  ``logger=`` takes orbax's loggers, any object with ``log_entry(dict)``, or a
  callable taking the dict: one entry per event, each with ``event_type``,
  ``step``, ``directory`` and ``start_time`` (wall-clock seconds): ``"save"`` (``blocking_secs``,
  ``skipped_busy``, ``skipped_plan``, ``persist_lag_steps``,
  ``persist_lag_secs``), ``"snapshot"`` (``snapshot_secs``, ``nbytes``,
  ``snapshot_GBps``), ``"persist"`` (``persisted``, ``persist_secs``,
  ``nbytes``, ``persist_GBps``) and ``"restore"`` (``tier``, ``restore_secs``,
  ``nbytes``, ``restore_GBps``, ``skipped_steps``). Snapshot and persist entries
  come from the background thread. ``examples/metrics_tensorboard.py`` writes
  them to TensorBoard.
  """

  def __init__(self, directory: Any = None, options: Any = None, *,
               store: HostStore | None = None, metadata: Any = None, item_names: Any = None,
               item_handlers: Any = None, logger: Any = None,  # pylint: disable=redefined-outer-name
               handler_registry: Any = None) -> None:
    d = None if directory is None else os.fspath(directory)
    orbax_form = any(x is not None for x in (item_names, item_handlers, handler_registry))
    opts, rules = _options.translate(options, d, orbax_form=orbax_form)
    self._forms = _items.Forms(item_names, item_handlers)
    self._sink = _LogSink(logger, d)
    self._core = CoreManager(d, opts, rules=rules, store=store,
                             policy=_policies.from_options(opts), log_entry=self._sink,
                             already_exists=_errors.already_exists)
    self._root = _root.RootMetadata(d, metadata, rules, jax.process_index())

  @property
  def options(self) -> Any:
    """The manager's ``CheckpointOptions`` (orbax's options as translated)."""
    return self._core.options

  @property
  def stats(self) -> SaveStats:
    """Counters of the manager's saves."""
    return self._core.stats

  @property
  def last_restore(self) -> _read.RestoreInfo | None:
    """What the last ``restore()`` did: the step, the tier, seconds, bytes, skipped steps."""
    return self._core.last_restore

  @property
  def directory(self) -> epath.Path | None:
    """The checkpoint directory, as a path object (orbax's ``directory``), or None."""
    return None if self._core.directory is None else epath.Path(self._core.directory)

  # -- saving -----------------------------------------------------------------

  def save(self, step: int, state: Any = None, *, args: Any = None,
           metadata: dict[str, Any] | None = None, force: bool = False, metrics: Any = None,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """Starts a snapshot of ``state`` (or orbax's ``args=``) at ``step``; True if started.

    False (counted in ``stats``) when the save policy does not save ``step`` (it
    is off ``save_interval_steps``; or orbax's policy says no), or the job's save
    plan does not snapshot it. Every process of a job snapshots the same steps
    and persists the same ones (:mod:`jaxckpt.core._schedule`): in a job of
    several processes the plan spaces snapshots so that the previous copy is done
    when the next starts; in a one-process job a snapshot is skipped while the
    previous one is still being copied and ``on_busy="skip"`` (logged). A save
    that may not be skipped never is: one due for storage, one the job's plan
    takes, one with ``force=True``, and any with ``on_busy="wait"`` wait for the
    previous copy and a free slot (at
    most ``timeout_secs``, or ``busy_timeout_secs`` with ``on_busy="wait"``).
    Without ``persist_interval_steps`` the first snapshot is persisted, then the
    next ones as storage keeps up (planning.md); ``force=True`` snapshots ``step``
    whatever the interval and the plan say and persists it. A snapshot of ``step``
    drops held snapshots of steps >= ``step`` (a rolled back timeline).
    ``metrics`` are kept with the step (``best_fn`` ranks by them);
    ``custom_metadata`` is orbax's name of ``metadata``.

    Raises:
      StepAlreadyExistsError (a ValueError): ``step`` is on storage or on its way
        there (no two tiers hold different bytes under one step).
      SnapshotTimeoutError: a save that may not skip found no slot in time, naming why.
    """
    self._core.check_open("save")
    state, metadata = self._forms.save(state, args, _merged(metadata, custom_metadata))
    return self._core.save(step, state, metadata, force=force, metrics=metrics)

  def should_save(self, step: int) -> bool:
    """Whether ``save(step)`` now would save, exactly: the manager is open, the save
    policy saves ``step`` and the job's save plan snapshots it (storage-only: it is
    due for storage); in a one-process job with ``on_busy="skip"``, a step not due
    for storage is also refused while the previous snapshot is still being copied,
    or when no snapshot slot is free (persists hold them). A save that may not skip
    (due for storage, in a job of several processes, or ``on_busy="wait"``) is
    True: it waits, bounded."""
    return self._core.should_save(step)

  def prepare(self, state: Any) -> None:
    """Does now, before the loop, what the first save of ``state``'s layout would
    do while the loop waits: plans it, runs the packed gather once, touches every
    snapshot slot, and on accelerators warms the pinned host pool. Saves nothing."""
    self._core.prepare(state)

  def wait_until_finished(self, timeout_secs: float | None = None) -> None:
    """Blocks until every save so far has finished, as orbax's: the snapshot is
    committed and every step saved for storage is committed on storage, on every
    process of the job (else its error is raised; a timeout names who was late).
    :meth:`wait_until_snapshotted` waits for the host snapshot only."""
    self._core.wait_until_finished(timeout_secs)

  def wait_until_snapshotted(self, timeout_secs: float | None = None) -> None:
    """Blocks until the snapshot in flight is committed in host memory (not
    storage: see :meth:`wait_until_finished`); raises its error if it failed."""
    self._core.wait_until_snapshotted(timeout_secs)

  def wait_until_persisted(self, step: int | None = None,
                           timeout_secs: float | None = None) -> None:
    """Blocks until this manager's persist of ``step`` (default: its newest due
    snapshot) is committed on storage.

    Raises:
      StepExistsError: another writer committed ``step``; this one's was not stored.
      StorageError (or the jaxckpt error that fits): the persist failed.
      SnapshotTimeoutError: naming the processes whose part is missing on storage.
    """
    self._core.wait_until_persisted(step, timeout_secs)

  def is_saving_in_progress(self) -> bool:
    """Whether a save has not ended yet: its snapshot is being copied, or a step this
    manager saved for storage is still being persisted."""
    return self._core.is_saving_in_progress()

  def check_for_errors(self) -> None:
    """Raises the error of a background save that has ended, without waiting."""
    self._core.check_for_errors()

  # -- what is held -------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Restorable steps: the one being saved, those complete on every host that
    saved them, rebuildable from the survivors' parity (parity on), or on storage
    (as orbax's: those stored when this manager started, by itself since, or seen
    by ``reload()``), less those the keep policy dropped."""
    self._core.check_open("all_steps")
    return self._core.listing.all_steps()

  def latest_step(self) -> int | None:
    """The newest restorable step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The best kept step by ``best_fn``, else the newest; None if none has metrics
    (with ``best_fn``) or no step is held."""
    self._core.check_open("best_step")
    return self._core.listing.best_step()

  def metrics(self, step: int) -> Any:
    """The metrics given to ``save(step, ..., metrics=...)``, or None."""
    return self._core.listing.metrics(step)

  def reload(self) -> None:
    """Reads the steps again from every tier (orbax's ``reload``): steps another writer
    stored since this manager started are listed from now on."""
    self._core.reload()

  def protected_steps(self) -> list[int]:
    """Steps whose parity every host's agent holds in full (parity on), oldest first:
    each survives the loss of up to ``parity.parity`` hosts per parity group (the
    newest committed step becomes protected a little after its commit)."""
    return self._core.protected_steps()

  def is_protected(self, step: int) -> bool:
    """Whether ``step`` is protected by parity now (see :meth:`protected_steps`)."""
    return step in self.protected_steps()

  def wait_until_protected(self, step: int | None = None,
                           timeout_secs: float | None = None) -> None:
    """Blocks until ``step`` (default: this process's newest committed one) is protected.

    Raises:
      ValueError: parity is off.
      SnapshotTimeoutError, ParityError: naming the hosts that were late or failed, and why.
    """
    self._core.wait_until_protected(step, timeout_secs)

  def delete(self, step: int) -> None:
    """Deletes ``step`` from every tier, for good: this host's snapshot, its persist
    (a queued one never runs, a running one never commits) and, from process 0,
    storage. A read-only manager deletes nothing (logged).

    Raises:
      StepNotFoundError: no tier holds ``step``.
    """
    self._core.delete(step)

  # -- metadata -----------------------------------------------------------------

  def metadata(self, step: int | None = None) -> Any:
    """The structure of ``step``: every leaf's kind, shape, dtype and saving
    sharding, and the metadata saved with it, from the host tier when it holds the
    step, else from storage. Reads no array bytes. Without a step, orbax's root
    metadata (``RootMetadata``: ``CheckpointManager(metadata=...)``).

    Raises:
      StepNotFoundError: neither this host nor storage holds ``step``.
    """
    self._core.check_open("metadata")
    if step is None:
      return self._root.read()
    step = check_step(step, "metadata")
    tier, leaves, meta = self._core.listing.step_metadata(step)
    return _read.StepMetadata(
        step, tier, tree.nest(leaves) if leaves else {}, meta, leaves=leaves,
        item_metadata=self._forms.item_metadata(leaves, meta),
        custom_metadata=_items.user_metadata(meta), metrics=meta.get(METRICS_KEY) or {})

  def item_metadata(self, step: int) -> Any:
    """``metadata(step).item_metadata`` (orbax's older name)."""
    if step is None:
      raise errors.InvalidArgumentError(
          "item_metadata(step=None): item metadata exists per step; pass the step "
          "(metadata() without a step is the manager's root metadata)")
    return self.metadata(step).item_metadata

  # -- restoring ----------------------------------------------------------------

  def restore(self, step: int | None = None, target: Any = None, *, args: Any = None,
              partial: bool = False, directory: Any = None) -> Any:
    """Restores ``step`` (the newest when None) onto ``target``'s structure and shardings.

    ``target``: the abstract state (``jax.ShapeDtypeStruct`` leaves with
    ``sharding``, e.g. ``nnx.eval_shape``) or concrete arrays; numpy leaves come
    back as numpy. None: the saved tree as nested dicts and lists of numpy arrays,
    PRNG keys and scalars. ``partial=True``: any subset of the saved leaves, only
    those read. orbax's ``args=`` forms are taken too (:mod:`jaxckpt.orbax._items`),
    and ``directory=`` restores a step stored elsewhere.

    Raises:
      StepNotFoundError: no tier holds ``step``.
      StructureMismatchError: ``target`` does not match what was saved (the first
        mismatching path is named; nothing is restored).
      CorruptSnapshotError: a stored shard fails its checksum.
    """
    if directory is not None:
      self._core.check_open("restore")
      return self._restore_elsewhere(os.fspath(directory), step, target, args, partial)
    if args is None and target is not None:
      return self._core.restore(step, target, partial=partial)

    def onto(chosen: int, read: Any) -> Any:
      _, leaves, meta = self._core.listing.step_metadata(chosen)
      return self._forms.restore(args, target, partial, leaves, meta, read)
    return self._core.restore(step, target, partial=partial, onto=onto)

  def _restore_elsewhere(self, other: str, step: int | None, target: Any, args: Any,
                         partial: bool) -> Any:
    """``restore(..., directory=other)``: a step stored in another directory (storage only)."""
    if step is not None:
      step = check_step(step, "restore")
    steps = universal.stored_steps(other)
    if step is None:
      if not steps:
        raise errors.StepNotFoundError(f"restore(directory={other!r}): no steps are stored there")
      step = steps[-1]
    elif step not in steps:
      raise errors.StepNotFoundError(f"restore(step={step}, directory={other!r}): not stored there")
    source = _tiers.StorageSource(other, step)
    leaves = {r.path: _tiers.leaf_metadata(r) for r in source.leaves}

    def read(t: Any, p: bool) -> Any:
      out = _read.restore_tree(_tiers.StorageSource(other, step), t, partial=p)
      return tree.nest(out) if t is None else out
    return self._forms.restore(args, target, partial, leaves, dict(source.reader_.metadata), read)

  # -- preemption and lifecycle -------------------------------------------------

  def reached_preemption(self, step: int) -> bool:
    """True once a preemption notice (SIGTERM, or JAX's preemption service, the same
    step on every process) arrived: snapshot ``step`` and exit."""
    return self._core.reached_preemption(step)

  def close(self) -> None:
    """Waits for the snapshot in flight and the persists, then releases host memory.
    Idempotent."""
    self._core.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


class _LogSink:
  """``logger=``: orbax's ``AbstractLogger`` (anything with ``log_entry(dict)``) or a
  plain callable taking the dict, handed one entry per event: orbax's fields and
  jaxckpt's figures. A failing sink never fails a save (said once)."""

  def __init__(self, sink: Any, directory: str | None) -> None:
    self.sink, self.directory, self.failed = sink, directory, False

  def __call__(self, event: str, step: int, t0: float, **figures: Any) -> None:
    """``t0``, read from ``time.perf_counter``, becomes ``start_time`` in wall-clock seconds."""
    sink = self.sink
    if sink is None:
      return
    entry = {"event_type": event, "step": step, "directory": str(self.directory),
             "start_time": time.time() - (time.perf_counter() - t0), **figures}
    try:
      (sink.log_entry if hasattr(sink, "log_entry") else sink)(entry)
    except Exception as e:  # pylint: disable=broad-except  (a metrics sink never fails a save)
      if not self.failed:
        self.failed = True
        logger.warning("logger=%r failed on a %r entry (%s: %s); its entries go on, this "
                       "warning is said once", sink, event, type(e).__name__, e)


def _merged(metadata: dict[str, Any] | None,
            custom_metadata: dict[str, Any] | None) -> dict[str, Any] | None:
  """``metadata`` and orbax's ``custom_metadata`` (its name for it), as one dict."""
  if custom_metadata is None:
    return metadata
  if metadata is not None:
    raise errors.InvalidArgumentError(
        "save() got both metadata= and custom_metadata= (orbax's name for metadata=); pass one")
  return dict(custom_metadata)
