"""The step manifest (``manifest.json``) and per-process part records.

Both follow ``manifest.schema.json`` (checked in beside this module) and are
validated with jsonschema on every write and every read.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
from typing import Any, Callable

import fastjsonschema
import jsonschema
import numpy as np

from jaxckpt import errors
from jaxckpt.host.snapshot import Box, dtype_from_name
from jaxckpt.tree import scalar_from_json, scalar_to_json
from jaxckpt.util import _json

FORMAT = "jaxckpt.universal"
VERSION = 1
CHECKSUM_ALGORITHM = "xxh3_64"

# What a stored leaf can be (:func:`check_leaf_numbers`): a manifest's numbers past
# these are impossible, refused before anything is sized by them. Ranks and
# dimensions as tensorstore allows them; bytes within int64 with room to spare; a
# chunk (one stored object, a process's shard at most) that no host holds.
MAX_RANK = 32
MAX_DIM = 2**62 - 2
MAX_LEAF_BYTES = 2**62
MAX_CHUNK_BYTES = 2**48


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafInfo:
  """One leaf of a stored step.

  Attributes:
    path: tree path (``jax.tree_util.keystr``).
    kind: ``"jax"``, ``"numpy"``, ``"prng_key"`` or ``"scalar"``.
    shape: global shape (of the key data for ``prng_key``).
    dtype: logical dtype name (``"bfloat16"``, ``"int4"``, ...).
    storage_dtype: zarr data type when it differs from ``dtype`` (raw view).
    array: zarr array directory relative to the step directory.
    chunk_shape: zarr chunk (one stored shard file); inner_chunk_shape: the
      read unit inside it (crc32c-protected).
    chunks: chunk grid key (``'i.j'``) -> xxh3-64 of its C-order bytes.
    sharding: the saving mesh and PartitionSpec (informational).
    value: a scalar leaf's JSON value; key_impl: a PRNG key's implementation.
  """

  path: str
  kind: str
  shape: tuple[int, ...] = ()
  dtype: str = ""
  storage_dtype: str | None = None
  array: str | None = None
  chunk_shape: tuple[int, ...] | None = None
  inner_chunk_shape: tuple[int, ...] | None = None
  chunks: dict[str, str] = dataclasses.field(default_factory=dict)
  sharding: Any = None
  value: Any = None
  key_impl: str | None = None

  def __post_init__(self):
    if self.kind not in ("jax", "numpy", "prng_key", "scalar"):
      raise errors.InvalidArgumentError(f"LeafInfo.kind must be jax, numpy, prng_key or scalar, got {self.kind=}")
    if self.kind == "scalar" and isinstance(self.value, (bool, int, float, complex, str, bytes)):
      # One stored form for every scalar: a plain value (a step imported from
      # another format, an older jaxckpt) is kept as the manager keeps its own.
      object.__setattr__(self, "value", scalar_to_json(self.value))

  @property
  def is_array(self) -> bool:
    return self.kind != "scalar"

  @property
  def scalar(self) -> Any:
    """A scalar leaf's Python value (``value`` holds its JSON form, see
    :func:`jaxckpt.tree.scalar_to_json`; steps imported before that form was
    the only one hold the plain value, read the same)."""
    return scalar_from_json(self.value)

  @property
  def numpy_dtype(self) -> np.dtype:
    return dtype_from_name(self.dtype)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.numpy_dtype.itemsize if self.is_array else 0

  def to_obj(self) -> dict[str, Any]:
    o = dataclasses.asdict(self)
    for k in ("shape", "chunk_shape", "inner_chunk_shape"):
      o[k] = None if o[k] is None else list(o[k])
    return o

  @classmethod
  def from_obj(cls, o: dict[str, Any]) -> "LeafInfo":
    tup = lambda v: None if v is None else tuple(int(x) for x in v)
    return cls(path=o["path"], kind=o["kind"], shape=tup(o["shape"]), dtype=o["dtype"],
               storage_dtype=o.get("storage_dtype"), array=o.get("array"),
               chunk_shape=tup(o.get("chunk_shape")),
               inner_chunk_shape=tup(o.get("inner_chunk_shape")),
               chunks=dict(o.get("chunks") or {}), sharding=o.get("sharding"),
               value=o.get("value"), key_impl=o.get("key_impl"))


def check_leaf_numbers(leaf: dict[str, Any], where: str) -> None:
  """Raises CorruptSnapshotError unless an array leaf's numbers (from a manifest: data,
  see the module's bounds) are possible: a rank and dimensions tensorstore allows,
  at most ``MAX_LEAF_BYTES`` in all and ``MAX_CHUNK_BYTES`` a chunk, inner chunks
  of 1 up to their chunk's size, a dtype this jaxckpt knows (ManifestError if not:
  another version's). Python integers throughout: nothing overflows."""
  shape, chunk = leaf.get("shape"), leaf.get("chunk_shape")
  inner = leaf.get("inner_chunk_shape")

  def dims(v: Any, lo: int) -> bool:
    return (isinstance(v, list) and len(v) <= MAX_RANK and all(
        isinstance(d, int) and not isinstance(d, bool) and lo <= d <= MAX_DIM for d in v))

  why = None
  if not (dims(shape, 0) and dims(chunk, 1) and dims(inner, 1)
          and len(shape) == len(chunk) == len(inner)):
    why = (f"shape {shape!r}, chunk layout {chunk!r} and inner chunks {inner!r} are not "
           f"{MAX_RANK} or fewer dimensions of 0 to {MAX_DIM} (chunks from 1) of one rank")
  elif any(i > c for i, c in zip(inner, chunk)):
    why = f"its inner chunks {inner} are larger than its chunks {chunk}"
  else:
    itemsize = dtype_from_name(str(leaf.get("dtype"))).itemsize
    total, per_chunk = math.prod(shape) * itemsize, math.prod(chunk) * itemsize
    if total > MAX_LEAF_BYTES:
      why = f"its shape {shape} holds {total} bytes, more than any leaf can ({MAX_LEAF_BYTES})"
    elif per_chunk > MAX_CHUNK_BYTES:
      why = (f"its chunk {chunk} holds {per_chunk} bytes, more than any stored chunk can "
             f"({MAX_CHUNK_BYTES})")
  if why is not None:
    raise errors.CorruptSnapshotError(
        f"{where}: {why}; the manifest is damaged or forged, so nothing was sized by it: "
        "restore another step")


@functools.lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
  text = importlib.resources.files(__package__).joinpath("manifest.schema.json").read_text()
  return json.loads(text)


@functools.lru_cache(maxsize=1)
def _validator() -> jsonschema.protocols.Validator:
  cls = jsonschema.validators.validator_for(schema())
  cls.check_schema(schema())  # once per process, not per document
  return cls(schema())


@functools.lru_cache(maxsize=1)
def _fast_validator() -> Callable[[Any], Any]:
  """The schema compiled to Python once (fastjsonschema: ~20x jsonschema's speed). The
  schema's keywords mean the same in draft 07, which fastjsonschema compiles."""
  return fastjsonschema.compile(dict(schema(), **{"$schema": _DRAFT_07}))


_DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def loads(body: bytes | str, *, what: str) -> Any:
  """The JSON document ``body`` (a manifest, a commit marker) read from storage;
  ManifestError naming ``what`` if it is not JSON, or nested deeper than Python's
  parser goes (valid JSON ``[[[...]]]`` 200,000 levels deep is damage like any other,
  never a bare RecursionError that stops every restore)."""
  try:
    return json.loads(body)
  except RecursionError:
    raise errors.ManifestError(
        f"{what} is nested deeper than Python's JSON parser goes; it cannot be read "
        "(damaged or forged)") from None
  except ValueError as e:
    raise errors.ManifestError(f"{what} is not valid JSON: {e}") from None


def validate(obj: dict[str, Any], *, what: str) -> None:
  """Raises ManifestError naming ``what`` and the failing field if ``obj`` is off-schema.

  The compiled validator decides; jsonschema runs only to name the failing field."""
  try:
    try:
      _fast_validator()(obj)
      return
    except fastjsonschema.JsonSchemaException:
      pass
    error = jsonschema.exceptions.best_match(_validator().iter_errors(obj))
  except RecursionError:
    raise errors.ManifestError(
        f"{what} is nested too deep to be checked against manifest.schema.json v{VERSION}; "
        "it is damaged or forged") from None
  if error is None:              # the two disagree: refuse, as the compiled one did
    raise errors.ManifestError(f"{what} does not follow manifest.schema.json v{VERSION}; it "
                               "was written by another jaxckpt version or damaged")
  e = error
  if e is not None:
    where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
    raise errors.ManifestError(
        f"{what} does not follow manifest.schema.json v{VERSION} at {where}: {e.message}; "
        "it was written by another jaxckpt version or damaged")


def document(*, step: int, process_count: int, metadata: dict[str, Any],
             leaves: list[dict[str, Any]], process_index: int | None = None) -> dict[str, Any]:
  doc = {"format": FORMAT, "version": VERSION, "step": step,
         "process_count": process_count, "metadata": metadata,
         "checksum_algorithm": CHECKSUM_ALGORITHM, "leaves": leaves}
  if process_index is not None:
    doc["process_index"] = process_index
  return doc


def encode(doc: dict[str, Any], *, what: str) -> bytes:
  """``doc`` (a manifest or a part record, built by jaxckpt itself) as the bytes written
  to storage, in jaxckpt's JSON (:mod:`jaxckpt.util._json`: a NaN metric as ``NaN``).
  Only the metadata and the leaves' values and shardings can hold a float; the chunk
  tables (most of a large manifest: 11 MB at 4,096 processes) are not walked for one.
  Not validated here: every reader validates what it reads (a commit its part
  records, a restore its manifest), and validating what this code just built,
  on every save, cost a third of a persist of many small leaves."""
  del what
  floats = [doc.get("metadata")] + [(leaf.get("value"), leaf.get("sharding"))
                                    for leaf in doc.get("leaves", ())]
  return _json.encode(doc, floats=floats)


def boxes_of(leaf_obj: dict[str, Any]) -> list[Box]:
  return [tuple((int(a), int(b)) for a, b in box) for box in leaf_obj.get("boxes", [])]
