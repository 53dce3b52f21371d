"""One leaf's zarr array: its layout, and opening it to read or to write.

Shared by the writers (``_write``), the commit (``_commit``) and the readers
(``_read``), which import this module and never each other's internals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorstore as ts

from jaxckpt import errors
from jaxckpt.host import snapshot as snap
from jaxckpt.host.snapshot import Box
from jaxckpt.universal import _failures
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _local
from jaxckpt.universal import _manifest as man


def plan_leaf(path: str, kind: str, shape: tuple[int, ...], dtype: str,
              boxes: list[Box], chunk_shape: tuple[int, ...] | None = None, *,
              attempt: str | None = None,
              inner_chunk_bytes: int = lay.INNER_CHUNK_TARGET_BYTES,
              merged_chunk_bytes: int = lay.MERGED_CHUNK_MAX_BYTES,
              **extra: Any) -> man.LeafInfo:
  """Chooses storage dtype and chunk layout of one leaf (its array under ``attempt``):
  ``boxes`` (this process's shards) as one chunk up to ``merged_chunk_bytes``, else
  one chunk per shard on a regular grid, else a grid from the shape alone."""
  if kind == "scalar":
    return man.LeafInfo(path=path, kind=kind, shape=shape, dtype=dtype, **extra)
  np_dtype = snap.dtype_from_name(dtype)
  chunk = (chunk_shape or lay.merged_chunk(shape, boxes, np_dtype.itemsize, merged_chunk_bytes)
           or lay.uniform_chunk(shape, boxes) or lay.fallback_chunk(shape, np_dtype.itemsize))
  stored = lay.storage_dtype(dtype)
  name = lay.array_name(path)
  return man.LeafInfo(path=path, kind=kind, shape=shape, dtype=dtype,
                      storage_dtype=None if stored == dtype else stored,
                      array=name if attempt is None else f"{attempt}/{name}",
                      chunk_shape=tuple(chunk),
                      inner_chunk_shape=lay.inner_chunk(chunk, np_dtype.itemsize, inner_chunk_bytes),
                      **extra)


def replace(info: man.LeafInfo, **kw: Any) -> man.LeafInfo:
  return dataclasses.replace(info, **kw)


def _spec(directory: str, step: int, info: man.LeafInfo) -> dict[str, Any]:
  lay.check_array_path(info.array, None, where=f"step {step}: leaf {info.path!r}")
  return lay.zarr_spec(directory, step, info.array, shape=info.shape,
                       dtype=info.storage_dtype or info.dtype,
                       chunk=info.chunk_shape, inner=info.inner_chunk_shape)


def open_for_read(directory: str, step: int, info: man.LeafInfo) -> ts.TensorStore:
  """The stored zarr array of a committed leaf (raw: reads are not verified here). In
  a local directory every file of it is checked first to be a regular file reached
  through real directories (no link out of the checkpoint, no FIFO that never answers)."""
  spec = _spec(directory, step, info)
  local = lay.local_path(directory)
  if local is not None:
    _local.check_tree(local, f"{lay.step_dir(step)}arrays/{info.array}/",
                      where=f"step {step}: leaf {info.path!r}")
  with _failures.reading(f"step {step}: the zarr array of leaf {info.path!r} in {directory!r}",
                         lambda cause: (f"step {step}: zarr array of leaf {info.path!r} cannot "
                                        f"be opened ({cause}); the step is damaged: restore "
                                        "another step")):
    return ts.open(spec, open=True, read=True,
                   context=lay.context()).result(timeout=lay.REQUEST_TIMEOUT_SECS)


def open_for_write(directory: str, step: int,
                   info: man.LeafInfo) -> tuple[ts.TensorStore, man.LeafInfo]:
  """Creates the leaf's zarr array, or adopts the layout another process created.

  The first process of an attempt to create an array fixes its chunk layout;
  the others write their boxes into it whatever it is (tensorstore's
  conditional writes keep concurrent partial writes of one chunk safe), so
  processes never need to agree on a layout beforehand.
  """
  spec = _spec(directory, step, info)
  try:
    return ts.open(spec, create=True, context=lay.context()).result(
        timeout=lay.REQUEST_TIMEOUT_SECS), info
  except TimeoutError:
    raise errors.StorageError(
        f"step {step}: creating the array of leaf {info.path!r} in {directory!r} took over "
        f"{lay.REQUEST_TIMEOUT_SECS} s: {lay.server_of(directory)} did not answer; is it "
        "reachable?") from None
  except ValueError as e:
    if "ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
      raise errors.StorageError(
          f"step {step}: cannot create the array of leaf {info.path!r} in {directory!r}: "
          f"{lay.ts_error(e)}") from None
  del spec["metadata"]
  store = lay.storage_result(ts.open(spec, open=True, context=lay.context()),
                             f"step {step}: opening the array of leaf {info.path!r}", directory)
  if tuple(store.shape) != info.shape or str(store.dtype.name) != (info.storage_dtype or info.dtype):
    raise errors.ManifestError(
        f"step {step}: leaf {info.path!r} exists in storage as {store.dtype.name}{list(store.shape)}, "
        f"not {info.dtype}{list(info.shape)}; the processes of one persist attempt saved "
        "different trees")
  layout = store.chunk_layout
  return store, replace(info, chunk_shape=tuple(layout.write_chunk.shape),
                        inner_chunk_shape=tuple(layout.read_chunk.shape))
