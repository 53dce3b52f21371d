"""Runs of one job through one agent: an earlier run's steps still being persisted reach its
own storage, whatever the later runs save, and a run that comes back takes them back."""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from jaxckpt import universal
from jaxckpt.agent import _protocol, _requests
from jaxckpt.agent.server import _server
from jaxckpt.host import _persist
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, checksum
from jaxckpt.net import _wire

_SECRET = b"k" * 32


class _Job:
  """An in-process agent whose storage answers only once ``go`` is set, and its requests."""

  def __init__(self, tmp) -> None:
    d = os.path.join(tmp, "j", "host0")
    os.makedirs(d)
    self.agent = _server.Agent(job="j", host=0, directory=d, max_snapshots=2,
                               limit_bytes=1 << 24, idle_timeout_secs=60.0, secret=_SECRET)
    self.go = threading.Event()
    self.dirs = {r: os.path.join(tmp, r) for r in "ABC"}

    def opened(step, attempt=None):     # a persist reads its step once storage answers
      assert self.go.wait(60), "storage was never released"
      return self.agent.durable.pinned(step, attempt)
    self.agent.durable.persister = _persist.Persister(
        _persist.PersistConfig(self.dirs["A"], 1), opened, self.agent.durable.release_held,
        storage=lambda: universal)

  def ask(self, req):
    reply = _wire.unpack(_server.handle(self.agent, _protocol.request(_SECRET, req, 10.0))[0])
    assert reply["ok"], reply
    return _requests.decode_reply(type(req), reply, "agent", "in-process")

  def hello(self, run: str) -> None:
    self.ask(_requests.Hello(pid=os.getpid(), run=self.dirs[run], persist=_requests.PersistOptions(
        directory=self.dirs[run], interval_steps=1)))

  def save(self, step: int, value: float, attempt: str | None = None) -> None:
    slot = self.ask(_requests.Reserve(pid=os.getpid(), step=step, nbytes=64))
    data = np.full(16, value, np.float32)
    with open(slot.path, "r+b") as f:
      f.truncate(slot.size)
      f.write(data.tobytes())
    leaf = LeafRecord(path="w", kind="numpy", shape=(16,), dtype="float32",
                      shards=(ShardRecord(((0, 16),), 0, 64, checksum(data.tobytes())),))
    manifest = SnapshotManifest(step=step, leaves=(leaf,), nbytes=64)
    self.ask(_requests.Commit(index=slot.index, manifest=manifest.to_json(), step=step, nbytes=64,
                              process=[0, 1], persist_attempt=attempt))

  def stored(self, run: str, step: int) -> np.ndarray:
    self.go.set()
    assert self.agent.persister.wait_idle(60)
    assert universal.all_steps(self.dirs[run]) == [step]
    return np.asarray(universal.open_step(self.dirs[run], step).read("w"))


@contextlib.contextmanager
def _job(tmp_path):
  job = _Job(str(tmp_path))
  try:
    yield job
  finally:
    job.go.set()
    job.agent.cleanup()


def test_a_third_run_leaves_the_first_runs_persist_its_own_bytes(tmp_path):
  # A's step 10 is being persisted when B starts; B saves a step 10 of its own; then C starts.
  # A's step 10 took B's manifest at C's start, and its persist failed on the checksums.
  with _job(tmp_path) as job:
    job.hello("A")
    job.save(10, 1.0, "rA-s10-0")
    job.hello("B")
    job.save(10, 2.0)
    assert job.ask(_requests.Steps()).steps == [10]              # B's own
    job.hello("C")
    assert job.ask(_requests.Steps()).steps == []
    np.testing.assert_array_equal(job.stored("A", 10), np.full(16, 1.0, np.float32))
    assert job.agent.persister.take_errors() == [] and job.agent.table.foreign_steps() == []


def test_a_run_that_comes_back_takes_back_its_steps_still_being_persisted(tmp_path):
  # A, then B, then A again: A's step 10 (still being persisted) is A's own again, listed,
  # and a save of step 10 in the resumed A is a rollback that fences the old persist (the
  # old timeline's bytes won on A's storage, and the new persist failed: step exists).
  with _job(tmp_path) as job:
    job.hello("A")
    job.save(10, 1.0, "rA1-s10-0")
    job.hello("B")
    assert job.ask(_requests.Steps()).steps == []
    job.hello("A")
    assert job.ask(_requests.Steps()).steps == [10]
    job.save(10, 3.0, "rA2-s10-0")
    np.testing.assert_array_equal(job.stored("A", 10), np.full(16, 3.0, np.float32))
    assert job.agent.persister.take_errors() == []
