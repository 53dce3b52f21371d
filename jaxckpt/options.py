"""Frozen, keyword-only option dataclasses, validated on construction."""

from __future__ import annotations

import dataclasses
import os
import shutil

import psutil

_ON_BUSY = ("skip", "wait")


def default_host_memory_limit_bytes() -> int:
  """Half of the free RAM and of the free space of /dev/shm, whichever is less."""
  free = psutil.virtual_memory().available
  if os.path.isdir("/dev/shm"):
    free = min(free, shutil.disk_usage("/dev/shm").free)
  return free // 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointOptions:
  """How a CheckpointManager snapshots and keeps state.

  Attributes:
    max_snapshots: committed host-memory snapshots kept (the newest is never
      dropped). Host memory holds ``max_snapshots + 1`` slots.
    save_interval_steps: ``save(step)`` snapshots only steps divisible by this
      (``force=True`` overrides).
    on_busy: what ``save()`` does while the previous snapshot is still being
      copied: ``"skip"`` (return False and count the skip) or ``"wait"``.
    busy_timeout_secs: the longest ``on_busy="wait"`` waits.
    host_memory_limit_bytes: budget for all snapshot slots of this process;
      None means half of the free RAM and of free /dev/shm at start.
    timeout_secs: the longest any internal wait (a background copy, a restore
      agreement) may take before a SnapshotTimeoutError names who was late.

  >>> CheckpointOptions(max_snapshots=0)
  Traceback (most recent call last):
  ...
  ValueError: CheckpointOptions.max_snapshots must be >= 1, got max_snapshots=0
  """

  max_snapshots: int = 2
  save_interval_steps: int = 1
  on_busy: str = "skip"
  busy_timeout_secs: float = 600.0
  host_memory_limit_bytes: int | None = None
  timeout_secs: float = 300.0

  def __post_init__(self) -> None:
    _at_least(self, "max_snapshots", 1)
    _at_least(self, "save_interval_steps", 1)
    if self.on_busy not in _ON_BUSY:
      raise ValueError(f"CheckpointOptions.on_busy must be one of {_ON_BUSY}, "
                       f"got on_busy={self.on_busy!r}")
    _positive(self, "busy_timeout_secs")
    _positive(self, "timeout_secs")
    if self.host_memory_limit_bytes is not None:
      _at_least(self, "host_memory_limit_bytes", 1)


def _at_least(obj: object, name: str, lo: int) -> None:
  v = getattr(obj, name)
  if not isinstance(v, int) or isinstance(v, bool) or v < lo:
    raise ValueError(f"{type(obj).__name__}.{name} must be >= {lo}, got {name}={v!r}")


def _positive(obj: object, name: str) -> None:
  v = getattr(obj, name)
  if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
    raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {name}={v!r}")
