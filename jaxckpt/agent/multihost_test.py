"""Multi-process jax.distributed jobs on loopback: every process killed and restarted."""

from __future__ import annotations

import os

import pytest

from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(n, root, job, mode, *extra):
  port = processes.free_port()
  return [processes.Proc(["-m", "jaxckpt.testing.multihost_worker", "--port", str(port),
                          "--num-processes", str(n), "--process-id", str(i), "--run-root",
                          root, "--job", job, "--mode", mode, *extra], cwd=REPO)
          for i in range(n)]


def run_job(n_save, n_restore, *restore_extra):
  with processes.agent_sandbox() as (root, job):
    savers = launch(n_save, root, job, "save")
    try:
      for p in savers:
        p.wait_for("SAVED [2, 3]", 400)
    finally:
      for p in savers:                    # every trainer process killed (SIGKILL)
        p.__exit__(None, None, None)
    assert len(processes.agent_pids(root)) == n_save      # the agents live on
    restorers = launch(n_restore, root, job, "restore", *restore_extra)
    try:
      for p in restorers:
        assert "OK 3 host" in p.finish(400)
    finally:
      for p in restorers:
        p.__exit__(None, None, None)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_killed_and_restarted():
  run_job(2, 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_processes_restart_with_another_device_mapping():
  run_job(4, 4, "--permute")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fewer_processes_read_pieces_from_every_agent():
  run_job(4, 2)
