"""A job is one unit: its processes agree on their options at start, and every process's
wait_until_finished returns once the step is committed on storage (real processes of
one jax.distributed job on loopback: :mod:`tests.support.job_worker`)."""

from __future__ import annotations

import pytest

from jaxckpt.job_faults_test import finish, launch, lines, wait_all
from jaxckpt.testing import processes


@pytest.mark.parametrize("variant", ["", "agent"], ids=["in_process", "agent"])
def test_every_process_waits_for_the_commit(tmp_path, variant):
  """Process 0 is five seconds late: process 1's wait_until_finished returned after
  0.6-0.8 s, its own part written and the step not committed; now it returns once the
  step is on storage."""
  with processes.agent_sandbox() as (root, job):
    with launch(2, root, job, "late_commit", str(tmp_path / "ckpt"), variant) as procs:
      outs = finish(procs, timeout=240)
  for i, out in enumerate(outs):
    (waited,) = lines(out, "WAITED")
    assert waited.endswith("COMMITTED True"), (i, waited)
  secs = float(lines(outs[1], "WAITED")[0].split()[1])
  assert secs > 3.0, secs          # it waited for process 0's commit, not only its own part


@pytest.mark.parametrize("variant", ["save_interval_steps=2", "persist_interval_steps=3"])
def test_processes_with_other_options_are_refused_at_start(tmp_path, variant):
  """Before, process 1's save() returned True for steps the job did not hold whole
  (save_interval_steps), or nothing was ever committed (persist_interval_steps)."""
  name, value = variant.split("=")
  with processes.agent_sandbox() as (root, job):
    with launch(2, root, job, "options_differ", str(tmp_path / "ckpt"), variant) as procs:
      outs = finish(procs, timeout=240)
  for i, out in enumerate(outs):
    (refused,) = lines(out, "REFUSED")
    assert f"process {i}:" in refused and "the 2 processes of this job" in refused, refused
    assert f"{name}: process 0 has None, processes [1] have {value}" in refused or (
        f"{name}: process 0 has 1, processes [1] have {value}" in refused), refused
    assert "Give every process the same CheckpointOptions" in refused


_VALUES = {"keep_time_interval": "1,2", "should_save_fn": "2,3", "preservation_policy": "2,5"}


def test_processes_whose_options_differ_only_in_value_are_refused(tmp_path):
  """A per-host configuration file gives process 0 keep_time_interval=1 h and process 1
  2 h, should_save_fn=every(2) and every(3) (one closure, other values), or orbax's
  AnyPreservationPolicy([LatestN(2)]) and ([LatestN(5)]): each job was accepted, and its
  processes then save or keep different steps."""
  variant = ";".join(f"{name}={values}" for name, values in _VALUES.items())
  with processes.agent_sandbox() as (root, job):
    with launch(2, root, job, "options_differ_in_value", str(tmp_path / "ckpt"),
                variant) as procs:
      outs = finish(procs, timeout=240)
  for i, out in enumerate(outs):
    assert not lines(out, "ACCEPTED"), (i, lines(out, "ACCEPTED"))
    refused = lines(out, "REFUSED")
    assert len(refused) == len(_VALUES), (i, refused)
    for name, said in zip(_VALUES, refused):
      assert f"{name}: process 0 has" in said and "processes [1] have" in said, said


def test_a_step_deleted_beside_the_running_job_is_not_waited_for(tmp_path):
  """guide.md: `jaxckpt delete DIR --step N` runs beside a job (it reaches the job's
  agents). Steps 1 and 2 stored, step 1 deleted that way, step 3 saved: process 1's
  wait_until_finished and close() timed out waiting for step 1 ("processes [0, 1] of 2
  did not write their part"), which nobody saves again."""
  with processes.agent_sandbox() as (root, job):
    with launch(2, root, job, "deleted_elsewhere", str(tmp_path / "ckpt"), "") as procs:
      outs = finish(procs, timeout=240)
  assert lines(outs[0], "CLI")[0].startswith("0 "), outs[0]
  for i, out in enumerate(outs):
    assert not lines(out, "TIMEOUT"), (i, lines(out, "TIMEOUT"))
    assert lines(out, "WAITED") == lines(out, "CLOSED") == ["[2, 3]"], (i, out[-3000:])


@pytest.mark.parametrize("variant", ["bound", "global"])
def test_processes_with_other_save_schedules_save_the_same_steps(tmp_path, variant):
  """should_save_fn=Every(2).due on process 0 and Every(3).due on process 1 (a per-host
  configuration object), or a module function reading a per-host setting: the options'
  digest saw the same function, so the job was accepted, and process 0 saved 2, 4, 6, 8,
  process 1 3, 6; the job held [6] only. Now the job follows process 0's decisions: both
  processes save (and should_save says) 2, 4, 6, 8, every one of them held by the job, and
  process 1 says at WARNING that its own schedule differs, naming the option, the step,
  both decisions and the processes."""
  with processes.agent_sandbox() as (root, job):
    with launch(2, root, job, "schedules_differ", str(tmp_path / "ckpt"), variant) as procs:
      outs = finish(procs, timeout=240)
  want = " ".join(f"{s}:{11 if s % 2 == 0 else '00'}" for s in range(1, 9))
  for i, out in enumerate(outs):
    assert lines(out, "DECIDED") == [want], (i, out[-3000:])
    assert lines(out, "STEPS") == ["[2, 4, 6, 8]"], (i, lines(out, "STEPS"))
  assert not lines(outs[0], "WARNED"), lines(outs[0], "WARNED")
  (warned,) = lines(outs[1], "WARNED")
  assert warned.startswith("process 1: should_save_fn decides False for step 2 where "
                           "process 0 decides True"), warned
  assert "the 2 processes follow process 0's decisions" in warned, warned


def test_a_save_forced_on_process_0_only_is_the_jobs_and_shifts_no_later_decision(tmp_path):
  """Both processes save every 2 steps (should_save_fn); process 0 alone saves step 3
  with force=True, not asking should_save. Process 0 published its decisions by call
  count, so process 1's every later call read another step's: should_save(3) raised
  InvalidArgumentError ('other steps'). Now they are keyed by step: process 0's force
  is the job's True for step 3, process 1 saves it too, and the later steps agree."""
  with processes.agent_sandbox() as (root, job):
    with launch(2, root, job, "schedules_differ", str(tmp_path / "ckpt"), "forced") as procs:
      outs = finish(procs, timeout=240)
  later = " ".join(f"{s}:{11 if s % 2 == 0 else '00'}" for s in range(4, 9))
  assert lines(outs[0], "DECIDED") == [f"1:00 2:11 3:-1 {later}"], outs[0][-3000:]
  assert lines(outs[1], "DECIDED") == [f"1:00 2:11 3:11 {later}"], outs[1][-3000:]
  for i, out in enumerate(outs):
    assert lines(out, "STEPS") == ["[2, 3, 4, 6, 8]"], (i, lines(out, "STEPS"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["", "parity"], ids=["agents", "agents_parity"])
def test_a_job_killed_while_its_processes_drift_relaunches_from_a_step_every_host_holds(
    variant):
  """issue 46 (1): process 0 one step ahead, the last process one behind (its copy
  running) when the job is killed. Each host kept its own newest steps (host 0 [6, 7],
  the last host [4, 5]; with parity host 0 kept its protected 4 and 7): no step was
  held by every host, and the relaunch restored nothing and started from step 1.
  Now a host drops a step only once a newer one is held by every host."""
  with processes.agent_sandbox("jd") as (root, job):
    with launch(4, root, job, "ahead_when_killed", "", variant) as procs:
      wait_all(procs, "HELD")
      for p in procs:                   # the scheduler stops the job: SIGKILL, agents stay
        p.kill()
    with launch(4, root, job, "relaunched", "", variant) as procs:
      outs = finish(procs)
  said = [lines(out, "RESTORED") for out in outs]
  assert all(not lines(out, "NOTHING") for out in outs), said
  assert all(len(s) == 1 for s in said), said
  steps = {s[0].split()[0] for s in said}
  assert steps == {"5"}, said       # the newest step every host holds, on every process
  assert all("host" in s[0].split()[1] and s[0].endswith(" ok") for s in said), said


@pytest.mark.timeout(600)
def test_the_last_saves_of_a_loop_are_held_or_said():
  """issue 46 (4): a job of 4 processes saved every step to 10 and waited: the newest
  step was 8, skipped_plan=2, skip_reasons empty and nothing said. A loop faster than
  its copies still has saves left out by the job's plan, but a wait after them says
  which at WARNING and why, skip_reasons counts them, and force=True holds the last
  save (protected by parity) on every process."""
  with processes.agent_sandbox("jl") as (root, job):
    with launch(4, root, job, "last_saves") as procs:
      outs = finish(procs)
  for i, out in enumerate(outs):
    (newest,) = lines(out, "NEWEST")
    held, _, skipped, _, reasons = newest.split()
    assert skipped == reasons, (i, newest)            # each skip has its reason
    if held != "10":                                  # (left out: said, with why)
      warned = [w for w in lines(out, "WARNED") if "the job's plan left out" in w]
      assert len(warned) == 1, (i, lines(out, "WARNED"))
      assert "wait_until_finished() after saves" in warned[0], warned
      assert ", 10]" in warned[0] or "-10 (" in warned[0], warned
      assert "force=True" in warned[0], warned
    assert lines(out, "FORCED") == ["20 PROTECTED [20]"], (i, out[-3000:])
  assert len({lines(out, "NEWEST")[0] for out in outs}) == 1, [lines(o, "NEWEST") for o in outs]
