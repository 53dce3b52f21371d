"""Committing, listing and deleting steps.

A step is committed by process 0 after every process wrote its part record:
it merges them into ``manifest.json`` and then writes ``commits/<step>.json``
(one atomic put; it records the manifest's checksum). Readers list only
markers, so a crash at any point before the marker leaves nothing that
:func:`latest_step` or a restore would pick.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any, Iterable

import numpy as np
import tensorstore as ts

from jaxckpt import errors
from jaxckpt import snapshot as snap
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _manifest as man

log = logging.getLogger(__name__)

_SAME_FIELDS = ("kind", "shape", "dtype", "storage_dtype", "array", "chunk_shape",
                "inner_chunk_shape")


def _wait_for_parts(kv: ts.KvStore, step: int, process_count: int,
                    timeout_secs: float) -> list[dict[str, Any]]:
  deadline = time.monotonic() + timeout_secs
  parts: dict[int, dict[str, Any]] = {}
  delay = 0.02
  while True:
    for i in range(process_count):
      if i not in parts:
        obj = lay.read_json(kv, lay.part_key(step, i))
        if obj is not None:
          man.validate(obj, what=f"part record of process {i} at step {step}")
          parts[i] = obj
    missing = [i for i in range(process_count) if i not in parts]
    if not missing:
      return [parts[i] for i in range(process_count)]
    if time.monotonic() > deadline:
      raise errors.SnapshotTimeoutError(
          f"commit of step {step}: processes {missing} of {process_count} did not write "
          f"their part records within {timeout_secs} s; they are late or died while "
          "persisting (the step stays uncommitted)")
    time.sleep(delay)
    delay = min(delay * 2, 0.5)


def _merge_leaf(step: int, into: dict[str, Any], part: dict[str, Any], proc: int) -> None:
  if into.get("chunk_shape") is None:  # layout comes from a process that wrote boxes
    for f in ("chunk_shape", "inner_chunk_shape"):
      into[f] = part.get(f)
  for f in _SAME_FIELDS:
    if f in ("chunk_shape", "inner_chunk_shape") and part.get(f) is None:
      continue
    if into.get(f) != part.get(f):
      raise errors.ManifestError(
          f"commit of step {step}: process {proc} disagrees on {f} of leaf {into['path']!r} "
          f"({part.get(f)!r} != {into.get(f)!r}); the processes saved different trees")
  for key, value in part.get("chunks", {}).items():
    if into["chunks"].setdefault(key, value) != value:
      raise errors.CorruptSnapshotError(
          f"commit of step {step}: chunk {key} of leaf {into['path']!r} has checksum {value} "
          f"on process {proc} but {into['chunks'][key]} elsewhere; replicas differ")
  seen = {tuple(map(tuple, b)) for b in into["boxes"]}
  into["boxes"] += [b for b in part.get("boxes", []) if tuple(map(tuple, b)) not in seen]


def _finish_leaf(directory: str, step: int, leaf: dict[str, Any]) -> dict[str, Any]:
  """Checks that the written boxes cover the leaf; hashes chunks no process hashed."""
  boxes = man.boxes_of(leaf)
  if leaf["kind"] != "scalar":
    have = sum(int(np.prod(snap.box_shape(b))) for b in boxes)
    need = int(np.prod(leaf["shape"]))
    if have != need:
      raise errors.ManifestError(
          f"commit of step {step}: the processes wrote {have} of the {need} elements of "
          f"leaf {leaf['path']!r} (boxes {boxes}); some shards are missing")
    if leaf.get("chunk_shape") is None:  # empty leaf: nobody wrote, create it here
      _create_empty(directory, step, leaf)
    info = man.LeafInfo.from_obj(leaf)
    grid = [ix for ix in np.ndindex(*lay.chunk_grid(info.shape, info.chunk_shape))]
    todo = [ix for ix in grid if lay.chunk_key(ix) not in leaf["chunks"]]
    if todo:
      from jaxckpt.universal import _read  # pylint: disable=import-outside-toplevel
      store = _read.open_array(directory, step, info)
      for ix in todo:
        region = lay.chunk_box(ix, info.shape, info.chunk_shape)
        arr = store[tuple(slice(a, b) for a, b in region)].read().result()
        leaf["chunks"][lay.chunk_key(ix)] = snap.checksum(arr)
  out = dict(leaf)
  out.pop("boxes", None)
  return out


def _create_empty(directory: str, step: int, leaf: dict[str, Any]) -> None:
  from jaxckpt.universal import _write  # pylint: disable=import-outside-toplevel
  info = _write.plan_leaf(leaf["path"], leaf["kind"], tuple(leaf["shape"]), leaf["dtype"], [])
  _, info = _write._open_array(directory, step, info)  # pylint: disable=protected-access
  leaf["chunk_shape"] = list(info.chunk_shape)
  leaf["inner_chunk_shape"] = list(info.inner_chunk_shape)


def commit_step(directory: str, step: int, *, process_count: int,
                timeout_secs: float) -> None:
  """Merges every process's part record into the manifest and commits the step.

  Run by process 0 once all processes called write_process_shards. Waits up
  to ``timeout_secs`` for the part records; the commit marker is written last,
  in one atomic put. Committing a committed step again does nothing.

  Raises:
    SnapshotTimeoutError: naming the processes whose part records are missing.
    ManifestError: the parts disagree or do not cover every leaf.
  """
  if process_count < 1:
    raise ValueError(f"commit_step: process_count must be >= 1, got {process_count=}")
  kv = lay.open_kvstore(directory)
  if kv.read(lay.commit_key(step)).result().state == "value":
    log.info("step %d is already committed in %s", step, directory)
    return
  parts = _wait_for_parts(kv, step, process_count, timeout_secs)
  leaves: dict[str, dict[str, Any]] = {}
  for proc, part in enumerate(parts):
    for leaf in part["leaves"]:
      if leaf["path"] not in leaves:
        leaves[leaf["path"]] = dict(leaf, chunks=dict(leaf.get("chunks", {})),
                                    boxes=list(leaf.get("boxes", [])))
      else:
        _merge_leaf(step, leaves[leaf["path"]], leaf, proc)
  merged = [_finish_leaf(directory, step, leaf) for leaf in leaves.values()]
  doc = man.document(step=step, process_count=process_count,
                     metadata=parts[0]["metadata"], leaves=merged)
  body = man.encode(doc, what=f"manifest of step {step}")
  kv.write(lay.manifest_key(step), body).result()
  marker = {"step": step, "manifest_xxh3": snap.checksum(body),
            "process_count": process_count, "committed_at": time.time()}
  kv.write(lay.commit_key(step), json.dumps(marker).encode()).result()
  log.info("step %d committed in %s (%d leaves, %d processes)", step, directory,
           len(merged), process_count)


def all_steps(directory: str) -> list[int]:
  """Committed steps in ``directory``, ascending."""
  kv = lay.open_kvstore(directory)
  keys = kv.list(ts.KvStore.KeyRange(lay.COMMITS_PREFIX, "commits0")).result()
  steps = []
  for key in keys:
    name = key.decode()[len(lay.COMMITS_PREFIX):]
    if name.endswith(".json") and name[:-5].isdigit():
      steps.append(int(name[:-5]))
  return sorted(steps)


def latest_step(directory: str) -> int | None:
  """The newest committed step, or None if there is none."""
  steps = all_steps(directory)
  return steps[-1] if steps else None


def discard_step(directory: str, step: int) -> None:
  """Deletes a step (marker first, so it is never listed half-deleted)."""
  kv = lay.open_kvstore(directory)
  kv.delete_range(ts.KvStore.KeyRange(lay.commit_key(step), lay.commit_key(step) + "\0")).result()
  prefix = lay.step_dir(step)
  kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
  local = lay.local_path(directory)
  if local is not None:  # the file kvstore leaves empty directories behind
    shutil.rmtree(os.path.join(local, prefix), ignore_errors=True)


def gc_steps(directory: str, *, max_to_keep: int, keep: Iterable[int] = ()) -> list[int]:
  """Deletes committed steps older than the newest ``max_to_keep`` (except ``keep``).

  Never touches uncommitted steps (a save may be writing them) nor steps in
  ``keep``, so it can run in a background thread beside any save; it takes no
  lock. Returns the deleted steps.
  """
  if max_to_keep < 1:
    raise ValueError(f"gc_steps: max_to_keep must be >= 1, got {max_to_keep=}")
  protected = set(keep)
  steps = all_steps(directory)
  doomed = [s for s in steps[:-max_to_keep] if s not in protected]
  for s in doomed:
    discard_step(directory, s)
    log.info("gc: deleted step %d from %s", s, directory)
  return doomed
