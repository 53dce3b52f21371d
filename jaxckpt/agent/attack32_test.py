"""Adversarial checks of the snapshot agent (issue 32, round 5): a sidecar agent serves
the restarted trainer of a container (its own pid namespace: the trainer is pid 1
there, each time), which the lease must not take for the dead one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxckpt.testing import processes

TRAINER = r"""
import os, sys
import numpy as np
import jaxckpt as jc
root, job, mode = sys.argv[1:4]
opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root, spawn=False),
                            handle_sigterm=False)
m = jc.CheckpointManager(options=opts)
if mode == "save":
  assert m.save(3, {"w": np.full(8, 3.0, np.float32)})
  m.wait_until_finished()
  print("saved as pid", os.getpid(), flush=True)
  os._exit(0)                                  # the container dies: no close, no bye
out = m.restore(target={"w": np.zeros(8, np.float32)})
print(f"restored {m.last_restore.step} {m.last_restore.tier} {out['w'][0]}", flush=True)
m.close()
"""

UNSHARE = ["unshare", "--pid", "--fork", "--kill-child"]


def _in_own_pid_namespace(*args: str, timeout_secs: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([*UNSHARE, sys.executable, *args], capture_output=True, text=True,
                        timeout=timeout_secs, check=False)


def test_a_containerised_trainer_restarted_by_its_sidecar_agent_takes_the_lease_back(tmp_path):
  probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, check=False)
  if probe.returncode:
    pytest.skip(f"no pid namespaces here ({probe.stderr.strip()}); needs root")
  script = tmp_path / "trainer.py"
  script.write_text(TRAINER)
  with processes.agent_sandbox("ja") as (root, job):
    start = subprocess.run([sys.executable, "-m", "jaxckpt", "agent", "start", "--job-name", job,
                            "--run-root", root], capture_output=True, text=True, timeout=120,
                           check=False)
    assert start.returncode == 0, start.stdout + start.stderr
    assert json.loads(start.stdout.strip().splitlines()[-1])["job"] == job
    first = _in_own_pid_namespace(str(script), root, job, "save")
    assert first.returncode == 0 and "saved as pid 1" in first.stdout, first.stdout + first.stderr
    again = _in_own_pid_namespace(str(script), root, job, "restore")   # pid 1 again
    assert again.returncode == 0, again.stderr[-3000:]
    assert "restored 3 host 3.0" in again.stdout, again.stdout
