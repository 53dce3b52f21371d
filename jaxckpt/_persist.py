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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import tempfile
import threading
import uuid
from typing import Any, Callable, ContextManager

from jaxckpt import errors, universal
from jaxckpt.snapshot import SnapshotManifest
from jaxckpt.store import PersistError
from jaxckpt.universal import _layout

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PersistConfig:
  """Where and how often to persist (sent by the trainer to its agent)."""

  directory: str
  interval_steps: int
  max_to_keep: int | None = None
  timeout_secs: float = 300.0

  def to_obj(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def attempt_id(run_id: str, step: int, nth: int) -> str:
  """The id of the ``nth`` persist of ``step`` by the run ``run_id`` (same on every process)."""
  return f"{run_id}-s{step}-{nth}"


def new_run_id() -> str:
  return "r" + uuid.uuid4().hex[:16]


class Persister:
  """Persists committed snapshots on a background thread.

  ``open_step(step)`` must return a context manager yielding the step's
  (manifest, buffer) and keeping its slot pinned until the context exits.
  """

  def __init__(self, config: PersistConfig,
               open_step: Callable[[int], ContextManager[tuple[SnapshotManifest, Any]]]) -> None:
    self.config = config
    self._open_step = open_step
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-persist")
    self._futures: list[concurrent.futures.Future] = []
    self._lock = threading.Lock()
    self.persisted: list[int] = []
    self._errors: list[PersistError] = []

  def due(self, step: int) -> bool:
    return step % self.config.interval_steps == 0

  def on_commit(self, step: int, attempt: str | None) -> None:
    """Schedules ``step`` for persistence under ``attempt`` if it is due; returns at once."""
    if attempt is not None and self.due(step):
      with self._lock:
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._pool.submit(self._persist, step, attempt))

  def _persist(self, step: int, attempt: str) -> None:
    directory = self.config.directory
    try:
      with self._open_step(step) as (manifest, buffer):
        universal.write_process_shards(directory, manifest, buffer, attempt=attempt)
      if manifest.process_index == 0:
        universal.commit_step(directory, step, process_count=manifest.process_count,
                              timeout_secs=self.config.timeout_secs, attempt=attempt)
        if self.config.max_to_keep:
          universal.gc_steps(directory, max_to_keep=self.config.max_to_keep, keep=(step,))
      with self._lock:
        self.persisted.append(step)
      logger.info("step %d persisted to %s (attempt %s)", step, directory, attempt)
    except Exception as e:  # pylint: disable=broad-except  (handed to the trainer)
      discard_quietly(directory, step, attempt)   # never the committed data (it refuses)
      logger.error("step %d: persisting to %s failed: %s", step, directory, e)
      with self._lock:
        self._errors.append(PersistError.of(step, attempt, e))

  def take_errors(self) -> list[PersistError]:
    """The errors since the last call (each is handed out once)."""
    with self._lock:
      out, self._errors = self._errors, []
    return out

  def wait(self, timeout_secs: float) -> None:
    with self._lock:
      futures = list(self._futures)
    done, late = concurrent.futures.wait(futures, timeout=timeout_secs)
    del done
    if late:
      raise errors.SnapshotTimeoutError(
          f"{len(late)} persist(s) to {self.config.directory!r} did not finish within "
          f"{timeout_secs} s")

  def close(self, timeout_secs: float) -> None:
    try:
      self.wait(timeout_secs)
    finally:
      self._pool.shutdown(wait=True)


def discard_quietly(directory: str, step: int, attempt: str) -> None:
  """Removes what a losing attempt wrote (best effort: it is unreachable anyway)."""
  try:
    universal.discard_attempt(directory, step, attempt)
  except errors.StepExistsError:
    pass                          # it committed (a later stage failed): keep it
  except Exception as e:  # pylint: disable=broad-except
    logger.warning("step %d: could not remove attempt %s from %s: %s", step, attempt,
                   directory, e)


def check_directory(directory: str, *, timeout_secs: float) -> None:
  """Fails now, not in a background write, if ``directory`` cannot hold checkpoints.

  A local directory is created if missing and must take a test file; a URL's
  store must answer a listing within ``timeout_secs``.

  Raises:
    InvalidArgumentError: an empty directory string.
    StorageError: naming the path and the cause (errno) and what to do.
  """
  if not isinstance(directory, str) or not directory.strip():
    raise errors.InvalidArgumentError(
        f"directory={directory!r} is empty; pass a path or a URL (s3://bucket/prefix), or "
        "None for host snapshots only")
  local = _layout.local_path(directory)
  if local is None:
    kv = _layout.open_kvstore(directory, timeout_secs=timeout_secs)
    _layout.storage_result(kv.list(_layout.prefix_range(_layout.COMMITS_PREFIX)),
                           "listing the steps", directory, timeout_secs)
    return
  try:
    os.makedirs(local, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".jaxckpt-probe-", dir=local)
    try:
      os.write(fd, b"x")
      os.fsync(fd)
    finally:
      os.close(fd)
      os.unlink(probe)
  except OSError as e:
    raise errors.StorageError(
        e.errno, f"checkpoint directory {local!r} cannot be written ({e.strerror}); "
        "choose a writable directory", local) from None
