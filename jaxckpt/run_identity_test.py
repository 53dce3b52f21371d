"""A run is its job and its directory: a new run under the same job name never sees the
previous run's host snapshots; a run that names the same directory resumes them."""

from __future__ import annotations

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import processes


def _opts(root: str, job: str) -> jc.CheckpointOptions:
  return jc.CheckpointOptions(max_snapshots=3, on_busy="wait", persist_interval_steps=100,
                              agent=jc.AgentOptions(job_name=job, run_root=root))


def _run(directory: str, opts: jc.CheckpointOptions, steps, value: float) -> None:
  with jc.CheckpointManager(directory, opts) as m:
    for s in steps:
      assert m.save(s, {"w": np.full(16, value + s, np.float32)})
    m.wait_until_finished()


def test_a_new_run_of_the_same_job_name_starts_empty(tmp_path):
  """The docs' sweep: AgentOptions(job_name="run1") kept for two runs, each in a new
  directory. The second sees nothing of the first (before, it restored run 1's
  step 5 from the agent, tier host)."""
  with processes.agent_sandbox() as (root, job):
    opts = _opts(root, job)
    _run(str(tmp_path / "sweep1"), opts, (4, 5), 100.0)
    with jc.CheckpointManager(str(tmp_path / "sweep2"), opts) as m:
      assert m.all_steps() == [] and m.latest_step() is None
      with pytest.raises(errors.StepNotFoundError):
        m.restore(None, {"w": np.zeros(16, np.float32)})


def test_the_same_directory_resumes_from_the_agent(tmp_path):
  with processes.agent_sandbox() as (root, job):
    opts = _opts(root, job)
    _run(str(tmp_path / "run"), opts, (4, 5), 100.0)
    with jc.CheckpointManager(str(tmp_path / "run") + "/", opts) as m:   # the same directory
      assert m.all_steps() == [4, 5]
      out = m.restore(None, {"w": np.zeros(16, np.float32)})
      assert m.last_restore.tier == "host" and m.last_restore.step == 5
      np.testing.assert_array_equal(out["w"], np.full(16, 105.0, np.float32))


def test_host_snapshots_without_a_directory_resume_by_job_name(tmp_path):
  """directory=None (the README's example): the job's name is the run; a relaunch
  resumes; a run with a directory afterwards does not see them."""
  del tmp_path
  with processes.agent_sandbox() as (root, job):
    opts = _opts(root, job)
    with jc.CheckpointManager(None, jc.CheckpointOptions(
        max_snapshots=3, agent=opts.agent)) as m:
      assert m.save(7, {"w": np.ones(16, np.float32)})
      m.wait_until_finished()
    with jc.CheckpointManager(None, jc.CheckpointOptions(max_snapshots=3, agent=opts.agent)) as m:
      assert m.all_steps() == [7]
