"""The gradient ring and the digest chain that names a replica group's state.

Every committed step ``s`` moves a group's state from step ``s`` to ``s + 1``
with one averaged gradient. Groups that start from the same state and apply the
same averaged gradients hold bit-identical state, so the state at step ``s`` is
named by a digest chain: ``digest(s + 1) = xxh3_64(digest(s), grads(s))``.
Healthy groups keep the averaged gradients of their most recent steps in a
bounded :class:`GradientRing`, so a group that missed a few steps can replay
them instead of fetching a whole snapshot.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Sequence

import numpy as np
import xxhash

from jaxckpt import errors

INITIAL_DIGEST = 0
"""Digest of step 0: every group must start from the same initial state."""


def chain_digest(previous: int, leaves: Sequence[np.ndarray]) -> int:
  """The digest after applying ``leaves`` (an averaged gradient) to a state named ``previous``."""
  h = xxhash.xxh3_64(previous.to_bytes(8, "little"))
  for leaf in leaves:
    h.update(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
  return h.intdigest()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RingEntry:
  """The averaged gradient that moved the state from ``step`` to ``step + 1``."""
  step: int
  digest_before: int
  digest_after: int
  leaves: tuple[np.ndarray, ...]
  batches_after: int = 0          # batches the job's commits up to and with this step consumed


class GradientRing:
  """A thread-safe, bounded map from step to :class:`RingEntry` (oldest dropped first).

  >>> ring = GradientRing(capacity=2)
  >>> for s in range(3):
  ...   ring.put(RingEntry(step=s, digest_before=s, digest_after=s + 1, leaves=()))
  >>> ring.steps()
  (1, 2)
  """

  def __init__(self, capacity: int):
    if capacity < 1:
      raise errors.InvalidArgumentError(f"GradientRing capacity must be >= 1, got {capacity=}")
    self.capacity = capacity
    self._entries: collections.OrderedDict[int, RingEntry] = collections.OrderedDict()
    self._lock = threading.Lock()

  def put(self, entry: RingEntry) -> None:
    with self._lock:
      self._entries.pop(entry.step, None)
      self._entries[entry.step] = entry
      while len(self._entries) > self.capacity:
        self._entries.popitem(last=False)

  def get(self, step: int) -> RingEntry | None:
    with self._lock:
      return self._entries.get(step)

  def steps(self) -> tuple[int, ...]:
    with self._lock:
      return tuple(self._entries)

  def covers(self, start: int, digest: int, stop: int) -> bool:
    """Whether steps ``start .. stop - 1`` are held and chain on from ``digest``."""
    with self._lock:
      for s in range(start, stop):
        entry = self._entries.get(s)
        if entry is None or entry.digest_before != digest:
          return False
        digest = entry.digest_after
      return True


class DigestLog:
  """Thread-safe, bounded record of the digest of each step a group reached."""

  def __init__(self, capacity: int = 1 << 16):
    self._digests: collections.OrderedDict[int, int] = collections.OrderedDict()
    self._capacity = capacity
    self._lock = threading.Lock()

  def record(self, step: int, digest: int) -> None:
    with self._lock:
      self._digests.pop(step, None)
      self._digests[step] = digest
      while len(self._digests) > self._capacity:
        self._digests.popitem(last=False)

  def get(self, step: int) -> int | None:
    with self._lock:
      return self._digests.get(step)
