"""The job's save plan: every process decides the same, from what the job agreed."""

from __future__ import annotations

import threading

import pytest

from jaxckpt import errors
from jaxckpt.core import _schedule as sch


class DictChannel:
  """The key-value channel's contract over a dict (the real one, jax.distributed's
  store, is exercised by the multi-process tests)."""

  def __init__(self) -> None:
    self.kv: dict[str, str] = {}
    self.cv = threading.Condition()

  def set(self, key, value):
    with self.cv:
      self.kv[key] = value
      self.cv.notify_all()

  def get(self, key, timeout_secs):
    with self.cv:
      self.cv.wait_for(lambda: key in self.kv, timeout_secs)
      return self.kv.get(key)

  def gather(self, directory, count, *, timeout_secs):
    with self.cv:
      have = lambda: {int(k.rsplit("/", 1)[1]): v for k, v in self.kv.items()
                      if k.startswith(directory + "/")}
      self.cv.wait_for(lambda: len(have()) >= count, timeout_secs)
      got = have()
      return got if len(got) >= count else sorted(set(range(count)) - set(got))

  def delete(self, key):
    with self.cv:
      for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
        del self.kv[k]


class Clock:
  """A loop whose calls are ``step`` seconds apart."""

  def __init__(self, step: float) -> None:
    self.t, self.step = 0.0, step

  def __call__(self) -> float:
    self.t += self.step
    return self.t


def test_the_plan_spaces_snapshots_by_the_slowest_copy_and_persists_by_the_slowest_persist():
  r = [sch.Report(copy_secs=0.3, gap_secs=0.1, persist_secs=2.0),
       sch.Report(copy_secs=0.05, gap_secs=0.2, persist_secs=6.0)]
  assert sch.plan_of(r, on_busy="skip", auto_persist=True) == sch.Plan(4, 23)
  assert sch.plan_of(r, on_busy="wait", auto_persist=True) == sch.Plan(1, 90)
  assert sch.plan_of(r, on_busy="skip", auto_persist=False) == sch.Plan(4, 0)
  # nothing measured yet: every call, and no persist after the first until one is measured
  assert sch.plan_of([sch.Report()], on_busy="skip", auto_persist=True) == sch.Plan(1, None)
  fast = [sch.Report(copy_secs=0.01, gap_secs=0.1, persist_secs=0.05)]
  assert sch.plan_of(fast, on_busy="skip", auto_persist=True) == sch.Plan(1, 1)


def _run(schedules, steps):
  """Every schedule decides ``steps`` in order (each on its own thread, as processes
  do); each takes every snapshot it decides. Returns their decisions."""
  out = [[] for _ in schedules]

  def loop(i, s):
    for step in steps:
      d = s.decide(step)
      if d.snapshot:
        s.took(d)
      out[i].append((step, d.snapshot, d.due))
  threads = [threading.Thread(target=loop, args=(i, s)) for i, s in enumerate(schedules)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  return out


def test_processes_with_different_timings_decide_the_same_steps():
  ch = DictChannel()
  schedules = [sch.Schedule(process=(i, 3), on_busy="skip", persist_interval=None,
                            timeout_secs=10, channel=ch, clock=Clock(0.1)) for i in range(3)]
  for i, s in enumerate(schedules):      # process 2 copies slowly, process 1 persists slowly
    s.measure.copy.extend([0.9] + [0.25 if i == 2 else 0.02] * 3)   # (a slow first copy: no)
    s.measure.persist.extend([1.0 if i == 1 else 0.1])
  decisions = _run(schedules, range(1, 41))
  assert decisions[0] == decisions[1] == decisions[2]
  taken = [step for step, snap, _ in decisions[0] if snap]
  due = [step for step, _, d in decisions[0] if d]
  assert taken[:4] == [1, 2, 3, 4]                 # the first epoch: nothing measured yet
  assert len(taken) < 40 and taken[-1] - taken[-2] == 4      # ceil(1.25 * 0.25 / 0.1)
  assert due[0] == 1 and len(due) >= 2             # the first at once, then by the plan
  assert all(b - a >= 3 for a, b in zip(due[1:], due[2:]))   # ceil(1.5*1.0 / (4*0.1)) snapshots


def test_a_process_that_never_reports_is_named():
  ch = DictChannel()
  leader = sch.Schedule(process=(0, 2), on_busy="skip", persist_interval=None,
                        timeout_secs=0.3, channel=ch)
  with pytest.raises(errors.SnapshotTimeoutError, match=r"processes \[1\] did not report"):
    for step in range(1, 5):
      leader.decide(step)
  follower = sch.Schedule(process=(1, 2), on_busy="skip", persist_interval=None,
                          timeout_secs=0.3, channel=DictChannel())
  with pytest.raises(errors.SnapshotTimeoutError,
                     match=r"process 0 did not publish the job's save plan for calls 4-7"):
    for step in range(1, 6):
      follower.decide(step)


def test_one_process_persists_whenever_its_last_persist_has_ended():
  s = sch.Schedule(process=(0, 1), on_busy="skip", persist_interval=None, timeout_secs=1)
  first = s.decide(1, persisting=False)
  assert first == sch.Decision(True, True)
  s.took(first)
  for step in range(2, 6):                 # the first persist has not ended: none due
    d = s.decide(step, persisting=True)
    assert d == sch.Decision(True, False)
    s.took(d)
  assert s.decide(6, persisting=False) == sch.Decision(True, True)


def test_a_relaunched_process_persists_its_first_snapshot_once_the_earlier_persists_ended():
  # Its agent still persists a killed trainer's step: the first snapshot waits for storage
  # as any other (persisted at once, it held a slot; relaunches held them all).
  s = sch.Schedule(process=(0, 1), on_busy="skip", persist_interval=None, timeout_secs=1)
  for step in (11, 12):
    d = s.decide(step, persisting=True)
    assert d == sch.Decision(True, False)
    s.took(d)
  assert s.decide(13, persisting=False) == sch.Decision(True, True)
  assert s.decide(14, persisting=True, force=True) == sch.Decision(True, True)


def test_a_fixed_interval_is_due_on_its_steps_and_force_persists_under_the_automatic_one():
  fixed = sch.Schedule(process=(0, 1), on_busy="skip", persist_interval=5, timeout_secs=1)
  assert [s for s in range(1, 16) if fixed.decide(s).due] == [5, 10, 15]
  auto = sch.Schedule(process=(0, 1), on_busy="skip", persist_interval=None, timeout_secs=1)
  auto.took(auto.decide(1))
  assert not auto.decide(2, persisting=True).due
  assert auto.decide(3, force=True, persisting=True).due
  none = sch.Schedule(process=(0, 1), on_busy="skip", persist_interval=0, timeout_secs=1)
  assert not any(none.decide(s, force=True).due for s in range(1, 4))
