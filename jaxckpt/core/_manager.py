"""The manager's core: the tiers, around one step ledger and one policy.

:class:`CoreManager` saves a tree to the host tier (a snapshot, persisted to
storage as the job's plan says), restores from the fastest tier that holds a
verified copy, deletes from every tier, and answers what is held. It knows no
orbax type: :class:`jaxckpt.CheckpointManager` wraps it, translating orbax's
arguments at the edge.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable

import jax

from jaxckpt import capture, errors, tree, universal
from jaxckpt.agent.trainer import _factory
from jaxckpt.capture import _storage_only
from jaxckpt.core import _decide, _deletes, _flow, _identity, _listing, _policy, _schedule
from jaxckpt.core._ledger import Ledger
from jaxckpt.core._persists import Persists
from jaxckpt.host.store import HostStore
from jaxckpt.options import CheckpointOptions, check_step, default_copy_threads
from jaxckpt.restore import _read, _tiers
from jaxckpt.util import _preemption

logger = logging.getLogger("jaxckpt.manager")


def _no_log(event: str, step: int, t0: float, **figures: Any) -> None:
  del event, step, t0, figures


class CoreManager:
  """Snapshots a tree every step and restores it from the fastest tier.

  Args:
    directory: where steps due for storage are persisted (None: host snapshots only).
    options: how the tiers work.
    rules: how the directory is treated (read-only, blocking saves, ...).
    store: a HostStore to use instead of the one ``options`` ask for.
    policy: which steps are saved and kept (None: ``options``' plain rules, the save
      interval and ``max_to_keep``).
    log_entry: ``(event, step, t0, **figures)``: one call per save, snapshot, persist
      and restore (the façade's ``logger=``).
    already_exists: the error a save of a step already kept raises (a StepAlreadyExistsError).
  """

  def __init__(self, directory: str | None, options: CheckpointOptions, *,
               rules: _policy.DirectoryRules = _policy.DirectoryRules(),
               store: HostStore | None = None, policy: _policy.Policy | None = None,
               log_entry: Callable[..., None] = _no_log,
               already_exists: Callable[[str], Exception] = errors.StepAlreadyExistsError
               ) -> None:
    self.directory, self.options, self.rules = directory, options, rules
    self._process = (jax.process_index(), jax.process_count())
    _identity.agree_options(options, directory, process=self._process)   # first: all agree
    self.policy = policy or _policy.plain(options)
    self._log, self._already_exists = log_entry, already_exists
    config, run_id = _factory.persistence(directory, options, writes=not rules.read_only,
                                          create=rules.create)
    self._config = config
    self.ledger = Ledger(run_id, stored=() if config is None else universal.stored_steps(directory))
    self._decide = _decide.SaveDecisions(self.policy, rules, directory, self.ledger, self._process,
                                         options.timeout_secs, saving=self.is_saving_in_progress,
                                         preempted=self.reached_preemption)
    where = "the in-process store" if options.agent is None else "the snapshot agent"
    self._persists = Persists(self.ledger, None if config is None else directory,
                              self._process, where)
    self._store = _factory.open_store(options, config, store=store, run_id=run_id,
                                      run=_identity.run_name(directory))
    self._planner = capture.Planner()
    self._schedule = _schedule.for_manager(options, self._process,
                                           persists=config is not None)
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-save")
    self._pool.submit(int)        # its thread starts here, not in the first save (~8 ms)
    threads = options.copy_threads or default_copy_threads()
    self._copy_pool = None if threads == 1 else concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix="jaxckpt-copy")
    self._closed = False
    self._ending = False               # SIGTERM's deadline closes it: the process ends next
    self._unfinalized = False
    self._flow = _flow.SaveFlow(self._schedule, self._store, self.ledger,
                                None if config is None else directory, options=options,
                                where=where, log_entry=self._log)
    self.last_restore: _read.RestoreInfo | None = None
    self._preemption = _preemption.Notice(install=options.handle_sigterm,
                                          grace_secs=options.sigterm_grace_secs,
                                          on_deadline=self._close_before_exit)
    if rules.cleanup_tmp_directories and config is not None and self._process[0] == 0:
      universal.discard_uncommitted(directory, keep=set(self._store.steps()) | set(
          self._store.persist_status().pending))     # what crashed saves left
    self._deletes = _deletes.Deletes(self._store, self.ledger, directory, self._process, rules,
                                     self.policy, options.timeout_secs)
    if not rules.read_only:
      self._deletes.resume()            # a rollback a crash interrupted, before any listing
    self.listing = _listing.Listing(self._store, self.ledger, directory, self.policy,
                                    parity=options.parity is not None,
                                    settle=self.wait_until_snapshotted)
    self.listing.load()
    self._said_unrestorable()

  def _said_unrestorable(self) -> None:
    """A relaunch whose host holds steps while no step is restorable (none held by every
    process of the job, nor rebuildable, nor stored) starts from scratch: said at
    WARNING, never silently."""
    if self._process[1] == 1:
      return
    mine = self._store.steps()
    if mine and not self.listing.all_steps():
      logger.warning(
          "process %d: its host holds steps %s, but no step is held by every process of the "
          "job (nor rebuildable from parity, nor on storage): nothing can be restored, and "
          "latest_step() is None", self._process[0], mine)

  @property
  def stats(self) -> Any:
    return self.ledger.stats

  # -- saving ---------------------------------------------------------------

  def save(self, step: int, state: Any, metadata: dict[str, Any] | None, *,
           force: bool = False, metrics: Any = None) -> bool:
    """Starts a snapshot of ``state`` at ``step`` (see ``jaxckpt.CheckpointManager.save``)."""
    t0 = time.perf_counter()
    self.check_open("save")
    step = check_step(step, "save")
    if not self._decide.may_save(step, force):
      self._raise_background_error(ask_agent=False)
      return False
    try:
      return self._snapshot(step, state, metadata, metrics, force, t0)
    finally:
      self.ledger.starting(None)
      self._schedule.blocked(time.perf_counter() - t0)   # not the loop's own time

  def _snapshot(self, step: int, state: Any, metadata: dict[str, Any] | None, metrics: Any,
                force: bool, t0: float) -> bool:
    d = self._flow.decide(step, force or self.policy.forced(step))
    # Raised after the decision: this call counts in the job's plan like every other
    # process's, so a loop that goes on after the error takes the job's steps.
    self._raise_background_error(ask_agent=False)
    tree.check_metadata(metadata)          # here, not in the background copy
    if not d.snapshot:
      self.ledger.skipped_plan(step, _flow.PLAN_SKIP)
      return False
    self._deletes.timeline(step)
    self._persists.refuse_existing(step, self._store, self._already_exists)
    self.ledger.starting(step)             # in flight from its record on (another thread lists)
    metadata = self._decide.record(step, metadata, metrics, d.due)
    if not self.options.host_snapshots:
      if not d.due:
        return self._saved(step, False, t0)
      self._schedule.took(d)
      return self._saved(step, self._save_to_storage(step, state, metadata, t0), t0)
    # may this save skip? (one process, not due, not forced: the user asked for this step)
    must = "force=True" if force else self._flow.never_skipped(d)
    if not self._wait_for_previous(step, must):   # before any per-leaf work: skips stay cheap
      return self._saved(step, False, t0)
    leaves, _ = tree.flatten(state)
    plan = self._planner.plan(leaves)
    slot = self._store.reserve(step, plan.nbytes, timeout_secs=self._flow.reserve_timeout(must))
    self.ledger.agent_restarts(self._store.restarts)
    if slot is None:
      self._flow.no_slot(step, must)
      return self._saved(step, False, t0)
    try:
      sources = capture.start(leaves, plan)
    except BaseException:
      self._store.abort(slot)
      raise
    self._flow.started(step, d, plan.nbytes, t0)
    attempt = self.ledger.new_attempt(step) if d.due else None
    self.ledger.fly(step, self._pool.submit(self._complete, step, plan, sources, slot,
                                            metadata, t0, attempt))
    self.ledger.started(step, time.perf_counter() - t0)
    return self._saved(step, True, t0)

  def _save_to_storage(self, step: int, state: Any, metadata: dict[str, Any] | None,
                       t0: float) -> bool:
    """A storage-only save (``host_snapshots=False``): see :mod:`jaxckpt.capture._storage_only`."""
    nbytes = _storage_only.save_step(
        self.directory, step, tree.flatten(state)[0], self._planner,
        budget=self.options.host_memory_limit_bytes or _storage_only.DEFAULT_STAGING_BYTES,
        attempt=self.ledger.new_attempt(step), process=self._process, metadata=metadata,
        timeout_secs=self.options.timeout_secs)
    self.ledger.stored_directly(step, nbytes, time.perf_counter() - t0)
    return True

  def _saved(self, step: int, started: bool, t0: float) -> bool:
    """After ``save(step)``: the steps the keep policy drops, a blocking save's wait,
    the logger's entry."""
    if not started:
      rec = self.ledger.get(step)
      if rec is not None and rec.attempt is None:
        self.ledger.forget(step)
      return False
    self._unfinalized = True
    if self.policy.to_remove is not None:
      self.ledger.drop(self.policy.to_remove(self.ledger.kept()), "retention")
    if self.rules.blocking:
      self.wait_until_finished()
    else:
      self._deletes.collect(in_flight=self.ledger.in_flight())
    st = self.stats
    self._log("save", step, t0, blocking_secs=time.perf_counter() - t0,
              skipped_busy=st.skipped_busy, skipped_plan=st.skipped_plan,
              persist_lag_steps=st.persist_lag_steps, persist_lag_secs=st.persist_lag_secs)
    return True

  def prepare(self, state: Any) -> None:
    """See ``jaxckpt.CheckpointManager.prepare``."""
    self.check_open("prepare")
    leaves, _ = tree.flatten(state)
    plan = self._planner.plan(leaves, wait=True)
    capture.warm_up(leaves, plan)
    self._store.preallocate(plan.nbytes)

  def _wait_for_previous(self, step: int, must: str | None) -> bool:
    pending = self.ledger.flight
    if pending is None or pending.done():
      return True
    must = must or self._flow.copy_skipped
    if not must:
      if self._flow.done_within_grace(pending):
        self._raise_background_error(ask_agent=False)
        return True
      self._flow.skip_busy(step, _flow.COPY_BUSY)
      return False
    self._wait(pending, self._flow.reserve_timeout(must),
               f"save of step {step} ({must}: never skipped)")
    self._raise_background_error(ask_agent=False)
    return True

  def should_save(self, step: int) -> bool:
    """See ``jaxckpt.CheckpointManager.should_save``."""
    step = check_step(step, "should_save")
    if self._closed or self.rules.read_only or not self._decide.policy_saves(step):
      return False
    d = self._flow.peek(step)
    if not d.snapshot and self._schedule.agreed:
      self.ledger.left_out(step)      # (a loop that ends here is told: wait_until_finished)
    if not d.snapshot or not self.options.host_snapshots:
      return d.snapshot and d.due
    if self._flow.never_skipped(d) or self._flow.copy_skipped:
      return True
    pending = self.ledger.flight
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
      self.ledger.fail(e)
      return
    secs = time.perf_counter() - t0
    self._log("snapshot", step, t0, snapshot_secs=secs, nbytes=plan.nbytes,
              snapshot_GBps=plan.nbytes / max(secs, 1e-9) / 1e9)
    self._flow.committed(step, attempt is not None, plan.nbytes, secs)
    logger.debug("step %d: snapshot committed (%d bytes)", step, plan.nbytes)

  # -- waits ------------------------------------------------------------------

  def wait_until_finished(self, timeout_secs: float | None = None) -> None:
    """See ``jaxckpt.CheckpointManager.wait_until_finished``."""
    timeout = timeout_secs or self.options.timeout_secs
    t0 = time.perf_counter()
    self._flow.left_out("wait_until_finished()")
    try:
      self.wait_until_snapshotted(timeout)
      if self._config is not None and self.options.host_snapshots:
        self._persists.wait_ended(self._store, timeout, "wait_until_finished")
        self._flow.note_lag()
      self._finalized()
    finally:
      self._schedule.blocked(time.perf_counter() - t0)      # not the loop's own time

  def wait_until_snapshotted(self, timeout_secs: float | None = None) -> None:
    """See ``jaxckpt.CheckpointManager.wait_until_snapshotted``."""
    if self.ledger.flight is not None:
      self._wait(self.ledger.flight, timeout_secs or self.options.timeout_secs,
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
    err = self.ledger.take_error()
    if err is not None:
      raise err
    self._persists.raise_errors(self._store, ask_agent=ask_agent)

  def check_for_errors(self) -> None:
    self.check_open("check_for_errors")
    self._raise_background_error()

  def wait_until_persisted(self, step: int | None = None,
                           timeout_secs: float | None = None) -> None:
    """See ``jaxckpt.CheckpointManager.wait_until_persisted``."""
    self.check_open("wait_until_persisted")
    if self.directory is None:
      raise errors.InvalidArgumentError(
          "wait_until_persisted(): this manager has no directory; pass "
          "CheckpointManager(directory=...) to persist")
    if step is not None:
      step = check_step(step, "wait_until_persisted")
    self.wait_until_snapshotted()
    attempts = self.ledger.attempts()
    if step is None and not attempts:
      return
    step = max(attempts) if step is None else step
    t0 = time.perf_counter()
    try:
      self._persists.wait_stored(self._store, step, timeout_secs or self.options.timeout_secs)
    finally:
      self._schedule.blocked(time.perf_counter() - t0)      # not the loop's own time
    self._flow.note_lag()

  def protected_steps(self) -> list[int]:
    self.check_open("protected_steps")
    return _tiers.protected_steps(self._store)

  def wait_until_protected(self, step: int | None = None,
                           timeout_secs: float | None = None) -> None:
    """See ``jaxckpt.CheckpointManager.wait_until_protected``."""
    if self.options.parity is None:
      raise errors.InvalidArgumentError("wait_until_protected(): parity is off; set "
                                        "CheckpointOptions(parity=jaxckpt.ParityOptions(...))")
    self.wait_until_snapshotted()
    held = self._store.steps()
    if step is not None or held:
      _tiers.wait_protected(self._store, held[-1] if step is None else step,
                            timeout_secs=timeout_secs or self.options.timeout_secs)

  def is_saving_in_progress(self) -> bool:
    """Whether a save has not ended: its snapshot is being copied, or a step this
    manager saved for storage is still being persisted."""
    if self.ledger.in_flight():
      return True
    if self._config is None:
      return False
    return bool(set(self.ledger.attempts()) & set(self._store.persist_status().pending))

  # -- what is held -------------------------------------------------------------

  def reload(self) -> None:
    """Reads the steps again from every tier (orbax's ``reload``)."""
    self.check_open("reload")
    self.wait_until_snapshotted()
    self._deletes.collect(in_flight=self.ledger.in_flight())
    self.listing.load()

  # -- deleting -----------------------------------------------------------------

  def delete(self, step: int) -> None:
    """See ``jaxckpt.CheckpointManager.delete``."""
    self.check_open("delete")
    step = check_step(step, "delete")
    if self.rules.read_only:
      logger.warning("%s is read only: delete(%d) is skipped", self.directory, step)
      return
    if self.ledger.flight is not None:   # the snapshot in flight (its errors: raised later)
      self._wait(self.ledger.flight, self.options.timeout_secs, "delete")
    self._deletes.delete(step)

  def _finalized(self) -> None:
    """Every save so far has ended: the dropped steps go, and ``on_finalized`` runs
    (once per saves since the last time)."""
    self._deletes.collect(in_flight=self.ledger.in_flight(), all_ended=True)
    self._deletes.drain()
    self._raise_background_error(ask_agent=False)
    if self._unfinalized and self.rules.on_finalized is not None:
      self._unfinalized = False
      self.rules.on_finalized()

  # -- restoring ------------------------------------------------------------

  def restore(self, step: int | None, target: Any, *, partial: bool = False,
              onto: Callable[[int, Callable[[Any, bool], Any]], Any] | None = None) -> Any:
    """See ``jaxckpt.CheckpointManager.restore`` (``onto``: ``jaxckpt.restore._tiers.restore``)."""
    self.check_open("restore")
    t0 = time.perf_counter()
    if step is not None:
      step = check_step(step, "restore")
    self.wait_until_snapshotted()     # first: a step saved just now is the newest
    why = self.ledger.dropped().get(step) if step is not None else None
    if why is not None:
      raise errors.StepNotFoundError(
          f"restore(step={step}): step {step} was dropped ({why}) and is being deleted from "
          "every tier; all_steps() lists the steps there are")
    if step is None and self.ledger.dropped():     # not one the keep policy dropped
      step = max(self.listing.all_steps(), default=None)
    out, r = _tiers.restore(self._store, self.directory, step, target, partial=partial,
                            timeout_secs=self.options.timeout_secs,
                            writes=not self.rules.read_only, onto=onto)
    self.last_restore = r
    self.ledger.restored = r.step
    self._decide.restored()
    self._log("restore", r.step, t0, tier=str(r.tier), restore_secs=r.seconds,
              nbytes=r.nbytes, restore_GBps=r.nbytes / max(r.seconds, 1e-9) / 1e9,
              skipped_steps=[s for s, _ in r.skipped])
    return tree.nest(out) if target is None and onto is None else out

  # -- preemption and lifecycle -------------------------------------------------

  def reached_preemption(self, step: int) -> bool:
    return self._preemption.reached(step)

  def check_open(self, what: str) -> None:
    if self._closed:
      raise errors.ManagerClosedError(
          f"{what}() on a closed CheckpointManager; create a new one")

  @property
  def closed(self) -> bool:
    return self._closed

  def close(self) -> None:
    """Waits for the snapshot in flight and the persists, then releases host memory."""
    if self._closed:
      return
    self._flow.left_out("close()")
    try:
      if self.ledger.flight is not None:
        self._wait(self.ledger.flight, self.options.timeout_secs, "close")
      if self._config is not None:
        # the newest step on storage whose persists follow storage's pace (the user chose no
        # steps), or at SIGTERM's deadline (a job's processes may differ in their newest)
        if self._ending or (self._process[1] == 1 and self.options.persist_interval_steps is None):
          self._persists.persist_newest(self._store, "SIGTERM's deadline" if self._ending
                                        else "close")
        self._persists.wait_ended(self._store, self.options.timeout_secs, "close")
      self._raise_background_error()
      self._finalized()
    finally:
      self._closed = True
      self._pool.shutdown(wait=True)
      self._deletes.close()
      if self._copy_pool is not None:
        self._copy_pool.shutdown(wait=True)
      self._store.close()
      self._preemption.uninstall()

  def _close_before_exit(self) -> None:
    """SIGTERM's grace ran out and the loop never asked ``reached_preemption``: the
    snapshot in flight is committed, and the newest snapshot persisted (due or not,
    where host memory ends with the process), before the process ends."""
    try:
      self._ending = True
      self.close()
    except Exception:  # pylint: disable=broad-except  (the process ends next; say why)
      logger.exception("closing the manager before the SIGTERM deadline failed")
