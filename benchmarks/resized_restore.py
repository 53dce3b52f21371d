"""A job relaunched on another number of processes: its restore from the surviving agents
and parity against a restore of the same step from storage (issue 42 item 4).

Machines are processes with a run root and loopback address of their own, each with
its snapshot agent (one ``jax.distributed`` job of 2 CPU devices per process). A
4-process job saves step 1 (random float32 matrices, ``--size-mib`` in all, rows of one
and columns of another sharded over every device, persisted to storage and protected
by parity m=1); then, reusing the machines' agents:

- ``4->3``: machine 1 is lost for good; the job comes back on machines 2, 3, 0 (every
  process with another index): tier "parity".
- ``4->2``: on machines 3 and 2, machine 0 left out of the job (its agent still up):
  tier "parity"; the 2-process job then saves step 2.
- ``2->4``: on machines 2, 4, 3, 5 (two new ones): step 2 from tier "host".

In each relaunch every process restores the newest step onto the new mesh
``--repeats`` times from the host tiers, then ``--repeats`` times from storage (a
manager without agents, the same target): a restore of the job takes as long as its
slowest process, and each figure is the median over the repeats (the first, cold
restore of a fresh process also reported alone). Bytes read per process are what the
restore read (its own agent's memory, other agents, parity rebuilds; or storage).

  python benchmarks/resized_restore.py [--quick] [--size-mib 256] [--repeats 3] [--storage file|s3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from typing import Any, Iterator

from jaxckpt.testing import processes
import _repo  # noqa: F401  (the repository root on the path: tests.support)
from tests.support import resize_worker
from tests.support.resize_worker import finish, lose, said

CASES = [("4->3", [2, 3, 0], 1, "parity"), ("4->2", [3, 2], None, "parity"),
         ("2->4", [2, 4, 3, 5], None, "host")]


def shape(size_mib: float) -> tuple[int, int]:
  """Rows and columns of the state's matrices ((rows, cols) and (cols / 4, rows),
  float32) for about ``size_mib``: rows a multiple of 24 (8, 6 and 4 devices)."""
  cols = 4096 if size_mib >= 64 else 256
  rows = max(24, int(size_mib * 2**20 / 4 / 1.25 / cols) // 24 * 24)
  return rows, cols


@contextlib.contextmanager
def storage(kind: str) -> Iterator[str]:
  if kind == "s3":
    from tests.support.s3 import SeaweedS3  # pylint: disable=import-outside-toplevel  (its server only when asked)
    with SeaweedS3() as s3:
      yield s3.url(f"resized-{os.getpid()}")
    return
  with tempfile.TemporaryDirectory(prefix="jaxckpt-resized-") as d:
    yield os.path.join(d, "ckpt")


def case(outs: list[str], tier: str) -> dict[str, Any]:
  """One relaunch's figures from its processes' lines."""
  host = [[float(r[4]) for r in said(out, "RESTORED")] for out in outs]
  tiers = {r[1] for out in outs for r in said(out, "RESTORED")}
  oks = {r[2] for out in outs for r in said(out, "RESTORED")} | {
      r[1] for out in outs for r in said(out, "STORAGE")}
  if tiers != {tier} or oks != {"ok"}:
    raise AssertionError(f"restored from {tiers}, checks {oks}; wanted {tier!r}, ok")
  stored = [[float(r[2]) for r in said(out, "STORAGE")] for out in outs]
  job_host = [max(xs) for xs in zip(*host)]            # the job waits for its slowest process
  job_storage = [max(xs) for xs in zip(*stored)]
  nbytes = [int(said(out, "RESTORED")[0][3]) for out in outs]
  first, med = job_host[0], statistics.median(job_host)
  smed = statistics.median(job_storage)
  return {
      "processes": len(outs), "tier": tier,
      "restore_secs_first": round(first, 4),
      "restore_secs_median": round(med, 4),
      "storage_secs_first": round(job_storage[0], 4),
      "storage_secs_median": round(smed, 4),
      "storage_over_host_tiers": round(smed / med, 2),
      "bytes_read_per_process": nbytes,
      "host_tiers_GBps_per_process": round(statistics.median(nbytes) / med / 1e9, 3),
      "restore_secs_each": [round(x, 4) for x in job_host],
      "storage_secs_each": [round(x, 4) for x in job_storage],
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size-mib", type=float, default=256.0)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--storage", choices=["file", "s3"], default="file")
  p.add_argument("--quick", action="store_true", help="16 MiB, 2 repeats")
  a = p.parse_args()
  if a.quick:
    a.size_mib, a.repeats = 16.0, 2
  rows, cols = shape(a.size_mib)
  size = {"--rows": str(rows), "--cols": str(cols)}
  sized = [x for kv in size.items() for x in kv]
  out: dict[str, Any] = {"size_mib": round(rows * cols * 4 * 1.25 / 2**20, 1),
                         "storage": a.storage, "repeats": a.repeats, "cases": {}}
  t0 = time.perf_counter()
  with storage(a.storage) as directory, processes.agent_sandbox("jb") as (root, job):
    with resize_worker.launch([0, 1, 2, 3], root, job, directory, "--phase", "save",
                              "--steps", "1", *sized) as procs:
      finish(procs, 1200)
    for name, order, lost, tier in CASES:
      if lost is not None:
        lose(root, lost)
      args = ["--phase", "relaunch", "--restores", str(a.repeats), "--storage-restores",
              str(a.repeats), *sized]
      if name == "4->2":
        args += ["--save", "2"]
      with resize_worker.launch(order, root, job, directory, *args) as procs:
        out["cases"][name] = case(finish(procs, 1200), tier)
  out["wall_secs"] = round(time.perf_counter() - t0, 1)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
