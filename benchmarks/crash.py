"""Steps lost to a SIGKILL: the default options against the loop's step and storage's speed.

A trainer (``tests.support.crash_worker``: the default ``CheckpointOptions`` with a
snapshot agent and a directory on a real S3 server, SeaweedFS, reached through a proxy
that caps its speed) trains with a given step time and SIGKILLs itself at a random
step, anywhere in it; the next trainer resumes from the newest step the agent (or
storage) holds, checks it bit-exact, and is killed in turn. Steps lost by a run: the
step it was killed in minus the step the next one resumed at. For each step time and
storage speed, ``--runs`` kills in one job (one agent, as a relaunched job has).

  python benchmarks/crash.py [--runs 20] [--step-ms 0 10 50] [--storage-mbps 4 40]
                             [--size-mib 8] [--quick]

Prints one JSON object: per step time and speed, the distribution of steps lost
({lost: runs}), its median and maximum, the tiers resumed from, the snapshot's copy
time and the saves skipped (as the killed trainers' stats said), and the persist time
of one snapshot at that speed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # Uninstalled repo.

from jaxckpt.testing import processes  # pylint: disable=wrong-import-position
import _repo  # noqa: F401  (the repository root on the path: tests.support)
from tests.support.crash_worker import Trainer  # pylint: disable=wrong-import-position
from tests.support.s3 import SeaweedS3  # pylint: disable=wrong-import-position
from tests.support.throttle import ThrottledProxy  # pylint: disable=wrong-import-position

START_SECS = 300.0


def one_config(s3: SeaweedS3, *, step_ms: float, mbps: float, runs: int, size_mib: float,
               kill_range: tuple[int, int], seed: int) -> dict:
  """``runs`` kills of one job at ``step_ms`` with storage at ``mbps`` MB/s."""
  rng = random.Random(f"{seed}/{step_ms}/{mbps}")
  lost, tiers, copy_ms, skipped, exact = [], collections.Counter(), [], [], True
  reasons: collections.Counter = collections.Counter()
  killed_at = None
  with processes.agent_sandbox("crash") as (root, job), \
       ThrottledProxy(s3.endpoint, mbps * 1e6) as proxy:
    where = {"run_root": root, "job": job, "directory": s3.url(uuid.uuid4().hex[:12]),
             "step_ms": step_ms, "size_mib": size_mib, "seed": seed,
             "env": {"AWS_ENDPOINT_URL": proxy.endpoint}}
    for run in range(runs + 1):                 # the last one only resumes
      with Trainer(**where, kill_after=rng.randint(*kill_range)) as t:
        back = t.next("resumed", START_SECS)
        if killed_at is not None:
          lost.append(killed_at - back["resumed"] if back["resumed"] is not None else killed_at)
          tiers[back["tier"]] += 1
          exact &= bool(back["exact"])
        if run == runs:
          break
        t.next("ready", START_SECS)
        t.go()
        said = t.next("killing", START_SECS)
        t.wait_killed(60)
      killed_at = said["killing"]
      st = said["stats"]
      copy_ms.append(1e3 * st["last_snapshot_secs"])
      skipped.append(st["skipped_busy"])
      reasons.update(st["skip_reasons"])
    forwarded = proxy.forwarded
  dist = collections.Counter(lost)
  return {"step_ms": step_ms, "storage_mbps": mbps, "runs": len(lost),
          "lost": dict(sorted(dist.items())), "lost_median": statistics.median(lost),
          "lost_max": max(lost), "within_one_step": sum(x <= 1 for x in lost),
          "tiers": dict(tiers), "bit_exact": exact,
          "copy_ms_median": round(statistics.median(copy_ms), 2),
          "skipped_per_run_median": statistics.median(skipped),
          "skipped_per_run_max": max(skipped), "skip_reasons": dict(reasons),
          "persist_secs_one_snapshot": round(size_mib * 2**20 / (mbps * 1e6), 2),
          "bytes_through_proxy": forwarded}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--runs", type=int, default=20, help="kills per step time and speed")
  p.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 10.0, 50.0])
  p.add_argument("--storage-mbps", type=float, nargs="+", default=[4.0, 40.0],
                 help="storage speed caps, MB/s each way")
  p.add_argument("--size-mib", type=float, default=8.0, help="the state of each trainer")
  p.add_argument("--kill-range", type=int, nargs=2, default=[10, 40],
                 help="a run is killed this many steps after it resumed (uniform)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quick", action="store_true", help="3 runs each (a smoke run)")
  a = p.parse_args()
  runs = 3 if a.quick else a.runs
  t0 = time.perf_counter()
  results = []
  with SeaweedS3() as s3:
    for mbps in a.storage_mbps:
      for step_ms in a.step_ms:
        r = one_config(s3, step_ms=step_ms, mbps=mbps, runs=runs, size_mib=a.size_mib,
                       kill_range=tuple(a.kill_range), seed=a.seed)
        results.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)    # as it goes
  print(json.dumps({"benchmark": "crash", "options": "CheckpointOptions() defaults, agent, "
                    "directory on SeaweedFS S3 behind a speed cap", "size_mib": a.size_mib,
                    "kill_after_steps": a.kill_range, "runs": runs, "cpus": os.cpu_count(),
                    "secs": round(time.perf_counter() - t0, 1), "results": results}, indent=1))


if __name__ == "__main__":
  main()
