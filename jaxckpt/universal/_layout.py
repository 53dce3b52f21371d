"""Where things live in a universal-format directory, and how leaves are chunked.

Layout under ``directory`` (a local path or any tensorstore kvstore URL):

  step_0000000012/attempts/<A>/parts/process_00003.json  one part record per writing process
  step_0000000012/attempts/<A>/manifest.json   the manifest (written by the commit)
  step_0000000012/arrays/<A>/<leaf>/...  one zarr v3 array per array leaf
  commits/0000000012.json                the commit marker, written last: names <A>
  quarantine/0000000012.json             a marker set aside: the step was found damaged

``<A>`` is the persist *attempt* that wrote it (the writing job's run id and
a counter): every attempt writes only keys of its own, so two writers of one
step, or a crashed attempt and its retry, never touch each other's bytes.
A step is committed if and only if its marker exists, and its data is the
attempt the marker names: the marker is one small object written in one
put (exclusive where the store supports it, and read back to learn who won),
which works on every kvstore (no rename).
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import time
import uuid
from typing import Any, Sequence

import numpy as np
import tensorstore as ts
import xxhash

from jaxckpt import errors
from jaxckpt.host.snapshot import Box, box_shape, dtype_from_name
from jaxckpt.universal import _local

COMMITS_PREFIX = "commits/"
INNER_CHUNK_TARGET_BYTES = 4 << 20
FALLBACK_CHUNK_TARGET_BYTES = 64 << 20
# A process's shards of a leaf are one chunk (one object) up to one read unit: a
# restore that needs part of it reads no more than an inner chunk would have cost.
MERGED_CHUNK_MAX_BYTES = INNER_CHUNK_TARGET_BYTES


def kvstore_url(directory: str) -> str:
  """A tensorstore kvstore URL for a local path or URL, ending in ``/``.

  >>> kvstore_url("gs://bucket/ckpt")
  'gs://bucket/ckpt/'
  """
  url = directory if "://" in directory else "file://" + os.path.abspath(directory)
  return url if url.endswith("/") else url + "/"


def s3_endpoint() -> str | None:
  """The S3 endpoint from the usual AWS variables (``AWS_ENDPOINT_URL_S3``, then
  ``AWS_ENDPOINT_URL``), or None for AWS itself."""
  return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def server_of(directory: str) -> str:
  """Where ``directory``'s requests go, for a message that must name the store that did
  not answer: an S3 directory's endpoint (AWS itself when no endpoint variable is
  set), or the local path.

  >>> server_of("/ckpt")
  'the local filesystem'
  """
  if directory.startswith("s3://"):
    endpoint = s3_endpoint()
    return f"S3 endpoint {endpoint}" if endpoint else "AWS S3 (no AWS_ENDPOINT_URL set)"
  if directory.startswith("gs://"):
    return f"GCS endpoint {os.environ.get('TENSORSTORE_GCS_HTTP_URL') or 'https://storage.googleapis.com'}"
  if local_path(directory) is not None:
    return "the local filesystem"
  return f"the {directory.partition('://')[0]} store"


def kvstore_spec(directory: str, sub: str = "") -> Any:
  """The tensorstore kvstore spec of ``sub`` (a key prefix) under ``directory``.

  Local paths and most URLs are kvstore URLs; ``s3://bucket/prefix`` becomes
  an ``s3`` driver spec whose endpoint and region come from the usual AWS
  environment variables (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
  ``AWS_REGION`` / ``AWS_DEFAULT_REGION``), so S3-compatible servers work.

  >>> kvstore_spec("/ckpt", "step_0000000001/")
  'file:///ckpt/step_0000000001/'
  """
  if directory.startswith("s3://"):
    bucket, _, prefix = directory[len("s3://"):].partition("/")
    if not bucket:
      raise errors.InvalidArgumentError(
          f"directory={directory!r} names no bucket; use s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket,
                            "path": (prefix + "/" if prefix else "") + sub}
    endpoint = s3_endpoint()
    if endpoint:
      spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region or endpoint:
      spec["aws_region"] = region or "us-east-1"
    return spec
  return kvstore_url(directory) + sub


def local_path(directory: str) -> str | None:
  """The filesystem path of a local directory or ``file://`` URL, else None."""
  if "://" not in directory:
    return os.path.abspath(directory)
  return directory[len("file://"):] if directory.startswith("file://") else None


@functools.lru_cache(maxsize=1)
def context() -> ts.Context:
  """One shared tensorstore context: no chunk cache (bytes go straight through)."""
  return ts.Context({"cache_pool": {"total_bytes_limit": 0},
                     "file_io_concurrency": {"limit": 32}})


_SPEC = re.compile(r"\s*\[(?:tensorstore_spec|source locations)='.*'\]", re.S)


def ts_error(e: BaseException) -> str:
  """A tensorstore error as a message may carry it: without the spec tensorstore
  appends (~1 KB of JSON that names nothing the message does not)."""
  return _SPEC.sub("", str(e))


#: Where a URL's store is told to be elsewhere, for a message about one that does not answer.
_ENDPOINT_HINT = {"s3": "endpoint: AWS_ENDPOINT_URL for S3-compatible stores",
                  "gs": "endpoint: TENSORSTORE_GCS_HTTP_URL for a GCS emulator"}

#: The longest one storage request may take before it is an error naming the store.
REQUEST_TIMEOUT_SECS = 120.0
#: The longest a wait that ran out spends asking storage who was late (a storage that
#: does not answer must not stretch a wait's timeout by a request's).
LATE_PROBE_SECS = 5.0


def storage_result(future: Any, what: str, directory: str,
                   timeout_secs: float = REQUEST_TIMEOUT_SECS) -> Any:
  """``future``'s result; a timeout or a store's refusal is a StorageError naming ``what``."""
  try:
    return future.result(timeout=timeout_secs)
  except TimeoutError:
    raise errors.StorageError(
        f"{what} at {directory!r} took over {timeout_secs} s: {server_of(directory)} did not "
        f"answer; is it reachable "
        f"({_ENDPOINT_HINT.get(directory.partition('://')[0], 'its address')}; "
        "credentials)?") from None
  except ValueError as e:
    raise errors.StorageError(f"{what} at {directory!r} failed: {ts_error(e)}") from None


def open_kvstore(directory: str, *, timeout_secs: float = REQUEST_TIMEOUT_SECS) -> ts.KvStore:
  return storage_result(ts.KvStore.open(kvstore_spec(directory), context=context()),
                        "opening storage", directory, timeout_secs)



def check_directory(directory: str, *, timeout_secs: float) -> None:
  """Fails now, not in a background write, if ``directory`` cannot hold checkpoints.

  A local directory is created if missing and must take a test file; a URL's
  store must answer a listing and take (and delete) a test object, all within
  ``timeout_secs``: on ``gs://`` a bucket that does not exist lists as empty
  (tensorstore reads GCS's 404 as no keys), so only a write tells.

  Raises:
    InvalidArgumentError: an empty directory string.
    StorageError: naming the path and the cause (errno) and what to do.
  """
  if not isinstance(directory, str) or not directory.strip():
    raise errors.InvalidArgumentError(
        f"directory={directory!r} is empty; pass a path or a URL (s3://bucket/prefix), or "
        "None for host snapshots only")
  local = local_path(directory)
  if local is None:
    deadline = time.monotonic() + timeout_secs
    kv = open_kvstore(directory, timeout_secs=timeout_secs)
    storage_result(kv.list(prefix_range(COMMITS_PREFIX)), "listing the steps", directory,
                   max(0.0, deadline - time.monotonic()))
    probe = f".jaxckpt-probe-{uuid.uuid4().hex}"
    try:
      storage_result(kv.write(probe, b"x"), "writing a test object", directory,
                     max(0.0, deadline - time.monotonic()))
    except errors.StorageError as e:
      raise errors.StorageError(
          f"checkpoint directory {directory!r} cannot be written: {e}; does the bucket exist, "
          "and may these credentials write to it?") from None
    storage_result(kv.delete_range(ts.KvStore.KeyRange(probe, probe + "\0")),
                   "deleting a test object", directory, max(0.0, deadline - time.monotonic()))
    return
  try:
    _local.make_durable_dirs(local)     # what it makes survives a power loss
    fd, probe = tempfile.mkstemp(prefix=".jaxckpt-probe-", dir=local)
    try:
      os.write(fd, b"x")
      os.fsync(fd)
    finally:
      os.close(fd)
      os.unlink(probe)
  except OSError as e:
    raise errors.StorageError(
        e.errno, f"checkpoint directory {local!r} cannot be written ({e.strerror}); "
        "choose a writable directory", local) from None

def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
  """Every key that starts with ``prefix``."""
  return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def step_dir(step: int) -> str:
  return f"step_{step:010d}/"


def commit_key(step: int) -> str:
  return f"{COMMITS_PREFIX}{step:010d}.json"


#: A rollback under way (``core._deletes``): the abandoned timeline's steps, recorded
#: before any of them is deleted, removed once all are.
ROLLBACK_KEY = "rollback.json"


def quarantine_key(step: int) -> str:
  """Where a committed step found damaged is set aside (its marker, and why)."""
  return f"quarantine/{step:010d}.json"


def attempt_dir(step: int, attempt: str) -> str:
  """Where one persist attempt of ``step`` keeps its part records and manifest."""
  return f"{step_dir(step)}attempts/{attempt}/"


def part_key(step: int, process_index: int, attempt: str) -> str:
  return f"{attempt_dir(step, attempt)}parts/process_{process_index:05d}.json"


def manifest_key(step: int, attempt: str | None) -> str:
  """The manifest of a committed attempt (``None``: a format-1 step, one per step)."""
  return f"{step_dir(step) if attempt is None else attempt_dir(step, attempt)}manifest.json"


def claims_prefix(step: int) -> str:
  """Where the writers of ``step`` that are about to commit announce themselves."""
  return f"{step_dir(step)}claims/"


ATTEMPT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_attempt(attempt: str) -> str:
  """An attempt id is a short key-safe name (it becomes part of storage keys)."""
  if not isinstance(attempt, str) or not ATTEMPT.fullmatch(attempt):
    raise errors.InvalidArgumentError(
        f"persist attempt id {attempt!r} must be 1-128 letters, digits, '.', '_' or '-'")
  return attempt


_KEY_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


def check_array_path(array: Any, attempt: str | None, *, where: str) -> None:
  """Raises CorruptSnapshotError unless ``array`` (a leaf's array directory, read
  from a manifest or a part record) stays inside the step: relative, made of
  key-safe names, none of them ``.`` or ``..``, and under ``attempt``'s own
  arrays when the step has one (every array jaxckpt writes is). Checked before
  anything is read through it."""
  parts = array.split("/") if isinstance(array, str) else None
  ok = bool(parts) and all(_KEY_PART.fullmatch(p) and p not in (".", "..") for p in parts)
  if ok and attempt is not None:
    ok = len(parts) >= 2 and parts[0] == attempt
  if not ok:
    raise errors.CorruptSnapshotError(
        f"{where}: its array path {array!r} leads outside the step"
        + ("" if attempt is None else f" (its data is attempt {attempt!r}'s arrays)")
        + "; the manifest is damaged or forged, so nothing was read through it: restore "
        "another step")


def local_root(kv: ts.KvStore) -> str | None:
  """The filesystem path of a local ``kv`` (its root, ending in ``/``), else None."""
  try:
    url = kv.url
  except NotImplementedError:           # (an s3 store with an endpoint has no URL form)
    return None
  return kv.path if url.startswith("file://") else None


def read(kv: ts.KvStore, key: str) -> Any:
  """``kv.read(key)`` started, once a local key is known to be a regular file reached
  through real directories (a link or a FIFO planted there is refused first:
  CorruptSnapshotError, see :mod:`jaxckpt.universal._local`)."""
  root = local_root(kv)
  if root is not None:
    _local.check_key(root, key, where=f"reading {key!r} in {root!r}")
  return kv.read(key)


def read_json(kv: ts.KvStore, key: str) -> dict[str, Any] | None:
  """Reads one JSON object, or None if the key is missing."""
  return json_of(read(kv, key), key, kv)


def json_of(read: Any, key: str, kv: ts.KvStore) -> dict[str, Any] | None:
  """The JSON object a started ``kv.read(key)`` returns, or None if the key is missing."""
  res = read.result(timeout=REQUEST_TIMEOUT_SECS)
  if res.state != "value":
    return None
  try:
    return json.loads(res.value)
  except (ValueError, RecursionError) as e:   # (RecursionError: nested past any we write)
    raise errors.ManifestError(f"{key!r} in {kv.path!r} is not valid JSON: {e}") from None


def array_name(path: str) -> str:
  """A readable, filesystem-safe, collision-free array directory for a leaf path.

  >>> array_name("['params']['w']")
  'params.w-9d0453e9'
  """
  clean = re.sub(r"[^A-Za-z0-9_-]+", ".", path).strip(".")[:96] or "leaf"
  return f"{clean}-{xxhash.xxh32_hexdigest(path.encode())}"


def chunk_key(index: Sequence[int]) -> str:
  """The manifest key of a chunk grid index: ``'i.j.k'`` (``'0'`` for rank 0)."""
  return ".".join(str(i) for i in index) or "0"


def chunk_grid(shape: Sequence[int], chunk: Sequence[int]) -> tuple[int, ...]:
  return tuple(-(-d // c) for d, c in zip(shape, chunk))


def chunk_box(index: Sequence[int], shape: Sequence[int], chunk: Sequence[int]) -> Box:
  """The in-bounds box of the chunk at ``index``."""
  return tuple((i * c, min((i + 1) * c, d)) for i, c, d in zip(index, chunk, shape))


def chunks_in(box: Box, chunk: Sequence[int]) -> list[tuple[int, ...]]:
  """Grid indices of every chunk that intersects ``box``."""
  ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, chunk)]
  return [tuple(ix) for ix in np.ndindex(*[len(r) for r in ranges])
          for ix in [tuple(r[i] for r, i in zip(ranges, ix))]]


def aligned_cover_nbytes(box: Box, grid: Sequence[int], shape: Sequence[int],
                         itemsize: int) -> int:
  """Bytes in the ``grid``-aligned cover of ``box`` (clipped to ``shape``)."""
  n = itemsize
  for (lo, hi), g, d in zip(box, grid, shape):
    n *= min(-(-hi // g) * g, d) - (lo // g) * g
  return n


def uniform_chunk(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...] | None:
  """The shards' common shape if they tile ``shape`` on a regular grid, else None.

  Every process of a regular (divisible) jax sharding sees the same shard
  shape, so every process picks the same chunk layout without talking.
  """
  shapes = {box_shape(b) for b in boxes}
  if len(shapes) != 1:
    return None
  (s,) = shapes
  if any(c == 0 or d % c for c, d in zip(s, shape)):
    return None
  if any(lo % c for b in boxes for (lo, _), c in zip(b, s)):
    return None
  return s


def merged_chunk(shape: Sequence[int], boxes: Sequence[Box], itemsize: int,
                 max_bytes: int = MERGED_CHUNK_MAX_BYTES) -> tuple[int, ...] | None:
  """One chunk for all of a process's shards of a leaf, if they form one box of at
  most ``max_bytes`` that tiles ``shape`` on a regular grid; else None.

  A process of a regular jax sharding owns boxes of the same shape as every
  other process (a one-process job owns the whole array), so processes agree on
  this layout without talking; a leaf of many small shards is then one object
  on storage, not one per device.
  """
  if len(boxes) < 2:
    return None
  lo = [min(b[d][0] for b in boxes) for d in range(len(shape))]
  hi = [max(b[d][1] for b in boxes) for d in range(len(shape))]
  union = tuple(h - l for l, h in zip(lo, hi))
  if int(np.prod(union)) * itemsize > max_bytes:
    return None
  if sum(int(np.prod(box_shape(b))) for b in boxes) != int(np.prod(union)):
    return None                          # not one box (boxes given here never overlap)
  if any(c == 0 or d % c or l % c for c, d, l in zip(union, shape, lo)):
    return None
  return union


def _split(shape: Sequence[int], itemsize: int, target: int) -> tuple[int, ...]:
  """Divides the largest divisible dimension until a block is <= ``target`` bytes."""
  out = [max(1, d) for d in shape]
  while int(np.prod(out)) * itemsize > target:
    for i in sorted(range(len(out)), key=lambda k: -out[k]):
      p = next((p for p in (2, 3, 5, 7) if out[i] % p == 0), None)
      if p:
        out[i] //= p
        break
    else:
      break
  return tuple(out)


def fallback_chunk(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
  """A chunk layout from the global shape alone (same on every process).

  Used when shards are uneven; chunks then may straddle shards of several
  processes (tensorstore makes concurrent partial writes of a chunk safe).
  """
  out = [max(1, d) for d in shape]
  while int(np.prod(out)) * itemsize > FALLBACK_CHUNK_TARGET_BYTES:
    i = int(np.argmax(out))
    if out[i] == 1:
      break
    out[i] = -(-out[i] // 2)
  return tuple(out)


def inner_chunk(chunk: Sequence[int], itemsize: int,
                target_bytes: int = INNER_CHUNK_TARGET_BYTES) -> tuple[int, ...]:
  """Inner (read-unit) chunk of the zarr sharding codec: divides ``chunk`` evenly."""
  return _split(chunk, itemsize, target_bytes)


@functools.lru_cache(maxsize=None)
def storage_dtype(dtype_name: str) -> str:
  """The zarr v3 data type that stores ``dtype_name`` bit-exactly.

  The logical dtype when tensorstore's zarr3 driver supports it, else a raw
  unsigned integer of the same width (e.g. ``uint4`` -> ``uint8``).
  """
  try:
    ts.open({"driver": "zarr3", "kvstore": "memory://",
             "metadata": {"shape": [1], "data_type": dtype_name}},
            create=True).result()
    return dtype_name
  except ValueError:
    return f"uint{dtype_from_name(dtype_name).itemsize * 8}"


def zarr_spec(directory: str, step: int, array: str, *, shape: Sequence[int],
              dtype: str, chunk: Sequence[int], inner: Sequence[int]) -> dict[str, Any]:
  """The tensorstore spec of one leaf: zarr v3, sharding codec, crc32c per inner chunk."""
  little = {"name": "bytes", "configuration": {"endian": "little"}}
  return {
      "driver": "zarr3",
      "kvstore": kvstore_spec(directory, step_dir(step) + "arrays/" + array + "/"),
      "metadata": {
          "shape": list(shape),
          "data_type": dtype,
          "chunk_grid": {"name": "regular",
                         "configuration": {"chunk_shape": [max(1, c) for c in chunk]}},
          "codecs": [{"name": "sharding_indexed", "configuration": {
              "chunk_shape": [max(1, c) for c in inner],
              "codecs": [little, {"name": "crc32c"}],
              "index_codecs": [little, {"name": "crc32c"}]}}],
      },
  }


def logical_view(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """Reinterprets stored raw integers as the logical dtype (no copy)."""
  return arr if arr.dtype == dtype else arr.view(dtype)
