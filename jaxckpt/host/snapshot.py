"""The host-snapshot data model shared by every tier (no JAX here).

A snapshot of one step on one process is one contiguous byte buffer plus a
:class:`SnapshotManifest` that says where each shard of each leaf lies in it.
Shards are boxes of the leaf's global array (``index`` is ``[start, stop)``
per dimension), so a snapshot does not depend on the mesh that wrote it: any
reader can assemble any region of any leaf from the boxes that cover it.

>>> m = SnapshotManifest(step=3, leaves=(), nbytes=0)
>>> SnapshotManifest.from_json(m.to_json()) == m
True
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np
import xxhash

from jaxckpt import errors

MANIFEST_VERSION = 1
ALIGN_BYTES = 64

Box = tuple[tuple[int, int], ...]


def checksum(buf: Any) -> str:
  """Content checksum of a bytes-like object or contiguous array (xxh3-64, hex).

  >>> checksum(b"jaxckpt")
  'ec69423d273eb5cf'
  """
  if isinstance(buf, np.ndarray) and not (buf.dtype == np.uint8 and buf.flags.c_contiguous):
    buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
  return xxhash.xxh3_64_hexdigest(buf)     # ~1 us: called per shard, thousands per save


_CHUNK_BYTES = 1 << 20     # copy and hash chunk: hashed while it is still in L2


def copy_and_hash(src: np.ndarray, dst: np.ndarray) -> str:
  """Copies flat uint8 ``src`` into ``dst`` and returns the checksum of the bytes copied.

  One pass over memory: each chunk is hashed right after it is copied, while it
  is still in cache. The result equals ``checksum(src)``.
  """
  h = xxhash.xxh3_64()
  for lo in range(0, src.size, _CHUNK_BYTES):
    hi = min(lo + _CHUNK_BYTES, src.size)
    np.copyto(dst[lo:hi], src[lo:hi])
    h.update(memoryview(dst[lo:hi]))
  return h.hexdigest()


def align(n: int, alignment: int = ALIGN_BYTES) -> int:
  """Rounds ``n`` up to a multiple of ``alignment``."""
  return -(-n // alignment) * alignment


def box_shape(box: Box) -> tuple[int, ...]:
  return tuple(stop - start for start, stop in box)


def box_size(box: Box) -> int:
  """The number of elements in ``box``."""
  n = 1
  for start, stop in box:
    n *= stop - start
  return n


def box_intersection(a: Box, b: Box) -> Box | None:
  """The overlap of two boxes, or None if they do not overlap."""
  out = []
  for (a0, a1), (b0, b1) in zip(a, b):
    lo, hi = max(a0, b0), min(a1, b1)
    if lo >= hi:
      return None
    out.append((lo, hi))
  return tuple(out)


def relative_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
  """Slices that select ``inner`` inside an array that holds ``outer``."""
  return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def box_from_index(index: Sequence[slice], shape: Sequence[int]) -> Box:
  """Normalizes a tuple of slices (as jax shardings give them) to a box."""
  out = []
  for sl, dim in zip(index, shape):
    start, stop, step = sl.indices(dim)
    if step != 1:
      raise ValueError(f"strided shard index {sl=} is not supported")
    out.append((start, stop))
  return tuple(out)


def full_box(shape: Sequence[int]) -> Box:
  return tuple((0, d) for d in shape)


class ShardRecord(NamedTuple):
  """One stored shard of a leaf: a box of the global array at a buffer offset.

  A named tuple, not a frozen dataclass: a save builds one per shard
  (thousands), and a frozen dataclass's ``__init__`` costs ~3x as much.
  """

  index: Box
  offset: int
  nbytes: int
  checksum: str

  def to_obj(self) -> dict[str, Any]:
    return {"index": [list(p) for p in self.index], "offset": self.offset,
            "nbytes": self.nbytes, "checksum": self.checksum}

  @classmethod
  def many(cls, boxes: Iterable[Box], offsets: Iterable[int], nbytes: Iterable[int],
           checksums: Iterable[str]) -> list["ShardRecord"]:
    """``[ShardRecord(*t) for t in zip(...)]`` at C speed (~0.15 us a record, half
    of calling the class): a save builds thousands."""
    return list(map(tuple.__new__, itertools.repeat(cls),
                    zip(boxes, offsets, nbytes, checksums)))

  @classmethod
  def from_obj(cls, o: dict[str, Any]) -> "ShardRecord":
    # Positional, and the index pairs as they come (JSON and msgpack give ints):
    # an agent parses thousands of these on every commit.
    return cls(tuple(map(tuple, o["index"])), int(o["offset"]), int(o["nbytes"]),
               str(o["checksum"]))


# Leaf kinds: arrays live in the buffer; the rest live in the manifest.
ARRAY_KINDS = ("jax", "numpy", "prng_key")
VALUE_KINDS = ("scalar",)


class LeafRecord(NamedTuple):
  """One leaf of the saved tree (a named tuple: a save builds one per leaf).

  Attributes:
    path: the leaf's tree path as ``jax.tree_util.keystr`` writes it.
    kind: ``"jax"`` (a jax.Array), ``"numpy"`` (a numpy array or numpy
      scalar), ``"prng_key"`` (a typed key array, stored as its key data), or
      ``"scalar"`` (a Python bool/int/float/complex/str/bytes kept in ``value``).
    shape: global shape (of the key data for ``prng_key``).
    dtype: numpy dtype name (``"bfloat16"``, ``"int4"``, ...).
    shards: the boxes this process stored, each once.
    sharding: how the saving program laid the leaf out (informational).
    value: the JSON form of a ``scalar`` leaf.
    key_impl: the PRNG implementation name of a ``prng_key`` leaf.
  """

  path: str
  kind: str
  shape: tuple[int, ...] = ()
  dtype: str = ""
  shards: tuple[ShardRecord, ...] = ()
  sharding: dict[str, Any] | None = None
  value: Any = None
  key_impl: str | None = None

  @property
  def is_array(self) -> bool:
    return self.kind in ARRAY_KINDS

  @property
  def numpy_dtype(self) -> np.dtype:
    return dtype_from_name(self.dtype)

  def to_obj(self) -> dict[str, Any]:
    return {"path": self.path, "kind": self.kind, "shape": list(self.shape),
            "dtype": self.dtype, "shards": [s.to_obj() for s in self.shards],
            "sharding": self.sharding, "value": self.value,
            "key_impl": self.key_impl}

  @classmethod
  def from_obj(cls, o: dict[str, Any]) -> "LeafRecord":
    return cls(path=o["path"], kind=o["kind"], shape=tuple(o["shape"]),
               dtype=o["dtype"],
               shards=tuple(ShardRecord.from_obj(s) for s in o["shards"]),
               sharding=o.get("sharding"), value=o.get("value"),
               key_impl=o.get("key_impl"))


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotManifest:
  """Everything needed to read one process's snapshot buffer of one step."""

  step: int
  leaves: tuple[LeafRecord, ...]
  nbytes: int
  process_index: int = 0
  process_count: int = 1
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
  version: int = MANIFEST_VERSION
  # Renders ``to_json``'s text faster than encoding (capture's per-layout
  # template), or returns None; never compared.
  json_renderer: Callable[["SnapshotManifest"], str | None] | None = dataclasses.field(
      default=None, compare=False, repr=False)

  def to_obj(self) -> dict[str, Any]:
    return {"version": self.version, "step": self.step, "nbytes": self.nbytes,
            "process_index": self.process_index,
            "process_count": self.process_count, "metadata": self.metadata,
            "leaves": [leaf.to_obj() for leaf in self.leaves]}

  @classmethod
  def from_obj(cls, o: dict[str, Any]) -> "SnapshotManifest":
    """The manifest ``o`` describes (JSON from another process: an agent, a peer),
    its numbers checked (:func:`check_numbers`): CorruptSnapshotError if impossible."""
    check_manifest_version(o)
    try:
      m = cls(step=int(o["step"]), nbytes=int(o["nbytes"]),
              process_index=int(o.get("process_index", 0)),
              process_count=int(o.get("process_count", 1)),
              metadata=dict(o.get("metadata") or {}),
              leaves=tuple(LeafRecord.from_obj(x) for x in o["leaves"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise errors.CorruptSnapshotError(
          f"snapshot manifest of step {o.get('step')!r} is damaged ({type(e).__name__}: "
          f"{e}); restore another tier or step") from None
    check_numbers(m)
    return m

  def to_json(self) -> str:
    text = self.json_renderer(self) if self.json_renderer is not None else None
    return text if text is not None else json.dumps(self.to_obj(), separators=(",", ":"))

  @classmethod
  def from_json(cls, s: str | bytes) -> "SnapshotManifest":
    return cls.from_obj(manifest_obj(s))

  @property
  def paths(self) -> tuple[str, ...]:
    return tuple(leaf.path for leaf in self.leaves)


# What a snapshot can be (:func:`check_numbers`): ranks and dimensions as tensorstore
# allows them, bytes within int64 with room to spare.
MAX_RANK = 32
MAX_DIM = 2**62 - 2
MAX_BYTES = 2**62


def check_numbers(m: SnapshotManifest) -> None:
  """Raises CorruptSnapshotError unless every number of ``m`` is possible: the buffer's
  size, each array leaf's shape, and each shard's box inside that shape, its offset
  and size inside the buffer and its size that of its box. A manifest comes from
  another process (a peer's agent): its numbers are data, never used unchecked (a
  negative offset would read other bytes, a huge one size a buffer)."""
  def bad(why: str) -> errors.CorruptSnapshotError:
    return errors.CorruptSnapshotError(
        f"snapshot manifest of step {m.step} (process {m.process_index}) is damaged: {why}; "
        "restore another tier or step")

  total = m.nbytes
  if not (0 <= total <= MAX_BYTES and 1 <= m.process_count <= 2**31
          and 0 <= m.process_index < m.process_count):
    raise bad(f"buffer of {total} bytes, process {m.process_index} of {m.process_count}")
  for leaf in m.leaves:
    if leaf.kind not in ARRAY_KINDS:
      continue
    shape = leaf.shape
    if len(shape) > MAX_RANK or any(type(d) is not int or not 0 <= d <= MAX_DIM for d in shape):
      raise bad(f"leaf {leaf.path!r} has shape {list(shape)}")
    itemsize = leaf.numpy_dtype.itemsize
    for sh in leaf.shards:
      n, index = itemsize, sh.index
      if len(index) != len(shape):
        raise bad(f"leaf {leaf.path!r} of shape {list(shape)} has a shard at {list(index)}")
      for (lo, hi), d in zip(index, shape):
        if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= d:
          raise bad(f"leaf {leaf.path!r} of shape {list(shape)} has a shard at {list(index)}")
        n *= hi - lo
      if sh.nbytes != n or not 0 <= sh.offset <= total - n:
        raise bad(f"leaf {leaf.path!r}: its shard at {list(index)} ({n} bytes) is said to "
                  f"be {sh.nbytes} bytes at offset {sh.offset} of a {total}-byte buffer")


def manifest_obj(text: str | bytes) -> dict[str, Any]:
  """A manifest's JSON parsed, its version checked (ManifestError otherwise)."""
  try:
    obj = json.loads(text)
  except ValueError as e:
    raise errors.ManifestError(f"snapshot manifest is not valid JSON: {e}") from e
  check_manifest_version(obj)
  return obj


def check_manifest_version(o: dict[str, Any]) -> None:
  if o.get("version") != MANIFEST_VERSION:
    raise errors.ManifestError(
        f"snapshot manifest version {o.get('version')!r} is not supported "
        f"(this jaxckpt reads version {MANIFEST_VERSION}); run one jaxckpt version "
        "for trainers and agents, or upgrade jaxckpt")


def dtype_from_name(name: str) -> np.dtype:
  """numpy dtype for a name, including the ml_dtypes ones (bfloat16, int4, ...)."""
  try:
    return np.dtype(name)
  except TypeError:
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    try:
      return np.dtype(getattr(ml_dtypes, name))
    except AttributeError:
      raise errors.ManifestError(f"unknown dtype {name=}") from None


def shard_view(buffer: Any, shard: ShardRecord, dtype: np.dtype) -> np.ndarray:
  """A zero-copy array view of one stored shard inside a snapshot buffer."""
  flat = np.frombuffer(buffer, dtype=np.uint8, count=shard.nbytes, offset=shard.offset)
  return flat.view(dtype).reshape(box_shape(shard.index))


def verify_shard(buffer: Any, shard: ShardRecord, *, path: str, step: int) -> None:
  """Raises CorruptSnapshotError if the shard's bytes do not match its checksum
  (or lie past the end of ``buffer``: a truncated snapshot)."""
  with memoryview(buffer) as mv, mv.cast("B") as raw:
    end = shard.offset + shard.nbytes
    got = checksum(raw[shard.offset:end]) if end <= raw.nbytes else "<truncated>"
  if got != shard.checksum:
    raise errors.CorruptSnapshotError(
        f"step {step}: shard {list(shard.index)} of leaf {path!r} is corrupted "
        f"(checksum {got} != saved {shard.checksum}); restore another step "
        f"or tier (e.g. mgr.restore(step=...)) and discard this snapshot")


def aligned_empty(shape: Sequence[int], dtype: np.dtype, alignment: int = ALIGN_BYTES
                  ) -> np.ndarray:
  """An uninitialized C-contiguous array whose data starts on an ``alignment`` boundary.

  XLA:CPU adopts (does not copy) a 64-byte-aligned host buffer given to
  ``jax.device_put``, so building restored regions in aligned memory saves
  a copy per restore.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + alignment, np.uint8)
  lo = -raw.ctypes.data % alignment
  return raw[lo:lo + nbytes].view(dtype).reshape(tuple(shape))


def aligned_copy(a: np.ndarray) -> np.ndarray:
  """A fresh aligned copy of ``a``: what restore hands to ``device_put``.

  Restored arrays must never be views of snapshot memory that a later save
  overwrites (``device_put`` adopts aligned host buffers instead of copying).
  """
  out = aligned_empty(a.shape, a.dtype)
  np.copyto(out, a)
  return out


def assemble_region(region: Box, dtype: np.dtype,
                    pieces: Iterable[tuple[Box, np.ndarray]],
                    *, path: str = "") -> np.ndarray:
  """Builds a fresh array for ``region`` out of ``(box, array)`` pieces.

  Raises CorruptSnapshotError if the pieces leave part of the region uncovered.
  """
  out = aligned_empty(box_shape(region), dtype)
  covered = 0
  for box, arr in pieces:
    inter = box_intersection(box, region)
    if inter is None:
      continue
    out[relative_slices(inter, region)] = arr[relative_slices(inter, box)]
    covered += int(np.prod(box_shape(inter)))
  need = int(np.prod(box_shape(region)))
  if covered < need:
    raise errors.CorruptSnapshotError(
        f"leaf {path!r}: stored shards cover {covered} of the {need} elements "
        f"of region {list(region)}; the snapshot is incomplete")
  return out


ReadRegion = Callable[[Box], np.ndarray]
