"""JobDecisions: process 0's save decisions, published by step (and timeline), are the
job's, whatever calls only some processes make. A small in-memory channel stands in for
the job's key-value store (``jaxckpt.net._kv.Channel``'s set/get/delete); the real one
is exercised by job_agreement_test.py."""

import threading

import pytest

from jaxckpt import errors
from jaxckpt.core._policy import JobDecisions


class _Channel:
  """set/get/delete of ``_kv.Channel``, in memory: ``get`` waits for the key."""

  def __init__(self) -> None:
    self.keys: dict[str, str] = {}
    self._cv = threading.Condition()

  def set(self, key: str, value: str) -> None:
    with self._cv:
      self.keys[key] = value
      self._cv.notify_all()

  def get(self, key: str, timeout_secs: float) -> str | None:
    with self._cv:
      self._cv.wait_for(lambda: key in self.keys, timeout_secs)
      return self.keys.get(key)

  def delete(self, key: str) -> None:
    with self._cv:
      self.keys.pop(key, None)


def _job(count: int = 2, timeout: float = 30.0):
  ch = _Channel()
  return ch, [JobDecisions(process=(i, count), channel=ch, what="should_save_fn",
                           compare=False, timeout_secs=timeout) for i in range(count)]


def _every_third(step: int):
  return lambda: step % 3 == 0


def test_a_save_forced_on_process_0_only_shifts_no_later_decision():
  """The review's repro: process 0 saves step 2 with force=True (its decision not
  asked), process 1 does not. Before: every later save of process 1 raised
  InvalidArgumentError ('other steps'), then SnapshotTimeoutError. Now both take the
  same decisions, step 2's True (process 0's force) included."""
  _, (p0, p1) = _job()
  mine = []
  for s in range(1, 7):
    if s == 2:
      p0.forced(s)
      mine.append(True)
    else:
      mine.append(p0.decide(s, _every_third(s)))
  theirs = [p1.decide(s, _every_third(s)) for s in range(1, 7)]
  assert mine == theirs == [False, True, True, False, False, True]


def test_a_should_save_retried_on_one_process_shifts_nothing():
  _, (p0, p1) = _job()
  mine = []
  for s in range(1, 7):
    mine.append(p0.decide(s, _every_third(s)))
    p0.decide(s, lambda: pytest.fail("a step decided is not asked again"))  # save(s) after it
  theirs = [p1.decide(s, _every_third(s)) for s in range(1, 7)]
  assert mine == theirs == [s % 3 == 0 for s in range(1, 7)]


def test_a_rollback_reads_the_new_timelines_decisions():
  """Steps 1-6, restore of step 3, then steps 4-6 again: the second 4-6 are the new
  timeline's decisions (process 0 decides them anew), not the abandoned one's."""
  _, (p0, p1) = _job()
  first = [p0.decide(s, _every_third(s)) for s in range(1, 7)]
  p0.restored()
  again = [p0.decide(s, lambda: True) for s in range(4, 7)]
  assert first == [False, False, True, False, False, True] and again == [True] * 3
  assert [p1.decide(s, lambda: False) for s in range(1, 7)] == first
  p1.restored()
  assert [p1.decide(s, lambda: False) for s in range(4, 7)] == again
  assert p0.timeline == p1.timeline == 1


def test_process_1_waits_for_process_0s_decision():
  _, (p0, p1) = _job()
  got = []
  t = threading.Thread(target=lambda: got.append(p1.decide(3, lambda: False)))
  t.start()
  assert p0.decide(3, lambda: True) is True     # process 0 never waits
  t.join(60)
  assert not t.is_alive() and got == [True]


def test_a_step_process_0_never_decided_times_out_naming_process_0():
  _, (p0, p1) = _job(timeout=0.2)
  p0.decide(1, lambda: True)
  assert p1.decide(1, lambda: False) is True
  with pytest.raises(errors.SnapshotTimeoutError,
                     match=r"process 1: process 0 did not publish its save decision of step 5"):
    p1.decide(5, lambda: True)


def test_the_published_window_is_bounded(monkeypatch):
  ch, (p0, p1) = _job()
  monkeypatch.setattr(JobDecisions, "KEPT", 8)
  for s in range(1, 21):
    p0.decide(s, _every_third(s))
  assert sorted(ch.keys) == sorted(f"d/0/{s}" for s in range(13, 21))
  assert [p1.decide(s, lambda: False) for s in range(13, 21)] == [s % 3 == 0 for s in range(13, 21)]
