"""The persistent tier's writer: every N-th committed snapshot to the universal format.

Runs wherever the snapshots live: in the agent process when there is one
(never in the trainer), else in a background thread of the trainer. Writes
never block a save: they run on their own thread, from the committed slot,
which stays pinned until its bytes are on storage. GC of old steps runs on the
same thread after each commit and never blocks a save either.

Every persist is an *attempt* with an id that all processes of the job give
it alike (the job's run id, the step and how often this run saved the step),
so its part records and data never mix with another attempt's. An error is
kept (typed, with its cause) and handed to the trainer, which raises it from
its next ``save()``, ``wait_until_finished()``, ``wait_until_persisted()`` or
``close()``.

The writes go through the storage handed in (:class:`PersistStorage`: the
universal format, ``jaxckpt.universal``): this module imports nothing above
the host tier, and an agent that never persists never imports JAX.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import threading
import time
import uuid
from typing import Any, Callable, ContextManager, Iterable, Protocol

import msgspec
import numpy as np

from jaxckpt import errors
from jaxckpt.host.snapshot import SnapshotManifest

logger = logging.getLogger(__name__)


class PersistStorage(Protocol):
  """What a persist needs of storage: write a process's part, commit (process 0),
  wait for process 0's commit, gc, and remove a losing attempt. The universal
  format's package (``jaxckpt.universal``) is the one implementation; whoever
  runs a persister hands it in (the agent, the trainer's in-process store)."""

  def write_process_shards(self, directory: str, manifest: SnapshotManifest, buffer: np.ndarray, *,
                           attempt: str) -> None: ...

  def commit_step(self, directory: str, step: int, *, process_count: int, timeout_secs: float,
                  attempt: str, check: Callable[[], None] = ...) -> None: ...

  def wait_committed(self, directory: str, step: int, attempt: str, process_index: int,
                     process_count: int, *, timeout_secs: float,
                     check: Callable[[], None] = ...) -> None: ...

  def gc_steps(self, directory: str, *, max_to_keep: int,
               keep: Iterable[int] = ()) -> list[int]: ...

  def discard_attempt(self, directory: str, step: int, attempt: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class PersistConfig:
  """Where and how often to persist (sent by the trainer to its agent)."""

  directory: str
  interval_steps: int
  max_to_keep: int | None = None
  timeout_secs: float = 300.0
  # A process other than 0 holds the step until process 0 has committed it (with
  # parity: its snapshot and parity then rebuild a peer lost before the commit).
  hold_until_committed: bool = False

  def to_obj(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class PersistError(msgspec.Struct, frozen=True):
  """A failed persist: which step and attempt, and the error (its jaxckpt type and errno
  kept). It crosses from an agent to its trainer as it is (a reply's typed field)."""

  step: int
  attempt: str
  type: str
  message: str
  errno: int | None = None

  @classmethod
  def of(cls, step: int, attempt: str, e: BaseException) -> "PersistError":
    if not isinstance(e, errors.JaxckptError):
      e = errors.StorageError(*((e.errno, f"{type(e).__name__}: {e.strerror}")
                                if isinstance(e, OSError) and e.errno else
                                (f"{type(e).__name__}: {e}",)))
    return cls(step, attempt, type(e).__name__,
               e.strerror if isinstance(e, OSError) and e.errno else str(e),
               e.errno if isinstance(e, OSError) else None)

  def exception(self, where: str) -> BaseException:
    """The error to raise in the trainer: the same jaxckpt class, errno and message."""
    cls = getattr(errors, self.type, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.JaxckptError)):
      cls = errors.StorageError
    msg = f"persisting step {self.step} ({where}) failed: {self.message}"
    if self.errno and issubclass(cls, OSError):
      return cls(self.errno, msg)
    return cls(msg)


def attempt_id(run_id: str, step: int, nth: int) -> str:
  """The id of the ``nth`` persist of ``step`` by the run ``run_id`` (same on every process)."""
  return f"{run_id}-s{step}-{nth}"


def of_run(attempt: str, run_id: str | None) -> bool:
  """Whether ``attempt`` (an :func:`attempt_id`) is one of run ``run_id``'s."""
  return run_id is not None and attempt.startswith(f"{run_id}-s")


def new_run_id() -> str:
  return "r" + uuid.uuid4().hex[:16]


class PendingAttempt(msgspec.Struct, frozen=True, array_like=True):
  """A pending persist: its step, attempt and directory (an agent's may be of a trainer's
  earlier persist options: another directory than the present one). On the wire
  ``[step, attempt, directory]``; an agent of an older jaxckpt (still holding a job's
  snapshots) sends ``[step, attempt]``: its directory is then ``""``, the asking
  trainer's own, as it then meant."""

  step: int
  attempt: str
  directory: str = ""


class PersistStatus(msgspec.Struct, frozen=True):
  """Where a store's persists stand: what is queued or running (oldest first),
  since when the oldest has waited, and what was persisted. It crosses from an agent
  to its trainer as it is (a reply's typed field)."""

  pending: tuple[int, ...] = ()
  oldest_since: float | None = None      # time.time() the oldest pending step was committed
  persisted: tuple[int, ...] = ()
  attempts: tuple[PendingAttempt, ...] = ()    # each pending persist's


# A storage error with no errno (a timeout, an object store's HTTP failure) or one
# of these is worth trying again; a full disk or a refused permission is not.
_TRANSIENT = frozenset({None, errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNRESET,
                        errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH})
#: A full or read-only filesystem is not tried again: the persist fails at once (a
#: tensorstore error carries no errno, only its message).
_PERMANENT = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
              errno.EROFS: "Read-only file system"}


def _transient(e: errors.StorageError) -> bool:
  """Whether a persist that failed with ``e`` is tried again (until its timeout)."""
  if e.errno in _PERMANENT or any(text in str(e) for text in _PERMANENT.values()):
    return False
  return e.errno in _TRANSIENT


def persist_part(config: PersistConfig, manifest: SnapshotManifest, buffer: np.ndarray, attempt: str,
                 check: Callable[[], None], *, storage: PersistStorage) -> None:
  """Writes this process's part of ``attempt`` to ``storage`` and, as process 0,
  commits the step and runs gc: what every persist does (a Persister's, and one
  rebuilt from parity after a lost agent). With ``hold_until_committed`` (parity
  on) any other process then waits for that commit, so that it holds its snapshot
  (and the parity that rebuilds a lost peer's) until the step is on storage whole.
  ``check`` raises to stop it before the commit marker."""
  storage.write_process_shards(config.directory, manifest, buffer, attempt=attempt)
  check()
  if manifest.process_index != 0:
    if config.hold_until_committed:
      storage.wait_committed(config.directory, manifest.step, attempt, manifest.process_index,
                             manifest.process_count, timeout_secs=config.timeout_secs,
                             check=check)
    return
  storage.commit_step(config.directory, manifest.step, process_count=manifest.process_count,
                      timeout_secs=config.timeout_secs, attempt=attempt, check=check)
  if config.max_to_keep:
    storage.gc_steps(config.directory, max_to_keep=config.max_to_keep, keep=(manifest.step,))


class Cancelled(Exception):
  """A persist attempt fenced by a delete or a rollback: it must not commit."""


@dataclasses.dataclass
class _Job:
  step: int
  attempt: str
  since: float
  config: PersistConfig                # the configuration it was submitted under
  running: bool = False
  cancelled: bool = False
  process_index: int | None = None     # the manifest's, once the step was opened


class Persister:
  """Persists committed snapshots on a background thread, oldest first.

  The store holds a due step's slot from its commit (``SlotTable.commit(...,
  hold=True)``) and calls :meth:`submit`; ``open_step(step)`` must return a
  context manager yielding the step's (manifest, buffer) with its slot pinned,
  and ``release(step)`` is called once the persist has ended, whatever its
  outcome, so the store can hand the slot out again (both are also given the
  persist's attempt as ``attempt=``: a step number alone may name another run's). ``storage()`` returns the
  storage to write to (:class:`PersistStorage`); it is called on the persist
  thread when a persist runs, so a process that never persists never loads it.

  :meth:`fence` cancels every attempt of a step submitted so far (a delete, or
  a rollback that dropped it): a queued one never starts, a running one never
  commits (its commit checks the fence up to the moment it writes the marker),
  and :meth:`busy` says when the last of them has ended.

  :meth:`disown` marks the persists of an earlier run of the job (an agent's new
  run): they go on, but are no longer the present run's: its fences, ``busy``,
  status and errors leave them out (their errors are logged).
  """

  def __init__(self, config: PersistConfig,
               open_step: Callable[..., ContextManager[tuple[SnapshotManifest, np.ndarray]]],
               release: Callable[..., None] = lambda step, attempt=None: None, *,
               storage: Callable[[], PersistStorage]) -> None:
    self.config = config
    self._open_step = open_step
    self._release = release
    self._storage = storage
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-persist")
    self._lock = threading.Lock()
    self._jobs: dict[str, _Job] = {}          # attempt -> job, queued or running
    self._ended = threading.Condition(self._lock)
    self.persisted: list[int] = []
    self.cancelled = 0
    self._errors: list[PersistError] = []
    self._foreign: set[str] = set()           # attempts of an earlier run (disown)

  def configure(self, config: PersistConfig) -> None:
    """Persists submitted from now on follow ``config`` (a trainer relaunched with
    other options); those submitted before keep theirs, and stay in this
    persister's status, fences and errors: one queue per store, whatever its
    configurations."""
    with self._lock:
      self.config = config

  def submit(self, step: int, attempt: str) -> None:
    """Schedules ``step``'s persist as ``attempt`` (its slot is held); returns at once."""
    with self._lock:
      self._jobs[attempt] = _Job(step, attempt, time.time(), self.config)
    self._pool.submit(self._run, attempt)

  def disown(self, attempts: set[str]) -> None:
    """``attempts`` are those of earlier runs (see the class docstring); any other,
    one a run that came back takes back included, is the present run's."""
    with self._lock:
      self._foreign = set(attempts)

  def _ours(self) -> list[_Job]:
    return [j for j in self._jobs.values() if j.attempt not in self._foreign]

  def fence(self, step: int) -> bool:
    """Cancels every attempt of ``step`` submitted so far; True while one of them runs."""
    with self._lock:
      jobs = [j for j in self._ours() if j.step == step]
      for j in jobs:
        j.cancelled = True
      return any(j.running for j in jobs)

  def busy(self, step: int) -> bool:
    """Whether an attempt of ``step`` is queued or running."""
    with self._lock:
      return any(j.step == step for j in self._ours())

  def status(self) -> PersistStatus:
    with self._lock:
      jobs = sorted((j for j in self._ours() if not j.cancelled), key=lambda j: j.since)
      return PersistStatus(tuple(sorted(j.step for j in jobs)),
                           jobs[0].since if jobs else None, tuple(self.persisted),
                           tuple(PendingAttempt(*a) for a in sorted(
                               (j.step, j.attempt, j.config.directory) for j in jobs)))

  def directories(self) -> list[str]:
    """Where this persister writes: its present directory and those of the persists
    still queued or running under earlier options (a delete of a step in any of
    them must reach it)."""
    with self._lock:
      return sorted({self.config.directory, *(j.config.directory for j in self._jobs.values())})

  def _run(self, attempt: str) -> None:
    with self._lock:
      job = self._jobs[attempt]
      job.running = True
    try:
      self._persist(job)
    finally:
      try:
        if not job.cancelled:     # a fenced job's slot went with its step (a new save of the
          self._release(job.step, attempt=job.attempt)   # same step may hold one now)
      except Exception:  # pylint: disable=broad-except  (the store is closing)
        logger.exception("step %d: releasing its slot after its persist failed", job.step)
      with self._lock:
        del self._jobs[attempt]
        self._foreign.discard(attempt)
        self._ended.notify_all()

  def _check(self, job: _Job) -> None:
    if job.cancelled:
      raise Cancelled(job.step)

  def _persist(self, job: _Job) -> None:
    directory, step, attempt = job.config.directory, job.step, job.attempt
    t0 = time.monotonic()
    try:
      nbytes = self._write_and_commit(job)
      with self._lock:
        if attempt not in self._foreign:
          self.persisted.append(step)
      secs = time.monotonic() - t0
      logger.info("step %d persisted to %s: %.1f MiB in %.2f s (%.3g GB/s; attempt %s)", step,
                  directory, nbytes / 2**20, secs, nbytes / max(secs, 1e-9) / 1e9, attempt)
    except Cancelled:
      if job.process_index == 0:  # process 0 owns the attempt's data: only it removes it
        discard_quietly(self._storage(), directory, step, attempt)
      with self._lock:
        self.cancelled += 1
      logger.info("step %d: persist attempt %s cancelled (the step was deleted or rolled "
                  "back)", step, attempt)
    except Exception as e:  # pylint: disable=broad-except  (handed to the trainer)
      if job.process_index == 0:  # (another's failure is process 0's to clean up: it may
        # still commit) never the committed data
        discard_quietly(self._storage(), directory, step, attempt)
      if job.cancelled:
        logger.info("step %d: fenced persist attempt %s ended: %s", step, attempt, e)
        return
      logger.error("step %d: persisting to %s failed: %s", step, directory, e)
      with self._lock:
        if attempt not in self._foreign:       # (an earlier run's: its trainer is gone)
          self._errors.append(PersistError.of(step, attempt, e))

  def _write_and_commit(self, job: _Job) -> int:
    """Writes this process's part and (process 0) commits; returns the snapshot's
    bytes. A storage that does not
    answer or refuses for a while is tried again, with backoff, for up to the
    persist's ``timeout_secs`` (writes of one attempt are idempotent)."""
    config = job.config
    directory, step, attempt = config.directory, job.step, job.attempt
    deadline = time.monotonic() + config.timeout_secs
    pause = 0.5
    while True:
      self._check(job)
      try:
        with self._open_step(step, attempt=attempt) as (manifest, buffer):
          job.process_index = manifest.process_index
          persist_part(config, manifest, buffer, attempt, lambda: self._check(job),
                       storage=self._storage())
          return manifest.nbytes
      except errors.StorageError as e:
        if not _transient(e) or time.monotonic() + pause > deadline or job.cancelled:
          raise
        logger.warning("step %d: storage %s failed (%s); trying again in %.1f s", step,
                       directory, e, pause)
        time.sleep(pause)
        pause = min(pause * 2, 8.0)

  def take_errors(self) -> list[PersistError]:
    """The errors since the last call (each is handed out once)."""
    with self._lock:
      out, self._errors = self._errors, []
    return out

  def wait_idle(self, timeout_secs: float, *, step: int | None = None) -> bool:
    """Waits until no persist (of ``step``, or of any step) is queued or running."""
    deadline = time.monotonic() + timeout_secs
    with self._lock:
      while any(step is None or (j.step == step and j.attempt not in self._foreign)
                for j in self._jobs.values()):
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._ended.wait(left)
    return True

  def close(self, timeout_secs: float | None = None) -> None:
    """Waits up to ``timeout_secs`` (default: the longest timeout of the persists
    queued or running, and of the present options) for the queued persists, then
    stops the thread."""
    if timeout_secs is None:
      with self._lock:
        timeout_secs = max([self.config.timeout_secs,
                            *(j.config.timeout_secs for j in self._jobs.values())])
    try:
      if not self.wait_idle(timeout_secs):
        with self._lock:
          late = sorted((j.step, j.config.directory) for j in self._jobs.values())
        raise errors.SnapshotTimeoutError(
            "persists of " + ", ".join(f"step {s} to {d!r}" for s, d in late)
            + f" did not finish within {timeout_secs} s")
    finally:
      self._pool.shutdown(wait=True, cancel_futures=True)


def discard_quietly(storage: PersistStorage, directory: str, step: int, attempt: str) -> None:
  """Removes what a losing attempt wrote (best effort: it is unreachable anyway)."""
  try:
    storage.discard_attempt(directory, step, attempt)
  except errors.StepExistsError:
    pass                          # it committed (a later stage failed): keep it
  except Exception as e:  # pylint: disable=broad-except
    logger.warning("step %d: could not remove attempt %s from %s: %s", step, attempt,
                   directory, e)
