"""An agent's persists across trainers with other persist options: a relaunched
trainer's options apply to its own saves, and the persists still running from
before stay in the agent's one queue (its status, its fences, its errors)."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt import universal as u
from jaxckpt.agent import _paths, _requests
from jaxckpt.agent.trainer.client import AgentStore
from jaxckpt.host._persist import PendingAttempt, PersistConfig
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, checksum
from jaxckpt.testing import processes
from tests.support.fixtures import run_cli
from jaxckpt.util import _wait

N = 1024
ATTEMPT = "r1-s5-1"


def _piece(host: int, step: int) -> tuple[SnapshotManifest, np.ndarray]:
  """Host ``host``'s half of leaf ['x'] at ``step`` (a job of two processes)."""
  data = np.full(N, step + 10 * host, np.uint8)
  shard = ShardRecord(((host * N, (host + 1) * N),), 0, N, checksum(data))
  leaf = LeafRecord("['x']", "numpy", (2 * N,), "uint8", (shard,))
  return SnapshotManifest(step=step, leaves=(leaf,), nbytes=N, process_index=host,
                          process_count=2), data


@contextlib.contextmanager
def _store(root: str, job: str, persist: dict):
  store = AgentStore(jc.AgentOptions(job_name=job, run_root=root), host=0, max_snapshots=2,
                     limit_bytes=64 << 20, persist=persist)
  try:
    yield store
  finally:
    store.close()


def _persist_step_5_on_host_0(store: AgentStore, directory: str) -> None:
  """Host 0 snapshots step 5 (due) and writes its part; its commit then waits for
  host 1's part, which no agent here writes."""
  manifest, data = _piece(0, 5)
  slot = store.reserve(5, N, timeout_secs=30)
  np.asarray(slot.buffer)[:N] = data
  store.commit(slot, manifest, persist_attempt=ATTEMPT)
  _wait.until(lambda: u.missing_parts(directory, 5, ATTEMPT, of=[0]) == [], timeout_secs=60,
              late=lambda: "host 0's agent did not write its part of step 5")


@contextlib.contextmanager
def _relaunched(sandbox, first: dict, **changes):
  """A trainer with persist options ``first`` persists step 5 on host 0 (its commit then
  waits for host 1) and closes; yields the store of a trainer relaunched with ``changes``."""
  root, job = sandbox
  with _store(root, job, first) as store:
    _persist_step_5_on_host_0(store, first["directory"])
  with _store(root, job, dict(first, **changes)) as store:
    yield store


@pytest.fixture
def sandbox():
  with processes.agent_sandbox("jpc") as (root, job):
    yield root, job


def test_a_relaunch_with_other_persist_options_still_fences_the_running_persist(
    sandbox, tmp_path):
  # The first trainer's persist of step 5 waits for host 1. A relaunched trainer with
  # other options (what a manager with parity asks for) must still see it, and its
  # delete must stop it: host 1's part, written afterwards, never commits the step.
  d = str(tmp_path / "ckpt")
  first = PersistConfig(directory=d, interval_steps=5, timeout_secs=120).to_obj()
  with _relaunched(sandbox, first, timeout_secs=60.0, hold_until_committed=True) as store:
    status = store.persist_status()
    assert status.pending == (5,) and status.attempts == (PendingAttempt(5, ATTEMPT, d),), status
    assert store.discard(5, timeout_secs=60)
    assert store.persist_status().pending == ()
    manifest, data = _piece(1, 5)                       # host 1's part arrives late
    u.write_process_shards(d, manifest, data, attempt=ATTEMPT)
    assert store.persist_status().pending == ()         # nothing is left to commit it
    assert 5 not in u.all_steps(d)
    assert store.persist_errors() == []                 # a fenced persist is no failure


def test_a_persist_from_before_a_relaunch_reports_its_failure_to_the_new_trainer(
    sandbox, tmp_path):
  # The first trainer's persist of step 5 gives up on host 1 after its own 2 s; the
  # relaunched trainer (60 s) hears of it.
  d = str(tmp_path / "ckpt")
  first = PersistConfig(directory=d, interval_steps=5, timeout_secs=2.0).to_obj()
  with _relaunched(sandbox, first, timeout_secs=60.0) as store:
    failed = _wait.until(store.persist_errors, timeout_secs=60,
                         late=lambda: "the persist of step 5 neither failed nor committed")
    assert [(e.step, e.attempt) for e in failed] == [(5, ATTEMPT)], failed
    assert "processes [1] of 2 did not write their part records within 2.0 s" in \
        failed[0].message, failed[0].message
    assert store.persist_status().pending == ()
    assert 5 not in u.all_steps(d)
    with pytest.raises(errors.StepNotFoundError):
      u.open_step(d, 5)


def test_jaxckpt_delete_of_the_earlier_directory_reaches_its_running_persist(
    sandbox, tmp_path, capsys):
  # The relaunched trainer persists to d2; `jaxckpt delete d1 --step 5` must still find
  # and stop the persist of step 5 to d1 (the agent names every directory it writes to).
  root, _ = sandbox
  d1, d2 = str(tmp_path / "d1"), str(tmp_path / "d2")
  first = PersistConfig(directory=d1, interval_steps=5, timeout_secs=120).to_obj()
  with _relaunched(sandbox, first, directory=d2) as store:
    out = run_cli(capsys, "delete", d1, "--step", "5", "--run-root", root)
    assert out.returncode == 0, out.stderr
    assert f"deleted step 5 of {d1}" in out.stdout, out.stdout
    assert store.persist_status().pending == ()
    manifest, data = _piece(1, 5)                       # host 1's part arrives late
    u.write_process_shards(d1, manifest, data, attempt=ATTEMPT)
    assert store.persist_status().pending == ()
    assert 5 not in u.all_steps(d1)


def test_an_agent_stopped_during_an_earlier_runs_persist_still_frees_its_memory(
    sandbox, tmp_path):
  # The earlier run's persist (8 s timeout) outlasts the relaunch's 0.5 s: the agent's
  # stop waits for it, reports it, and still removes its slots and files.
  root, job = sandbox
  d = str(tmp_path / "ckpt")
  first = PersistConfig(directory=d, interval_steps=5, timeout_secs=8.0).to_obj()
  with _relaunched(sandbox, first, timeout_secs=0.5) as store:
    pid = store.pid
    store.call(_requests.Stop())
  processes.wait_gone(pid, 60, "the stopped agent")
  agent_dir = _paths.agent_dir(root, job, 0)
  assert not os.path.exists(agent_dir), os.listdir(agent_dir)
  assert 5 not in u.all_steps(d)
