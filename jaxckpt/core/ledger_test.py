"""The ledger under its three writers at once: the loop, the save thread and the delete
janitor (each race of issue 49 as threads calling the ledger's methods as those threads
do, many times over)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable

from jaxckpt.core._ledger import Ledger

RECORDS = 2_000        # a long run's records: a comprehension over them spans thread switches
PASSES = 500           # the loop's calls beside the background thread (~100 thread switches)


def _race(background: Callable[[int], None], loop: Callable[[], object]) -> list[BaseException]:
  """Runs ``background(i)`` for i = 0, 1, ... in a thread of its own while the calling
  thread runs ``loop()`` ``PASSES`` times; the errors either raised."""
  stop = threading.Event()
  raised: list[BaseException] = []

  def run() -> None:
    try:
      i = 0
      while not stop.is_set():
        background(i)
        i += 1
        time.sleep(0)               # (the GIL to the loop: it is made to drop it where it is)
    except BaseException as e:  # pylint: disable=broad-except  (reported by the test)
      raised.append(e)

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    fut = pool.submit(run)
    try:
      for _ in range(PASSES):
        loop()
    except BaseException as e:  # pylint: disable=broad-except  (reported by the test)
      raised.append(e)
    finally:
      stop.set()
    fut.result(timeout=60)          # (it ends at its next round)
  return raised


def _ledger() -> Ledger:
  led = Ledger("run0")
  for s in range(RECORDS):
    led.record(s)
  led.drop(range(0, RECORDS, 2), "retention")
  return led


def test_the_janitor_forgetting_steps_while_the_loop_lists_the_dropped_ones():
  """The janitor's forget (a dropped step gone from every tier) pops a record while the
  loop's save reads the dropped steps, the kept ones and the attempts."""
  led = _ledger()

  def janitor(i: int) -> None:
    s = RECORDS + i // 2
    if i % 2:
      led.forget(s)                   # gone from every tier
    else:
      led.drop([s], "retention")      # (the next one dropped: the loop's, in the code)

  raised = _race(janitor, lambda: (led.dropped(), led.kept(), led.attempts()))
  assert not raised, f"the loop's reads of the ledger failed beside the janitor: {raised[0]!r}"
  assert set(range(0, RECORDS, 2)) <= set(led.dropped()) <= set(range(0, RECORDS, 2)) | {max(led.dropped())}


def test_the_save_thread_reading_the_persists_while_the_loop_starts_the_next_save():
  """The save thread's commit reads the due steps still persisting while the loop's next
  ``save()`` adds its step's record (and a skipped one forgets it again)."""
  led = _ledger()
  for s in range(1, RECORDS, 2):
    led.new_attempt(s)
    led.record(s).persisting = True   # (due steps whose persist runs)

  def loop_saves(i: int) -> None:
    step = RECORDS + i
    led.new_attempt(step)             # the next save's record
    if i % 2:
      led.forget(step)                # (a save skipped: its record goes again)

  def save_thread() -> None:
    led.persisting()
    led.unanswered()

  raised = _race(loop_saves, save_thread)
  assert not raised, f"the save thread's reads of the ledger failed beside the loop: {raised[0]!r}"
  assert {r.step for r in led.persisting()} >= set(range(1, RECORDS, 2))


def test_every_method_of_the_ledger_takes_its_lock():
  """Every method is wrapped in the ledger's lock (a method added without it is named);
  ``saving`` takes it after mapping the user's metrics."""
  names = [n for n, v in vars(Ledger).items() if callable(v) and not n.startswith("__")]
  unlocked = [n for n in names if not getattr(vars(Ledger)[n], "__wrapped__", None)
              and n != "saving"]
  assert not unlocked, f"Ledger methods without the ledger's lock: {unlocked}"
  assert all(getattr(vars(Ledger)[n].fget, "__wrapped__", None) for n in ("flight", "flight_step"))


# -- the manager's steps under its threads at once (a hypothesis state machine) --------

import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import hypothesis  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

import jaxckpt as jc  # noqa: E402
from jaxckpt import universal  # noqa: E402

KEEP = 3


def _state(step: int) -> dict:
  return {"w": np.full((64,), step, np.float32), "b": np.arange(4, dtype=np.int64) * step}


class ManagerSteps(RuleBasedStateMachine):
  """A manager that saves, persists, drops by retention (``max_to_keep``: its janitor
  deletes them), deletes and restores, while another thread asks it what it holds all
  the time; the model: the newest ``KEEP`` steps saved and not deleted, and their metrics."""

  def __init__(self) -> None:
    super().__init__()
    self.directory = tempfile.mkdtemp(prefix="jaxckpt-ledger-")
    self.mgr = jc.CheckpointManager(self.directory, jc.CheckpointOptions(
        max_to_keep=KEEP, persist_interval_steps=1, on_busy="wait", max_snapshots=2))
    self.kept: list[int] = []
    self.metrics: dict[int, float] = {}
    self.next_step = 1
    self.stop = threading.Event()
    self.raised: list[BaseException] = []
    self.asker = threading.Thread(target=self._ask, name="asker", daemon=True)
    self.asker.start()

  def _ask(self) -> None:
    """The other thread: the listing, the best step, the stats and metrics, over and over."""
    try:
      while not self.stop.is_set():
        for step in self.mgr.all_steps():
          self.mgr.metrics(step)
        self.mgr.best_step()
        self.mgr.stats.skip_reasons.copy()
        time.sleep(0)
    except jc.errors.ManagerClosedError:
      pass
    except BaseException as e:  # pylint: disable=broad-except  (the invariant reports it)
      self.raised.append(e)

  @rule(loss=st.floats(allow_nan=True, allow_infinity=True))
  def save(self, loss: float) -> None:
    step, self.next_step = self.next_step, self.next_step + 1
    assert self.mgr.save(step, _state(step), metrics={"loss": loss})
    self.kept = (self.kept + [step])[-KEEP:]
    self.metrics[step] = loss

  @rule()
  def persist(self) -> None:
    self.mgr.wait_until_finished()
    assert universal.all_steps(self.directory) == self.kept

  @precondition(lambda self: self.kept)
  @rule(data=st.data())
  def restore(self, data: st.DataObject) -> None:
    step = data.draw(st.sampled_from(self.kept))
    out = self.mgr.restore(step, _state(0))
    np.testing.assert_array_equal(out["w"], _state(step)["w"])
    np.testing.assert_array_equal(out["b"], _state(step)["b"])

  @precondition(lambda self: self.kept)
  @rule(data=st.data())
  def delete(self, data: st.DataObject) -> None:
    step = data.draw(st.sampled_from(self.kept))
    self.mgr.delete(step)
    self.kept.remove(step)

  @invariant()
  def lists_the_model(self) -> None:
    assert not self.raised, f"the asking thread failed: {self.raised[0]!r}"
    assert self.mgr.all_steps() == self.kept
    for step in self.kept:
      got, want = self.mgr.metrics(step)["loss"], self.metrics[step]
      assert got == want or (math.isnan(got) and math.isnan(want)), (step, got, want)

  def teardown(self) -> None:
    self.stop.set()
    try:
      self.mgr.close()
    finally:
      self.asker.join(timeout=60)
      shutil.rmtree(self.directory, ignore_errors=True)
    assert not self.asker.is_alive(), "the asking thread did not end within 60 s of close()"
    assert not self.raised, f"the asking thread failed: {self.raised[0]!r}"


def test_a_listing_in_another_thread_keeps_the_record_of_a_step_being_saved(tmp_path):
  """``all_steps()`` in another thread, while ``save()`` has recorded its step but no tier
  holds it yet, forgot the step's record: the keep policy never ranked it again, and
  ``max_to_keep=2`` kept every step."""
  mgr = jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(
      max_to_keep=2, persist_interval_steps=1, on_busy="wait", max_snapshots=2))
  stop = threading.Event()
  raised: list[BaseException] = []

  def ask() -> None:
    try:
      while not stop.is_set():
        mgr.all_steps()
        time.sleep(0)
    except BaseException as e:  # pylint: disable=broad-except  (reported below)
      raised.append(e)

  asker = threading.Thread(target=ask, name="asker")
  asker.start()
  try:
    listed = []
    for step in range(1, 13):
      mgr.save(step, _state(step), metrics={"loss": float(step)})
      listed.append(mgr.all_steps())
    mgr.wait_until_finished()
  finally:
    stop.set()
    asker.join(timeout=60)
    mgr.close()
  assert not asker.is_alive(), "the asking thread did not end within 60 s"
  assert not raised, f"the asking thread failed: {raised[0]!r}"
  assert listed == [[1], [1, 2]] + [[s - 1, s] for s in range(3, 13)]
  assert universal.all_steps(str(tmp_path)) == [11, 12]


TestManagerSteps = pytest.mark.slow(ManagerSteps.TestCase)
TestManagerSteps.settings = hypothesis.settings(
    max_examples=10, stateful_step_count=20, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
