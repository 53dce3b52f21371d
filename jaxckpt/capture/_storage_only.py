"""Storage-only saves: straight to storage through a bounded staging buffer.

For models whose per-host state does not fit in host memory twice (the host
tier holds ``max_snapshots + 1`` copies), ``CheckpointOptions(host_snapshots=
False)`` keeps no snapshot in host memory: ``save()`` copies the leaves a few at
a time into one staging buffer of at most ``host_memory_limit_bytes`` (a leaf
whose local part is larger is staged alone), writes each batch to storage, and
commits the step once every process has written its part. ``save()`` returns
when the step is on storage; host memory held by jaxckpt stays at
``max(host_memory_limit_bytes, largest local leaf)`` instead of growing with
the state.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from jaxckpt import capture, universal
from jaxckpt.host import _persist
from jaxckpt.host.snapshot import SnapshotManifest, aligned_empty
from jaxckpt.tree import Leaf
from jaxckpt.universal import _write, commit_step

logger = logging.getLogger("jaxckpt")

DEFAULT_STAGING_BYTES = 1 << 30


def batches(leaves: Sequence[Leaf], sizes: Sequence[int], budget: int) -> list[list[Leaf]]:
  """``leaves`` in order, grouped so each group's ``sizes`` add up to at most
  ``budget`` (a leaf larger than the budget is a group of its own).

  >>> [[x for x in b] for b in batches("abcd", [4, 4, 9, 1], budget=8)]
  [['a', 'b'], ['c'], ['d']]
  """
  out: list[list[Leaf]] = [[]]
  used = 0
  for leaf, n in zip(leaves, sizes):
    if out[-1] and used + n > budget:
      out.append([])
      used = 0
    out[-1].append(leaf)
    used += n
  return [b for b in out if b]


def save(directory: str, step: int, leaves: Sequence[Leaf], planner: capture.Planner, *,
         budget: int, attempt: str, process: tuple[int, int], metadata: dict[str, Any] | None,
         timeout_secs: float) -> int:
  """Writes ``leaves`` as ``step`` of ``directory`` (see the module); returns the
  largest number of bytes staged at once."""
  sizes = [planner.plan([leaf]).nbytes for leaf in leaves]
  groups = batches(leaves, sizes, budget)
  staged = max((planner.plan(g).nbytes for g in groups), default=0)
  buffer = aligned_empty((max(staged, 1),), np.uint8)
  records: list[dict[str, Any]] = []
  manifest = SnapshotManifest(step=step, leaves=(), nbytes=0, process_index=process[0],
                              process_count=process[1], metadata=metadata or {})
  for group in groups:
    plan = planner.plan(group)
    sources = capture.start(group, plan, copy_numpy=False)   # copied before save() returns
    manifest = capture.complete(plan, sources, buffer, step=step, process_index=process[0],
                                process_count=process[1], metadata=metadata)
    del sources
    # no merged chunks: assembling a process's shards into one chunk would take memory
    # beyond the staging budget this path promises (a grid from the shape alone, for
    # uneven shards, may still assemble chunks, as it always did)
    records += _write.write_shard_data(directory, manifest, buffer, attempt=attempt,
                                       merged_chunk_bytes=0)
  _write.write_part_record(directory, manifest, records, attempt=attempt)
  if process[0] == 0:
    commit_step(directory, step, process_count=process[1], timeout_secs=timeout_secs,
                attempt=attempt)
  logger.info("step %d written to %s without a host snapshot (%d leaves in %d batches, at most "
              "%d bytes staged)", step, directory, len(leaves), len(groups), staged)
  return staged


def save_step(directory: str, step: int, leaves: Sequence[Leaf], planner: Any, *,
              attempt: str, **kwargs: Any) -> int:
  """:func:`save` as ``attempt``; if it fails, what it wrote is removed (no one could read it)."""
  try:
    return save(directory, step, leaves, planner, attempt=attempt, **kwargs)
  except BaseException:
    _persist.discard_quietly(universal, directory, step, attempt)
    raise
