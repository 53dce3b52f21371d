"""Writing one process's shards of a step (and the single-writer path).

Each process writes the zarr chunks of the boxes it owns, then its part record
``parts/process_NNNNN.json`` last; :func:`commit_step` (process 0) merges the
part records into ``manifest.json`` and writes the commit marker.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from typing import Any, Mapping

import numpy as np
import tensorstore as ts

from jaxckpt import errors
from jaxckpt import snapshot as snap
from jaxckpt.snapshot import Box, SnapshotManifest
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _manifest as man

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30
WRITE_TIMEOUT_SECS = 600.0


class _Inflight:
  """Bounds the bytes handed to tensorstore and not yet committed to storage."""

  def __init__(self, max_bytes: int, *, step: int):
    if max_bytes <= 0:
      raise ValueError(f"max_inflight_bytes must be positive, got {max_bytes=}")
    self._max, self._step = max_bytes, step
    self._pending: collections.deque = collections.deque()
    self._bytes = 0

  def add(self, future: Any, nbytes: int, what: str) -> None:
    while self._pending and self._bytes + nbytes > self._max:
      self._wait_oldest()
    self._pending.append((future, nbytes, what))
    self._bytes += nbytes

  def _wait_oldest(self) -> None:
    future, nbytes, what = self._pending.popleft()
    try:
      future.result(timeout=WRITE_TIMEOUT_SECS)
    except TimeoutError:
      raise errors.SnapshotTimeoutError(
          f"step {self._step}: writing {what} to storage took over {WRITE_TIMEOUT_SECS} s; "
          "check the storage backend") from None
    self._bytes -= nbytes

  def drain(self) -> None:
    while self._pending:
      self._wait_oldest()


def _open_array(directory: str, step: int, info: man.LeafInfo) -> tuple[ts.TensorStore, man.LeafInfo]:
  """Creates the leaf's zarr array, or adopts the layout another process created.

  The first process to create an array fixes its chunk layout; the others
  write their boxes into it whatever it is (tensorstore's conditional writes
  keep concurrent partial writes of one chunk safe), so processes never need
  to agree on a layout beforehand.
  """
  spec = lay.zarr_spec(directory, step, info.array, shape=info.shape,
                       dtype=info.storage_dtype or info.dtype,
                       chunk=info.chunk_shape, inner=info.inner_chunk_shape)
  try:
    return ts.open(spec, create=True, context=lay.context()).result(), info
  except ValueError as e:
    if "ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
      raise
  del spec["metadata"]
  store = ts.open(spec, open=True, context=lay.context()).result()
  if tuple(store.shape) != info.shape or str(store.dtype.name) != (info.storage_dtype or info.dtype):
    raise errors.ManifestError(
        f"step {step}: leaf {info.path!r} exists in storage as {store.dtype.name}{list(store.shape)}, "
        f"not {info.dtype}{list(info.shape)}; an earlier attempt at step {step} left it: call "
        f"jaxckpt.universal.discard_step({directory!r}, {step}) and persist again")
  layout = store.chunk_layout
  return store, _replace(info, chunk_shape=tuple(layout.write_chunk.shape),
                         inner_chunk_shape=tuple(layout.read_chunk.shape))


def plan_leaf(path: str, kind: str, shape: tuple[int, ...], dtype: str,
              boxes: list[Box], chunk_shape: tuple[int, ...] | None = None, *,
              inner_chunk_bytes: int = lay.INNER_CHUNK_TARGET_BYTES,
              **extra: Any) -> man.LeafInfo:
  """Chooses storage dtype and chunk layout of one leaf."""
  if kind == "scalar":
    return man.LeafInfo(path=path, kind=kind, shape=shape, dtype=dtype, **extra)
  np_dtype = snap.dtype_from_name(dtype)
  chunk = chunk_shape or lay.uniform_chunk(shape, boxes) or lay.fallback_chunk(shape, np_dtype.itemsize)
  stored = lay.storage_dtype(dtype)
  return man.LeafInfo(path=path, kind=kind, shape=shape, dtype=dtype,
                      storage_dtype=None if stored == dtype else stored,
                      array=lay.array_name(path), chunk_shape=tuple(chunk),
                      inner_chunk_shape=lay.inner_chunk(chunk, np_dtype.itemsize, inner_chunk_bytes),
                      **extra)


def _stored(arr: np.ndarray, info: man.LeafInfo) -> np.ndarray:
  """The array as the zarr data type holds it (a raw view for unsupported dtypes)."""
  return arr if info.storage_dtype is None else arr.view(snap.dtype_from_name(info.storage_dtype))


def _local_chunk_checksums(info: man.LeafInfo, pieces: dict[Box, np.ndarray],
                           shard_sums: dict[Box, str]) -> dict[str, str]:
  """Checksums of the chunks this process holds completely.

  When chunks are the shards, the shard checksums already are the chunk
  checksums (no re-hash); otherwise chunks fully covered here are assembled
  and hashed, and the rest are hashed by commit_step from storage.
  """
  out: dict[str, str] = {}
  for box, arr in pieces.items():
    for idx in lay.chunks_in(box, info.chunk_shape):
      cbox = lay.chunk_box(idx, info.shape, info.chunk_shape)
      if cbox == box:
        out[lay.chunk_key(idx)] = shard_sums[box]
      elif lay.chunk_key(idx) not in out and _covered(cbox, pieces):
        region = snap.assemble_region(cbox, arr.dtype, pieces.items(), path=info.path)
        out[lay.chunk_key(idx)] = snap.checksum(region)
  return out


def _covered(cbox: Box, pieces: Mapping[Box, np.ndarray]) -> bool:
  got = 0
  for box in pieces:
    inter = snap.box_intersection(box, cbox)
    got += 0 if inter is None else int(np.prod(snap.box_shape(inter)))
  return got >= int(np.prod(snap.box_shape(cbox)))


def write_process_shards(directory: str, manifest: SnapshotManifest, buffer: Any, *,
                         max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                         inner_chunk_bytes: int = lay.INNER_CHUNK_TARGET_BYTES) -> None:
  """Writes this process's shards of ``manifest.step`` into an uncommitted step.

  Idempotent per process: writing the same snapshot again rewrites the same
  chunks and part record. The part record is written last, after every chunk
  is on storage, so commit_step never merges a half-written process.

  Args:
    directory: local path or kvstore URL (``gs://``, ``s3://``, ``file://``...).
    manifest: this process's host-snapshot manifest.
    buffer: the contiguous snapshot buffer the manifest points into.
    max_inflight_bytes: bytes handed to tensorstore and not yet on storage.
    inner_chunk_bytes: target size of the inner chunks (the unit of partial
      reads, each crc32c-protected) inside each stored shard.

  Raises:
    FileExistsError (StepExistsError): the step is already committed.
  """
  step = manifest.step
  kv = lay.open_kvstore(directory)
  if kv.read(lay.commit_key(step)).result().state == "value":
    raise errors.StepExistsError(
        f"step {step} is already committed in {directory!r}; refusing to overwrite it "
        f"(gc_steps or discard_step({directory!r}, {step}) removes it first)")
  inflight = _Inflight(max_inflight_bytes, step=step)
  plans = []
  for rec in manifest.leaves:
    unique = {s.index: s for s in rec.shards}  # replicated boxes are stored once
    info = plan_leaf(rec.path, rec.kind, tuple(rec.shape), rec.dtype, list(unique),
                     inner_chunk_bytes=inner_chunk_bytes, sharding=rec.sharding,
                     value=rec.value, key_impl=rec.key_impl)
    plans.append((info, unique))
  with concurrent.futures.ThreadPoolExecutor(8) as pool:  # creating arrays is latency-bound
    opened = list(pool.map(lambda p: _open_array(directory, step, p[0])
                           if p[0].is_array and p[1] else None, plans))
  leaves = []
  for (info, unique), store_info in zip(plans, opened):
    if info.is_array and not unique:  # another process creates the array
      info = _replace(info, chunk_shape=None, inner_chunk_shape=None)
    elif info.is_array:
      store, info = store_info
      pieces = {b: snap.shard_view(buffer, s, info.numpy_dtype) for b, s in unique.items()}
      for box, arr in pieces.items():
        target = store[tuple(slice(a, b) for a, b in box)]
        inflight.add(target.write(_stored(arr, info)), arr.nbytes, f"{info.path!r} {list(box)}")
      sums = _local_chunk_checksums(info, pieces, {b: s.checksum for b, s in unique.items()})
      info = _replace(info, chunks=sums)
    obj = info.to_obj()
    obj["boxes"] = [[list(p) for p in b] for b in unique]
    leaves.append(obj)
  inflight.drain()
  doc = man.document(step=step, process_count=manifest.process_count,
                     process_index=manifest.process_index,
                     metadata=manifest.metadata, leaves=leaves)
  what = f"part record of process {manifest.process_index} at step {step}"
  kv.write(lay.part_key(step, manifest.process_index), man.encode(doc, what=what)).result()
  log.info("step %d process %d: wrote %d leaves to %s", step, manifest.process_index,
           len(leaves), directory)


def _replace(info: man.LeafInfo, **kw: Any) -> man.LeafInfo:
  import dataclasses  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(info, **kw)


def write_leaves(directory: str, step: int, leaves: Mapping[str, man.LeafInfo],
                 sources: Mapping[str, "ts.TensorStore | np.ndarray"], *,
                 metadata: dict[str, Any],
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                 inner_chunk_bytes: int = lay.INNER_CHUNK_TARGET_BYTES,
                 commit: bool = True) -> None:
  """Writes a whole step from one process, chunk by chunk, and commits it.

  Sources may be lazy tensorstore views (e.g. from :meth:`StepReader.open_leaf`
  after indexing/transposing): each chunk is read, hashed and written on its
  own, so no full tensor is ever materialized.

  Args:
    directory: local path or kvstore URL.
    step: the step to create.
    leaves: path -> LeafInfo (kind, shape, dtype, sharding, value, key_impl;
      chunk_shape optional, chosen if None).
    sources: path -> array-like of the leaf's shape, for every array leaf.
    metadata: user metadata stored in the manifest.
    max_inflight_bytes: bytes read from sources and not yet on storage.
    commit: commit the step when done (single writer: process_count 1).
  """
  from jaxckpt.universal import _commit  # pylint: disable=import-outside-toplevel
  kv = lay.open_kvstore(directory)
  if kv.read(lay.commit_key(step)).result().state == "value":
    raise errors.StepExistsError(f"step {step} is already committed in {directory!r}")
  inflight = _Inflight(max_inflight_bytes, step=step)
  objs = []
  for path, given in leaves.items():
    info = plan_leaf(path, given.kind, tuple(given.shape), given.dtype, [],
                     chunk_shape=given.chunk_shape, inner_chunk_bytes=inner_chunk_bytes,
                     sharding=given.sharding,
                     value=given.value, key_impl=given.key_impl)
    if info.is_array:
      if path not in sources:
        raise ValueError(f"write_leaves: no source for array leaf {path!r}; pass it in sources")
      info = _write_from_source(directory, step, info, sources[path], inflight)
    obj = info.to_obj()
    obj["boxes"] = [[[0, d] for d in info.shape]] if info.is_array else []
    objs.append(obj)
  inflight.drain()
  doc = man.document(step=step, process_count=1, process_index=0, metadata=metadata, leaves=objs)
  kv.write(lay.part_key(step, 0), man.encode(doc, what=f"part record of step {step}")).result()
  if commit:
    _commit.commit_step(directory, step, process_count=1, timeout_secs=60.0)


def _write_from_source(directory: str, step: int, info: man.LeafInfo, source: Any,
                       inflight: _Inflight) -> man.LeafInfo:
  if tuple(source.shape) != info.shape:
    raise ValueError(f"write_leaves: source of {info.path!r} has shape {tuple(source.shape)}, "
                     f"LeafInfo says {info.shape}")
  if isinstance(source, ts.TensorStore) and source.rank:
    source = source[ts.d[:].translate_to[0]]  # views may keep their origin
  store, info = _open_array(directory, step, info)
  sums = {}
  for idx in lay.chunks_in(snap.full_box(info.shape), info.chunk_shape):
    cbox = lay.chunk_box(idx, info.shape, info.chunk_shape)
    sl = tuple(slice(a, b) for a, b in cbox)
    piece = source[sl]
    piece = piece.read().result() if isinstance(piece, ts.TensorStore) else np.asarray(piece)
    if info.storage_dtype and piece.dtype == snap.dtype_from_name(info.storage_dtype):
      piece = piece.view(info.numpy_dtype)
    piece = np.require(piece, dtype=info.numpy_dtype, requirements="C")  # rank 0 stays rank 0
    sums[lay.chunk_key(idx)] = snap.checksum(piece)
    inflight.add(store[sl].write(_stored(piece, info)), piece.nbytes, f"{info.path!r} {list(cbox)}")
  return _replace(info, chunks=sums)
