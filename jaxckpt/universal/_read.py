"""Reading committed steps: any region of any leaf, onto any sharding, verified.

Every byte that reaches a caller was checked against the manifest: a read
fetches the whole stored chunks its region touches (each at most once per
reader while it is cached, and once per leaf in :func:`restore_arrays`),
checks each against its xxh3-64 in the manifest, and slices locally. A
missing chunk (read back as fill values), a swapped or foreign chunk file or a
flipped bit is a :class:`~jaxckpt.errors.CorruptSnapshotError` naming the leaf
and the chunk. Lazy views (:meth:`StepReader.open_leaf`, which conversions and
orbax export build on) verify the same way.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any, Iterable, Iterator, Mapping

import jax
import numpy as np
import tensorstore as ts

from jaxckpt import errors
from jaxckpt.arrays import _assemble
from jaxckpt.host import snapshot as snap
from jaxckpt.host.snapshot import Box
from jaxckpt.universal import _arrays, _budget, _commit, _failures, _fill
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _lazy
from jaxckpt.universal import _manifest as man

DEFAULT_MAX_INFLIGHT_BYTES = _budget.DEFAULT_MAX_INFLIGHT_BYTES
#: Verified chunks a reader keeps for later reads (least recently used dropped first).
DEFAULT_CACHE_BYTES = 256 << 20

Index = tuple[int, ...]


class StepReader:
  """A committed step: its manifest, and verified reads of any region.

  Attributes:
    step: the step. metadata: user metadata saved with it. attempt: the
      persist attempt whose data the step is (None for format-1 steps).
    leaves: path -> LeafInfo. process_count: processes that wrote it.
    bytes_read: bytes fetched from storage (whole stored chunks).
    bytes_needed: bytes of the distinct regions asked for.
  """

  def __init__(self, directory: str, step: int, manifest: dict[str, Any], *,
               attempt: str | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES):
    self.directory, self.step, self.attempt = directory, step, attempt
    self.metadata: dict[str, Any] = manifest["metadata"]
    self.process_count: int = manifest["process_count"]
    self.leaves: dict[str, man.LeafInfo] = {
        o["path"]: man.LeafInfo.from_obj(o) for o in manifest["leaves"]}
    self.bytes_read = 0
    self.bytes_needed = 0
    self._lock = threading.Lock()
    self._stores: dict[str, ts.TensorStore] = {}
    self._views: dict[str, ts.TensorStore] = {}
    self._cache: collections.OrderedDict[tuple[str, Index], np.ndarray] = collections.OrderedDict()
    self._cache_bytes, self._cached = cache_bytes, 0

  def _info(self, path: str) -> man.LeafInfo:
    info = self.leaves.get(path)
    if info is None:
      raise errors.StructureMismatchError(
          f"step {self.step} has no leaf {path!r}; it has {sorted(self.leaves)[:20]}")
    if not info.is_array:
      raise errors.StructureMismatchError(
          f"leaf {path!r} of step {self.step} is a {info.kind} (value {info.value!r}), not an array")
    return info

  def raw_leaf(self, path: str) -> ts.TensorStore:
    """The stored zarr array of a leaf, unverified (stored dtype): for tools that
    check it themselves. Callers that use values want :meth:`read` or :meth:`open_leaf`."""
    info = self._info(path)
    with self._lock:
      store = self._stores.get(path)
    if store is None:    # opened without the lock: tensorstore's threads take it (views)
      store = _arrays.open_for_read(self.directory, self.step, info)
      with self._lock:
        store = self._stores.setdefault(path, store)
    return store

  # -- verified chunks ----------------------------------------------------------

  def _check(self, info: man.LeafInfo, idx: Index, raw: np.ndarray) -> np.ndarray:
    """The chunk's values if they match the manifest's checksum, else raises."""
    arr = lay.logical_view(np.require(raw, requirements="C"), info.numpy_dtype)  # rank 0 stays
    key = lay.chunk_key(idx)
    want = info.chunks.get(key)
    got = snap.checksum(arr)
    if want is None or got != want:
      cbox = lay.chunk_box(idx, info.shape, info.chunk_shape)
      why = ("the manifest records no checksum for it" if want is None else
             f"checksum {got} != saved {want}: the chunk is missing, damaged, swapped or "
             "from another leaf")
      raise errors.CorruptSnapshotError(
          f"step {self.step}: leaf {info.path!r} region {[list(p) for p in cbox]} (chunk "
          f"{key}) in {self.directory!r} is damaged ({why}); restore another step "
          f"(`jaxckpt verify {self.directory}` lists every damaged chunk)")
    return arr

  def _load(self, info: man.LeafInfo, idxs: list[Index]) -> dict[Index, np.ndarray]:
    """Reads stored chunks ``idxs`` of a leaf concurrently and verifies each."""
    if not idxs:
      return {}
    store = self.raw_leaf(info.path)
    futures = {}
    for idx in idxs:
      box = lay.chunk_box(idx, info.shape, info.chunk_shape)
      futures[idx] = store[tuple(slice(a, b) for a, b in box)].read()
    out = {}
    for idx, fut in futures.items():
      try:
        raw = fut.result(timeout=lay.REQUEST_TIMEOUT_SECS)
      except TimeoutError:
        raise self._failed(info, lay.chunk_box(idx, info.shape, info.chunk_shape), TimeoutError(
            f"no answer within {lay.REQUEST_TIMEOUT_SECS} s")) from None
      except ValueError as e:
        raise self._failed(info, lay.chunk_box(idx, info.shape, info.chunk_shape), e) from None
      out[idx] = self._check(info, idx, raw)
    with self._lock:
      self.bytes_read += sum(a.nbytes for a in out.values())
    return out

  def _failed(self, info: man.LeafInfo, box: Box, error: Exception) -> errors.JaxckptError:
    """A failed read of the chunk at ``box``: proven damage (CorruptSnapshotError) or an
    error of this attempt (StorageError), as :mod:`~jaxckpt.universal._failures` tells."""
    key = lay.chunk_key(lay.chunks_in(box, info.chunk_shape)[0])
    where = (f"step {self.step}: leaf {info.path!r} region {[list(p) for p in box]} (chunk "
             f"{key}) in {self.directory!r}")
    return _failures.classify(error, where, lambda cause: (
        f"{where} is damaged ({cause}); restore another step (`jaxckpt verify "
        f"{self.directory}` lists every damaged chunk)"))

  def _fetch(self, path: str, idxs: Iterable[Index]) -> dict[Index, np.ndarray]:
    """Verified chunks ``idxs`` of a leaf: from the cache, the rest read and cached."""
    info = self._info(path)
    out: dict[Index, np.ndarray] = {}
    todo = []
    with self._lock:
      for idx in idxs:
        hit = self._cache.get((path, idx))
        if hit is None:
          todo.append(idx)
        else:
          self._cache.move_to_end((path, idx))
          out[idx] = hit
    loaded = self._load(info, todo)
    out.update(loaded)
    with self._lock:
      for idx, arr in loaded.items():
        self._remember(path, idx, arr)
    return out

  def _remember(self, path: str, idx: Index, arr: np.ndarray) -> None:
    if arr.nbytes > self._cache_bytes:
      return
    key = (path, idx)
    if key not in self._cache:
      self._cache[key] = arr
      self._cached += arr.nbytes
    while self._cached > self._cache_bytes:
      _, old = self._cache.popitem(last=False)
      self._cached -= old.nbytes

  def _assemble(self, info: man.LeafInfo, box: Box, chunks: Mapping[Index, np.ndarray]) -> np.ndarray:
    out = snap.aligned_empty(snap.box_shape(box), info.numpy_dtype)
    for idx in lay.chunks_in(box, info.chunk_shape):
      cbox = lay.chunk_box(idx, info.shape, info.chunk_shape)
      inter = snap.box_intersection(cbox, box)
      if inter is not None:
        out[snap.relative_slices(inter, box)] = chunks[idx][snap.relative_slices(inter, cbox)]
    return out

  # -- reads ------------------------------------------------------------------

  def _box(self, info: man.LeafInfo, box: Box | None) -> Box:
    if box is None:
      return snap.full_box(info.shape)
    box = tuple((int(lo), int(hi)) for lo, hi in box)
    if len(box) != len(info.shape) or any(not 0 <= lo <= hi <= d
                                           for (lo, hi), d in zip(box, info.shape)):
      raise errors.InvalidArgumentError(
          f"box {[list(p) for p in box]} is not inside leaf {info.path!r} of shape "
          f"{list(info.shape)}")
    return box

  def _chunks_of(self, info: man.LeafInfo, box: Box) -> list[Index]:
    return lay.chunks_in(box, info.chunk_shape) if snap.box_size(box) else []

  def read(self, path: str, box: Box | None = None) -> np.ndarray:
    """A fresh array holding ``box`` (default: all) of leaf ``path``, verified."""
    info = self._info(path)
    box = self._box(info, box)
    out = self._assemble(info, box, self._fetch(path, self._chunks_of(info, box)))
    with self._lock:
      self.bytes_needed += out.nbytes
    return out

  def region_reader(self, path: str, *, boxes: Iterable[Box] | None = None,
                    budget: _budget.ByteBudget | None = None) -> "RegionReader":
    """``read_region(box)`` for one restore of leaf ``path``. ``boxes``, the regions
    the restore will ask for, lets the first read fetch every stored chunk they
    and it touch once, straight into their buffers, verified (targets that cut
    across chunks read no byte twice); a box asked for again, or not named, is
    read anew."""
    return RegionReader(self, self._info(path), budget, boxes)

  def open_leaf(self, path: str) -> ts.TensorStore:
    """A lazy read-only view of one leaf (stored dtype) whose every read is verified.

    Reads fetch the stored chunks they touch and check each against the
    manifest, as :meth:`read` does; conversions and orbax export build on it.
    """
    info = self._info(path)
    with self._lock:
      view = self._views.get(path)
    if view is not None:
      return view
    raw = self.raw_leaf(path)
    dtype = info.numpy_dtype

    def plan(box: Box) -> _lazy.Plan:
      idxs = lay.chunks_in(box, info.chunk_shape) if snap.box_size(box) else []
      cboxes = [lay.chunk_box(i, info.shape, info.chunk_shape) for i in idxs]

      def compute(parts: list[np.ndarray]) -> np.ndarray:
        chunks = {i: self._check(info, i, p) for i, p in zip(idxs, parts)}
        with self._lock:
          self.bytes_read += sum(p.nbytes for p in chunks.values())
        return self._assemble(info, box, chunks)

      return [(raw, cb, dtype) for cb in cboxes], compute

    def failed(box: Box, e: Exception) -> Exception:
      return self._failed(info, box, e)

    view = _lazy.virtual(plan, info.shape, info.dtype, info.chunk_shape, damaged=failed)
    with self._lock:
      return self._views.setdefault(path, view)

  def iter_chunks(self, path: str) -> Iterator[tuple[str, Box]]:
    info = self._info(path)
    for ix in np.ndindex(*lay.chunk_grid(info.shape, info.chunk_shape)):
      yield lay.chunk_key(ix), lay.chunk_box(ix, info.shape, info.chunk_shape)


class RegionReader:
  """Verified regions of one leaf for one restore (see :meth:`StepReader.region_reader`).

  The first call reads every box it and the boxes named up front need, at once
  (:func:`~jaxckpt.universal._fill.fill`: each stored chunk read once, straight
  into the boxes' buffers, checked as it arrives, at most a window of chunks in
  flight, held in the restore's ``budget``); each call then hands out its box's
  buffer. A box asked for again, or not named up front, is read anew.
  """

  def __init__(self, reader: StepReader, info: man.LeafInfo,
               budget: _budget.ByteBudget | None, boxes: Iterable[Box] | None = None,
               window: int | None = None) -> None:
    self._reader, self._info, self._budget, self._window = reader, info, budget, window
    self._ready: dict[Box, np.ndarray] = {}
    self._asked: set[Box] = set()
    self._ahead = [] if boxes is None else list(boxes)

  def __call__(self, box: Box | None = None) -> np.ndarray:
    r, info = self._reader, self._info
    box = r._box(info, box)                       # pylint: disable=protected-access
    if box not in self._ready:
      boxes = [box] + [b for b in (r._box(info, b) for b in self._ahead)  # pylint: disable=protected-access
                       if b not in self._asked]
      self._ahead = []
      store = r.raw_leaf(info.path)
      files = _fill.ChunkFiles(r.directory, r.step, info, np.dtype(store.dtype.numpy_dtype))
      got, n = _fill.fill(store, info, boxes, budget=self._budget,
                          window=self._window or files.window, files=files,
                          verify=lambda idx, raw: r._check(info, idx, raw),  # pylint: disable=protected-access
                          failed=lambda cbox, e: r._failed(info, cbox, e))   # pylint: disable=protected-access
      with r._lock:                               # pylint: disable=protected-access
        r.bytes_read += n
      self._ready.update(got)
    out = self._ready.pop(box)
    if box not in self._asked:
      self._asked.add(box)
      with r._lock:                               # pylint: disable=protected-access
        r.bytes_needed += out.nbytes
    return out

  def close(self) -> None:
    self._ready.clear()


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
  with _failures.reading(f"step {step}: its commit marker in {directory!r}"):
    marker = _commit.read_marker(kv, directory, step)
  if marker is None:
    raise errors.StepNotFoundError(
        f"step {step} is not committed in {directory!r}; committed steps: "
        f"{_commit.all_steps(directory)}")
  attempt = marker.get("attempt")
  if attempt is not None and not (isinstance(attempt, str)
                                  and lay.ATTEMPT.fullmatch(attempt)):
    raise errors.CorruptSnapshotError(
        f"step {step} in {directory!r}: its commit marker names attempt {attempt!r}, not a "
        "key-safe name; the marker is damaged or forged: restore another step")
  with _failures.reading(f"step {step}: its manifest in {directory!r}"):
    body = lay.read(kv, lay.manifest_key(step, attempt)).result(timeout=lay.REQUEST_TIMEOUT_SECS)
  if body.state != "value" or snap.checksum(body.value) != marker.get("manifest_xxh3"):
    raise errors.CorruptSnapshotError(
        f"step {step} in {directory!r}: the manifest of attempt {attempt!r} is missing or "
        "does not match the checksum in its commit marker; restore another step")
  doc = man.loads(body.value, what=f"manifest of step {step} in {directory!r}")
  man.validate(doc, what=f"manifest of step {step} in {directory!r}")
  if doc["step"] != step:
    raise errors.CorruptSnapshotError(
        f"step {step} in {directory!r}: its manifest says step {doc['step']}; restore "
        "another step")
  for leaf in doc["leaves"]:               # every path checked before anything is read
    if leaf.get("kind") != "scalar":
      where = f"step {step} in {directory!r}: leaf {leaf.get('path')!r}"
      lay.check_array_path(leaf.get("array"), attempt, where=where)
      _check_chunk_table(leaf, where)
  return StepReader(directory, step, doc, attempt=attempt)


def _check_chunk_table(leaf: dict[str, Any], where: str) -> None:
  """The leaf's numbers are possible (:func:`man.check_leaf_numbers`) and its shape,
  chunk layout and table of chunk checksums agree (one checksum per chunk of the
  grid): a manifest whose shape was changed is refused before a read sizes anything
  by it."""
  man.check_leaf_numbers(leaf, where)
  shape, chunk = leaf.get("shape") or [], leaf.get("chunk_shape") or []
  inner = leaf.get("inner_chunk_shape") or []
  grid = lay.chunk_grid(shape, chunk) if len(chunk) == len(shape) else None
  if grid is None or len(inner) != len(shape) or int(np.prod(grid, dtype=object)) != len(
      leaf.get("chunks") or {}):
    raise errors.CorruptSnapshotError(
        f"{where}: its shape {shape}, chunk layout {chunk} (inner {inner}) and its "
        f"{len(leaf.get('chunks') or {})} chunk checksums disagree; the manifest is damaged "
        "or forged: restore another step")


def _restore_one(reader: StepReader, path: str, target: Any,
                 budget: _budget.ByteBudget) -> Any:
  info = reader.leaves[path]
  if not info.is_array:
    return info.scalar
  sharding = getattr(target, "sharding", None) if target is not None else None
  if target is not None and tuple(target.shape) != info.shape:
    raise errors.StructureMismatchError(
        f"leaf {path!r}: target shape {tuple(target.shape)} != saved shape {info.shape}")
  if target is not None and np.dtype(target.dtype) != info.numpy_dtype:
    raise errors.StructureMismatchError(
        f"leaf {path!r}: target dtype {np.dtype(target.dtype)} != saved dtype {info.dtype}; "
        "restore with the saved dtype and cast afterwards")
  boxes = None if sharding is None else set(_assemble.device_boxes(info.shape, sharding).values())
  read_region = reader.region_reader(path, boxes=boxes, budget=budget)
  try:
    if sharding is None:
      return read_region(None)
    return _assemble.make_array(info.shape, info.numpy_dtype, sharding, read_region)
  finally:
    read_region.close()


def restore_arrays(reader: StepReader, targets: Mapping[str, Any], *,
                   max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                   max_workers: int = 4) -> dict[str, Any]:
  """Restores leaves onto target shardings, each process reading only what it needs.

  Every stored chunk a leaf's targets touch is read once and verified against
  the manifest before any of its bytes are used.

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
  budget = _budget.ByteBudget(max_inflight_bytes, what=f"restore of step {reader.step}")
  with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
    futures = {p: pool.submit(_restore_one, reader, p, t, budget) for p, t in targets.items()}
    return {p: f.result() for p, f in futures.items()}


def verify_step(reader: StepReader, *, progress: Any = None) -> list[str]:
  """Reads every chunk of every leaf and checks it; returns one line per damage.

  Raises:
    StorageError: storage refused or did not answer a read (not damage: the step's
      bytes were not all checked).
  """
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
        progress.update(snap.box_size(box) * info.numpy_dtype.itemsize)
  return problems


def to_jax_dtype_struct(info: man.LeafInfo, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
  """A restore target for ``info`` on ``sharding``."""
  return jax.ShapeDtypeStruct(info.shape, info.numpy_dtype, sharding=sharding)
