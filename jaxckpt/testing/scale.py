"""Simulated scale: what a job of many processes leaves on storage, made in one process.

Used by ``benchmarks/scale.py`` and by the tests that keep costs linear.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from typing import Callable

from jaxckpt import universal
from jaxckpt.universal import _layout as lay, _manifest as man


def simulated_commit_secs(processes: int, leaves: int = 100, rows_per_process: int = 4, *,
                          clock: Callable[[], float] = time.perf_counter) -> float:
  """Process 0's ``commit_step`` of a step whose ``processes`` part records are on
  storage (written here as each process would: one row block of every leaf), in
  seconds of ``clock`` (``time.process_time``: CPU seconds, which another
  process's load does not inflate)."""
  d = tempfile.mkdtemp(prefix="scale-commit-")
  try:
    attempt = f"rsim{uuid.uuid4().hex[:12]}-s1-0"
    kv = lay.open_kvstore(d)
    rows = processes * rows_per_process
    for p in range(processes):
      recs = []
      for i in range(leaves):
        recs.append({
            "array": f"{attempt}/w{i:04d}", "path": f"['w{i:04d}']", "kind": "jax",
            "shape": [rows, 4], "dtype": "float32", "chunk_shape": [rows_per_process, 4],
            "inner_chunk_shape": [rows_per_process, 4], "key_impl": None, "value": None,
            "storage_dtype": None, "sharding": None,
            "chunks": {f"{p}.0": f"{(p * 7919 + i) & 0xffffffffffffffff:016x}"},
            "boxes": [[[p * rows_per_process, (p + 1) * rows_per_process], [0, 4]]]})
      doc = man.document(step=1, process_count=processes, process_index=p, metadata={},
                         leaves=recs)
      doc["attempt"] = attempt
      kv.write(lay.part_key(1, p, attempt), man.encode(doc, what="part")).result()
    t = clock()
    universal.commit_step(d, 1, process_count=processes, timeout_secs=600, attempt=attempt)
    return clock() - t
  finally:
    shutil.rmtree(d, ignore_errors=True)
