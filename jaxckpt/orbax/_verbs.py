"""orbax's CheckpointManager verbs on jaxckpt's manager, and the steps an orbax manager keeps.

:class:`OrbaxVerbs` is mixed into :class:`jaxckpt.CheckpointManager`: it holds what
orbax's manager adds to the tiers (the kept steps with their time and metrics, the
steps its preservation policy dropped, its items, the root metadata) and orbax's
verbs (``best_step``, ``metrics``, ``reload``, ``is_saving_in_progress``,
``check_for_errors``, ``item_metadata``, ``restore(directory=)``). The manager owns
the tiers; this class calls them through the manager's own methods.

A step dropped by the preservation policy (``max_to_keep``, ``keep_period``,
``best_fn``, ...) leaves ``all_steps()`` at once and is deleted from every tier
once its persist has ended: each process discards its host snapshot, process 0
the stored step. Every process decides the same: the policy is a function of the
kept steps, their metrics (given alike to every process's ``save()``) and their
times, which with a time-based policy are process 0's.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
import os
import threading
from typing import Any, Callable

import jax
import numpy as np
from etils import epath

from jaxckpt import errors, tree, universal
from jaxckpt.net import _kv
from jaxckpt.options import check_step
from jaxckpt.orbax import _items, _options
from jaxckpt.restore import _read, _tiers

logger = logging.getLogger(__name__)

TIME_KEY = _items.TIME_KEY          # a step's save time (seconds since the epoch), orbax managers
METRICS_KEY = _items.METRICS_KEY    # the metrics given to save(metrics=)
ROOT_METADATA = "root_metadata.json"   # CheckpointManager(metadata=...), beside the steps
_EPOCH = datetime.datetime.fromtimestamp(0, tz=datetime.timezone.utc)


@functools.lru_cache(maxsize=None)
def _already_exists_cls() -> type:
  from orbax.checkpoint import checkpoint_manager as ocm  # pylint: disable=import-outside-toplevel  (orbax's own error, so orbax code catches it)

  class StepAlreadyExistsError(errors.StepAlreadyExistsError, ocm.StepAlreadyExistsError):
    """jaxckpt's StepAlreadyExistsError that orbax's ``except`` catches too."""
  return StepAlreadyExistsError


def already_exists(message: str) -> Exception:
  """orbax's StepAlreadyExistsError (a ValueError), also jaxckpt's."""
  return _already_exists_cls()(message)


def _now() -> datetime.datetime:
  return datetime.datetime.now(tz=datetime.timezone.utc)


def _jsonable(metrics: Any) -> Any:
  """``metrics`` with numpy and jax scalars as Python numbers (JSON)."""
  return jax.tree.map(lambda x: np.asarray(x).item() if hasattr(x, "dtype") else x, metrics)


class OrbaxVerbs:
  """orbax's verbs and kept-step bookkeeping (see the module docstring)."""

  def _init_orbax(self, metadata: Any, item_names: Any, item_handlers: Any,
                  logger_: Any) -> None:
    self._forms = _items.Forms(item_names, item_handlers)
    self._orbax_logger = logger_
    self._infos: dict[int, _options.StepInfo] = {}   # kept steps (orbax's checkpoint infos)
    self._removed: set[int] = set()         # dropped by the preservation policy, to delete
    self._known: set[int] = set()           # stored steps this manager lists (others: reload())
    self._collect_lock = threading.Lock()
    self._unfinalized = False
    self._root_given = None if metadata is None else dict(metadata)
    if (self._rules.cleanup_tmp_directories and self._persist_config is not None
        and self._process[0] == 0):           # what crashed saves left (not what agents persist)
      universal.discard_uncommitted(self._dir, keep=set(self._store.steps()) | set(
          self._store.persist_status().pending))
    self._load()
    self._write_root_metadata()

  @property
  def directory(self) -> epath.Path | None:
    """The checkpoint directory, as a path object (orbax's ``directory``), or None."""
    return None if self._dir is None else epath.Path(self._dir)

  # -- the kept steps -------------------------------------------------------

  def _load(self) -> None:
    """The steps held now, with their time and metrics (what orbax reads at start).
    Steps dropped by the preservation policy stay dropped (deleted once persisted)."""
    self._known = set(_tiers.storage_steps(self._dir))
    steps = (set(self.all_steps()) | self._known) - self._removed
    self._infos = ({s: self._read_info(s) for s in sorted(steps)} if self._rules.orbax else {})

  def _read_info(self, step: int) -> _options.StepInfo:
    try:
      meta = self._core_metadata(step)[2]
    except (errors.StepNotFoundError, errors.CorruptSnapshotError, errors.ManifestError) as e:
      logger.warning("step %d: its time and metrics cannot be read (%s)", step, e)
      return _options.StepInfo(step, _EPOCH, None)
    t = meta.get(TIME_KEY)
    when = _EPOCH if t is None else datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc)
    return _options.StepInfo(step, when, meta.get(METRICS_KEY))

  def _in_flight(self) -> set[int]:
    """The step whose snapshot is being taken, if any."""
    pending = self._pending
    return {self._pending_step} if pending is not None and not pending.done() else set()

  def _listed(self, flight: set[int], held: set[int], stored: list[int]) -> list[int]:
    """``all_steps()`` from the step in ``flight``, those the host tier ``held`` and those
    ``stored``: another writer's stored steps once ``reload()`` saw them and (orbax's
    options) every step this manager saved whose persist has not failed, as orbax lists a
    step from its save on (another process may commit it a little later), less the
    steps the preservation policy dropped."""
    mine = set(self._persists.by_step)
    self._known.update(held)
    self._known.intersection_update(set(stored) | held | flight | mine)   # gone: forgotten
    listed = flight | held | self._known.intersection(stored)
    if self._rules.orbax:
      told = self._persists.told
      listed |= {s for s, a in self._persists.by_step.items() if a not in told}
    else:                             # metrics of steps no tier holds any more
      for s in set(self._infos) - listed:
        del self._infos[s]
    return sorted(listed - self._removed)

  def _kept(self) -> list[_options.StepInfo]:
    return [self._infos[s] for s in sorted(self._infos) if s not in self._removed]

  def reload(self) -> None:
    """Reads the steps again from every tier (orbax's ``reload``): steps another writer
    stored since this manager started are listed from now on."""
    self._check_open("reload")
    self.wait_until_snapshotted()
    self._collect()
    self._load()

  def _record(self, step: int, metadata: dict[str, Any] | None,
              metrics: Any) -> dict[str, Any] | None:
    """``metadata`` with the step's time (orbax managers) and metrics; notes the step kept."""
    when = _now()
    if self._rules.uses_time and self._process[1] > 1:    # one time for the job: process 0's
      when = datetime.datetime.fromtimestamp(float(_kv.broadcast_from_0(
          f"save_time/{step}", lambda: repr(when.timestamp()),
          timeout_secs=self.options.timeout_secs)), tz=datetime.timezone.utc)
    if metrics is not None:
      metrics = _jsonable(metrics)
    self._removed.discard(step)
    self._known.add(step)
    if not self._rules.orbax and metrics is None:
      return metadata                 # jaxckpt's options: nothing to rank the step by
    self._infos[step] = _options.StepInfo(step, when, metrics)
    out = dict(metadata or {})
    out[TIME_KEY] = when.timestamp()
    if metrics is not None and self._rules.write_metrics:
      out[METRICS_KEY] = metrics
    return out

  def _saved(self, step: int, started: bool, t0: float) -> bool:
    """After ``save(step)``: the steps the preservation policy drops, a blocking save's
    wait (``enable_async_checkpointing=False``), the logger's entry."""
    if not started:
      self._infos.pop(step, None)
      return False
    self._unfinalized = True
    if self._rules.to_remove is not None:
      dropped = self._rules.to_remove(self._kept())
      self._removed.update(dropped)
      for s in dropped:
        self._infos.pop(s, None)
    if self._rules.blocking:
      self.wait_until_finished()
    else:
      self._collect()
    st = self.stats
    self._log_entry("save", step, t0, blocking_secs=time.perf_counter() - t0,
                    skipped_busy=st.skipped_busy, skipped_plan=st.skipped_plan,
                    persist_lag_steps=st.persist_lag_steps, persist_lag_secs=st.persist_lag_secs)
    return True

  def _finalized(self) -> None:
    """Every save so far has ended: the dropped steps go, and orbax's
    ``post_finalization_callback`` runs (once per saves since the last time)."""
    self._collect(all_ended=True)
    if self._unfinalized and self._rules.on_finalized is not None:
      self._unfinalized = False
      self._rules.on_finalized()

  def _collect(self, *, all_ended: bool = False) -> None:
    """Deletes the dropped steps whose persist has ended, from every tier."""
    if not self._removed:
      return
    with self._collect_lock:
      busy = self._in_flight() | (set() if all_ended else set(self._store.persist_status().pending))
      for step in sorted(self._removed - busy):
        self._delete_everywhere(step)
        self._removed.discard(step)
        self._known.discard(step)

  def _orbax_should_save(self, step: int) -> bool:
    """orbax's ``should_save``: not read-only, newer than the newest kept step, and the
    save decision policy's answer."""
    if self._rules.read_only:
      logger.warning("%s is read only: save(%d) is skipped", self._dir, step)
      return False
    kept = self._kept()
    if kept and kept[-1].step >= step:
      return False
    saving = self._rules.asks_progress and self.is_saving_in_progress()   # (an agent request)
    return self._rules.should_save(step, kept, saving, self.reached_preemption(step))

  def _orbax_may_save(self, step: int, force: bool) -> bool:
    """Whether an orbax manager saves ``step`` (``force`` skips the policy, never the
    existing step: StepAlreadyExistsError, as orbax)."""
    if self._rules.read_only:
      return self._orbax_should_save(step)
    if not force and not self._orbax_should_save(step):
      return False
    if step in {i.step for i in self._kept()}:
      raise already_exists(
          f"Checkpoint for step {step} already exists (save(step={step})): a step is saved "
          f"once; delete({step}) it first to save it again")
    return True

  # -- verbs ------------------------------------------------------------------

  def best_step(self) -> int | None:
    """The best kept step by ``best_fn`` (orbax's options), else the newest; None if none
    has metrics (with ``best_fn``) or no step is held."""
    if self._rules.best_key is None:
      return self.latest_step()
    with_metrics = [i for i in self._kept() if i.metrics is not None]
    if not with_metrics:
      return None
    ranked = sorted(with_metrics, key=lambda i: self._rules.best_key(i.metrics),
                    reverse=self._rules.best_min)
    return ranked[-1].step

  def metrics(self, step: int) -> Any:
    """The metrics given to ``save(step, ..., metrics=...)``, or None."""
    info = self._infos.get(step)
    if info is not None and info.metrics is not None:
      return info.metrics
    try:
      return self._core_metadata(step)[2].get(METRICS_KEY)
    except errors.StepNotFoundError:
      return None

  def is_saving_in_progress(self) -> bool:
    """Whether a save has not ended yet: its snapshot is being copied, or a step this
    manager saved for storage is still being persisted."""
    if self._in_flight():
      return True
    if self._persist_config is None:
      return False
    own = set(self._persists.by_step)
    return bool(own & set(self._store.persist_status().pending))

  def check_for_errors(self) -> None:
    """Raises the error of a background save that has ended, without waiting."""
    self._check_open("check_for_errors")
    self._raise_background_error()

  def item_metadata(self, step: int) -> Any:
    """``metadata(step).item_metadata`` (orbax's older name)."""
    if step is None:
      raise errors.InvalidArgumentError(
          "item_metadata(step=None): item metadata exists per step; pass the step "
          "(metadata() without a step is the manager's root metadata)")
    return self.metadata(step).item_metadata

  # -- metadata ---------------------------------------------------------------

  def metadata(self, step: int | None = None) -> Any:
    """The structure of ``step``: every leaf's kind, shape, dtype and saving
    sharding, and the metadata saved with it, from the host tier when it holds the
    step, else from storage. Reads no array bytes. Without a step, orbax's root
    metadata (``RootMetadata``: ``CheckpointManager(metadata=...)``).

    Raises:
      StepNotFoundError: neither this host nor storage holds ``step``.
    """
    self._check_open("metadata")
    if step is None:
      return self._root_metadata()
    step = check_step(step, "metadata")
    return self._step_metadata(step, *self._core_metadata(step))

  def _core_metadata(self, step: int) -> tuple[str, dict[str, _read.LeafMetadata], dict]:
    """The tier that describes ``step``, its leaves by path and its metadata."""
    if step == self._pending_step:
      self.wait_until_snapshotted()          # the step being saved: once it is held
    return _tiers.step_metadata(self._store, self._dir, step)


  def _step_metadata(self, step: int, tier: str, leaves: dict[str, Any],
                     meta: dict[str, Any]) -> _read.StepMetadata:
    return _read.StepMetadata(
        step, tier, tree.nest(leaves) if leaves else {}, meta, leaves=leaves,
        item_metadata=self._forms.item_metadata(leaves, meta),
        custom_metadata=_items.user_metadata(meta), metrics=meta.get(METRICS_KEY) or {})

  def _write_root_metadata(self) -> None:
    """``CheckpointManager(metadata=...)``: written once (a later manager's is ignored),
    by process 0, unless read-only or ``save_root_metadata=False``."""
    if (self._root_given is None or self._dir is None or self._rules.read_only
        or not self._rules.save_root_metadata or self._process[0] != 0):
      return
    if universal.read_json(self._dir, ROOT_METADATA) is None:
      universal.write_json(self._dir, ROOT_METADATA, {"custom_metadata": self._root_given})

  def _root_metadata(self) -> Any:
    """orbax's ``RootMetadata``: the stored root metadata, else the given one (read-only
    managers and ``save_root_metadata=False`` never store it)."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel  (orbax's own type, only for its users)
    stored = None if self._dir is None else universal.read_json(self._dir, ROOT_METADATA)
    if stored is not None:
      return ocp.metadata.RootMetadata(custom_metadata=stored.get("custom_metadata") or {})
    given = self._root_given if self._rules.read_only or self._dir is None else None
    return ocp.metadata.RootMetadata(custom_metadata=dict(given or {}))

  def _restore_forms(self, step: int | None, target: Any, args: Any, partial: bool) -> Any:
    """A restore of orbax's ``args`` (or as saved): the step's items read onto their targets
    (step None: the newest that can be restored, a damaged one skipped as ``_read`` does)."""
    def onto(chosen: int, read: Any) -> Any:
      _, leaves, meta = self._core_metadata(chosen)
      return self._forms.restore(args, target, partial, leaves, meta, read)
    if step is None:
      return self._read(None, target, partial, onto=onto)
    step, _ = _tiers.choose_step(self._store, self._dir, step,   # the job's, on its tiers
                                 timeout_secs=self.options.timeout_secs)
    return onto(step, lambda t, p: self._read(step, t, p))

  # -- another directory ------------------------------------------------------

  def _restore_elsewhere(self, directory: Any, step: int | None, target: Any, args: Any,
                         partial: bool) -> Any:
    """``restore(..., directory=other)``: a step stored in another directory (storage only)."""
    other = os.fspath(directory)
    if step is None:
      steps = universal.all_steps(other)
      if not steps:
        raise errors.StepNotFoundError(f"restore(directory={other!r}): no steps are stored there")
      step = steps[-1]
    elif step not in universal.all_steps(other):
      raise errors.StepNotFoundError(f"restore(step={step}, directory={other!r}): not stored there")
    source = _tiers.StorageSource(other, step)
    leaves = {r.path: _tiers.leaf_metadata(r) for r in source.leaves}

    def read(t: Any, p: bool) -> Any:
      out = _read.restore_tree(_tiers.StorageSource(other, step), t, partial=p)
      return tree.nest(out) if t is None else out
    return self._forms.restore(args, target, partial, leaves, dict(source.reader_.metadata), read)

  def _log_entry(self, event: str, step: int, t0: float, *,
                 clock: Callable[[], float] = time.perf_counter, **figures: Any) -> None:
    """Hands ``logger=`` (orbax's ``AbstractLogger``: anything with ``log_entry(dict)``,
    or a plain callable taking the dict) one entry: orbax's fields, and jaxckpt's
    figures of the event (see :func:`jaxckpt.manager.CheckpointManager`). ``t0``, read
    from ``clock``, becomes ``start_time`` in wall-clock seconds, as orbax's."""
    sink = self._orbax_logger
    if sink is None:
      return
    entry = {"event_type": event, "step": step, "directory": str(self._dir),
             "start_time": time.time() - (clock() - t0), **figures}
    try:
      (sink.log_entry if hasattr(sink, "log_entry") else sink)(entry)
    except Exception as e:  # pylint: disable=broad-except  (a metrics sink never fails a save)
      if not getattr(self, "_logger_failed", False):
        self._logger_failed = True
        logger.warning("logger=%r failed on a %r entry (%s: %s); its entries go on, this "
                       "warning is said once", sink, event, type(e).__name__, e)

