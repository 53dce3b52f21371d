"""A rollback starts a new timeline on every tier: the abandoned timeline's steps are
gone from host memory, the agent and storage, in the same manager and after a relaunch."""

from __future__ import annotations

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors, universal
from jaxckpt.testing import processes


def _state(step: int, version: int = 0) -> dict:
  return {"w": np.full((8, 4), step + 1000 * version, np.float32), "step": step}


def _options(agent, **kw):
  return jc.CheckpointOptions(max_snapshots=8, persist_interval_steps=10, agent=agent,
                              on_busy="wait", **kw)          # every save taken, however loaded


def _spike_and_roll_back(m) -> None:
  """The guide's rollback: steps 21-30 (30 persisted), a loss spike, back to 25, then
  26-28 on the new timeline."""
  for s in range(21, 31):
    assert m.save(s, _state(s))
  m.wait_until_finished()
  assert 30 in universal.all_steps(str(m.directory))
  out = m.restore(25, _state(0))
  assert m.last_restore.tier == "host" and out["step"] == 25
  for s in (26, 27, 28):
    assert m.save(s, _state(s, version=1))
  m.wait_until_finished()


def _check_new_timeline(m, directory: str) -> None:
  assert m.all_steps()[-3:] == [26, 27, 28] and 29 not in m.all_steps()
  assert 30 not in m.all_steps() and 30 not in universal.all_steps(directory)
  out = m.restore(None, _state(0))
  assert m.last_restore.step == 28 and out["step"] == 28
  np.testing.assert_array_equal(out["w"], _state(28, version=1)["w"])
  with pytest.raises(errors.StepNotFoundError):
    m.restore(30, _state(0))


@pytest.mark.parametrize("with_agent", [False, True], ids=["in_process", "agent"])
def test_a_rollback_deletes_the_abandoned_timeline_from_every_tier(tmp_path, with_agent):
  directory = str(tmp_path / "run")
  with processes.agent_sandbox() as (root, job):
    agent = jc.AgentOptions(job_name=job, run_root=root) if with_agent else None
    with jc.CheckpointManager(directory, _options(agent)) as m:
      _spike_and_roll_back(m)
      _check_new_timeline(m, directory)
    if with_agent:                       # a relaunch finds the new timeline only
      with jc.CheckpointManager(directory, _options(agent)) as m:
        _check_new_timeline(m, directory)


def test_a_relaunch_that_rolls_back_deletes_what_the_agent_and_storage_hold(tmp_path):
  directory = str(tmp_path / "run")
  with processes.agent_sandbox() as (root, job):
    agent = jc.AgentOptions(job_name=job, run_root=root)
    with jc.CheckpointManager(directory, _options(agent)) as m:
      for s in range(21, 31):
        assert m.save(s, _state(s))
      m.wait_until_finished()
    with jc.CheckpointManager(directory, _options(agent)) as m:    # the relaunch rolls back
      assert m.all_steps()[-1] == 30
      m.restore(25, _state(0))
      for s in (26, 27, 28):
        assert m.save(s, _state(s, version=1))
      m.wait_until_finished()
      _check_new_timeline(m, directory)


def test_a_save_older_than_a_stored_step_without_a_restore_is_refused(tmp_path):
  """No restore chose where the run goes back to: a save that would mix two timelines
  on storage is refused, naming the newer steps and the fix; nothing is deleted."""
  directory = str(tmp_path / "run")
  with jc.CheckpointManager(directory, _options(None)) as m:
    for s in (10, 20):
      assert m.save(s, _state(s))
    m.wait_until_finished()
  with jc.CheckpointManager(directory, _options(None)) as m:
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"save\(step=5\): .* holds newer steps \[10, 20\].*restore\(step=\.\.\.\)"):
      m.save(5, _state(5))
    assert m.all_steps() == [10, 20] == universal.all_steps(directory)


def test_orbax_managers_never_roll_back(tmp_path):
  """orbax's manager saves only newer steps (its should_save), so nothing is deleted."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  directory = str(tmp_path / "run")
  with jc.CheckpointManager(directory, ocp.CheckpointManagerOptions()) as m:
    for s in (10, 20):
      assert m.save(s, args=ocp.args.StandardSave(_state(s)))
    m.wait_until_finished()
    m.restore(10)
    assert not m.save(15, args=ocp.args.StandardSave(_state(15)))
    m.wait_until_finished()
    assert m.all_steps() == [10, 20] == universal.all_steps(directory)
