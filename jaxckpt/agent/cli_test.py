"""`jaxckpt agent status|stop` find this machine's agents of a job by themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_status_and_stop_find_every_agent_of_the_job_with_no_host_id():
  """Agents of hosts 3 and 5 (per-process run roots: no host 0 here) are found by job alone."""
  with processes.agent_sandbox() as (root, job):
    def agent(*argv):
      return subprocess.run([sys.executable, "-m", "jaxckpt.agent", *argv, "--job-name", job,
                             "--run-root", root], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=REPO))
    started = {h: json.loads(agent("start", "--host-id", str(h)).stdout) for h in (3, 5)}
    out = agent("status")
    assert out.returncode == 0, out.stderr
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["running"], r["host"], r["pid"]) for r in replies] == [
        (True, h, started[h]["pid"]) for h in (3, 5)]
    one, = (json.loads(line) for line in agent("status", "--host-id", "5").stdout.splitlines())
    assert one["host"] == 5
    out = agent("stop")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"stopped agent pid {started[h]['pid']} of job {job!r} host {h}" for h in (3, 5)]
    for h in (3, 5):
      processes.wait_gone(started[h]["pid"], 10, f"agent of host {h}")
    out = agent("status")
    assert out.returncode == 1 and json.loads(out.stdout) == {
        "running": False, "job": job, "host": None, "run_root": root}
    assert agent("stop").stdout.strip() == f"no agent of job {job!r} is running under {root}"
