"""A step orbax wrote, opened for reading where it lies (see ``_orbax_steps``)."""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Iterable

import numpy as np

from jaxckpt import errors
from jaxckpt.host import snapshot as snap
from jaxckpt.host.snapshot import Box
from jaxckpt.universal import _budget, _orbax_steps
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _manifest as man
from jaxckpt.universal import _read

#: Where the metadata of a step read from orbax names its step directory (jaxckpt's record).
ORBAX_KEY = "jaxckpt.orbax"


def open_stored(directory: str, step: int) -> "_read.StepReader | OrbaxStepReader":
  """A stored step opened for reading: jaxckpt's committed step, else orbax's.

  Raises:
    StepNotFoundError: neither holds ``step`` (naming jaxckpt's committed steps).
  """
  try:
    return _read.open_step(directory, step)
  except errors.StepNotFoundError:
    where = _orbax_steps.orbax_step_dir(directory, step)
    if where is None:
      raise
    return OrbaxStepReader(directory, step, where)


class OrbaxStepReader:
  """A step orbax wrote, read where it lies: what restores need of a
  :class:`~jaxckpt.universal.StepReader` (``leaves``, ``metadata``, ``read``,
  ``region_reader``, ``bytes_read``).

  Attributes:
    step: the step. directory: the checkpoint directory. where: its step directory.
    leaves: path -> LeafInfo. metadata: what a jaxckpt step of it carries (orbax's
      ``custom_metadata``, its time and metrics, the item kinds, and ``jaxckpt.orbax``
      naming the step directory).
  """

  process_count = 1
  attempt = None

  def __init__(self, directory: str, step: int, where: str) -> None:
    self.directory, self.step, self.where = directory, step, where
    got = _opened(where, step, *_identity(where))
    self.leaves: dict[str, man.LeafInfo] = dict(got.leaves)
    self._sources = got.sources
    self.metadata: dict[str, Any] = dict(got.metadata)
    self.metadata[ORBAX_KEY] = {"directory": where, "items": dict(got.kinds)}
    self.bytes_read = 0
    self.bytes_needed = 0
    self._lock = threading.Lock()

  def _info(self, path: str) -> man.LeafInfo:
    info = self.leaves.get(path)
    if info is None:
      raise errors.StructureMismatchError(
          f"orbax step {self.step} ({self.where}) has no leaf {path!r}; it has "
          f"{sorted(self.leaves)[:20]}")
    if not info.is_array:
      raise errors.StructureMismatchError(
          f"leaf {path!r} of orbax step {self.step} is a {info.kind} (value {info.value!r}), "
          "not an array")
    return info

  def read(self, path: str, box: Box | None = None) -> np.ndarray:
    """A fresh array holding ``box`` (default: all) of leaf ``path``."""
    info = self._info(path)
    box = snap.full_box(info.shape) if box is None else tuple((int(a), int(b)) for a, b in box)
    if len(box) != len(info.shape) or any(not 0 <= a <= b <= d
                                           for (a, b), d in zip(box, info.shape)):
      raise errors.InvalidArgumentError(
          f"box {[list(p) for p in box]} is not inside leaf {path!r} of shape {list(info.shape)}")
    raw = self._sources[path][tuple(slice(a, b) for a, b in box)]
    out = np.array(lay.logical_view(np.asarray(raw), info.numpy_dtype), copy=True)
    if out.shape != snap.box_shape(box):
      raise errors.CorruptSnapshotError(
          f"orbax step {self.step}: leaf {path!r} {[list(p) for p in box]} read back as shape "
          f"{list(out.shape)} from {self.where!r}: the step is damaged; restore another step")
    with self._lock:
      self.bytes_read += out.nbytes
      self.bytes_needed += out.nbytes
    return out

  def region_reader(self, path: str, *, boxes: Iterable[Box] | None = None,
                    budget: _budget.ByteBudget | None = None) -> "_Regions":
    """``read_region(box)`` for one restore of leaf ``path`` (each box read once, on
    demand: orbax's arrays are read through tensorstore, which fetches what a box needs)."""
    del boxes, budget
    self._info(path)
    return _Regions(self, path)


def _identity(where: str) -> tuple[int, int, int]:
  """What tells one finalized step directory from another at the same path (orbax never
  writes a finalized step again: a new save of the step is a new directory)."""
  st = os.lstat(os.path.join(where, _orbax_steps.FINALIZED))
  return st.st_dev, st.st_ino, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _opened(where: str, step: int, *identity: int) -> Any:
  """orbax's step read once per step directory (orbax's metadata read costs ~25 ms a step:
  a manager reads each step's metadata at open, and a restore describes, then reads it)."""
  del identity
  from jaxckpt.universal import _orbax_files  # pylint: disable=import-outside-toplevel
  # (orbax itself loads only when an orbax step is read: the agent, which lists steps, never)
  return _orbax_files.open_orbax_step(where, step)


class _Regions:
  """Regions of one leaf of an orbax step for one restore (``make_array`` asks each
  distinct box once)."""

  def __init__(self, reader: OrbaxStepReader, path: str) -> None:
    self._reader, self._path = reader, path

  def __call__(self, box: Box | None = None) -> np.ndarray:
    return self._reader.read(self._path, box)

  def close(self) -> None:
    """Nothing is held between reads."""
