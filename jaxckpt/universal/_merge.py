"""The merge of a persist attempt's part records into its manifest, linear in what differs.

Every process of an attempt writes one part record: the outline of every leaf
(path, kind, shape, dtype, array, chunk layout), which is the same on every
process, and what it wrote of each (its boxes and the checksums of its chunks).
Process 0 merges P records of L leaves. Where the time went at P = 4,096
(L = 100, a profile of the earlier merge, 6.9 s):

* decoding 119 MB of JSON into dicts (json: 1.8-2.6 s on this machine), then
  checking each of the P x L leaf dicts field by field in Python;
* comparing the outline of every leaf of every part (seven fields) and checking
  each part's array path (a regex per leaf per part);
* validating the merged manifest (P x L chunk entries) against the JSON schema
  once more, and rebuilding every chunk key of the grid to find the chunks no
  process hashed, though every one was.

So here each part decodes straight into typed records (:class:`Part`, msgspec:
the schema's field rules are checked in C while decoding, once per value, with
no second pass); the outline of a leaf is checked once (its array path) and
each later part's only compared with it (five fields); chunk tables and boxes
are merged with set and dict operations in C; the schema checks the merged
outline (L leaves) and not the chunk tables the decoder checked; and a leaf's
chunk table is known complete from its count and one pass over its keys.

>>> import msgspec
>>> part = decode(b'{"format": "jaxckpt.universal", "version": 1, "step": 1, "process_count": 1, '
...               b'"metadata": {}, "checksum_algorithm": "xxh3_64", "leaves": [{"path": "a", '
...               b'"kind": "numpy", "shape": [2], "dtype": "float32", "boxes": [[[0, 2]]]}]}', "part")
>>> part.leaves[0].boxes
[((0, 2),)]
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from jaxckpt import errors
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _manifest as man

_Dim = Annotated[int, msgspec.Meta(ge=0)]
_Extent = Annotated[int, msgspec.Meta(ge=1)]
_Attempt = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
Box = tuple[tuple[int, int], ...]


class Leaf(msgspec.Struct, forbid_unknown_fields=True, gc=False):
  """A leaf of a part record (manifest.schema.json's ``leaf``)."""
  path: str
  kind: Literal["jax", "numpy", "prng_key", "scalar"]
  shape: list[_Dim]
  dtype: str
  storage_dtype: str | None = None
  array: str | None = None
  chunk_shape: list[_Extent] | None = None
  inner_chunk_shape: list[_Extent] | None = None
  # The chunk table stays JSON until a leaf's tables merge (one decode of them all, in C,
  # rather than a dict per part and leaf: 409,600 at 4,096 processes); checked then.
  chunks: msgspec.Raw = msgspec.Raw(b"{}")
  boxes: list[Box] = []
  sharding: Any = None
  value: Any = None
  key_impl: str | None = None


class Part(msgspec.Struct, forbid_unknown_fields=True):
  """A part record (manifest.schema.json, with ``process_index`` and ``attempt``)."""
  format: Literal["jaxckpt.universal"]
  version: Literal[1]
  step: Annotated[int, msgspec.Meta(ge=0)]
  process_count: Annotated[int, msgspec.Meta(ge=1)]
  metadata: dict[str, Any]
  checksum_algorithm: Literal["xxh3_64"]
  leaves: list[Leaf]
  process_index: Annotated[int, msgspec.Meta(ge=0)] | None = None
  attempt: _Attempt | None = None


_DECODER = msgspec.json.Decoder(Part)
_TABLE = msgspec.json.Decoder(dict[str, str])
_INDEX = r"(?:0|[1-9][0-9]{0,17})"              # (a chunk index of int64, with no leading zero)
_CHECKSUMS = re.compile(r"(?:[0-9a-f]{16}\n)*")   # the schema's chunk checksum, one per line


def decode(body: bytes, what: str) -> Part:
  """The part record in ``body``; ManifestError naming ``what`` and the field if it is off-schema."""
  try:
    return _DECODER.decode(body)
  except (msgspec.ValidationError, msgspec.DecodeError):
    pass                      # (JSON msgspec does not take, e.g. a NaN in the metadata, or damage)
  try:
    obj = json.loads(body)    # (jaxckpt's JSON: a non-finite float as NaN, see util._json)
  except ValueError as e:
    raise errors.ManifestError(f"{what} is not valid JSON: {e}") from None
  try:
    return msgspec.convert(_raw_chunks(obj), Part)
  except msgspec.ValidationError as e:
    man.validate(obj, what=what)         # (names the field in the schema's words)
    raise errors.ManifestError(f"{what} does not follow manifest.schema.json v{man.VERSION} ({e}); "
                               "it was written by another jaxckpt version or damaged") from None


def _raw_chunks(obj: Any) -> Any:
  """``obj`` (a part record json read) with each leaf's chunk table as JSON text again, as
  the fast path keeps it (:attr:`Leaf.chunks`); anything else is left for the schema."""
  leaves = obj.get("leaves") if isinstance(obj, dict) else None
  if not isinstance(leaves, list):
    return obj
  out = []
  for leaf in leaves:
    if isinstance(leaf, dict) and isinstance(leaf.get("chunks"), dict):
      try:
        leaf = dict(leaf, chunks=msgspec.Raw(msgspec.json.encode(leaf["chunks"])))
      except (OverflowError, TypeError):
        pass                  # (not a table of strings: the schema names it)
    out.append(leaf)
  return dict(obj, leaves=out)


class _Merged:
  """One leaf across the parts: the first part's outline, and each part's chunk table and boxes."""

  __slots__ = ("first", "chunk_shape", "inner_chunk_shape", "tables", "procs", "boxes")

  def __init__(self, leaf: Leaf, proc: int) -> None:
    self.first = leaf
    self.chunk_shape, self.inner_chunk_shape = leaf.chunk_shape, leaf.inner_chunk_shape
    empty = len(leaf.chunks) <= 2                    # ('{}')
    self.tables: list[msgspec.Raw] = [] if empty else [leaf.chunks]   # (each part's, JSON)
    self.procs: list[int] = [] if empty else [proc]  # (whose each table is, for the error)
    self.boxes = list(leaf.boxes)

  def chunks(self, step: int) -> dict[str, str]:
    """Every part's chunk table in one; ManifestError if one is off-schema,
    CorruptSnapshotError if two parts hashed a chunk differently."""
    # The tables as one JSON object ('{a}{b}' -> '{a,b}'); its entries are its colons (no
    # key or checksum has one). Anything else (spaces, an empty table, a colon in a damaged
    # key, a chunk in two tables) takes the slow way, table by table.
    body = b"".join(self.tables).replace(b"}{", b",") or b"{}"
    out = None
    if b"{}" not in body or body == b"{}":
      try:
        out = _TABLE.decode(body)
      except (msgspec.ValidationError, msgspec.DecodeError):
        out = None
    if out is None or len(out) != body.count(b":"):
      return self._chunks_one_by_one(step)
    self._check_checksums(step, out)
    return out

  def _chunks_one_by_one(self, step: int) -> dict[str, str]:
    out: dict[str, str] = {}
    seen: dict[str, int] = {}
    for proc, raw in zip(self.procs, self.tables):
      try:
        table = _TABLE.decode(raw)
      except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise errors.ManifestError(
            f"commit of step {step}: the part record of process {proc} gives leaf {self.first.path!r} "
            f"a chunk table that does not follow manifest.schema.json v{man.VERSION} ({e}); it was "
            "written by another jaxckpt version or damaged") from None
      for key, value in table.items():
        if out.setdefault(key, value) != value:
          raise errors.CorruptSnapshotError(
              f"commit of step {step}: chunk {key} of leaf {self.first.path!r} has checksum "
              f"{value} on process {proc} but {out[key]} on process {seen[key]}; replicas differ")
        seen.setdefault(key, proc)
    self._check_checksums(step, out)
    return out

  def _check_checksums(self, step: int, out: dict[str, str]) -> None:
    if not _CHECKSUMS.fullmatch("\n".join(out.values()) + "\n" if out else ""):
      bad = next(v for v in out.values() if not _CHECKSUMS.fullmatch(v + "\n"))
      raise errors.ManifestError(
          f"commit of step {step}: a part record gives leaf {self.first.path!r} the chunk checksum "
          f"{bad!r:.40}, not 16 hex digits (manifest.schema.json v{man.VERSION}); it was written by "
          "another jaxckpt version or damaged")


def _disagree(step: int, proc: int, leaf: Leaf, ours: Any, fields: tuple[str, ...]) -> None:
  field = next(f for f in fields if getattr(leaf, f) != getattr(ours, f))
  raise errors.ManifestError(
      f"commit of step {step}: process {proc} disagrees on {field} of leaf {leaf.path!r} "
      f"({getattr(leaf, field)!r} != {getattr(ours, field)!r}); the processes saved different trees")


def merge(step: int, parts: list[Part], attempt: str) -> list[_Merged]:
  """The leaves of ``parts`` (process i's record at i), merged in first-seen order.

  Raises:
    ManifestError: the parts disagree on a leaf's outline.
    CorruptSnapshotError: a leaf's array path leads outside the attempt.
  """
  leaves: dict[str, _Merged] = {}
  for proc, part in enumerate(parts):
    for leaf in part.leaves:
      m = leaves.get(leaf.path)
      if m is None:
        if leaf.kind != "scalar":          # (every later part's array must equal this one)
          lay.check_array_path(leaf.array, attempt, where=(
              f"commit of step {step}: the part record of process {proc}, leaf {leaf.path!r}"))
        leaves[leaf.path] = _Merged(leaf, proc)
        continue
      first = m.first
      if (leaf.shape != first.shape or leaf.array != first.array or leaf.dtype != first.dtype
          or leaf.kind != first.kind or leaf.storage_dtype != first.storage_dtype):
        _disagree(step, proc, leaf, first, ("kind", "shape", "dtype", "storage_dtype", "array"))
      if leaf.chunk_shape is not None:     # (a process that wrote no box of the leaf has none)
        if m.chunk_shape is None:
          m.chunk_shape, m.inner_chunk_shape = leaf.chunk_shape, leaf.inner_chunk_shape
        elif leaf.chunk_shape != m.chunk_shape or leaf.inner_chunk_shape != m.inner_chunk_shape:
          _disagree(step, proc, leaf, m, ("chunk_shape", "inner_chunk_shape"))
      if len(leaf.chunks) > 2:            # (not '{}')
        m.tables.append(leaf.chunks)
        m.procs.append(proc)
      m.boxes += leaf.boxes
  return list(leaves.values())


def outline(merged: _Merged) -> dict[str, Any]:
  """The leaf's manifest entry without its chunk table and boxes (what the schema checks)."""
  obj = msgspec.structs.asdict(merged.first)
  obj.update(chunk_shape=merged.chunk_shape, inner_chunk_shape=merged.inner_chunk_shape, chunks={})
  del obj["boxes"]
  return obj


def covered(shape: list[int], boxes_: list[Box]) -> int | None:
  """Elements the distinct boxes of ``boxes_`` hold (a box written by two processes
  counts once), when every box lies inside ``shape``; None when one does not."""
  ndim = len(shape)
  if any(len(b) != ndim for b in boxes_):
    return None
  if not boxes_ or not ndim:
    return min(len(boxes_), 1)
  if max(shape) >= 1 << 62:              # (int64 would overflow: the slow way)
    distinct = set(boxes_)
    if any(not 0 <= a <= b <= d for box in distinct for (a, b), d in zip(box, shape)):
      return None
    return sum(math.prod(b - a for a, b in box) for box in distinct)
  flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(boxes_)),
                     dtype=np.int64, count=2 * ndim * len(boxes_)).reshape(len(boxes_), 2 * ndim)
  ordered = flat[np.lexsort(flat.T[::-1])]
  if (ordered[1:] == ordered[:-1]).all(axis=1).any():   # (a box written twice: count it once)
    flat = np.unique(ordered, axis=0)
  lo, hi = flat[:, 0::2], flat[:, 1::2]
  if ((lo < 0) | (hi < lo) | (hi > np.asarray(shape, dtype=np.int64))).any():
    return None
  return int(np.prod(hi - lo, axis=1).sum())


def complete(chunks: dict[str, str], grid: tuple[int, ...]) -> bool:
  """Whether ``chunks`` holds exactly the keys of every chunk of ``grid`` (one pass over the
  keys, no key of the grid rebuilt); False also when it cannot tell cheaply."""
  n = 1
  for g in grid:
    n *= g
  if len(chunks) != n:
    return False
  ndim = max(1, len(grid))
  form = re.compile(rf"(?:{_INDEX}(?:\.{_INDEX}){{{ndim - 1}}}\n)*")
  text = "\n".join(chunks) + "\n"
  if not form.fullmatch(text):
    return False
  index = np.fromstring(text.replace("\n", " ").replace(".", " "), dtype=np.int64, sep=" ")  # (in C)
  if index.size != n * ndim:
    return False
  index = index.reshape(n, ndim)
  bound = np.asarray(grid if grid else (1,), dtype=np.int64)
  # Canonical keys (no leading zeros), n of them, distinct (dict keys), each inside the grid:
  # that is every key of the grid.
  return bool((index < bound).all())


def encode(doc: dict[str, Any]) -> bytes:
  """``doc`` (a merged manifest) as JSON bytes (:func:`jaxckpt.universal._manifest.encode`)."""
  return man.encode(doc, what="manifest")
