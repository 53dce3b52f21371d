"""docs/local_job.md's job killed at a random moment, relaunched, again and again.

  python benchmarks/local_job_kills.py [--relaunches 50] [--processes 4] [--seed 0]

The job of ``examples/local_job.py`` (its processes, agents and parity, no directory)
trains; at a random moment (once every process passed a random number of steps, then a
random fraction of a second) one process, chosen at random, is SIGKILLed and the
whole job stopped, as a scheduler does; the job is relaunched on the same agents and
must resume (a relaunch that restores nothing while the hosts hold steps exits 2:
``--resume``), every process at the same step, bit-exact, and is killed again. Prints
one JSON object: the relaunches, how many restored nothing, how many resumed at
different steps, the steps lost per kill (the newest step any process had saved minus
the step resumed at: median, max, distribution) and the tiers.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from examples import local_job  # pylint: disable=wrong-import-position


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--relaunches", type=int, default=50)
  p.add_argument("--processes", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  rng = random.Random(a.seed)
  job_args = argparse.Namespace(processes=a.processes, steps=10**6, job=f"kills-{os.getpid()}")
  top = tempfile.mkdtemp(prefix="jaxckpt-local-job-kills-",
                         dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
  roots = [os.path.join(top, f"process{i}") for i in range(a.processes)]
  nothing, apart, lost, tiers, errors = 0, 0, [], collections.Counter(), []
  t0 = time.monotonic()
  try:
    killed_at = None
    for run in range(a.relaunches + 1):
      job = local_job.Job(job_args, roots, resume=run > 0)
      try:
        start = 0
        if run:
          try:
            job.wait("a resume on every process", lambda: sum(
                ": resumed at step " in ln for ln in job.lines) >= a.processes
                or any(": NOTHING" in ln for ln in job.lines))
          except RuntimeError:              # a process exited (2: nothing to resume from)
            for t in job._readers:          # pylint: disable=protected-access
              t.join(30)                    # (its last lines)
            if not any(": NOTHING" in ln for ln in job.lines):
              raise
          if any(": NOTHING" in ln for ln in job.lines):
            nothing += 1
            errors.append(f"relaunch {run}: " + next(ln for ln in job.lines if ": NOTHING" in ln))
            job.kill()
            killed_at = None
            continue
          try:
            start = local_job.resumed_at(job, a.processes)
          except RuntimeError as e:
            apart += 1
            errors.append(f"relaunch {run}: {str(e)[:300]}")
          if killed_at is not None:
            lost.append(killed_at - start)
          tiers.update(ln.split(" from tier ")[1].split()[0] for ln in job.lines
                       if ": resumed at step " in ln)
        if run == a.relaunches:
          break
        ahead = start + rng.randint(1, 4)
        job.wait(f"step {ahead} on every process", lambda: min(job.steps) >= ahead)
        time.sleep(rng.uniform(0.0, 0.3))          # anywhere in a step, a copy, a parity
        job.kill(rng.randrange(a.processes))
        killed_at = max(job.steps)
      finally:
        job.kill()
  finally:
    for root in roots:
      if os.path.isdir(root):
        subprocess.run([sys.executable, "-m", "jaxckpt", "agent", "stop", "--job-name",
                        job_args.job, "--run-root", root], capture_output=True, timeout=120,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, check=False)
    shutil.rmtree(top, ignore_errors=True)
  print(json.dumps({
      "relaunches": a.relaunches, "processes": a.processes, "restored_nothing": nothing,
      "resumed_at_different_steps": apart,
      "lost_median": statistics.median(lost) if lost else None,
      "lost_max": max(lost, default=None), "lost": dict(sorted(collections.Counter(lost).items())),
      "tiers": dict(tiers), "errors": errors[:10], "secs": round(time.monotonic() - t0, 1)}))
  return 1 if nothing or apart else 0


if __name__ == "__main__":
  sys.exit(main())
