"""CheckpointManager: the one place that knows every tier and picks among them."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any

import jax

from jaxckpt import capture, errors, tree, universal
from jaxckpt.capture import _storage_only
from jaxckpt.orbax import _options as _orbax_options
from jaxckpt.orbax import _verbs
from jaxckpt.orbax._verbs import OrbaxVerbs
from jaxckpt.util import _preemption, _wait
from jaxckpt.agent import _factory
from jaxckpt.host import _flow, _persist, _schedule
from jaxckpt.host.store import HostStore
from jaxckpt.net import _kv
from jaxckpt.options import check_step, default_copy_threads
from jaxckpt.restore import _read, _tiers

logger = logging.getLogger(__name__)



@dataclasses.dataclass
class SaveStats:
  """Counters of a manager's saves (``mgr.stats``)."""

  started: int = 0
  committed: int = 0
  skipped_busy: int = 0
  skipped_interval: int = 0
  #: candidate saves the job's plan does not snapshot (``snapshot_every``)
  skipped_plan: int = 0
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
  #: a job of several processes: its plan takes a snapshot every this many save
  #: calls on the save interval and, without ``persist_interval_steps``, persists
  #: every this many snapshots (None: no more, until a persist has been measured)
  snapshot_every: int = 1
  persist_every: int | None = None

  def __post_init__(self) -> None:
    self._lag_warn_at = 4               # persists pending that get a warning (doubles each time)

  def note_persist_lag(self, status: Any, step: int, directory: str | None) -> None:
    """Updates the persist lag after ``step`` committed (``status``: the store's
    persist status); logs when it grows."""
    self.persists_pending = len(status.pending)
    self.oldest_unpersisted_step = status.pending[0] if status.pending else None
    self.persist_lag_steps = step - status.pending[0] if status.pending else 0
    self.persist_lag_secs = (time.time() - status.oldest_since) if status.oldest_since else 0.0
    if self.persists_pending >= self._lag_warn_at:
      self._lag_warn_at *= 2
      logger.warning(
          "storage is slower than the loop: %d persists to %s are queued (oldest step %d, "
          "%.1f s and %d steps behind); while their slots are held, saves not due for storage "
          "are skipped and due ones wait: raise persist_interval_steps, or leave it unset so "
          "that persists follow storage's pace", self.persists_pending, directory,
          self.oldest_unpersisted_step, self.persist_lag_secs, self.persist_lag_steps)


class CheckpointManager(OrbaxVerbs):
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
    self._dir = None if directory is None else os.fspath(directory)
    orbax_form = any(x is not None for x in (item_names, item_handlers, handler_registry))
    self.options, self._rules = _orbax_options.translate(options, self._dir,
                                                         orbax_form=orbax_form)
    self._persist_config, self._run_id = _factory.persistence(
        self._dir, self.options, writes=not self._rules.read_only, create=self._rules.create)
    self._process = (jax.process_index(), jax.process_count())
    self._persists = _persist.Attempts(
        self._persist_config, self._run_id, self._process,
        "the in-process store" if self.options.agent is None else "the snapshot agent")
    self._store = store or _factory.make_store(self.options, self._persist_config)
    if store is not None and self._persist_config is not None:
      store.persist_to(self._persist_config)   # every store persists what it holds
    if store is None and self.options.agent is not None and jax.process_count() > 1:
      self._store.discover(timeout_secs=self.options.timeout_secs)
      self._store.recover_persists(jax.process_index(), run_id=self._run_id)
    self._planner = capture.Planner()
    persist_interval = (0 if self._persist_config is None else
                        self.options.persist_interval_steps or (
                            None if self.options.host_snapshots
                            else self.options.save_interval_steps))
    self._schedule = _schedule.Schedule(
        process=self._process, on_busy=self.options.on_busy,
        persist_interval=persist_interval, timeout_secs=self.options.timeout_secs,
        channel=None if self._process[1] == 1 else _kv.Channel(
            "schedule", timeout_secs=self.options.timeout_secs))
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-save")
    self._pool.submit(int)        # its thread starts here, not in the first save (~8 ms)
    threads = self.options.copy_threads or default_copy_threads()
    self._copy_pool = None if threads == 1 else concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix="jaxckpt-copy")
    self._pending: concurrent.futures.Future | None = None
    self._pending_step: int | None = None
    self._error: BaseException | None = None
    self._lock = threading.Lock()
    self._closed = False
    self.stats = SaveStats()
    self._flow = _flow.SaveFlow(
        self._schedule, self._store, self.stats, self._persists.on_storage,
        None if self._persist_config is None else self._dir,
        options=self.options, where=self._persists.where, log_entry=self._log_entry)
    self.last_restore: _read.RestoreInfo | None = None
    self._preemption = _preemption.Notice(install=self.options.handle_sigterm,
                                          grace_secs=self.options.sigterm_grace_secs,
                                          on_deadline=self._close_before_exit)
    self._init_orbax(metadata, item_names, item_handlers, logger)

  # -- saving ---------------------------------------------------------------

  def save(self, step: int, state: Any = None, *, args: Any = None,
           metadata: dict[str, Any] | None = None, force: bool = False, metrics: Any = None,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """Starts a snapshot of ``state`` (or orbax's ``args=``) at ``step``; True if started.

    False (counted in ``stats``) when ``step`` is off the save interval, or the
    job's save plan does not snapshot it. Every process of a job snapshots the
    same steps and persists the same ones (:mod:`jaxckpt.host._schedule`): in a
    job of several processes the plan spaces snapshots so that the previous copy
    is done when the next starts; in a one-process job a snapshot is skipped
    while the previous one is still being copied and ``on_busy="skip"`` (logged).
    A save that is not skipped never is: one due for storage, one the job's plan
    takes, and any with ``on_busy="wait"`` wait for the previous copy and a free
    slot (at most ``timeout_secs``, or ``busy_timeout_secs`` with
    ``on_busy="wait"``). Without ``persist_interval_steps`` the first snapshot
    is persisted, then the next ones as storage keeps up (planning.md);
    ``force=True`` snapshots ``step`` whatever the interval and the plan say and
    persists it. A snapshot of ``step`` drops held snapshots of steps >= ``step``
    (a rolled back timeline). With orbax's options, orbax's policy decides.
    ``metrics`` are kept with the step (``best_fn`` ranks by them);
    ``custom_metadata`` is orbax's name of ``metadata``.

    Raises:
      StepAlreadyExistsError (a ValueError): ``step`` is on storage or on its way
        there (no two tiers hold different bytes under one step) or, with orbax's
        options, held at all.
      SnapshotTimeoutError: a save that may not skip found no slot in time, naming why.
    """
    t0 = time.perf_counter()
    self._check_open("save")
    state, metadata = self._forms.save(state, args, _merged(metadata, custom_metadata))
    step = check_step(step, "save")
    if self._rules.orbax:
      if not self._orbax_may_save(step, force):
        self._raise_background_error(ask_agent=False)
        return False
    elif not force and step % self.options.save_interval_steps:
      self._raise_background_error(ask_agent=False)
      self.stats.skipped_interval += 1
      return False
    try:
      return self._snapshot(step, state, metadata, metrics, force, t0)
    finally:
      self._schedule.blocked(time.perf_counter() - t0)   # not the loop's own time

  def _snapshot(self, step: int, state: Any, metadata: dict[str, Any] | None, metrics: Any,
                force: bool, t0: float) -> bool:
    d = self._flow.decide(step, force)
    # Raised after the decision: this call counts in the job's plan like every other
    # process's, so a loop that goes on after the error takes the job's steps.
    self._raise_background_error(ask_agent=False)
    tree.check_metadata(metadata)          # here, not in the background copy
    if not d.snapshot:
      self.stats.skipped_plan += 1
      return False
    self._persists.refuse_existing(step, self._store, _verbs.already_exists)
    metadata = self._record(step, metadata, metrics)
    if not self.options.host_snapshots:
      if not d.due:
        return self._saved(step, False, t0)
      self._schedule.took(d)
      return self._saved(step, self._save_to_storage(step, state, metadata, t0), t0)
    # May this save skip? Only in a one-process job, and not a due or a waiting one.
    must = self._flow.never_skipped(d)
    if not self._wait_for_previous(step, must):   # before any per-leaf work: skips stay cheap
      return self._saved(step, False, t0)
    leaves, _ = tree.flatten(state)
    plan = self._planner.plan(leaves)
    slot = self._store.reserve(step, plan.nbytes, timeout_secs=self._flow.reserve_timeout(must))
    self.stats.agent_restarts = self._store.restarts
    if slot is None:
      self._flow.no_slot(step, must)
      return self._saved(step, False, t0)
    try:
      sources = capture.start(leaves, plan)
    except BaseException:
      self._store.abort(slot)
      raise
    self._flow.started(step, d, plan.nbytes, t0)
    attempt = self._persists.new(step) if d.due else None
    self._pending_step = step
    self._pending = self._pool.submit(self._complete, step, plan, sources, slot,
                                      metadata, t0, attempt)
    self.stats.started += 1
    self.stats.last_blocking_secs = time.perf_counter() - t0
    return self._saved(step, True, t0)

  def _save_to_storage(self, step: int, state: Any, metadata: dict[str, Any] | None,
                       t0: float) -> bool:
    """A storage-only save (``host_snapshots=False``): see :mod:`jaxckpt.capture._storage_only`."""
    st = self.stats
    st.last_nbytes = _storage_only.save_step(
        self._dir, step, tree.flatten(state)[0], self._planner,
        budget=self.options.host_memory_limit_bytes or _storage_only.DEFAULT_STAGING_BYTES,
        attempt=self._persists.new(step), process=self._process, metadata=metadata,
        timeout_secs=self.options.timeout_secs, max_to_keep=self.options.max_to_keep)
    self._persists.on_storage.add(step)
    st.started, st.committed = st.started + 1, st.committed + 1
    st.last_blocking_secs = st.last_snapshot_secs = time.perf_counter() - t0
    return True

  def prepare(self, state: Any) -> None:
    """Does now, before the loop, what the first save of ``state``'s layout would
    do while the loop waits: plans it, runs the packed gather once, touches every
    snapshot slot, and on accelerators warms the pinned host pool. Saves nothing."""
    self._check_open("prepare")
    leaves, _ = tree.flatten(state)
    plan = self._planner.plan(leaves, wait=True)
    capture.warm_up(leaves, plan)
    self._store.preallocate(plan.nbytes)

  def _wait_for_previous(self, step: int, must: str | None) -> bool:
    pending = self._pending
    if pending is None or pending.done():
      return True
    if not must:
      if self._flow.done_within_grace(pending):
        self._raise_background_error(ask_agent=False)
        return True
      self._flow.skip_busy(step, "the previous snapshot is still being copied")
      return False
    self._wait(pending, self._flow.reserve_timeout(must), f"save of step {step} ({must}: never skipped)")
    self._raise_background_error(ask_agent=False)
    return True

  def should_save(self, step: int) -> bool:
    """Whether ``save(step)`` now would save, exactly: the manager is open, ``step`` is
    on the save interval and the job's save plan snapshots it (storage-only: it is
    due for storage); in a one-process job with ``on_busy="skip"``, a step not due
    for storage is also refused while the previous snapshot is still being copied,
    or when no snapshot slot is free (persists hold them). A save that may not skip
    (due for storage, in a job of several processes, or ``on_busy="wait"``) is
    True: it waits, bounded. With orbax's options, orbax's ``should_save``."""
    step = check_step(step, "should_save")
    if self._rules.orbax:
      return not self._closed and self._orbax_should_save(step)
    if self._closed or step % self.options.save_interval_steps:
      return False
    d = self._flow.peek(step)
    if not d.snapshot or not self.options.host_snapshots:
      return d.snapshot and d.due
    if self._flow.never_skipped(d):
      return True
    pending = self._pending
    if pending is not None and not pending.done() and not self._flow.done_within_grace(pending):
      return False
    return self._store.has_free_slot()

  def _complete(self, step, plan, sources, slot, metadata, t0, attempt) -> None:
    try:
      manifest = capture.complete(
          plan, sources, slot.buffer, step=step, process_index=self._process[0],
          process_count=self._process[1], metadata=metadata, pool=self._copy_pool)
      del sources                     # release the device-buffer views at once
      self._store.commit(slot, manifest, persist_attempt=attempt)
    except BaseException as e:  # surfaced by the next save / wait
      self._flow.forget(step)
      self._store.abort(slot)
      logger.exception("step %d: snapshot failed", step)
      with self._lock:
        self._error = e
      return
    self.stats.committed += 1
    self.stats.last_snapshot_secs = secs = time.perf_counter() - t0
    self.stats.last_nbytes = plan.nbytes
    self._log_entry("snapshot", step, t0, snapshot_secs=secs, nbytes=plan.nbytes,
                    snapshot_GBps=plan.nbytes / max(secs, 1e-9) / 1e9)
    self._flow.committed(step, attempt is not None, plan.nbytes, secs)
    logger.debug("step %d: snapshot committed (%d bytes)", step, plan.nbytes)

  def wait_until_finished(self, timeout_secs: float | None = None) -> None:
    """Blocks until every save so far has finished, as orbax's: the snapshot is
    committed and every step saved for storage is on storage (else its error is
    raised). :meth:`wait_until_snapshotted` waits for the host snapshot only."""
    timeout = timeout_secs or self.options.timeout_secs
    t0 = time.perf_counter()
    try:
      self._wait_until_finished(timeout)
    finally:
      self._schedule.blocked(time.perf_counter() - t0)      # not the loop's own time

  def _wait_until_finished(self, timeout: float) -> None:
    self.wait_until_snapshotted(timeout)
    if self._persist_config is not None and self.options.host_snapshots:
      self._persists.wait_ended(self._store, timeout, "wait_until_finished")
      self._flow.note_lag()
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
    flight = self._in_flight()        # first: once it is done, the host tier holds it
    held = _tiers.complete_steps(self._store)
    rebuilt = _tiers.rebuildable_steps(held, self._store) if self.options.parity else []
    return self._listed(flight, set(held) | set(rebuilt), _tiers.storage_steps(self._dir))

  def wait_until_persisted(self, step: int | None = None,
                           timeout_secs: float | None = None) -> None:
    """Blocks until this manager's persist of ``step`` (default: its newest due
    snapshot) is committed on storage.

    Raises:
      StepExistsError: another writer committed ``step``; this one's was not stored.
      StorageError (or the jaxckpt error that fits): the persist failed.
      SnapshotTimeoutError: naming the processes whose part is missing on storage.
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
    timeout = timeout_secs or self.options.timeout_secs
    t0 = time.perf_counter()
    try:
      self._persists.wait_stored(self._store, step, timeout)
    finally:
      self._schedule.blocked(time.perf_counter() - t0)      # not the loop's own time
    _wait.until(lambda: step not in self._store.persist_status().pending,   # its job's end
                timeout_secs=timeout, late=lambda: (
                    f"step {step} is on {self._dir!r} but {self._persists.where} still "
                    f"reports its persist as running after {timeout} s"))
    self._flow.note_lag()

  def protected_steps(self) -> list[int]:
    """Steps whose parity every host's agent holds in full (parity on), oldest first:
    each survives the loss of up to ``parity.parity`` hosts per parity group (the
    newest committed step becomes protected a little after its commit)."""
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
      SnapshotTimeoutError, ParityError: naming the hosts that were late or failed, and why.
    """
    if self.options.parity is None:
      raise errors.InvalidArgumentError("wait_until_protected(): parity is off; set "
                       "CheckpointOptions(parity=jaxckpt.ParityOptions(...))")
    self.wait_until_snapshotted()
    held = self._store.steps()
    if step is not None or held:
      _tiers.wait_protected(self._store, held[-1] if step is None else step,
                            timeout_secs=timeout_secs or self.options.timeout_secs)

  def latest_step(self) -> int | None:
    """The newest restorable step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def delete(self, step: int) -> None:
    """Deletes ``step`` from every tier, for good: this host's snapshot, its persist
    (a queued one never runs, a running one never commits) and, from process 0,
    storage. A read-only manager deletes nothing (logged).

    Raises:
      StepNotFoundError: no tier holds ``step``.
    """
    self._check_open("delete")
    step = check_step(step, "delete")
    if self._rules.read_only:
      logger.warning("%s is read only: delete(%d) is skipped", self._dir, step)
      return
    if self._pending is not None:      # the snapshot in flight (its errors: raised later)
      self._wait(self._pending, self.options.timeout_secs, "delete")
    held, stored, fenced = self._delete_everywhere(step)
    if not (held or stored or fenced):
      raise errors.StepNotFoundError(f"delete(): step {step} is not held on any tier")
    logger.info("deleted step %d (host: %s, storage: %s)", step, held, stored)

  def _delete_everywhere(self, step: int) -> tuple[bool, bool, bool]:
    """Deletes ``step`` from this host and, from process 0, storage; says what held it."""
    # Fenced first: a queued persist of the step never runs, a running one never
    # commits, and discard returns once it has ended; only then is storage cleared.
    held = self._store.discard(step, timeout_secs=self.options.timeout_secs)
    attempt = self._persists.by_step.pop(step, None)
    fenced = attempt is not None
    if fenced:
      self._persists.told.add(attempt)        # its persist's failure is moot now
    self._flow.forget(step)
    stored = self._dir is not None and step in _tiers.storage_steps(self._dir)
    if stored and (self._process[0] == 0 or self._store.fences_job):
      universal.discard_step(self._dir, step, todelete_subdir=self._rules.todelete_subdir)
    self._persists.on_storage.discard(step)
    self._infos.pop(step, None)
    return held, stored, fenced

  # -- restoring ------------------------------------------------------------

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
    self._check_open("restore")
    t0 = time.perf_counter()
    if step is not None:
      step = check_step(step, "restore")
    if directory is not None:
      return self._restore_elsewhere(directory, step, target, args, partial)
    self.wait_until_snapshotted()     # first: a step saved just now is the newest
    if step is None and self._removed:
      step = self.latest_step()       # not one the preservation policy dropped
    out = (self._read(step, target, partial) if args is None and target is not None
           else self._restore_forms(step, target, args, partial))
    r = self.last_restore
    self._log_entry("restore", r.step, t0, tier=str(r.tier), restore_secs=r.seconds,
                    nbytes=r.nbytes, restore_GBps=r.nbytes / max(r.seconds, 1e-9) / 1e9,
                    skipped_steps=[s for s, _ in r.skipped])
    return out

  def _read(self, step: int | None, target: Any, partial: bool, onto: Any = None) -> Any:
    out, self.last_restore = _tiers.restore(self._store, self._dir, step, target,
                                            partial=partial,
                                            timeout_secs=self.options.timeout_secs,
                                            writes=not self._rules.read_only, onto=onto)
    return tree.nest(out) if target is None and onto is None else out

  # -- preemption -----------------------------------------------------------

  def reached_preemption(self, step: int) -> bool:
    """True once a preemption notice (SIGTERM, or JAX's preemption service, the same
    step on every process) arrived: snapshot ``step`` and exit."""
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


def _merged(metadata: dict[str, Any] | None,
            custom_metadata: dict[str, Any] | None) -> dict[str, Any] | None:
  """``metadata`` and orbax's ``custom_metadata`` (its name for it), as one dict."""
  if custom_metadata is None:
    return metadata
  if metadata is not None:
    raise errors.InvalidArgumentError(
        "save() got both metadata= and custom_metadata= (orbax's name for metadata=); pass one")
  return dict(custom_metadata)
