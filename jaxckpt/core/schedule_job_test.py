"""The job's save plan against loops that use it as users do."""

from __future__ import annotations

import os
import threading

import pytest

from jaxckpt.core import _schedule as sch
from jaxckpt.core.schedule_test import Clock, DictChannel
from jaxckpt.testing import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _schedules(n, copy_secs):
  ch = DictChannel()
  out = [sch.Schedule(process=(i, n), on_busy="skip", persist_interval=None, timeout_secs=10,
                      channel=ch, clock=Clock(0.1)) for i in range(n)]
  for s in out:
    s.measure.copy.extend([copy_secs])      # copies slower than the loop: n > 1
  return out


def _threads(schedules, loop):
  out = [[] for _ in schedules]
  threads = [threading.Thread(target=loop, args=(s, out[i])) for i, s in enumerate(schedules)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  return out


def test_a_loop_that_asks_should_save_first_keeps_snapshotting():
  # `if mgr.should_save(step): mgr.save(step, state)` (orbax's loop): a step the plan
  # does not take must still count, else the plan never comes round again.
  def loop(s, taken):
    for step in range(1, 61):
      if s.peek(step).snapshot:
        d = s.decide(step)
        assert d.snapshot
        s.took(d)
        taken.append(step)
  gated = _threads(_schedules(2, 0.3), loop)

  def plain(s, taken):
    for step in range(1, 61):
      d = s.decide(step)
      if d.snapshot:
        s.took(d)
        taken.append(step)
  every = _threads(_schedules(2, 0.3), plain)
  assert gated[0] == gated[1]
  assert gated[0] == every[0], "asking should_save first changed which steps are taken"
  assert gated[0][-1] > 50


def test_a_process_whose_planned_snapshot_failed_decides_the_next_steps_as_the_others():
  # Process 1's save of the first planned snapshot after step 8 raised (its previous copy
  # or a slot was late: the snapshot was decided, not started); its loop goes on (the
  # error was caught). The job must still take the same steps.
  def loop(s, taken):
    for step in range(1, 61):
      d = s.decide(step)
      if d.snapshot:
        failed = s.index == 1 and step > 8 and not [t for t in taken if t > 8]
        if not failed:
          s.took(d)
        taken.append(step)
  decided = _threads(_schedules(2, 0.3), loop)
  assert decided[0] == decided[1]


@pytest.mark.timeout(300)
def test_two_processes_asking_should_save_first_take_the_same_steps_to_the_end():
  port = processes.free_port()
  procs = [processes.Proc(["-m", "tests.support.plan_worker", "--port", str(port),
                           "--num-processes", "2", "--process-id", str(i), "--gated",
                           "--steps", "48", "--sleep", "0.01", "--ballast-mib", "32"],
                          cwd=REPO) for i in range(2)]
  try:
    taken = [p.wait_for("STEPS", 240).split("STEPS", 1)[1].strip() for p in procs]
  finally:
    for p in procs:
      p.__exit__(None, None, None)
  assert taken[0] == taken[1], taken
  steps = [int(s) for s in taken[0].strip("[]").split(",")]
  assert steps[-1] > 24, f"the job took no snapshot after step {steps[-1]} of 48: {steps}"


@pytest.mark.timeout(300)
def test_a_process_whose_save_raised_a_background_error_goes_on_with_the_jobs_steps():
  # Process 1's agent is killed while a snapshot is copied into it: the commit fails in
  # the background, the next save() raises that error, and the loop goes on (the error
  # was caught; that save starts a new agent). That save is one of the job's calls like
  # any other: the processes must go on taking the same steps.
  with processes.agent_sandbox() as (root, job):
    port = processes.free_port()
    procs = [processes.Proc(["-m", "tests.support.plan_worker", "--port", str(port),
                             "--num-processes", "2", "--process-id", str(i), "--run-root", root,
                             "--job", job, "--steps", "120", "--sleep", "0.002", "--prepare",
                             "--kill-agent-after", "8"], cwd=REPO) for i in range(2)]
    try:
      out = [p.finish(240) for p in procs]
    finally:
      for p in procs:
        p.__exit__(None, None, None)
  assert "RAISED" in out[1] and "AgentUnavailableError" in out[1], out[1][-2000:]
  raised = int(out[1].split("RAISED", 1)[1].split()[0])
  taken = [o.split("STEPS", 1)[1].splitlines()[0].strip() for o in out]
  assert taken[0] == taken[1], taken
  assert int(taken[0].strip("[]").split(",")[-1]) > raised, (
      f"no snapshot after step {raised}, where process 1 raised: nothing was compared", taken)


def test_a_plan_that_does_not_come_names_the_process_process_0_waits_for():
  # Process 2 stopped calling save(). Process 0 waits for its report; process 1 waits for
  # process 0's plan, and its timeout blamed process 0 ("that far behind, or gone").
  ch = DictChannel()
  s = [sch.Schedule(process=(i, 3), on_busy="skip", persist_interval=None, timeout_secs=0.5,
                    channel=ch, clock=Clock(0.1)) for i in range(3)]
  s[2].decide(1)                             # it reported for calls 0-3, then stopped
  raised = {}

  def loop(i):
    try:
      for step in range(1, 13):
        s[i].decide(step)
    except Exception as e:  # pylint: disable=broad-except
      raised[i] = e
  threads = [threading.Thread(target=loop, args=(i,)) for i in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert "processes [2]" in str(raised[0])
  assert "process 2" in str(raised[1]) or "processes [2]" in str(raised[1]), str(raised[1])
