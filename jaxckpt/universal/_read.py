"""Reading committed steps: any region of any leaf, onto any sharding.

Every read is verified: chunks read whole are checked against their xxh3-64
in the manifest, and partial reads go through the zarr sharding codec's
inner chunks, each protected by a crc32c codec that tensorstore checks.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import Any, Iterator, Mapping

import jax
import numpy as np
import tensorstore as ts

from jaxckpt import _assemble
from jaxckpt import errors
from jaxckpt import snapshot as snap
from jaxckpt.snapshot import Box
from jaxckpt.universal import _commit
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _manifest as man

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30
BUDGET_TIMEOUT_SECS = 600.0


def open_array(directory: str, step: int, info: man.LeafInfo) -> ts.TensorStore:
  spec = lay.zarr_spec(directory, step, info.array, shape=info.shape,
                       dtype=info.storage_dtype or info.dtype,
                       chunk=info.chunk_shape, inner=info.inner_chunk_shape)
  try:
    return ts.open(spec, open=True, read=True, context=lay.context()).result()
  except ValueError as e:
    raise errors.CorruptSnapshotError(
        f"step {step}: zarr array of leaf {info.path!r} cannot be opened ({e}); "
        "the step is damaged: restore another step") from None


class StepReader:
  """A committed step: its manifest, and verified reads of any region.

  Attributes:
    step: the step. metadata: user metadata saved with it.
    leaves: path -> LeafInfo. process_count: processes that wrote it.
    bytes_read: bytes fetched from storage by :meth:`read` (whole chunks, or
      the inner chunks covering a partial read). bytes_needed: bytes asked for.
  """

  def __init__(self, directory: str, step: int, manifest: dict[str, Any]):
    self.directory, self.step = directory, step
    self.metadata: dict[str, Any] = manifest["metadata"]
    self.process_count: int = manifest["process_count"]
    self.leaves: dict[str, man.LeafInfo] = {
        o["path"]: man.LeafInfo.from_obj(o) for o in manifest["leaves"]}
    self.bytes_read = 0
    self.bytes_needed = 0
    self._lock = threading.Lock()
    self._stores: dict[str, ts.TensorStore] = {}

  def _info(self, path: str) -> man.LeafInfo:
    info = self.leaves.get(path)
    if info is None:
      raise errors.StructureMismatchError(
          f"step {self.step} has no leaf {path!r}; it has {sorted(self.leaves)[:20]}")
    if not info.is_array:
      raise errors.StructureMismatchError(
          f"leaf {path!r} of step {self.step} is a {info.kind} (value {info.value!r}), not an array")
    return info

  def open_leaf(self, path: str) -> ts.TensorStore:
    """A read-only tensorstore view of one leaf (stored dtype; lazy)."""
    info = self._info(path)
    with self._lock:
      if path not in self._stores:
        self._stores[path] = open_array(self.directory, self.step, info)
      return self._stores[path]

  def read(self, path: str, box: Box | None = None) -> np.ndarray:
    """A fresh array holding ``box`` (default: all) of leaf ``path``, verified."""
    info = self._info(path)
    box = snap.full_box(info.shape) if box is None else tuple(tuple(p) for p in box)
    sl = tuple(slice(a, b) for a, b in box)
    try:
      arr = self.open_leaf(path)[sl].read().result()
    except ValueError as e:
      raise self._damaged(info, box, str(e)) from None
    arr = lay.logical_view(arr, info.numpy_dtype)
    nread = 0
    for idx in lay.chunks_in(box, info.chunk_shape) if arr.size else []:
      cbox = lay.chunk_box(idx, info.shape, info.chunk_shape)
      inter = snap.box_intersection(cbox, box)
      if inter == cbox:
        got = snap.checksum(arr[snap.relative_slices(cbox, box)])
        want = info.chunks.get(lay.chunk_key(idx))
        if got != want:
          raise self._damaged(info, cbox, f"checksum {got} != saved {want}")
        nread += int(np.prod(snap.box_shape(cbox))) * arr.itemsize
      else:
        nread += lay.aligned_cover_nbytes(inter, info.inner_chunk_shape, info.shape, arr.itemsize)
    with self._lock:
      self.bytes_read += nread
      self.bytes_needed += arr.nbytes
    return arr

  def _damaged(self, info: man.LeafInfo, box: Box, why: str) -> errors.CorruptSnapshotError:
    return errors.CorruptSnapshotError(
        f"step {self.step}: leaf {info.path!r} region {[list(p) for p in box]} is damaged "
        f"in storage ({why}); restore another step (`jaxckpt verify {self.directory}` "
        "lists every damaged chunk)")

  def iter_chunks(self, path: str) -> Iterator[tuple[str, Box]]:
    info = self._info(path)
    for ix in np.ndindex(*lay.chunk_grid(info.shape, info.chunk_shape)):
      yield lay.chunk_key(ix), lay.chunk_box(ix, info.shape, info.chunk_shape)


def open_step(directory: str, step: int | None = None) -> StepReader:
  """Opens a committed step (default: the latest) for reading.

  Raises:
    StepNotFoundError: the step is not committed (names the committed ones).
    CorruptSnapshotError: the manifest does not match its commit marker.
  """
  kv = lay.open_kvstore(directory)
  if step is None:
    step = _commit.latest_step(directory)
    if step is None:
      raise errors.StepNotFoundError(f"no committed step in {directory!r}")
  marker = lay.read_json(kv, lay.commit_key(step))
  if marker is None:
    raise errors.StepNotFoundError(
        f"step {step} is not committed in {directory!r}; committed steps: "
        f"{_commit.all_steps(directory)}")
  body = kv.read(lay.manifest_key(step)).result()
  if body.state != "value" or snap.checksum(body.value) != marker["manifest_xxh3"]:
    raise errors.CorruptSnapshotError(
        f"step {step} in {directory!r}: manifest.json is missing or does not match the "
        "checksum in its commit marker; restore another step")
  doc = json.loads(body.value)
  man.validate(doc, what=f"manifest of step {step} in {directory!r}")
  return StepReader(directory, step, doc)


class _ByteBudget:
  """Caps bytes read from storage and not yet handed to devices."""

  def __init__(self, max_bytes: int):
    if max_bytes <= 0:
      raise ValueError(f"max_inflight_bytes must be positive, got {max_bytes=}")
    self._max, self._used = max_bytes, 0
    self._cv = threading.Condition()

  def acquire(self, n: int, what: str) -> None:
    with self._cv:
      ok = self._cv.wait_for(lambda: self._used == 0 or self._used + n <= self._max,
                             timeout=BUDGET_TIMEOUT_SECS)
      if not ok:
        raise errors.SnapshotTimeoutError(
            f"reading {what} waited {BUDGET_TIMEOUT_SECS} s for {n} bytes of the "
            f"in-flight budget ({self._used} of {self._max} held by other reads)")
      self._used += n

  def release(self, n: int) -> None:
    with self._cv:
      self._used -= n
      self._cv.notify_all()


def _restore_one(reader: StepReader, path: str, target: Any, budget: _ByteBudget) -> Any:
  info = reader.leaves[path]
  if not info.is_array:
    return info.value
  sharding = getattr(target, "sharding", None) if target is not None else None
  if target is not None and tuple(target.shape) != info.shape:
    raise errors.StructureMismatchError(
        f"leaf {path!r}: target shape {tuple(target.shape)} != saved shape {info.shape}")
  held = [0]

  def read_region(box: Box) -> np.ndarray:
    budget.release(held[0])
    held[0] = int(np.prod(snap.box_shape(box))) * info.numpy_dtype.itemsize
    budget.acquire(held[0], f"{path!r} {list(box)}")
    return reader.read(path, box)

  try:
    if sharding is None:
      return read_region(snap.full_box(info.shape))
    dtype = np.dtype(target.dtype)
    if dtype != info.numpy_dtype:
      raise errors.StructureMismatchError(
          f"leaf {path!r}: target dtype {dtype} != saved dtype {info.dtype}; "
          "restore with the saved dtype and cast afterwards")
    return _assemble.make_array(info.shape, dtype, sharding, read_region)
  finally:
    budget.release(held[0])


def restore_arrays(reader: StepReader, targets: Mapping[str, Any], *,
                   max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                   max_workers: int = 4) -> dict[str, Any]:
  """Restores leaves onto target shardings, each process reading only what it needs.

  Args:
    reader: from :func:`open_step`.
    targets: path -> ``jax.ShapeDtypeStruct`` with a sharding (a jax.Array on
      it), or None (a numpy array). Scalar leaves give their saved value.
    max_inflight_bytes: bytes read from storage and not yet placed on devices.
    max_workers: leaves restored concurrently.

  Returns:
    path -> jax.Array, numpy array, or scalar value (PRNG keys as key data;
    ``reader.leaves[path].key_impl`` names the implementation).
  """
  missing = [p for p in targets if p not in reader.leaves]
  if missing:
    raise errors.StructureMismatchError(
        f"step {reader.step} has no leaves {missing}; it has {sorted(reader.leaves)[:20]}")
  budget = _ByteBudget(max_inflight_bytes)
  with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
    futures = {p: pool.submit(_restore_one, reader, p, t, budget) for p, t in targets.items()}
    return {p: f.result() for p, f in futures.items()}


def verify_step(reader: StepReader, *, progress: Any = None) -> list[str]:
  """Reads every chunk of every leaf and checks it; returns one line per damage."""
  problems = []
  for path, info in reader.leaves.items():
    if not info.is_array:
      continue
    for key, box in reader.iter_chunks(path):
      try:
        reader.read(path, box)
      except errors.CorruptSnapshotError as e:
        problems.append(f"leaf {path!r} chunk {key}: {e}")
      if progress is not None:
        progress.update(int(np.prod(snap.box_shape(box))) * info.numpy_dtype.itemsize)
  return problems


def to_jax_dtype_struct(info: man.LeafInfo, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
  """A restore target for ``info`` on ``sharding``."""
  return jax.ShapeDtypeStruct(info.shape, info.numpy_dtype, sharding=sharding)
