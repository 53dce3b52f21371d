"""The persistent tier's writer: every N-th committed snapshot to the universal format.

Runs wherever the snapshots live: in the agent process when there is one
(never in the trainer), else in a background thread of the trainer. Writes
never block a save: they run on their own thread, from the committed slot,
which stays pinned until its bytes are on storage. GC of old steps runs on the
same thread after each commit and never blocks a save either.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any, Callable, ContextManager

from jaxckpt import universal
from jaxckpt.snapshot import SnapshotManifest

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
    self.persisted: list[int] = []
    self.errors: list[str] = []

  def due(self, step: int) -> bool:
    return step % self.config.interval_steps == 0

  def on_commit(self, step: int) -> None:
    """Schedules ``step`` for persistence if it is due; returns at once."""
    if self.due(step):
      self._futures = [f for f in self._futures if not f.done()]
      self._futures.append(self._pool.submit(self._persist, step))

  def _persist(self, step: int) -> None:
    try:
      with self._open_step(step) as (manifest, buffer):
        universal.write_process_shards(self.config.directory, manifest, buffer)
      if manifest.process_index == 0:
        universal.commit_step(self.config.directory, step,
                              process_count=manifest.process_count,
                              timeout_secs=self.config.timeout_secs)
        if self.config.max_to_keep:
          universal.gc_steps(self.config.directory, max_to_keep=self.config.max_to_keep,
                             keep=(step,))
      self.persisted.append(step)
      logger.info("step %d persisted to %s", step, self.config.directory)
    except Exception as e:  # pylint: disable=broad-except  (reported, never fatal to saves)
      logger.exception("step %d: persisting to %s failed", step, self.config.directory)
      self.errors.append(f"step {step}: {type(e).__name__}: {e}")

  def wait(self, timeout_secs: float) -> None:
    for f in list(self._futures):
      f.result(timeout=timeout_secs)

  def close(self, timeout_secs: float) -> None:
    try:
      self.wait(timeout_secs)
    finally:
      self._pool.shutdown(wait=True)
