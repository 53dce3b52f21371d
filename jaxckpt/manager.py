"""CheckpointManager: the one place that knows every tier and picks among them."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any

import jax
import numpy as np

from jaxckpt import _items, _preemption, _storage_only, _wait, capture, errors, tree, universal
from jaxckpt.agent import AgentStore, _parity, _paths
from jaxckpt.host import _persist, _schedule
from jaxckpt.host.store import HostStore, InProcessStore
from jaxckpt.net import _kv, _wire
from jaxckpt.options import (CheckpointOptions, default_copy_threads,
                             default_host_memory_limit_bytes)
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


class CheckpointManager:
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
  """

  def __init__(self, directory: str | None = None,
               options: CheckpointOptions | None = None, *,
               store: HostStore | None = None) -> None:
    self.options = options or CheckpointOptions()
    if not isinstance(self.options, CheckpointOptions):
      raise errors.InvalidArgumentError(
          f"options={self.options!r} must be a jaxckpt.CheckpointOptions")
    self.directory = None if directory is None else os.fspath(directory)
    self._persist_config = None
    self._run_id = None
    self._attempts: dict[int, str] = {}       # step -> this run's newest persist attempt
    self._persist_counts: dict[int, int] = {}
    self._on_storage: set[int] = set()
    self._told: set[str] = set()              # persist attempts whose failure was raised
    if self.directory is None and (self.options.persist_interval_steps is not None
                                   or self.options.max_to_keep is not None):
      given = ", ".join(f"{n}={getattr(self.options, n)!r}" for n in
                        ("persist_interval_steps", "max_to_keep")
                        if getattr(self.options, n) is not None)
      raise errors.InvalidArgumentError(
          f"CheckpointOptions({given}) says how to keep steps on storage, but the manager has "
          "no directory, so nothing would ever be persisted: pass CheckpointManager("
          "'/path/or/s3://bucket/run', options), or leave them None for host snapshots only")
    if not self.options.host_snapshots and self.directory is None:
      raise errors.InvalidArgumentError(
          "CheckpointOptions(host_snapshots=False) writes every save straight to storage, so "
          "the manager needs a directory: CheckpointManager('/path/or/s3://bucket/run', options)")
    if self.directory is not None:
      _persist.check_directory(self.directory, timeout_secs=self.options.timeout_secs)
      self._persist_config = _persist.PersistConfig(
          self.directory, self.options.persist_interval_steps or self.options.save_interval_steps,
          self.options.max_to_keep, self.options.timeout_secs,
          hold_until_committed=self.options.parity is not None)
      self._run_id = _agree_run_id(self.options.timeout_secs)
      self._on_storage = set(_tiers.storage_steps(self.directory))
    self._store = store or self._make_store()
    if store is not None and self._persist_config is not None:
      store.persist_to(self._persist_config)   # every store persists what it holds
    if store is None and self.options.agent is not None and jax.process_count() > 1:
      self._store.discover(timeout_secs=self.options.timeout_secs)
      self._store.recover_persists(jax.process_index(), run_id=self._run_id)
    self._planner = capture.Planner()
    persist_interval = (0 if self.directory is None else
                        self.options.persist_interval_steps or (
                            None if self.options.host_snapshots
                            else self.options.save_interval_steps))
    self._schedule = _schedule.Schedule(
        process=(jax.process_index(), jax.process_count()), on_busy=self.options.on_busy,
        persist_interval=persist_interval, timeout_secs=self.options.timeout_secs,
        channel=None if jax.process_count() == 1 else _kv.Channel(
            "schedule", timeout_secs=self.options.timeout_secs))
    self._committed_at: dict[int, float] = {}   # due step -> when its snapshot committed
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-save")
    threads = self.options.copy_threads or default_copy_threads()
    self._copy_pool = None if threads == 1 else concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix="jaxckpt-copy")
    self._pending: concurrent.futures.Future | None = None
    self._pending_due = False           # whether the copy in flight is of a due step
    self._error: BaseException | None = None
    self._lock = threading.Lock()
    self._closed = False
    self.stats = SaveStats()
    self._lag_warn_at = 2               # persists pending that get a warning (doubles each time)
    self._last_save_at = time.perf_counter()
    self.last_restore: _read.RestoreInfo | None = None
    self._process = (jax.process_index(), jax.process_count())
    self._preemption = _preemption.Notice(install=self.options.handle_sigterm,
                                          grace_secs=self.options.sigterm_grace_secs,
                                          on_deadline=self._close_before_exit)

  def _make_store(self) -> HostStore:
    limit = self.options.host_memory_limit_bytes or default_host_memory_limit_bytes()
    a = self.options.agent
    if a is None:
      return InProcessStore(max_snapshots=self.options.max_snapshots,
                            host_memory_limit_bytes=limit, persist=self._persist_config)
    p = self.options.parity
    if p is not None:
      from jaxckpt.parity import codec, placement  # pylint: disable=import-outside-toplevel  (numba, ~0.5 s: only with parity)
      if a.host_id is None:                                     # hosts = this job's processes
        placement.check_hosts(jax.process_count(), p)
      codec.warm_up(p.group_size - p.parity, p.parity)  # a rebuild after a restart must not load it
    host = jax.process_index() if a.host_id is None else a.host_id
    secret = None
    if jax.process_count() > 1 and a.secret is None and not os.environ.get(_paths.SECRET_ENV):
      # One secret for the whole job, each host's run root being private: the one the
      # hosts hold (it survives a lost host, process 0's too), else a new one of process 0.
      root = a.run_root or _paths.default_run_root()
      secret = _kv.agree_kept("agent_secret", _paths.held_secret(root, a.job_name),
                              _wire.new_secret, timeout_secs=self.options.timeout_secs)
    return AgentStore(a, host=host, max_snapshots=self.options.max_snapshots,
                      limit_bytes=limit,
                      persist=None if self._persist_config is None
                      else self._persist_config.to_obj(),
                      parity=self._parity_config(), secret=secret, owner=_owner_name())

  def _parity_config(self) -> dict[str, Any] | None:
    p = self.options.parity
    if p is None:
      return None
    return _parity.ParityConfig(p.group_size, p.parity, self.options.timeout_secs).to_obj()

  # -- saving ---------------------------------------------------------------

  def save(self, step: int, state: Any = None, *, args: Any = None,
           metadata: dict[str, Any] | None = None, force: bool = False) -> bool:
    """Starts a snapshot of ``state`` at ``step``; returns True if one was started.

    ``args=ocp.args.StandardSave(state)`` (orbax's form) is taken too, so an
    orbax loop ports with only its manager's construction changed.

    ``force=True`` snapshots ``step`` whatever the interval and the plan say
    and, with a directory and no ``persist_interval_steps``, persists it.

    Returns False (and counts it in ``stats``) when ``step`` is off the save
    interval, or is not snapshotted by the job's save plan. Every process of a
    job snapshots the same steps and persists the same ones
    (:mod:`jaxckpt.host._schedule`): in a job of several processes the plan
    spaces snapshots so that the previous copy is done when the next starts;
    in a one-process job a snapshot is skipped while the previous one is still
    being copied and ``on_busy="skip"`` (logged at WARNING with the running
    count). A save that is not skipped never is: a snapshot due for storage,
    one the job's plan takes, and any with ``on_busy="wait"`` wait for the
    previous copy and a free slot (at most ``timeout_secs``, or
    ``busy_timeout_secs`` with ``on_busy="wait"``); SnapshotTimeoutError names
    the step and what was late. A snapshot of ``step`` discards held snapshots
    of steps >= ``step`` (they belong to a timeline that was rolled back).
    """
    t0 = time.perf_counter()
    self._check_open("save")
    if _items.is_composite(args) and state is None:
      state, metadata = _items.to_tree(args, metadata)
      args = None
    state = _orbax_item(state, args, "save", "state", "StandardSave")
    step = check_step(step, "save")
    if not force and step % self.options.save_interval_steps:
      self._raise_background_error(ask_agent=False)
      self.stats.skipped_interval += 1
      return False
    try:
      return self._snapshot(step, state, metadata, force, t0)
    finally:
      self._schedule.blocked(time.perf_counter() - t0)   # not the loop's own time

  def _snapshot(self, step: int, state: Any, metadata: dict[str, Any] | None, force: bool,
                t0: float) -> bool:
    d = self._schedule.decide(step, force=force, persisting=self._persisting())
    self._note_plan()
    # Raised after the decision: this call counts in the job's plan like every other
    # process's, so a loop that goes on after the error takes the job's steps.
    self._raise_background_error(ask_agent=False)
    tree.check_metadata(metadata)          # here, not in the background copy
    if not d.snapshot:
      self.stats.skipped_plan += 1
      return False
    if d.due and step in self._on_storage:
      self._refuse_committed(step)
    if not self.options.host_snapshots:
      if not d.due:
        return False
      self._schedule.took(d)
      return self._save_to_storage(step, state, metadata, t0)
    # May this save skip? Only in a one-process job, and not a due or a waiting one.
    must = self._never_skipped(d)
    if not self._wait_for_previous(step, must):   # before any per-leaf work: skips stay cheap
      return False
    leaves, _ = tree.flatten(state)
    plan = self._planner.plan(leaves)
    slot = self._store.reserve(step, plan.nbytes, timeout_secs=self._reserve_timeout(must))
    self.stats.agent_restarts = self._store.restarts
    if slot is None:
      self._no_slot(step, must)
      return False
    try:
      sources = capture.start(leaves, plan)
    except BaseException:
      self._store.abort(slot)
      raise
    self._schedule.took(d)
    attempt = self._new_attempt(step) if d.due else None
    self._pending_due = attempt is not None
    self._pending = self._pool.submit(self._complete, step, plan, sources, slot,
                                      metadata, t0, attempt)
    self._last_save_at = t0
    self.stats.started += 1
    self.stats.last_blocking_secs = time.perf_counter() - t0
    return True

  def _persisting(self) -> bool:
    """Whether a persist this manager started has not ended, as last heard (no request);
    a due snapshot still being copied counts (its persist starts at its commit)."""
    if not self._attempts:
      return False
    pending = self._pending
    if self._pending_due and pending is not None and not pending.done():
      return True
    return any(s in self._attempts and s not in self._on_storage    # (seen committed)
               for s in self._store.persist_status(ask=False).pending)

  def _never_skipped(self, d: _schedule.Decision) -> str | None:
    """Why a save that was decided may not be skipped (None: it may)."""
    if d.due:
      return "due for storage"
    if self._schedule.agreed:
      return "in the job's save plan: every process snapshots it"
    return "on_busy='wait'" if self.options.on_busy == "wait" else None

  def _no_slot(self, step: int, must: str | None) -> None:
    """A save found no free slot: skipped if it may be, else raises."""
    status = self._store.persist_status()
    if status.pending:
      age = time.time() - status.oldest_since if status.oldest_since else 0.0
      held = (f"every slot is held: persists of steps {list(status.pending)} to "
              f"{self.directory!r} have not ended (the oldest was committed {age:.1f} s ago)")
    else:
      held = ("every slot is held by a committed step: one a restore still reads, or the "
              "newest step protected by parity, kept until a newer one is protected")
    if must:
      raise errors.SnapshotTimeoutError(
          f"save(step={step}) ({must}: never skipped): no slot of "
          f"{self._store_name()} freed up within {self._reserve_timeout(True)} s: {held}; "
          "storage is slower than the loop: persist less often (persist_interval_steps), keep "
          "more snapshots (max_snapshots) or wait longer (timeout_secs)")
    self._skip_busy(step, "no snapshot slot is free (persists in flight)" if status.pending
                    else "no snapshot slot is free", detail=held)

  def _save_to_storage(self, step: int, state: Any, metadata: dict[str, Any] | None,
                       t0: float) -> bool:
    """A storage-only save (``host_snapshots=False``): see :mod:`jaxckpt._storage_only`."""
    leaves, _ = tree.flatten(state)
    attempt = self._new_attempt(step)
    try:
      staged = _storage_only.save(
          self.directory, step, leaves, self._planner,
          budget=self.options.host_memory_limit_bytes or _storage_only.DEFAULT_STAGING_BYTES,
          attempt=attempt, process=self._process, metadata=metadata,
          timeout_secs=self.options.timeout_secs, max_to_keep=self.options.max_to_keep)
    except BaseException:
      _persist.discard_quietly(self.directory, step, attempt)   # what it wrote is unreachable
      raise
    self._on_storage.add(step)
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

  def _reserve_timeout(self, must: str | bool | None) -> float:
    """How long a save waits for the previous copy and a slot: 0 if it may skip."""
    if not must:
      return 0.0
    return self.options.busy_timeout_secs if self.options.on_busy == "wait" else \
        self.options.timeout_secs

  def _wait_for_previous(self, step: int, must: str | None) -> bool:
    pending = self._pending
    if pending is None or pending.done():
      return True
    if not must:
      if self._done_within_grace(pending):
        self._raise_background_error(ask_agent=False)
        return True
      self._skip_busy(step, "the previous snapshot is still being copied")
      return False
    self._wait(pending, self._reserve_timeout(True), f"save of step {step} ({must}: never skipped)")
    self._raise_background_error(ask_agent=False)
    return True

  def _done_within_grace(self, pending: concurrent.futures.Future) -> bool:
    """Waits for a copy that is nearly done, at most a tenth of the time the loop
    took since the last save (a loaded machine's jitter, not a stall)."""
    grace = min(SKIP_GRACE_FRACTION * (time.perf_counter() - self._last_save_at),
                SKIP_GRACE_MAX_SECS)
    done, _ = concurrent.futures.wait([pending], timeout=max(grace, 0.0))
    return bool(done)

  def _note_plan(self) -> None:
    """Keeps ``stats`` current with the job's plan (several processes); says when it
    changes."""
    if not self._schedule.agreed:
      return
    p, st = self._schedule.plan, self.stats
    if (p.snapshot_every, p.persist_every) != (st.snapshot_every, st.persist_every):
      logger.info("the job now snapshots every %d save calls%s", p.snapshot_every,
                  "" if not self._schedule.auto_persist else
                  " and persists no more snapshots until a persist is measured"
                  if p.persist_every is None else
                  f" and persists every {p.persist_every} snapshots")
      st.snapshot_every, st.persist_every = p.snapshot_every, p.persist_every

  def _skip_busy(self, step: int, why: str, detail: str = "") -> None:
    self.stats.skipped_busy += 1
    self.stats.skip_reasons[why] = self.stats.skip_reasons.get(why, 0) + 1
    logger.warning("step %d: save skipped: %s (%d skipped so far; saves due for storage wait "
                   "instead)", step, detail or why, self.stats.skipped_busy)

  def _note_persist_lag(self, step: int) -> None:
    """Updates ``stats``' persist lag after ``step`` committed; logs when it grows."""
    status = self._store.persist_status(ask=False)
    now = time.monotonic()
    for s, at in list(self._committed_at.items()):
      if s not in status.pending:             # ended: persisted, failed or fenced
        self._schedule.measure.persist.append(now - at)
        del self._committed_at[s]
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
          "are skipped and due ones wait", st.persists_pending, self.directory,
          st.oldest_unpersisted_step, st.persist_lag_secs, st.persist_lag_steps)

  def should_save(self, step: int) -> bool:
    """Whether ``save(step)`` now would save, exactly: the manager is open,
    ``step`` is on the save interval and the job's save plan snapshots it
    (storage-only: it is due for storage); in a one-process job with
    ``on_busy="skip"``, a step not due for storage is also refused while the
    previous snapshot is still being copied, or when no snapshot slot is free
    (persists hold them). A save that may not skip (due for storage, in a job
    of several processes, or ``on_busy="wait"``) is True: it waits, bounded.
    """
    step = check_step(step, "should_save")
    if self._closed or step % self.options.save_interval_steps:
      return False
    d = self._schedule.peek(step, persisting=self._persisting())
    if not d.snapshot or not self.options.host_snapshots:
      return d.snapshot and d.due
    if d.due or self._schedule.agreed or self.options.on_busy == "wait":
      return True
    pending = self._pending
    if pending is not None and not pending.done() and not self._done_within_grace(pending):
      return False
    return self._store.has_free_slot()

  def _new_attempt(self, step: int) -> str:
    """This run's next persist attempt of ``step`` (the same on every process)."""
    nth = self._persist_counts.get(step, 0)
    self._persist_counts[step] = nth + 1
    attempt = self._attempts[step] = _persist.attempt_id(self._run_id, step, nth)
    return attempt

  def _refuse_committed(self, step: int) -> None:
    """Raises StepExistsError if ``step`` is committed on storage (checked there)."""
    if step not in _tiers.storage_steps(self.directory):   # deleted since (gc, delete)
      self._on_storage.discard(step)
      return
    raise errors.StepExistsError(
        f"save(step={step}): step {step} is already committed in {self.directory!r} "
        f"(persist attempt {universal.committed_by(self.directory, step)!r}), by another job "
        "or by this job before a rollback; a save never overwrites a committed step, so "
        f"nothing was saved. Delete it first (jaxckpt.universal.discard_step("
        f"{self.directory!r}, {step})), or persist into another directory")

  def _complete(self, step, plan, sources, slot, metadata, t0, attempt) -> None:
    try:
      manifest = capture.complete(
          plan, sources, slot.buffer, step=step, process_index=self._process[0],
          process_count=self._process[1], metadata=metadata, pool=self._copy_pool)
      del sources                     # release the device-buffer views at once
      self._store.commit(slot, manifest, persist_attempt=attempt)
      if attempt is not None:
        self._committed_at[step] = time.monotonic()
    except BaseException as e:  # surfaced by the next save / wait
      self._store.abort(slot)
      logger.exception("step %d: snapshot failed", step)
      with self._lock:
        self._error = e
      return
    self.stats.committed += 1
    self.stats.last_snapshot_secs = time.perf_counter() - t0
    self._schedule.measure.copy.append(self.stats.last_snapshot_secs)
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
      self._wait_for_persists(timeout, "wait_until_finished")

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
    self._raise_persist_error(ask_agent=ask_agent)

  def _raise_persist_error(self, *, ask_agent: bool = True) -> None:
    """Raises the first error of a background persist (this process's or its agent's).

    Without ``ask_agent`` (``save()``: no request on the save path) an agent's
    errors are those its commit replies brought back.
    """
    if self._persist_config is None:
      return
    self._raise_failed(self._store.persist_errors(ask=ask_agent))

  def _raise_failed(self, failed: list[Any]) -> None:
    failed = [e for e in failed if e.attempt not in self._told]   # raised once only
    self._told.update(e.attempt for e in failed)
    earlier = [e for e in failed if not _persist.of_run(e.attempt, self._run_id)]
    for e in earlier:         # an earlier run's (its agent outlived it): not this run's save
      logger.error("a persist of step %d by an earlier run (attempt %s) failed: %s; that "
                   "step is not on storage", e.step, e.attempt, e.message)
    failed = [e for e in failed if e not in earlier]
    if failed:
      where = (f"process {self._process[0]}" + ("" if self.options.agent is None
                                                else ", in its snapshot agent"))
      first = failed[0].exception(f"{where}, to {self.directory!r}")
      for other in failed[1:]:
        logger.error("also: persisting step %d failed: %s", other.step, other.message)
      raise first

  def _wait_for_persists(self, timeout: float, what: str) -> None:
    """Waits until the store's persists of the steps this manager saved for
    storage have ended (persisted, failed or fenced), then raises the first failure."""
    want = {s for s, a in self._attempts.items() if a not in self._told}
    failed: list[Any] = []

    def ended() -> bool:
      failed.extend(self._store.persist_errors())
      return not want & set(self._store.persist_status().pending)

    def late() -> str:
      self._raise_failed(failed)          # a failure said first: it is why, not the wait
      left = sorted(want & set(self._store.persist_status(ask=False).pending))
      who = "; ".join(_persist.who_is_late(self.directory, s, self._attempts[s], self._process[1])
                      for s in left if s in self._attempts)
      return (f"{what}: steps {left} were not persisted to {self.directory!r} within {timeout} "
              f"s: {who} ({self._store_name()} of process {self._process[0]} goes on trying)")
    if want:
      _wait.until(ended, timeout_secs=timeout, late=late)
    self._raise_failed(failed)

  def _store_name(self) -> str:
    return "the in-process store" if self.options.agent is None else "the snapshot agent"

  # -- what is held ---------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Restorable steps: complete on every host that saved them, rebuildable from
    the survivors' parity (parity on), or on storage."""
    self._check_open("all_steps")
    held = _tiers.complete_steps(self._store)
    rebuilt = _tiers.rebuildable_steps(held, self._store) if self.options.parity else []
    return sorted(set(held) | set(rebuilt) | set(_tiers.storage_steps(self.directory)))

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
    if self.directory is None:
      raise errors.InvalidArgumentError(
          "wait_until_persisted(): this manager has no directory; pass "
          "CheckpointManager(directory=...) to persist")
    if step is not None:
      step = check_step(step, "wait_until_persisted")
    self.wait_until_snapshotted()
    if step is None:
      if not self._attempts:
        return
      step = max(self._attempts)
    attempt = self._attempts.get(step)
    timeout = timeout_secs or self.options.timeout_secs

    def stored() -> bool:
      self._raise_persist_error()
      if step in _tiers.storage_steps(self.directory):
        by = universal.committed_by(self.directory, step)
        if attempt is None or by == attempt:
          return True
        self._told.add(attempt)
        raise errors.StepExistsError(
            f"step {step} is already committed in {self.directory!r} by persist attempt "
            f"{by!r}, not by this manager's ({attempt!r}): another writer got there first; "
            "this manager's snapshot of it was not stored")
      if attempt is None:
        raise errors.StepNotFoundError(
            f"wait_until_persisted(step={step}): this manager never saved step {step} for "
            f"storage and it is not on {self.directory!r}")
      return False

    def late() -> str:
      who = _persist.who_is_late(self.directory, step, attempt, self._process[1])
      return (f"step {step} was not persisted to {self.directory!r} within {timeout} s: {who} "
              f"(persist attempt {attempt!r})")
    _wait.until(stored, timeout_secs=timeout, late=late)
    self._on_storage.add(step)

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

  def metadata(self, step: int | None = None) -> _read.StepMetadata:
    """The structure of ``step`` (default: the newest): every leaf's kind, shape,
    dtype and saving sharding, and the user metadata saved with it, from the
    host tier when the job's agents hold the step (this host's or another's),
    from the survivors' parity records when it can be rebuilt, else from
    storage: every step ``all_steps()`` lists. Reads no array bytes.

    Raises:
      StepNotFoundError: no tier of the job holds ``step``.
    """
    self._check_open("metadata")
    step = self.latest_step() if step is None else check_step(step, "metadata")
    if step is None:
      raise errors.StepNotFoundError("metadata(): no step is held on any tier")
    tier, records, meta = _tiers.describe(self._store, self.directory, step)
    leaves = {r.path: _leaf_metadata(r) for r in records}
    return _read.StepMetadata(step, tier, tree.nest(leaves), dict(meta))

  def delete(self, step: int) -> None:
    """Deletes ``step`` from every tier, for good: this host's snapshot (a
    restore reading it keeps its copy until done), its persist (a queued one
    never runs, a running one never commits: delete waits for it to end) and
    storage (from process 0; with agents, from any process: its delete reaches
    every host's agent, snapshot, parity and persist, so the step is gone from
    the job whichever process deletes it first and however long before the
    others). No tier holds it afterwards, nor commits it later; a failed
    persist of it (a peer gave up on it) is never raised.

    Raises:
      StepNotFoundError: no tier holds ``step`` (nor did another host's delete
        of it come first).
    """
    self._check_open("delete")
    step = check_step(step, "delete")
    if self._pending is not None:      # the snapshot in flight (its errors: raised later)
      self._wait(self._pending, self.options.timeout_secs, "delete")
    # Fenced first: a queued persist of the step never runs, a running one never
    # commits, and discard returns once it has ended; only then is storage cleared.
    held = self._store.discard(step, timeout_secs=self.options.timeout_secs)
    attempt = self._attempts.pop(step, None)
    fenced = attempt is not None
    if fenced:
      self._told.add(attempt)                 # its persist's failure is moot now
    stored = self.directory is not None and step in _tiers.storage_steps(self.directory)
    if stored and (self._process[0] == 0 or self._store.fences_job):
      universal.discard_step(self.directory, step)
    if not (held or stored or fenced):
      raise errors.StepNotFoundError(f"delete(): step {step} is not held on any tier")
    self._on_storage.discard(step)
    logger.info("deleted step %d (host: %s, storage: %s)", step, held, stored)

  # -- restoring ------------------------------------------------------------

  def restore(self, step: int | None = None, target: Any = None, *, args: Any = None,
              partial: bool = False) -> Any:
    """Restores ``step`` (the newest when None) onto ``target``'s structure and shardings.

    ``args=ocp.args.StandardRestore(target)`` (orbax's form) is taken too.

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
    if step is not None:
      step = check_step(step, "restore")
    if _items.is_composite(args) and target is None:
      step = self.latest_step() if step is None else step
      if step is None:
        raise errors.StepNotFoundError("restore(): no step is held on any tier; save first")
      meta = self.metadata(step)
      return _items.restore(args, meta.metadata,
                            lambda t: self.restore(step, t, partial=partial),
                            lambda name: meta.tree[name])
    target = _orbax_item(target, args, "restore", "target", "StandardRestore", required=False)
    self.wait_until_snapshotted()
    out, self.last_restore = _tiers.restore(self._store, self.directory, step, target,
                                            partial=partial,
                                            timeout_secs=self.options.timeout_secs)
    if target is None:
      out = tree.nest(out)
    return out

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
        self._wait_for_persists(self.options.timeout_secs, "close")
      self._raise_background_error()
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


def _leaf_metadata(rec: Any) -> _read.LeafMetadata:
  """What ``metadata()`` says of a saved leaf (a host LeafRecord or a stored LeafInfo)."""
  return _read.LeafMetadata(rec.kind, tuple(rec.shape), rec.dtype, rec.sharding,
                               tree.scalar_from_json(rec.value), rec.key_impl)


def _orbax_item(given: Any, args: Any, verb: str, name: str, orbax_cls: str, *,
                required: bool = True) -> Any:
  """``given``, or the tree inside orbax's ``args`` (``StandardSave(tree)``,
  ``StandardRestore(tree)``, ``PyTreeSave``: anything with ``.item``)."""
  if args is None:
    if required and given is None:
      raise errors.InvalidArgumentError(f"{verb}() needs the {name}: {verb}(step, {name})")
    return given
  if given is not None:
    raise errors.InvalidArgumentError(
        f"{verb}() got both {name}= and args=; pass one (args=ocp.args.{orbax_cls}({name}) is "
        f"the orbax form of {name}=)")
  try:
    return args.item
  except (AttributeError, KeyError):
    raise errors.InvalidArgumentError(
        f"{verb}(args={type(args).__name__}(...)): jaxckpt takes one tree per step, as "
        f"args=ocp.args.{orbax_cls}(tree), {name}=tree, or several items as "
        "args=ocp.args.Composite(name=ocp.args.StandardSave(...), ...)") from None


def _owner_name() -> str:
  """What names a manager to its agent (the lease holder a second manager is told of)."""
  return (f"the CheckpointManager {uuid.uuid4().hex[:8]} of pid {os.getpid()} (thread "
          f"{threading.current_thread().name!r}, made at {time.strftime('%H:%M:%S')})")


def _agree_run_id(timeout_secs: float) -> str:
  """A run id that every process of the job gets alike (process 0 picks it)."""
  if jax.process_count() == 1:
    return _persist.new_run_id()
  return _kv.broadcast_from_0("run_id", _persist.new_run_id, timeout_secs=timeout_secs)
