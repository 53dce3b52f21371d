"""Resumed runs, rollbacks and storage that hangs, as a careless user or a hostile
neighbour meets them: a retried save in a resumed run deletes nothing, an older save is
refused, the waits raise on time and all_steps() answers from the ledger while storage
hangs, a new run sees nothing of the previous run's persists, a dropped step stays
dropped, and a refused read at relaunch deletes nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors, universal
from jaxckpt.universal import _layout
from jaxckpt.testing import processes
from jaxckpt.util import _wait

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(step: int, version: int = 0) -> dict:
  return {"w": np.full((8, 4), step + 1000 * version, np.float32), "step": step}


def _options(**kw) -> jc.CheckpointOptions:
  return jc.CheckpointOptions(max_snapshots=4, persist_interval_steps=1, on_busy="wait",
                              handle_sigterm=False, **kw)


def _saved(directory: str, steps) -> None:
  with jc.CheckpointManager(directory, _options()) as m:
    for s in steps:
      assert m.save(s, _state(s))
    m.wait_until_finished()


# -- a restore is a rollback only for the save that follows it -----------------------------------


def test_a_retried_save_in_a_resumed_run_deletes_nothing(tmp_path):
  """The usual resume (restore(None) at start), five good steps, then a save that fails on a
  bad leaf and is retried at the same step: the retry deleted steps 31-35 from every tier
  ("starts a new timeline from step 30 (restored)") and saved 36 beside 30."""
  directory = str(tmp_path / "run")
  _saved(directory, range(28, 31))
  with jc.CheckpointManager(directory, _options()) as m:
    m.restore(None, _state(0))
    assert m.last_restore.step == 30
    for s in range(31, 36):
      assert m.save(s, _state(s))
    m.wait_until_finished()
    with pytest.raises(errors.UnsupportedLeafError):
      m.save(36, {"w": object()})                 # the loop's mistake, fixed and retried
    assert m.save(36, _state(36))
    m.wait_until_finished()
    assert m.all_steps() == list(range(28, 37))
    assert universal.all_steps(directory) == list(range(28, 37))



def test_an_older_save_long_after_a_restore_is_refused_not_a_rollback(tmp_path):
  """guide.md: 'A save of an older step *without* such a restore is refused while storage
  holds newer steps'. A restore at start followed by saves forward is not such a restore:
  save(33) at step 35 (a loop whose counter went back) must be refused naming [34, 35];
  it deleted 31-35 instead."""
  directory = str(tmp_path / "run")
  _saved(directory, (30,))
  with jc.CheckpointManager(directory, _options()) as m:
    m.restore(None, _state(0))
    for s in range(31, 36):
      assert m.save(s, _state(s))
    m.wait_until_finished()
    with pytest.raises(errors.InvalidArgumentError, match=r"save\(step=33\): .*newer steps"):
      m.save(33, _state(33, version=1))
    assert universal.all_steps(directory) == list(range(30, 36))


# -- a wait's timeout holds when storage does not answer -----------------------------------------

@pytest.mark.parametrize("with_agent", [False, True], ids=["in_process", "agent"])
def test_wait_until_finished_raises_on_time_when_storage_hangs(s3_server, with_agent):
  """wait_until_finished(timeout_secs=2) with the S3 server stopped raised after 122 s: naming
  who was late asked storage for the missing parts with the 120 s request timeout. Now the
  question is bounded (_layout.LATE_PROBE_SECS) and the timeout says it was not answered."""
  d = s3_server.url(uuid.uuid4().hex[:12])
  with contextlib.ExitStack() as stack:
    agent = None
    if with_agent:
      root, job = stack.enter_context(processes.agent_sandbox())
      agent = jc.AgentOptions(job_name=job, run_root=root)
    m = stack.enter_context(jc.CheckpointManager(d, _options(agent=agent, timeout_secs=120)))
    with s3_server.paused():
      assert m.save(1, _state(1))
      m.wait_until_snapshotted()
      t0 = time.monotonic()
      with pytest.raises(errors.SnapshotTimeoutError,
                         match=r"steps \[1\] were not persisted to .* within 2 s: step 1: which "
                               r"parts are missing is unknown \((TimeoutError|StorageError): .*"
                               r"5\.0 s"):
        m.wait_until_finished(timeout_secs=2)
      took = time.monotonic() - t0
    assert took < 2 + _layout.LATE_PROBE_SECS + 30, took      # (was 122 s)
    m.wait_until_finished()                          # storage answers again: the step is stored
    assert universal.all_steps(d) == [1]



def test_wait_until_persisted_raises_on_time_when_storage_hangs(s3_server):
  """wait_until_persisted(1, timeout_secs=2) with the S3 server stopped raised after the
  listing's 120 s request timeout (a StorageError), not after 2 s (plus the few seconds
  naming who was late). The wait runs on a thread so that the test ends in 30 s either way."""
  d = s3_server.url(uuid.uuid4().hex[:12])
  with jc.CheckpointManager(d, _options(timeout_secs=120)) as m:
    raised: list[BaseException] = []

    def wait() -> None:
      try:
        m.wait_until_persisted(1, timeout_secs=2)
      except BaseException as e:  # pylint: disable=broad-except  (looked at below)
        raised.append(e)
    with s3_server.paused():
      assert m.save(1, _state(1))
      m.wait_until_snapshotted()
      waiting = threading.Thread(target=wait)
      waiting.start()
      waiting.join(2 + _layout.LATE_PROBE_SECS + 23)
      on_time = not waiting.is_alive()
    waiting.join(300)                     # storage answers again: the listing returns
    assert on_time, "wait_until_persisted(timeout_secs=2) still waited after 30 s"
    assert len(raised) == 1 and isinstance(raised[0], errors.SnapshotTimeoutError), raised
    assert "step 1 was not persisted" in str(raised[0]), raised
    m.wait_until_finished()
    assert universal.all_steps(d) == [1]


def test_all_steps_answers_from_the_ledger_while_storage_hangs(s3_server):
  """all_steps() and latest_step() read the ledger (orbax's answer from memory).
  With the S3 server stopped, a loop's latest_step() blocked for the 120 s request
  timeout and then raised a StorageError, although the manager knows steps 1 and 2."""
  d = s3_server.url(uuid.uuid4().hex[:12])
  with jc.CheckpointManager(d, _options(timeout_secs=120)) as m:
    for s in (1, 2):
      assert m.save(s, _state(s))
    m.wait_until_finished()
    answers: list = []
    with s3_server.paused():
      asking = threading.Thread(target=lambda: answers.append((m.all_steps(), m.latest_step())))
      asking.start()
      asking.join(20)
      on_time = not asking.is_alive()
    asking.join(300)                     # storage answers again
    assert on_time, "all_steps() still waited for storage after 20 s"
    assert answers == [([1, 2], 2)], answers

# -- one run per agent: a new run never sees the previous run's snapshots -------------------------

_RUN1 = """
import os, sys, time
import jaxckpt as jc
from jaxckpt.resume_and_hung_storage_test import _options, _state
root, job, directory, go = sys.argv[1:5]
m = jc.CheckpointManager(directory, _options(agent=jc.AgentOptions(job_name=job, run_root=root),
                                             timeout_secs=120))
print("READY", flush=True)
while not os.path.exists(go):
  time.sleep(0.02)
assert m.save(2, _state(2))
m.wait_until_snapshotted()
print("SAVED", flush=True)
time.sleep(600)
"""


def test_a_new_run_sees_nothing_of_the_previous_run_s_unfinished_persists(s3_server, tmp_path):
  """A sweep script keeps the job name: run 1's trainer (on S3) is killed while its agent
  still persists step 2 (storage stopped answering), and run 2 starts at once in its own
  directory. Run 2 listed [2] and restore() gave run 1's step 2 from the agent (tier host);
  run 2's first snapshot then dropped run 1's step 2 as a rolled back step and fenced its
  persist, so it never reached run 1's storage once storage answered again. Run 2 also
  saves a step 2 of its own while run 1's still persists: each run keeps its own."""
  d1, go = s3_server.url(uuid.uuid4().hex[:12]), str(tmp_path / "go")
  with processes.agent_sandbox() as (root, job):
    agent = jc.AgentOptions(job_name=job, run_root=root)
    with processes.Proc(["-c", _RUN1, root, job, d1, go], cwd=_REPO) as run1, \
        contextlib.ExitStack() as later:
      run1.wait_for("READY", 240)
      with s3_server.paused():
        open(go, "w").close()
        run1.wait_for("SAVED", 120)
        run1.kill()                                  # its agent goes on persisting step 2
        m2 = later.enter_context(jc.CheckpointManager(str(tmp_path / "run2"),
                                                      _options(agent=agent)))
        assert m2.all_steps() == [] and m2.latest_step() is None
        with pytest.raises(errors.StepNotFoundError):
          m2.restore(None, _state(0))
        assert m2.save(1, _state(1, version=2))
        m2.wait_until_snapshotted()
        assert m2.all_steps() == [1]
        assert m2.save(2, _state(2, version=2))      # the step number run 1's persist holds
        m2.wait_until_snapshotted()
        assert m2.all_steps() == [1, 2]
        np.testing.assert_array_equal(m2.restore(2, _state(0))["w"], _state(2, version=2)["w"])
        assert m2.last_restore.tier == "host"
      m2.wait_until_finished()                       # storage answers again
      np.testing.assert_array_equal(m2.restore(2, _state(0))["w"], _state(2, version=2)["w"])
    _wait.until(lambda: universal.all_steps(d1) == [2], timeout_secs=120,
                late=lambda: f"run 1's agent did not store its step 2 on {d1}", max_poll_secs=0.5)
    with jc.CheckpointManager(d1, _options()) as m:
      np.testing.assert_array_equal(m.restore(2, _state(0))["w"], _state(2)["w"])


# -- a step the keep policy dropped never comes back ---------------------------------------------

_KEEP_ONE = """
import os, sys, time
import jaxckpt as jc
from jaxckpt.resume_and_hung_storage_test import _options, _state
root, job, directory, go = sys.argv[1:5]
m = jc.CheckpointManager(directory, _options(agent=jc.AgentOptions(job_name=job, run_root=root),
                                             max_to_keep=1, timeout_secs=120))
print("READY", flush=True)
while not os.path.exists(go):
  time.sleep(0.02)
assert m.save(1, _state(1)) and m.save(2, _state(2))
m.wait_until_snapshotted()
print("SAVED", flush=True)
time.sleep(600)
"""


def test_a_step_dropped_while_its_persist_runs_stays_dropped_through_a_kill(s3_server, tmp_path):
  """max_to_keep=1 with the agent: steps 1 and 2 are saved while storage is slow (stopped),
  so step 1 is dropped while its persist runs; the trainer is killed. Its agent stores both
  once storage answers, and the relaunch listed [1, 2] and restored the dropped step 1."""
  d, go = s3_server.url(uuid.uuid4().hex[:12]), str(tmp_path / "go")
  with processes.agent_sandbox() as (root, job):
    agent = jc.AgentOptions(job_name=job, run_root=root)
    with processes.Proc(["-c", _KEEP_ONE, root, job, d, go], cwd=_REPO) as trainer:
      trainer.wait_for("READY", 240)
      with s3_server.paused():
        open(go, "w").close()
        trainer.wait_for("SAVED", 120)
        trainer.kill()
    # the agent persists oldest first: once step 2 is stored, step 1's persist has ended
    _wait.until(lambda: 2 in universal.all_steps(d), timeout_secs=120,
                late=lambda: f"the agent did not store step 2 on {d}", max_poll_secs=0.5)
    with jc.CheckpointManager(d, _options(agent=agent, max_to_keep=1)) as m:
      assert m.all_steps() == [2]
      with pytest.raises(errors.StepNotFoundError):
        m.restore(1, _state(0))
      m.wait_until_finished()
      assert universal.all_steps(d) == [2]


def test_a_step_the_keep_policy_dropped_is_not_restored_by_name(s3_server):
  """max_to_keep=1, storage slow (stopped): after save(2), all_steps() == [2], yet
  restore(step=1) returned step 1 from host memory; orbax's manager raises for a step it
  does not list."""
  d = s3_server.url(uuid.uuid4().hex[:12])
  with jc.CheckpointManager(d, _options(max_to_keep=1, timeout_secs=120)) as m:
    with s3_server.paused():
      assert m.save(1, _state(1)) and m.save(2, _state(2))
      m.wait_until_snapshotted()
      with pytest.raises(errors.StepNotFoundError, match=r"step=1"):
        m.restore(1, _state(0))
    m.wait_until_finished()
    assert m.all_steps() == [2] == universal.all_steps(d)


def test_the_same_directory_as_a_file_url_resumes_from_the_agent(tmp_path):
  """A relaunch names the run's directory as file:///... (storage reads it as the same
  directory): it found nothing, the agent having freed the run's snapshots as another run's."""
  directory = str(tmp_path / "run")
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(max_snapshots=3, on_busy="wait", persist_interval_steps=100,
                                handle_sigterm=False,
                                agent=jc.AgentOptions(job_name=job, run_root=root))
    with jc.CheckpointManager(directory, opts) as m:
      for s in (4, 5):
        assert m.save(s, _state(s))
      m.wait_until_finished()
    with jc.CheckpointManager("file://" + directory, opts) as m:
      assert m.all_steps() == [4, 5]
      out = m.restore(None, _state(0))
      assert (m.last_restore.step, m.last_restore.tier) == (5, "host")
      np.testing.assert_array_equal(out["w"], _state(5)["w"])


# -- a refused read is never a reason to delete ---------------------------------------------------

def _loss(metrics: dict) -> float:
  return metrics["loss"]


def test_a_refused_metadata_read_at_relaunch_deletes_nothing():
  """best_fn (min loss), max_to_keep=2, keep_checkpoints_without_metrics=False: steps 10 (loss
  1.0, the best) and 20 (loss 5.0) are stored. The relaunch's read of step 10's manifest is
  refused (S3 403, credentials rotating); its next save deleted step 10, intact and the best,
  from storage for good."""
  from tests.support.s3 import SeaweedS3  # pylint: disable=import-outside-toplevel
  from jaxckpt.universal import _layout as lay  # pylint: disable=import-outside-toplevel
  opts = jc.CheckpointOptions(max_to_keep=2, best_fn=_loss, best_mode="min",
                              keep_checkpoints_without_metrics=False, save_interval_steps=10,
                              persist_interval_steps=10, on_busy="wait", handle_sigterm=False)
  with SeaweedS3() as s3:              # of its own: refusing reads turns authentication on
    d = s3.url()
    with jc.CheckpointManager(d, opts) as m:
      for s, loss in ((10, 1.0), (20, 5.0)):
        assert m.save(s, _state(s), metrics={"loss": loss})
      m.wait_until_finished()
    with s3.refusing_reads(f"{d}/{lay.step_dir(10)}"):
      with jc.CheckpointManager(d, opts) as m:
        assert m.save(30, _state(30), metrics={"loss": 3.0})
        m.wait_until_finished()
        assert 10 in m.all_steps()
    assert 10 in universal.all_steps(d)
    with jc.CheckpointManager(d, opts) as m:
      assert m.best_step() == 10
