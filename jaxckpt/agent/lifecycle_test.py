"""An agent that ends under a live trainer, however it ends (``jaxckpt agent stop``, a
SIGTERM of a node drain, SIGINT, SIGKILL, a crash), never locks that trainer out: its
next save starts a new agent (or finds the sidecar started again) that shares the job's
secret, and goes on saving."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt.agent import _paths, _requests
from jaxckpt.testing import processes
from tests.support.fixtures import run_cli

W = np.arange(1024, dtype=np.float32)


def _end(how: str, root: str, job: str, capsys) -> None:
  """Ends job ``job``'s agent of host 0 as ``how`` says; returns once its pid is gone."""
  pid = processes.agent_address(root, job)["pid"]
  if how == "agent stop":
    got = run_cli(capsys, "agent", "stop", "--job-name", job, "--run-root", root)
    assert got.returncode == 0, got
  else:
    if how == "its secret file removed too":     # (a /dev/shm cleaner; the agent killed)
      os.unlink(os.path.join(root, job, "secret"))
    os.kill(pid, {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT,
                  "a crash (SIGSEGV)": signal.SIGSEGV}.get(how, signal.SIGKILL))
  processes.wait_gone(pid, 60, f"the agent ended by {how}")


def _secret_of(root: str, job: str) -> str:
  with open(os.path.join(root, job, "secret")) as f:
    return f.read().strip()


@pytest.mark.parametrize("given", [None, "a-given-secret-" * 2])
@pytest.mark.parametrize("how", ["agent stop", "SIGTERM", "SIGINT", "SIGKILL", "a crash (SIGSEGV)",
                                 "its secret file removed too"])
def test_a_trainer_whose_agent_ended_goes_on_saving_with_the_next_save(how, given, capsys):
  with processes.agent_sandbox("jlc") as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root, secret=given),
                                handle_sigterm=False)
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": W})
      m.wait_until_finished()
      secret = _secret_of(root, job)
      _end(how, root, job, capsys)
      for step in (2, 3):                      # the next save starts a new agent, and goes on
        assert m.save(step, {"w": W + step})
        m.wait_until_finished()
      assert m.stats.agent_restarts == 1 and m.all_steps() == [2, 3]
      np.testing.assert_array_equal(m.restore(3)["w"], W + 3)
      assert m.last_restore.tier == "host"
      assert _secret_of(root, job) == secret         # the job's one secret, kept or written again
      with processes.agent_client(root, job, who="the new agent") as c:   # the file's secret
        assert list(c.call(_requests.Steps())[0].steps) == [2, 3]      # is the new agent's


def test_a_sidecar_agent_started_again_under_a_live_trainer_serves_it(capsys):
  """``jaxckpt agent start`` beside a trainer with AgentOptions(spawn=False): the sidecar
  SIGTERMed (a node drain) and started again serves the trainer's next save."""
  with processes.agent_sandbox("jlc") as (root, job):
    start = ("agent", "start", "--job-name", job, "--host-id", "0", "--run-root", root)
    assert run_cli(capsys, *start).returncode == 0
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root, spawn=False),
                                handle_sigterm=False)
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": W})
      m.wait_until_finished()
      _end("SIGTERM", root, job, capsys)
      again = run_cli(capsys, *start)
      assert again.returncode == 0, again
      assert m.save(2, {"w": W + 2})
      m.wait_until_finished()
      assert m.all_steps() == [2] and json.loads(again.stdout)["pid"] == processes.agent_address(
          root, job)["pid"]
      np.testing.assert_array_equal(m.restore(2)["w"], W + 2)


def test_the_secret_goes_with_the_last_of_the_jobs_processes(capsys):
  """Kept while its trainer lives after its agent stopped; removed when that trainer
  closes with no agent left (and with the last agent when no trainer lives)."""
  with processes.agent_sandbox("jlc") as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                handle_sigterm=False)
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": W})
      m.wait_until_finished()
      _end("agent stop", root, job, capsys)
      assert os.listdir(os.path.join(root, job)) == ["secret"]
    assert not os.path.exists(os.path.join(root, job))
    with jc.CheckpointManager(options=opts) as m:      # a trainer closes; its agent lives on
      assert m.save(1, {"w": W})
      m.wait_until_finished()
    _end("agent stop", root, job, capsys)
    assert not os.path.exists(os.path.join(root, job))
