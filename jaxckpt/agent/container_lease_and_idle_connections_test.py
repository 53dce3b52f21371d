"""The snapshot agent under a container's relaunches and strangers: a sidecar agent serves
the restarted trainer of a container (its own pid namespace: the trainer is pid 1
there, each time), which the lease must not take for the dead one; and connections
from anyone who reaches its ports never end it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt.agent import _paths, _protocol
from jaxckpt.testing import processes

W = np.arange(512, dtype=np.float32).reshape(64, 8)

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


def _start_agent(root: str, job: str, *, nofile: int) -> dict:
  """A sidecar agent whose process may open at most ``nofile`` files (a host's soft
  limit is often 1024); its address record."""
  limited = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, "
             f"{nofile})); os.execv(sys.executable, [sys.executable, '-m', 'jaxckpt', 'agent', "
             f"'start', '--job-name', {job!r}, '--run-root', {root!r}])")
  start = subprocess.run([sys.executable, "-c", limited], capture_output=True, text=True,
                         timeout=120, check=False)
  assert start.returncode == 0, start.stdout + start.stderr
  return json.loads(start.stdout.strip().splitlines()[-1])


def test_idle_connections_without_the_secret_do_not_end_the_agent_or_its_snapshots():
  # Anyone who reaches the bulk port can open connections and send nothing. Each held
  # a thread and a file descriptor for a minute: a few hundred made the agent's idle
  # check fail (EMFILE), and the agent exited, freeing every snapshot it held; its
  # accept loop had stopped for good too.
  with processes.agent_sandbox("ja") as (root, job):
    info = _start_agent(root, job, nofile=256)
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root, spawn=False),
                                handle_sigterm=False)
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": W})
      m.wait_until_finished()
      host, port = info["bulk"].rsplit(":", 1)
      idle = []
      try:
        for _ in range(400):
          try:
            idle.append(socket.create_connection((host, int(port)), timeout=2))
          except OSError:
            break                               # (its backlog is full: enough)
        time.sleep(2.5)                         # two of the agent's idle checks
        assert _paths.pid_alive(info["pid"]), "the agent exited"
      finally:
        for c in idle:
          c.close()
      secret = _paths.job_secret(root, job)
      remote = _protocol.Client.of(info, who="a remote reader", timeout_secs=20, secret=secret)
      try:
        data, = remote.read("snapshot", 1, [(0, W.nbytes)])   # the bulk port serves again
      finally:
        remote.close()
      np.testing.assert_array_equal(data.view(np.float32).reshape(W.shape), W)
      out = m.restore(target={"w": np.zeros_like(W)})
      assert (m.last_restore.step, m.last_restore.tier) == (1, "host")
      np.testing.assert_array_equal(out["w"], W)
