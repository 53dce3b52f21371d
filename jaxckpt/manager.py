"""CheckpointManager: the one place that knows every tier and picks among them."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any

import jax
import numpy as np

from etils import epath

from jaxckpt import capture, errors, tree, universal
from jaxckpt.capture import _storage_only
from jaxckpt.orbax import _options as _orbax_options
from jaxckpt.orbax import _verbs
from jaxckpt.orbax._verbs import OrbaxVerbs
from jaxckpt.util import _preemption, _wait
from jaxckpt.agent import _factory
from jaxckpt.host import _persist
from jaxckpt.host.store import HostStore
from jaxckpt.options import default_copy_threads
from jaxckpt.restore import _read, _tiers

logger = logging.getLogger(__name__)

# on_busy="skip" waits this fraction of the loop's time since the last save (at most
# SKIP_GRACE_MAX_SECS) for a copy that is nearly done before it skips a save.
SKIP_GRACE_FRACTION = 0.1
SKIP_GRACE_MAX_SECS = 0.05


@dataclasses.dataclass
class SaveStats:
  """Counters of a manager's saves (``mgr.stats``)."""

  started: int = 0
  committed: int = 0
  skipped_busy: int = 0
  skipped_interval: int = 0
  last_blocking_secs: float = 0.0
  last_snapshot_secs: float = 0.0      # save() call to committed snapshot
  last_nbytes: int = 0
  #: why saves were skipped (``skipped_busy`` in all), by reason
  skip_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
  #: persists queued or running in the store (their slots are held), as of the last commit
  persists_pending: int = 0
  oldest_unpersisted_step: int | None = None
  persist_lag_steps: int = 0           # newest committed step - oldest unpersisted one
  persist_lag_secs: float = 0.0        # how long the oldest unpersisted step has waited
  agent_restarts: int = 0              # dead snapshot agents replaced by a new one


class CheckpointManager(OrbaxVerbs):
  """Snapshots a training state every step and restores it from the fastest tier.

  >>> import jax.numpy as jnp, jaxckpt as jc
  >>> with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as mgr:
  ...   mgr.save(1, {"w": jnp.ones(4)})
  ...   mgr.wait_until_finished()
  ...   mgr.restore(target={"w": jnp.zeros(4)})["w"].tolist()
  True
  [1.0, 1.0, 1.0, 1.0]

  ``save()`` returns as soon as the device-to-host copies are dispatched; a
  background thread completes them into a preallocated host slot, with a
  checksum per shard, and commits the step. ``restore()`` verifies every
  checksum before anything is returned and reports what it did in
  ``last_restore``.

  orbax's manager is this one with orbax's arguments: ``options`` may be an
  ``ocp.CheckpointManagerOptions`` (orbax's meaning: :mod:`jaxckpt.orbax._options`),
  and ``metadata`` (the root metadata, written once), ``item_names``,
  ``item_handlers`` and ``logger`` are orbax's (``handler_registry`` is accepted:
  jaxckpt needs no handlers).
  """

  def __init__(self, directory: Any = None, options: Any = None, *,
               store: HostStore | None = None, metadata: Any = None, item_names: Any = None,
               item_handlers: Any = None, logger: Any = None,  # pylint: disable=redefined-outer-name
               handler_registry: Any = None) -> None:
    del handler_registry          # orbax's handlers: jaxckpt saves every item kind itself
    self.options, self._rules = _orbax_options.translate(options)
    self._dir = None if directory is None else os.fspath(directory)
    if self._dir is None and self._rules.orbax:
      raise errors.InvalidArgumentError(
          "CheckpointManager(options=ocp.CheckpointManagerOptions(...)) needs the directory, "
          "as orbax's: CheckpointManager('/path/or/s3://bucket/run', options)")
    self.options.check_directory(self._dir)
    self._persist_config = self._run_id = None
    if self._dir is not None and not self._rules.read_only:   # read-only: nothing is written
      if self._rules.create or os.path.isdir(self._dir) or "://" in self._dir:
        _persist.check_directory(self._dir, timeout_secs=self.options.timeout_secs)
      self._persist_config = _persist.PersistConfig(
          self._dir, self.options.persist_interval_steps or self.options.save_interval_steps,
          self.options.max_to_keep, self.options.timeout_secs,
          hold_until_committed=self.options.parity is not None)
      self._run_id = _factory.agree_run_id(self.options.timeout_secs)
    self._process = (jax.process_index(), jax.process_count())
    self._persists = _persist.Attempts(
        self._persist_config, self._run_id, self._process,
        "the in-process store" if self.options.agent is None else "the snapshot agent")
    self._store = store or _factory.make_store(self.options, self._persist_config)
    if store is not None and self._persist_config is not None:
      store.persist_to(self._persist_config)   # every store persists what it holds
    if store is None and self.options.agent is not None and jax.process_count() > 1:
      self._store.discover(timeout_secs=self.options.timeout_secs)
      self._store.recover_persists(jax.process_index())
    self._planner = capture.Planner()
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-save")
    threads = self.options.copy_threads or default_copy_threads()
    self._copy_pool = None if threads == 1 else concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix="jaxckpt-copy")
    self._pending: concurrent.futures.Future | None = None
    self._error: BaseException | None = None
    self._lock = threading.Lock()
    self._closed = False
    self.stats = SaveStats()
    self._lag_warn_at = 2               # persists pending that get a warning (doubles each time)
    self._last_save_at = time.perf_counter()
    self.last_restore: _read.RestoreInfo | None = None
    self._preemption = _preemption.Notice(install=self.options.handle_sigterm,
                                          grace_secs=self.options.sigterm_grace_secs,
                                          on_deadline=self._close_before_exit)
    self._init_orbax(metadata, item_names, item_handlers, logger)

  @property
  def directory(self) -> epath.Path | None:
    """The checkpoint directory, as a path object (orbax's ``directory``), or None."""
    return None if self._dir is None else epath.Path(self._dir)

  # -- saving ---------------------------------------------------------------

  def save(self, step: int, state: Any = None, *, args: Any = None,
           metadata: dict[str, Any] | None = None, force: bool = False, metrics: Any = None,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """Starts a snapshot of ``state`` at ``step``; returns True if one was started.

    orbax's forms are taken too, so an orbax loop ports with only its manager's
    construction changed: ``args=ocp.args.StandardSave(state)`` (and the other
    args, ``Composite`` included), ``metrics=`` (kept with the step: ``best_fn``
    ranks by them) and ``custom_metadata=`` (orbax's name of ``metadata``).

    Returns False (and counts it in ``stats``) when ``step`` is off the save
    interval or the previous snapshot is still being copied and
    ``on_busy="skip"`` (logged at WARNING with the running count). A save due
    for storage is never skipped: it waits for the previous snapshot (at most
    ``timeout_secs``; SnapshotTimeoutError names the step and what was late).
    A snapshot of ``step`` discards held snapshots of steps >= ``step`` (they
    belong to a timeline that was rolled back). With orbax's options, orbax
    decides which steps are saved (and a step is saved once).

    Raises:
      StepAlreadyExistsError (a ValueError): ``step`` is on storage or on its way
        there (so no two tiers ever hold different bytes under one step), or,
        with orbax's options, held at all.
    """
    t0 = time.perf_counter()
    self._check_open("save")
    state, metadata = self._forms.save(state, args, _merged(metadata, custom_metadata))
    self._raise_background_error(ask_agent=False)
    step = check_step(step, "save")
    if self._rules.orbax:
      if not self._orbax_may_save(step, force):
        return False
    elif not force and step % self.options.save_interval_steps:
      self.stats.skipped_interval += 1
      return False
    persist_due = self._persist_due(step)
    self._refuse_existing(step)
    metadata = self._record(step, metadata, metrics)
    if not self.options.host_snapshots:
      return self._saved(step, persist_due and self._save_to_storage(step, state, metadata, t0),
                         t0)
    if not self._wait_for_previous(step):   # before any per-leaf work: skips stay cheap
      return self._saved(step, False, t0)
    leaves, _ = tree.flatten(state)
    plan = self._planner.plan(leaves)
    slot = self._store.reserve(step, plan.nbytes, timeout_secs=self._reserve_timeout(step))
    self.stats.agent_restarts = self._store.restarts
    if slot is None:
      self._no_slot(step, persist_due)
      return self._saved(step, False, t0)
    try:
      sources = capture.start(leaves, plan)
    except BaseException:
      self._store.abort(slot)
      raise
    attempt = self._persists.new(step) if persist_due else None
    self._pending_step = step
    self._pending = self._pool.submit(self._complete, step, plan, sources, slot,
                                      metadata, t0, attempt)
    self._last_save_at = t0
    self.stats.started += 1
    self.stats.last_blocking_secs = time.perf_counter() - t0
    return self._saved(step, True, t0)

  def _no_slot(self, step: int, due: bool) -> None:
    """A save found no free slot: skipped if not due for storage, else raises."""
    status = self._store.persist_status()
    if status.pending:
      age = time.time() - status.oldest_since if status.oldest_since else 0.0
      held = (f"every slot is held: persists of steps {list(status.pending)} to "
              f"{self._dir!r} have not ended (the oldest was committed {age:.1f} s ago)")
    else:
      held = ("every slot is held by a committed step: one a restore still reads, or the "
              "newest step protected by parity, kept until a newer one is protected")
    if due:
      raise errors.SnapshotTimeoutError(
          f"save(step={step}): the step is due for storage but no slot of "
          f"{self._persists.where} freed up within {self._reserve_timeout(step)} s: {held}; "
          "storage is slower than the loop: persist less often (persist_interval_steps), keep "
          "more snapshots (max_snapshots) or wait longer (timeout_secs)")
    self._skip_busy(step, "no snapshot slot is free (persists in flight)" if status.pending
                    else "no snapshot slot is free", detail=held)

  def _save_to_storage(self, step: int, state: Any, metadata: dict[str, Any] | None,
                       t0: float) -> bool:
    """A storage-only save (``host_snapshots=False``): see :mod:`jaxckpt.capture._storage_only`."""
    leaves, _ = tree.flatten(state)
    attempt = self._persists.new(step)
    try:
      staged = _storage_only.save(
          self._dir, step, leaves, self._planner,
          budget=self.options.host_memory_limit_bytes or _storage_only.DEFAULT_STAGING_BYTES,
          attempt=attempt, process=self._process, metadata=metadata,
          timeout_secs=self.options.timeout_secs, max_to_keep=self.options.max_to_keep)
    except BaseException:
      _persist.discard_quietly(self._dir, step, attempt)   # what it wrote is unreachable
      raise
    self._persists.on_storage.add(step)
    self.stats.started += 1
    self.stats.committed += 1
    self.stats.last_blocking_secs = self.stats.last_snapshot_secs = time.perf_counter() - t0
    self.stats.last_nbytes = staged
    return True

  def prepare(self, state: Any) -> None:
    """Does now, before the first save, what the first save of ``state``'s layout
    would otherwise do while the training loop waits.

    Plans the layout, compiles and runs the packed gather once, allocates and
    touches every snapshot slot of the in-process store, and on accelerators
    grows the pinned host memory pool with one transfer of each leaf (the
    first transfers into a cold pool run at ~1 GB/s). Saves nothing; call it
    with the initial state (concrete arrays) before the loop.
    """
    self._check_open("prepare")
    leaves, _ = tree.flatten(state)
    plan = self._planner.plan(leaves, wait=True)
    capture.warm_up(leaves, plan)
    self._store.preallocate(plan.nbytes)

  def _reserve_timeout(self, step: int) -> float:
    if self.options.on_busy == "wait":
      return self.options.busy_timeout_secs
    return self.options.timeout_secs if self._persist_due(step) else 0.0

  def _wait_for_previous(self, step: int) -> bool:
    pending = self._pending
    if pending is None or pending.done():
      return True
    due = self._persist_due(step)
    if self.options.on_busy == "skip" and not due:
      if self._done_within_grace(pending):
        self._raise_background_error(ask_agent=False)
        return True
      self._skip_busy(step, "the previous snapshot is still being copied")
      return False
    self._wait(pending, self._reserve_timeout(step),
               f"save of step {step}" + (" (due for storage: never skipped)" if due else ""))
    self._raise_background_error(ask_agent=False)
    return True

  def _done_within_grace(self, pending: concurrent.futures.Future) -> bool:
    """Waits for a copy that is nearly done, at most a tenth of the time the loop
    took since the last save (a loaded machine's jitter, not a stall)."""
    grace = min(SKIP_GRACE_FRACTION * (time.perf_counter() - self._last_save_at),
                SKIP_GRACE_MAX_SECS)
    done, _ = concurrent.futures.wait([pending], timeout=max(grace, 0.0))
    return bool(done)

  def _persist_due(self, step: int) -> bool:
    """Whether a save of ``step`` is due for storage (such a save is never skipped)."""
    c = self._persist_config
    return c is not None and step % c.interval_steps == 0

  def _skip_busy(self, step: int, why: str, detail: str = "") -> None:
    self.stats.skipped_busy += 1
    self.stats.skip_reasons[why] = self.stats.skip_reasons.get(why, 0) + 1
    logger.warning("step %d: save skipped: %s (%d skipped so far; saves due for storage wait "
                   "instead)", step, detail or why, self.stats.skipped_busy)

  def _note_persist_lag(self, step: int) -> None:
    """Updates ``stats``' persist lag after ``step`` committed; logs when it grows."""
    status = self._store.persist_status(ask=False)
    st = self.stats
    st.persists_pending = len(status.pending)
    st.oldest_unpersisted_step = status.pending[0] if status.pending else None
    st.persist_lag_steps = step - status.pending[0] if status.pending else 0
    st.persist_lag_secs = (time.time() - status.oldest_since) if status.oldest_since else 0.0
    if st.persists_pending >= self._lag_warn_at:
      self._lag_warn_at *= 2
      logger.warning(
          "storage is slower than the loop: %d persists to %s are queued (oldest step %d, "
          "%.1f s and %d steps behind); while their slots are held, saves not due for storage "
          "are skipped and due ones wait", st.persists_pending, self._dir,
          st.oldest_unpersisted_step, st.persist_lag_secs, st.persist_lag_steps)

  def should_save(self, step: int) -> bool:
    """Whether ``save(step)`` now would save, exactly: the manager is open,
    ``step`` is on the save interval and, storage-only, due for storage; with
    host snapshots, a step not due for storage is also refused while
    ``on_busy="skip"`` and the previous snapshot is still being copied, or when
    no snapshot slot is free (persists hold them). A save due for storage is
    never skipped (it waits), so it is always True for one. With orbax's
    options: orbax's ``should_save`` (read-only, newer than the newest step, and
    the save decision policy).
    """
    step = check_step(step, "should_save")
    if self._rules.orbax:
      return not self._closed and self._orbax_should_save(step)
    if self._closed or step % self.options.save_interval_steps:
      return False
    due = self._persist_due(step)
    if due or not self.options.host_snapshots:
      return due
    pending = self._pending
    if pending is not None and not pending.done():
      if self.options.on_busy == "wait":
        return True                   # waits for it, then for a slot (bounded)
      if not self._done_within_grace(pending):
        return False
    return self.options.on_busy == "wait" or self._store.has_free_slot()

  def _refuse_existing(self, step: int) -> None:
    """Raises StepAlreadyExistsError if ``step`` is committed on storage or on its way
    there: a step saved again never leaves two tiers holding different bytes."""
    known = self._persists.on_storage.union(self._persists.by_step)
    if self._dir is None or step not in known:
      return
    if step in _tiers.storage_steps(self._dir):
      where = (f"is already committed in {self._dir!r} (persist attempt "
               f"{universal.committed_by(self._dir, step)!r})")
    elif step in self._store.persist_status(ask=False).pending:
      where = "is already being persisted (its first save)"
    else:                                     # deleted since (gc, delete), or never stored
      self._persists.on_storage.discard(step)
      return
    raise _verbs.already_exists(
        f"save(step={step}): step {step} {where}; a step is saved once (no two tiers may hold "
        f"different bytes under one step), so nothing was saved. Delete it first "
        f"(mgr.delete({step})), or save another step")

  def _complete(self, step, plan, sources, slot, metadata, t0, attempt) -> None:
    try:
      every = self._store.progress_bytes
      manifest = capture.complete(
          plan, sources, slot.buffer, step=step, process_index=self._process[0],
          process_count=self._process[1], metadata=metadata,
          on_progress=None if every is None else functools.partial(self._store.written, slot),
          progress_bytes=every or 0, pool=self._copy_pool)
      del sources                     # release the device-buffer views at once
      self._store.commit(slot, manifest, persist_attempt=attempt)
    except BaseException as e:  # surfaced by the next save / wait
      self._store.abort(slot)
      logger.exception("step %d: snapshot failed", step)
      with self._lock:
        self._error = e
      return
    self.stats.committed += 1
    self.stats.last_snapshot_secs = time.perf_counter() - t0
    self.stats.last_nbytes = plan.nbytes
    if self._persist_config is not None:
      self._note_persist_lag(step)
    logger.debug("step %d: snapshot committed (%d bytes)", step, plan.nbytes)

  def wait_until_finished(self, timeout_secs: float | None = None) -> None:
    """Blocks until every save so far has finished as orbax's would have: the
    snapshot in flight is committed and, with a directory, every step saved for
    storage is on storage (or its persist failed: its error is raised).

    :meth:`wait_until_snapshotted` is the cheaper wait, for the host snapshot only.
    """
    timeout = timeout_secs or self.options.timeout_secs
    self.wait_until_snapshotted(timeout)
    if self._persist_config is not None and self.options.host_snapshots:
      self._persists.wait_ended(self._store, timeout, "wait_until_finished")
    self._finalized()

  def wait_until_snapshotted(self, timeout_secs: float | None = None) -> None:
    """Blocks until the snapshot in flight is committed in host memory (not
    storage: see :meth:`wait_until_finished`); raises its error if it failed."""
    if self._pending is not None:
      self._wait(self._pending, timeout_secs or self.options.timeout_secs,
                 "wait_until_snapshotted")
    self._raise_background_error()

  def _wait(self, fut: concurrent.futures.Future, timeout: float, what: str) -> None:
    try:
      fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
      raise errors.SnapshotTimeoutError(
          f"{what}: the background snapshot copy of process {self._process[0]} "
          f"did not finish within {timeout} s") from None

  def _raise_background_error(self, *, ask_agent: bool = True) -> None:
    with self._lock:
      err, self._error = self._error, None
    if err is not None:
      raise err
    self._persists.raise_errors(self._store, ask_agent=ask_agent)

  # -- what is held ---------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Restorable steps: the one being saved, those complete on every host that
    saved them, rebuildable from the survivors' parity (parity on), or on storage
    (as orbax's: those stored when this manager started, by itself since, or seen
    by ``reload()``), less those the preservation policy dropped."""
    self._check_open("all_steps")
    pending = self._pending
    flight = {self._pending_step} if pending is not None and not pending.done() else set()
    held = _tiers.complete_steps(self._store)
    rebuilt = _tiers.rebuildable_steps(held, self._store) if self.options.parity else []
    self._known.update(held, rebuilt)
    stored = self._known.intersection(_tiers.storage_steps(self._dir))
    return sorted((flight | set(held) | set(rebuilt) | stored | self._saved_steps())
                  - self._removed)

  def wait_until_persisted(self, step: int | None = None,
                           timeout_secs: float | None = None) -> None:
    """Blocks until this manager's persist of ``step`` (default: its newest due
    snapshot) is committed on storage.

    Raises:
      StepExistsError: another writer (another job, or this one before a
        rollback) committed ``step``; this manager's data was not stored.
      StorageError (or the jaxckpt error that fits): the persist failed; the
        message names the path, the cause and the process.
      SnapshotTimeoutError: naming the processes whose part of the step is
        missing on storage.
    """
    self._check_open("wait_until_persisted")
    if self._dir is None:
      raise errors.InvalidArgumentError(
          "wait_until_persisted(): this manager has no directory; pass "
          "CheckpointManager(directory=...) to persist")
    if step is not None:
      step = check_step(step, "wait_until_persisted")
    self.wait_until_snapshotted()
    if step is None and not self._persists.by_step:
      return
    step = max(self._persists.by_step) if step is None else step
    self._persists.wait_stored(self._store, step, timeout_secs or self.options.timeout_secs)

  def protected_steps(self) -> list[int]:
    """Steps whose parity every host's agent holds in full (parity on), oldest first.

    A protected step survives the loss of up to ``parity.parity`` hosts per
    parity group. Agents exchange parity in the background after each commit,
    so the newest committed step becomes protected a little later.
    """
    self._check_open("protected_steps")
    return _tiers.protected_steps(self._store)

  def is_protected(self, step: int) -> bool:
    """Whether ``step`` is protected by parity now (see :meth:`protected_steps`)."""
    return step in self.protected_steps()

  def wait_until_protected(self, step: int | None = None,
                           timeout_secs: float | None = None) -> None:
    """Blocks until ``step`` (default: this process's newest committed one) is protected.

    Raises:
      ValueError: parity is off.
      SnapshotTimeoutError: naming the hosts whose parity was late, and why.
      ParityError: a host's parity of ``step`` failed (it is never retried), naming why.
    """
    if self.options.parity is None:
      raise errors.InvalidArgumentError("wait_until_protected(): parity is off; set "
                       "CheckpointOptions(parity=jaxckpt.ParityOptions(...))")
    self.wait_until_snapshotted()
    if step is None:
      held = self._store.steps()
      if not held:
        return
      step = held[-1]
    timeout = timeout_secs or self.options.timeout_secs
    _tiers.wait_protected(self._store, step, timeout_secs=timeout)

  def latest_step(self) -> int | None:
    """The newest restorable step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

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
    if step == self._pending_step:
      self.wait_until_snapshotted()          # the step being saved: once it is held
    return _tiers.step_metadata(self._store, self._dir, step)

  def delete(self, step: int) -> None:
    """Deletes ``step`` from every tier, for good: this host's snapshot (a
    restore reading it keeps its copy until done), its persist (a queued one
    never runs, a running one never commits: delete waits for it to end) and,
    from process 0, storage. No tier holds it afterwards, nor commits it later.

    A read-only manager (orbax's ``read_only``) deletes nothing (logged).

    Raises:
      StepNotFoundError: no tier holds ``step``.
    """
    self._check_open("delete")
    step = check_step(step, "delete")
    if self._rules.read_only:
      logger.warning("%s is read only: delete(%d) is skipped", self._dir, step)
      return
    self.wait_until_snapshotted()
    held, stored, fenced = self._delete_everywhere(step)
    if not (held or stored or fenced):
      raise errors.StepNotFoundError(f"delete(): step {step} is not held on any tier")
    logger.info("deleted step %d (host: %s, storage: %s)", step, held, stored)

  def _delete_everywhere(self, step: int) -> tuple[bool, bool, bool]:
    """Deletes ``step`` from this host and, from process 0, storage; says what held it."""
    # Fenced first: a queued persist of the step never runs, a running one never
    # commits, and discard returns once it has ended; only then is storage cleared.
    held = self._store.discard(step, timeout_secs=self.options.timeout_secs)
    fenced = self._persists.by_step.pop(step, None) is not None
    stored = self._dir is not None and step in _tiers.storage_steps(self._dir)
    if stored and self._process[0] == 0:
      universal.discard_step(self._dir, step, todelete_subdir=self._rules.todelete_subdir)
    self._persists.on_storage.discard(step)
    self._infos.pop(step, None)
    return held, stored, fenced

  # -- restoring ------------------------------------------------------------

  def restore(self, step: int | None = None, target: Any = None, *, args: Any = None,
              partial: bool = False, directory: Any = None) -> Any:
    """Restores ``step`` (the newest when None) onto ``target``'s structure and shardings.

    orbax's forms are taken too: ``args=ocp.args.StandardRestore(target)``,
    ``PyTreeRestore(item, restore_args=..., partial_restore=...)`` (with
    ``ocp.PLACEHOLDER`` leaves), ``ArrayRestore``, ``JsonRestore``, Grain's
    ``CheckpointRestore`` and a ``Composite`` of any of the saved items (a
    Composite comes back); ``directory=`` restores a step stored elsewhere.

    Args:
      step: the step to restore; None for the newest held one.
      target: the abstract state (``jax.ShapeDtypeStruct`` leaves with
        ``sharding``, e.g. from ``jax.eval_shape`` or ``nnx.eval_shape``) or
        concrete arrays whose shardings are used; numpy leaves come back as
        numpy. None returns the saved tree as nested dicts and lists (``.attr``
        levels become dict keys) of numpy arrays, PRNG keys and scalars.

    Raises:
      StepNotFoundError: no tier holds ``step``.
      StructureMismatchError: ``target`` does not match what was saved (the
        first mismatching path is named; nothing is restored). With
        ``partial=True`` the target may hold any subset of the saved leaves
        (e.g. the params alone); only those leaves are read, on every tier.
      CorruptSnapshotError: a stored shard fails its checksum.
    """
    self._check_open("restore")
    t0 = time.perf_counter()
    if step is not None:
      step = check_step(step, "restore")
    if directory is not None:
      return self._restore_elsewhere(directory, step, target, args, partial)
    self.wait_until_snapshotted()     # first: a step saved just now is the newest
    if step is None and self._removed:
      step = self.latest_step()       # not one the preservation policy dropped
    if args is None and target is not None:
      out = self._read(step, target, partial)
    else:
      step, _ = _tiers.choose_step(self._store, self._dir, step,   # the job's, on its tiers
                                   timeout_secs=self.options.timeout_secs)
      _, leaves, meta = self._core_metadata(step)
      out = self._forms.restore(args, target, partial, leaves, meta,
                                lambda t, p: self._read(step, t, p))
    self._log_entry("restore", self.last_restore.step, t0)
    return out

  def _read(self, step: int | None, target: Any, partial: bool) -> Any:
    out, self.last_restore = _tiers.restore(self._store, self._dir, step, target,
                                            partial=partial,
                                            timeout_secs=self.options.timeout_secs)
    return tree.nest(out) if target is None else out

  # -- preemption -----------------------------------------------------------

  def reached_preemption(self, step: int) -> bool:
    """True once a preemption notice (SIGTERM) arrived: snapshot ``step`` and exit.

    Under ``jax.distributed`` with JAX's preemption service, every process
    agrees on the same step (``multihost_utils.reached_preemption_sync_point``).
    """
    return self._preemption.reached(step)

  # -- lifecycle ------------------------------------------------------------

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise errors.ManagerClosedError(
          f"{what}() on a closed CheckpointManager; create a new one")

  def close(self) -> None:
    """Waits for the snapshot in flight, then releases host memory. Idempotent."""
    if self._closed:
      return
    try:
      if self._pending is not None:
        self._wait(self._pending, self.options.timeout_secs, "close")
      if self._persist_config is not None:
        self._persists.wait_ended(self._store, self.options.timeout_secs, "close")
      self._raise_background_error()
      self._finalized()
    finally:
      self._closed = True
      self._pool.shutdown(wait=True)
      if self._copy_pool is not None:
        self._copy_pool.shutdown(wait=True)
      self._store.close()
      self._preemption.uninstall()

  def _close_before_exit(self) -> None:
    """SIGTERM's grace ran out and the loop never asked ``reached_preemption``: the
    snapshot in flight is committed (and persisted, if due) before the process ends."""
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  (the process ends next; say why)
      logger.exception("closing the manager before the SIGTERM deadline failed")

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def check_step(step: Any, where: str) -> int:
  """``step`` as an int if it is a Python or numpy integer in [0, 2**63); else raises.

  >>> check_step(np.int64(3), "save")
  3
  """
  if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
    raise errors.InvalidArgumentError(
        f"{where}(step={step!r}): a step is a non-negative int (Python or numpy integer), "
        f"not a {type(step).__name__}")
  value = int(step)
  if not 0 <= value < 2**63:
    raise errors.InvalidArgumentError(
        f"{where}(step={step!r}): a step must be in [0, 2**63)")
  return value


def _merged(metadata: dict[str, Any] | None,
            custom_metadata: dict[str, Any] | None) -> dict[str, Any] | None:
  """``metadata`` and orbax's ``custom_metadata`` (its name for it), as one dict."""
  if custom_metadata is None:
    return metadata
  if metadata is not None:
    raise errors.InvalidArgumentError(
        "save() got both metadata= and custom_metadata= (orbax's name for metadata=); pass one")
  return dict(custom_metadata)
