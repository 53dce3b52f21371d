"""Writing one process's shards of a step (and the single-writer path).

Each process of a persist attempt writes the zarr chunks of the boxes it
owns under the attempt's own keys, then its part record
``attempts/<attempt>/parts/process_NNNNN.json`` last; :func:`commit_step`
(process 0) merges that attempt's part records into its ``manifest.json``
and writes the commit marker.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import uuid
from typing import Any, Mapping

import numpy as np
import tensorstore as ts

from jaxckpt import errors
from jaxckpt.host import snapshot as snap
from jaxckpt.host.snapshot import Box, SnapshotManifest
from jaxckpt.universal import _arrays, _budget, _commit
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _manifest as man
from jaxckpt.universal import _orbax_steps
from jaxckpt.util import _progress
from jaxckpt.util._text import counted

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT_BYTES = _budget.DEFAULT_MAX_INFLIGHT_BYTES
plan_leaf = _arrays.plan_leaf


def new_attempt(prefix: str = "w") -> str:
  """A fresh persist attempt id (unique across jobs and hosts)."""
  return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _stored(arr: np.ndarray, info: man.LeafInfo) -> np.ndarray:
  """The array as the zarr data type holds it (a raw view for unsupported dtypes)."""
  return arr if info.storage_dtype is None else arr.view(snap.dtype_from_name(info.storage_dtype))


def _write_pieces(store: ts.TensorStore, info: man.LeafInfo, pieces: dict[Box, np.ndarray],
                  shard_sums: dict[Box, str], budget: _budget.ByteBudget) -> dict[str, str]:
  """Writes this process's ``pieces`` of a leaf; returns the checksums of the
  chunks it holds completely.

  A chunk that is one shard is written from it, its checksum the shard's (no
  re-hash). A chunk made of several shards held here (``merged_chunk``) is
  assembled, hashed and written once: one write, not one per shard. Shards of
  chunks other processes share are written as they are; commit_step hashes
  those chunks from storage. An assembled chunk is new memory until it is
  written: the in-flight budget counts it like any write (tensorstore holds a
  copy of every write in flight anyway).
  """
  sums: dict[str, str] = {}
  whole: set[str] = set()                 # chunks written assembled
  private = isinstance(pieces, _ReadPieces)   # fresh copies: tensorstore need not copy them
  for box in pieces:
    for idx in lay.chunks_in(box, info.chunk_shape):
      key = lay.chunk_key(idx)
      if key in sums:
        continue
      cbox = lay.chunk_box(idx, info.shape, info.chunk_shape)
      if cbox == box:
        sums[key] = shard_sums[box]
      elif _covered(cbox, pieces):
        region = snap.assemble_region(cbox, info.numpy_dtype, pieces.items(), path=info.path)
        sums[key] = snap.checksum(region)
        whole.add(key)
        budget.track(store[tuple(slice(a, b) for a, b in cbox)].write(_stored(region, info)),
                     region.nbytes, f"leaf {info.path!r} chunk {key}")
  for box in pieces:
    if whole and all(lay.chunk_key(i) in whole for i in lay.chunks_in(box, info.chunk_shape)):
      continue                            # written as part of its chunk
    arr = pieces[box]                     # (a slot's shard is read here, as it is written)
    budget.track(store[tuple(slice(a, b) for a, b in box)].write(
        _stored(arr, info), can_reference_source_data_indefinitely=private),
                 arr.nbytes, f"leaf {info.path!r} {[list(p) for p in box]}")
  return sums


def _pieces(buffer: Any, unique: dict[Box, Any], info: man.LeafInfo,
            step: int) -> Mapping[Box, np.ndarray]:
  """This process's shards of a leaf (``unique``: box -> ShardRecord), each checked against
  its checksum (never store bytes that are not what was saved): views of ``buffer``, or,
  where the snapshot is read through its file (``buffer.read_shard``: an agent's slot,
  which may be truncated under it), a fresh copy read as that shard is written."""
  if not hasattr(buffer, "read_shard"):
    for s in unique.values():
      snap.verify_shard(buffer, s, path=info.path, step=step)
    return {b: snap.shard_view(buffer, s, info.numpy_dtype) for b, s in unique.items()}
  return _ReadPieces(buffer, unique, info, step)


class _ReadPieces(Mapping):
  """Shards read from a snapshot's file on each access (see :func:`_pieces`)."""

  def __init__(self, source: Any, unique: dict[Box, Any], info: man.LeafInfo, step: int) -> None:
    self._source, self._unique, self._info, self._step = source, unique, info, step

  def __getitem__(self, box: Box) -> np.ndarray:
    s = self._unique[box]
    data = self._source.read_shard(s)
    snap.verify_shard(data, s._replace(offset=0), path=self._info.path, step=self._step)
    return data.view(self._info.numpy_dtype).reshape(snap.box_shape(s.index))

  def __iter__(self):
    return iter(self._unique)

  def __len__(self) -> int:
    return len(self._unique)


def _covered(cbox: Box, pieces: Mapping[Box, np.ndarray]) -> bool:
  got = 0
  for box in pieces:
    inter = snap.box_intersection(box, cbox)
    got += 0 if inter is None else int(np.prod(snap.box_shape(inter)))
  return got >= int(np.prod(snap.box_shape(cbox)))


def write_process_shards(directory: str, manifest: SnapshotManifest, buffer: Any, *,
                         attempt: str,
                         max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                         inner_chunk_bytes: int = lay.INNER_CHUNK_TARGET_BYTES,
                         merged_chunk_bytes: int = lay.MERGED_CHUNK_MAX_BYTES) -> None:
  """Writes this process's shards of ``manifest.step`` for persist ``attempt``.

  Every key it writes belongs to ``attempt`` (its arrays and its part record),
  so nothing another attempt wrote is touched, and the part record is written
  last, after every chunk is on storage: commit_step never merges a
  half-written process. Writing the same snapshot again for the same attempt
  rewrites the same keys.

  Args:
    directory: local path or kvstore URL (``s3://``, ``gs://``, ``file://``...).
    manifest: this process's host-snapshot manifest.
    buffer: the contiguous snapshot buffer the manifest points into.
    attempt: the persist attempt's id, the same on every process of it.
    max_inflight_bytes: bytes handed to tensorstore and not yet on storage.
    inner_chunk_bytes: target size of the inner chunks inside each stored shard.
    merged_chunk_bytes: a leaf whose shards here form one box of at most this
      many bytes is stored as one chunk (one object); 0 keeps a chunk per shard.

  Raises:
    StepExistsError: the step is already committed by another attempt.
    StorageError: storage refused a write (the message names path and cause).
    CorruptSnapshotError: a shard of ``buffer`` does not match its checksum
      (nothing of it is recorded: the step is never committed with it).
  """
  leaves = write_shard_data(directory, manifest, buffer, attempt=attempt,
                            max_inflight_bytes=max_inflight_bytes,
                            inner_chunk_bytes=inner_chunk_bytes,
                            merged_chunk_bytes=merged_chunk_bytes)
  write_part_record(directory, manifest, leaves, attempt=attempt)


def write_shard_data(directory: str, manifest: SnapshotManifest, buffer: Any, *, attempt: str,
                     max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                     inner_chunk_bytes: int = lay.INNER_CHUNK_TARGET_BYTES,
                     merged_chunk_bytes: int = lay.MERGED_CHUNK_MAX_BYTES) -> list[dict[str, Any]]:
  """The array bytes of :func:`write_process_shards` (every write done when it
  returns, so ``buffer`` may be reused), and the leaves' records for
  :func:`write_part_record`. A process may write its leaves in several calls
  (a storage-only save stages them a few at a time) and record them once."""
  step = manifest.step
  lay.check_attempt(attempt)
  shards = [{s.index: s for s in rec.shards} for rec in manifest.leaves]  # replicated boxes
  # A line every 5 s of a long persist, from its first request to storage: the bytes on
  # storage (counted as each write completes, so the drain of the last writes shows too)
  # and those handed to it and not yet on it.
  budget = None
  progress = _progress.LogProgress(
      log, f"persisting step {step} to {directory}",
      sum(s.nbytes for unique in shards for s in unique.values()), verb="written",
      in_flight=lambda: 0 if budget is None else budget.in_flight)
  try:
    kv = lay.open_kvstore(directory)
    _commit.check_not_committed(kv, directory, step, attempt)
    _orbax_steps.check_not_orbax(directory, step)
    plans = []
    for rec, unique in zip(manifest.leaves, shards):      # (are stored once)
      info = plan_leaf(rec.path, rec.kind, tuple(rec.shape), rec.dtype, list(unique),
                       attempt=attempt, inner_chunk_bytes=inner_chunk_bytes,
                       merged_chunk_bytes=merged_chunk_bytes,
                       sharding=rec.sharding, value=rec.value, key_impl=rec.key_impl)
      plans.append((info, unique))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # creating arrays is latency-bound
      opened = list(pool.map(lambda p: _arrays.open_for_write(directory, step, p[0])
                             if p[0].is_array and p[1] else None, plans))
    budget = _budget.ByteBudget(max_inflight_bytes,
                                what=f"persist of step {step} to {directory!r}",
                                on_done=progress.update)
    leaves = []
    try:
      for (info, unique), store_info in zip(plans, opened):
        if info.is_array and not unique:  # another process creates the array
          info = _arrays.replace(info, chunk_shape=None, inner_chunk_shape=None)
        elif info.is_array:
          store, info = store_info
          pieces = _pieces(buffer, unique, info, step)
          sums = _write_pieces(store, info, pieces, {b: s.checksum for b, s in unique.items()},
                               budget)
          info = _arrays.replace(info, chunks=sums)
        obj = info.to_obj()
        obj["boxes"] = [[list(p) for p in b] for b in unique]
        leaves.append(obj)
    finally:
      budget.drain()
  finally:
    progress.close()
  return leaves


def write_part_record(directory: str, manifest: SnapshotManifest, leaves: list[dict[str, Any]], *,
                      attempt: str) -> None:
  """Records this process's ``leaves`` (from :func:`write_shard_data`) of
  ``manifest.step`` for ``attempt``: written last, once every chunk is on storage."""
  step = manifest.step
  kv = lay.open_kvstore(directory)
  doc = man.document(step=step, process_count=manifest.process_count,
                     process_index=manifest.process_index,
                     metadata=manifest.metadata, leaves=leaves)
  doc["attempt"] = attempt
  what = f"part record of process {manifest.process_index} at step {step}"
  _put(kv, directory, lay.part_key(step, manifest.process_index, attempt),
       man.encode(doc, what=what), what)
  log.info("step %d process %d: wrote %s to %s (attempt %s)", step,
           manifest.process_index, counted(len(leaves), "leaf", "leaves"), directory, attempt)


def _put(kv: ts.KvStore, directory: str, key: str, body: bytes, what: str) -> None:
  try:
    kv.write(key, body).result(timeout=lay.REQUEST_TIMEOUT_SECS)
  except TimeoutError:
    raise errors.StorageError(
        errno.ETIMEDOUT, f"writing the {what} to {directory!r} took over "
        f"{lay.REQUEST_TIMEOUT_SECS} s ({lay.server_of(directory)} did not answer)", key) from None
  except ValueError as e:
    raise errors.StorageError(
        f"writing the {what} to {directory!r} ({key}) failed: {lay.ts_error(e)}") from None


def write_leaves(directory: str, step: int, leaves: Mapping[str, man.LeafInfo],
                 sources: Mapping[str, "ts.TensorStore | np.ndarray"], *,
                 metadata: dict[str, Any],
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                 inner_chunk_bytes: int = lay.INNER_CHUNK_TARGET_BYTES,
                 commit: bool = True, attempt: str | None = None) -> str:
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
    attempt: the persist attempt's id (default: a fresh one).

  Returns:
    The attempt id (``commit_step(..., attempt=...)`` commits it later).

  Raises:
    StepExistsError: the step is already committed (nothing is written).
  """
  attempt = lay.check_attempt(attempt or new_attempt())
  kv = lay.open_kvstore(directory)
  _commit.check_not_committed(kv, directory, step, attempt)
  _orbax_steps.check_not_orbax(directory, step)
  budget = _budget.ByteBudget(max_inflight_bytes, what=f"writing step {step} to {directory!r}")
  objs = []
  try:
    for path, given in leaves.items():
      info = plan_leaf(path, given.kind, tuple(given.shape), given.dtype, [],
                       chunk_shape=given.chunk_shape, attempt=attempt,
                       inner_chunk_bytes=inner_chunk_bytes, sharding=given.sharding,
                       value=given.value, key_impl=given.key_impl)
      if info.is_array:
        if path not in sources:
          raise errors.InvalidArgumentError(
              f"write_leaves: no source for array leaf {path!r}; pass it in sources")
        info = _write_from_source(directory, step, info, sources[path], budget)
      obj = info.to_obj()
      obj["boxes"] = [[[0, d] for d in info.shape]] if info.is_array else []
      objs.append(obj)
  finally:
    budget.drain()
  doc = man.document(step=step, process_count=1, process_index=0, metadata=metadata, leaves=objs)
  doc["attempt"] = attempt
  _put(kv, directory, lay.part_key(step, 0, attempt),
       man.encode(doc, what=f"part record of step {step}"), f"part record of step {step}")
  if commit:
    _commit.commit_step(directory, step, process_count=1, timeout_secs=60.0, attempt=attempt)
  return attempt


def _write_from_source(directory: str, step: int, info: man.LeafInfo, source: Any,
                       budget: _budget.ByteBudget) -> man.LeafInfo:
  if tuple(source.shape) != info.shape:
    raise errors.StructureMismatchError(
        f"write_leaves: source of {info.path!r} has shape {tuple(source.shape)}, "
        f"LeafInfo says {info.shape}")
  if isinstance(source, ts.TensorStore) and source.rank:
    source = source[ts.d[:].translate_to[0]]  # views may keep their origin
  store, info = _arrays.open_for_write(directory, step, info)
  sums = {}
  for idx in lay.chunks_in(snap.full_box(info.shape), info.chunk_shape):
    cbox = lay.chunk_box(idx, info.shape, info.chunk_shape)
    sl = tuple(slice(a, b) for a, b in cbox)
    piece = source[sl]
    piece = (piece.read().result(timeout=lay.REQUEST_TIMEOUT_SECS)
             if isinstance(piece, ts.TensorStore) else np.asarray(piece))
    if info.storage_dtype and piece.dtype == snap.dtype_from_name(info.storage_dtype):
      piece = piece.view(info.numpy_dtype)
    piece = np.require(piece, dtype=info.numpy_dtype, requirements="C")  # rank 0 stays rank 0
    sums[lay.chunk_key(idx)] = snap.checksum(piece)
    budget.track(store[sl].write(_stored(piece, info)), piece.nbytes,
                 f"leaf {info.path!r} {[list(p) for p in cbox]}")
  return _arrays.replace(info, chunks=sums)
