"""Host snapshots built directly from arrays, for tests and benchmarks.

Mimics what capture produces (replica-0 shards, one buffer per process) and
can split the shards over several simulated processes.
"""

from __future__ import annotations

import types
from typing import Any, Mapping

import jax
import numpy as np

from jaxckpt import cli
from jaxckpt.host import snapshot as snap
from jaxckpt.universal import _commit, _write


def _pieces(value: Any) -> tuple[str, list[tuple[snap.Box, np.ndarray]], Any]:
  if isinstance(value, jax.Array):
    shards = [s for s in value.addressable_shards if s.replica_id == 0]
    pieces = [(snap.box_from_index(s.index, value.shape), np.asarray(s.data)) for s in shards]
    mesh = getattr(value.sharding, "mesh", None)
    spec = getattr(value.sharding, "spec", None)
    info = None if mesh is None else {"mesh_shape": dict(mesh.shape), "spec": [str(p) for p in spec]}
    return "jax", sorted(pieces, key=lambda p: p[0]), info
  arr = np.asarray(value)
  return "numpy", [(snap.full_box(arr.shape), arr)], None


def host_snapshots(step: int, leaves: Mapping[str, Any], *, process_count: int = 1,
                   metadata: dict[str, Any] | None = None,
                   ) -> list[tuple[snap.SnapshotManifest, np.ndarray]]:
  """One (manifest, buffer) per simulated process; box i goes to process i % n."""
  per_proc: list[list[snap.LeafRecord]] = [[] for _ in range(process_count)]
  payloads: list[list[np.ndarray]] = [[] for _ in range(process_count)]
  offsets = [0] * process_count
  for path, value in leaves.items():
    if isinstance(value, (int, float, str, bool)):
      for recs in per_proc:
        recs.append(snap.LeafRecord(path=path, kind="scalar", value=value))
      continue
    kind, pieces, sharding = _pieces(value)
    shards: list[list[snap.ShardRecord]] = [[] for _ in range(process_count)]
    for i, (box, arr) in enumerate(pieces):
      p = i % process_count
      arr = np.ascontiguousarray(arr)
      shards[p].append(snap.ShardRecord(index=box, offset=offsets[p], nbytes=arr.nbytes,
                                        checksum=snap.checksum(arr)))
      payloads[p].append(arr)
      offsets[p] = snap.align(offsets[p] + arr.nbytes)
    dtype = np.dtype(value.dtype).name
    for p in range(process_count):
      per_proc[p].append(snap.LeafRecord(path=path, kind=kind, shape=tuple(value.shape),
                                         dtype=dtype, shards=tuple(shards[p]), sharding=sharding))
  out = []
  for p in range(process_count):
    buf = np.zeros(max(offsets[p], 1), np.uint8)
    it = iter(payloads[p])
    for rec in per_proc[p]:
      for s in rec.shards:
        buf[s.offset:s.offset + s.nbytes] = np.ascontiguousarray(next(it)).reshape(-1).view(np.uint8)
    out.append((snap.SnapshotManifest(step=step, leaves=tuple(per_proc[p]), nbytes=offsets[p],
                                      process_index=p, process_count=process_count,
                                      metadata=dict(metadata or {})), buf))
  return out


def stored_steps(directory: str, *steps: int) -> str:
  """Commits ``steps`` to ``directory`` (one process, one leaf ``['w']`` of
  ``arange(8.0) * step``); returns ``directory``."""
  for step in steps:
    for manifest, buf in host_snapshots(step, {"['w']": np.arange(8.0) * step}):
      _write.write_process_shards(directory, manifest, buf, attempt=f"t{step}")
    _commit.commit_step(directory, step, process_count=1, timeout_secs=10, attempt=f"t{step}")
  return directory


def run_cli(capsys: Any, *argv: str) -> types.SimpleNamespace:
  """``jaxckpt ARGV`` in this process (pytest's ``capsys`` takes its output): its
  ``returncode``, ``stdout`` and ``stderr``."""
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
