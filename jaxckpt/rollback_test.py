"""A rollback starts a new timeline on every tier: the abandoned timeline's steps are
gone from host memory, the agent and storage, in the same manager and after a relaunch."""

from __future__ import annotations

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors, universal
from jaxckpt.testing import processes
from jaxckpt.universal import _commit, _rollbacks


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


# A rollback killed at each of its points (the trainer SIGKILLs itself at the K-th, K = 1,
# 2, ... until it passes them all): the tiers, the storage it persists to, and the crash
# points each case passes (its record, the agent's request, each marker, each step's data).
_KILLED = {"agent_and_directory": ("agent", 10, 5), "agent_only": ("agent", None, 1),
           "directory_only": (None, 1, 12)}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_KILLED))
def test_a_rollback_killed_at_any_point_never_resumes_the_abandoned_timeline(tmp_path, case):
  """The guide's rollback (21-30 saved, restore(25), save(26)) with the trainer SIGKILLed
  at each point of the rollback that save(26) runs. Before, with the agent, a kill while
  the host tier discarded steps 26-30 one by one left [21..25, 28, 29, 30] listed and
  restore(None) gave the abandoned step 30 from host memory. Now every relaunch lists
  21-25 and restores step 25 bit for bit, storage lists none of 26-30 and keeps no record
  of a rollback under way; a run past the last point ends on the new timeline."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  agent_kind, interval, points = _KILLED[case]
  kills = 0
  for k in range(1, points + 2):
    directory = None if interval is None else str(tmp_path / f"run{k}")
    with processes.agent_sandbox() as (root, job):
      args = ["-m", "tests.support.rollback_worker", "--run-root", root, "--job", job]
      args += ["--agent"] * (agent_kind == "agent")
      args += [] if directory is None else ["--directory", directory,
                                            "--persist-interval", str(interval)]
      with processes.Proc(args, env={"JAXCKPT_CRASH_AT": f"rollback:{k}"}) as proc:
        proc.wait_for("RESTORED 25", timeout_secs=240)
        try:
          rc = proc.p.wait(timeout=240)
        except subprocess.TimeoutExpired:
          pytest.fail(f"crash point {k}: the trainer (pid {proc.p.pid}) neither died nor "
                      f"ended within 240 s")
        out = proc.p.stdout.read()
      agent = jc.AgentOptions(job_name=job, run_root=root) if agent_kind else None
      opts = jc.CheckpointOptions(max_snapshots=10, agent=agent, on_busy="wait",
                                  **({} if directory is None else
                                     {"persist_interval_steps": interval}))
      if rc == -9:                                   # killed in the rollback
        kills += 1
        with jc.CheckpointManager(directory, opts) as m:
          assert m.all_steps() == [21, 22, 23, 24, 25], (k, m.all_steps())
          got = m.restore(None, _state(0))
          assert m.last_restore.step == 25 and got["step"] == 25, (k, m.last_restore)
          np.testing.assert_array_equal(got["w"], _state(25)["w"])
          for s in (26, 30):
            with pytest.raises(errors.StepNotFoundError):
              m.restore(s, _state(0))
          if directory is not None:
            assert [s for s in universal.all_steps(directory) if s > 25] == [], k
            assert _rollbacks.rollback_record(directory) is None, k
          assert m.save(26, _state(26, version=1))   # the new timeline goes on
          m.wait_until_finished()
          assert m.all_steps() == [21, 22, 23, 24, 25, 26], (k, m.all_steps())
        continue
      assert rc == 0 and "DONE" in out, (k, rc, out[-3000:])
      assert k == points + 1, f"the rollback passed {k - 1} crash points, not {points}"
      with jc.CheckpointManager(directory, opts) as m:
        _check_new_timeline(m, directory) if directory is not None else None
        assert m.all_steps()[-3:] == [26, 27, 28] and 30 not in m.all_steps()
  assert kills == points, (kills, points)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_job_killed_at_any_point_of_its_rollback_resumes_the_new_timeline(tmp_path):
  """Two processes with agents and parity roll back (21-30, restore(25), save(26)), both
  SIGKILLed at the K-th point of their rollback, K = 1, 2, ... (the job dies mid-way: an
  agent, or a peer's agent and its parity, or storage reached and the rest not). The
  relaunched job lists 21-25 on every process, storage none of 26-30, and every process
  restores step 25 bit for bit."""
  from jaxckpt.job_faults_test import finish, launch, lines  # pylint: disable=import-outside-toplevel
  for k in range(1, 30):
    directory = str(tmp_path / f"run{k}")
    with processes.agent_sandbox() as (root, job):
      with launch(2, root, job, "rollback_killed", directory, str(k)) as procs:
        for p in procs:
          p.wait_for("RESTORED 25 ok", timeout_secs=240)
        rcs = []
        for p in procs:              # one killed takes the job's coordination with it
          try:
            rcs.append(p.p.wait(timeout=120))
          except Exception:  # pylint: disable=broad-except
            p.kill()
            rcs.append(p.p.returncode)
        outs = [p.p.stdout.read() for p in procs]
      if all(rc == 0 for rc in rcs):                 # past every point
        assert all("DONE" in out for out in outs), outs
        assert k == 7, f"the job's rollback passed {k - 1} crash points, not 6"
        return
      assert -9 in rcs, (k, rcs, [o[-2000:] for o in outs])
      with launch(2, root, job, "after_rollback", directory, "") as procs:
        outs = finish(procs, timeout=240)
      for i, out in enumerate(outs):
        assert lines(out, "STEPS") == ["[21, 22, 23, 24, 25]"], (k, i, out[-3000:])
        assert lines(out, "STORED") == ["[]"], (k, i, lines(out, "STORED"))
        (restored,) = lines(out, "RESTORED")
        assert restored.startswith("25 ") and restored.endswith(" ok"), (k, i, restored)
  pytest.fail("the rollback did not end within 29 crash points")


def test_a_rollback_asked_again_never_deletes_the_new_timeline(tmp_path):
  """The agent records the rollback (its id and steps) and applies it once: the same
  rollback asked again (a relaunch completing it, another process's) after steps 26-28
  of the new timeline were saved leaves them held, in this manager and after a relaunch."""
  from jaxckpt.agent import _requests  # pylint: disable=import-outside-toplevel
  directory = str(tmp_path / "run")
  with processes.agent_sandbox() as (root, job):
    agent = jc.AgentOptions(job_name=job, run_root=root)
    with jc.CheckpointManager(directory, _options(agent)) as m:
      _spike_and_roll_back(m)
      with processes.agent_client(root, job, who="the test") as c:
        (rid, record), = c.call(_requests.Rollback())[0].rollbacks.items()
        steps = record.steps
        assert steps == [26, 27, 28, 29, 30], steps
        again = c.call(_requests.Rollback(id=rid, steps=steps))[0]
        assert not again.applied and again.persisting == [], again
      _check_new_timeline(m, directory)
    with jc.CheckpointManager(directory, _options(agent)) as m:
      _check_new_timeline(m, directory)


@pytest.mark.parametrize("record", [
    {"id": "r1", "fork": 1, "step": 2, "steps": ["../../etc", "3"]},
    {"id": "r1", "fork": 0, "step": 2, "steps": [True]},
    {"id": "r1", "fork": 9, "step": 10, "steps": [1, 2]},      # live steps before the fork
    {"id": "../x", "fork": 0, "step": 1, "steps": [2]},
    {"id": "r1", "fork": 0, "step": 1, "steps": [2**64]},
    {"id": "x"}, [1, 2, 3], "hello",
], ids=["paths", "bool", "before-fork", "bad-id", "beyond-int64", "partial", "list", "text"])
def test_a_rollback_record_that_jaxckpt_did_not_write_is_refused_and_deletes_nothing(
    tmp_path, record):
  """rollback.json on storage is data: a planted or garbled record (steps that are no
  steps, a bool, steps at or before the restored one, an id that is a path) is refused
  with a ManifestError naming the file and the fix; nothing it names is deleted. Before,
  it raised a bare ValueError/KeyError/TypeError at every open, took true for step 1, or
  deleted the live steps 1 and 2."""
  d = str(tmp_path / "ckpt")
  with jc.CheckpointManager(d, jc.CheckpointOptions(max_snapshots=8, persist_interval_steps=1,
                                                    on_busy="wait")) as m:
    for s in (1, 2, 3):
      assert m.save(s, _state(s))
      m.wait_until_finished()
  _commit.write_json(d, "rollback.json", record)
  with pytest.raises(errors.ManifestError, match=r"rollback\.json .*is not one jaxckpt wrote"
                     r".*nothing it names was deleted.*remove rollback\.json"):
    jc.CheckpointManager(d, _options(None))
  assert universal.all_steps(d) == [1, 2, 3]
  (tmp_path / "ckpt" / "rollback.json").unlink()
  with jc.CheckpointManager(d, _options(None)) as m:
    assert m.all_steps() == [1, 2, 3]
    out = m.restore(2, target=_state(0))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(_state(2)["w"]))
