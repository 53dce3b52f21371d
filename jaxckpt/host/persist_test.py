"""The persistent tier never reports a step it did not write, and its errors reach the caller.

One writer per step (rollback re-saves, a second job, stale parts of an
abandoned attempt, two concurrent writers), and persist failures (a directory
under a file, a read-only or full filesystem, an unreachable object store)
raised through the API, with the in-process writer and with the agent, on a
local directory and on real S3 and GCS servers.
"""

import contextlib
import errno
import os
import subprocess
import sys
import textwrap
import uuid

import jax
import msgspec
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.util import _wait
from jaxckpt.host import _persist
from jaxckpt.testing import processes
from tests.support import fixtures as _fixtures


def _state(value: float) -> dict:
  mesh = jax.make_mesh((8,), ("x",))
  return {"w": jax.device_put(np.full((16, 4), value, np.float32), NamedSharding(mesh, P("x"))),
          "b": np.full(3, value)}


def _stored(d, step):
  return u.restore_arrays(u.open_step(d, step), {"['w']": None, "['b']": None})


@contextlib.contextmanager
def _agent_opts(tmp_path, **kw):
  job = "p" + uuid.uuid4().hex[:8]
  root = str(tmp_path / "run")
  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root), **kw)
  try:
    yield opts
  finally:
    subprocess.run([sys.executable, "-m", "jaxckpt.agent", "stop", "--job-name", job,
                    "--run-root", root], check=False, timeout=60, capture_output=True)


def test_a_rollback_resave_of_a_persisted_step_starts_a_new_timeline_on_storage(storage_dir):
  """After restore(step=2), saving step 4 again is the new timeline's: the old step 4 is
  deleted from storage before anything is captured (it was refused before, so the new
  timeline could never persist its own step 4)."""
  with jc.CheckpointManager(storage_dir, jc.CheckpointOptions(max_snapshots=3)) as mgr:
    for step in (2, 4):
      mgr.save(step, _state(step))
      mgr.wait_until_persisted(step)
    mgr.restore(step=2, target=_state(0))                 # roll back
    assert mgr.save(4, _state(40), force=True)             # the new timeline's step 4
    mgr.wait_until_persisted(4)
    assert mgr.save(6, _state(6))                         # the new timeline goes on
    mgr.wait_until_persisted(6)
  np.testing.assert_array_equal(_stored(storage_dir, 4)["['w']"], np.full((16, 4), 40.0))
  np.testing.assert_array_equal(_stored(storage_dir, 6)["['w']"], np.full((16, 4), 6.0))


def test_a_second_job_never_overwrites_and_learns_it(storage_dir):
  first = jc.CheckpointManager(storage_dir)
  late = jc.CheckpointManager(storage_dir)                # created before step 4 exists
  try:
    first.save(4, _state(1))
    first.wait_until_persisted(4)
    with jc.CheckpointManager(storage_dir) as second:      # sees step 4 at creation
      with pytest.raises(errors.StepExistsError, match="already committed"):
        second.save(4, _state(2))
    assert late.save(4, _state(3))                        # finds out in the background
    with pytest.raises(errors.StepExistsError, match="step 4 is already committed"):
      late.wait_until_persisted(4)
    late.wait_until_finished()                            # the error was handed out once
  finally:
    first.close()
    late.close()
  np.testing.assert_array_equal(_stored(storage_dir, 4)["['w']"], np.full((16, 4), 1.0))
  assert u.all_steps(storage_dir) == [4]


def test_a_stale_part_of_an_abandoned_attempt_is_never_merged(storage_dir):
  old = _fixtures.host_snapshots(3, {"w": np.full(8, 1.0)}, process_count=2)
  new = _fixtures.host_snapshots(3, {"w": np.full(8, 2.0)}, process_count=2)
  u.write_process_shards(storage_dir, *old[1], attempt="abandoned")   # then it died
  u.write_process_shards(storage_dir, *new[0], attempt="retry")
  with pytest.raises(errors.SnapshotTimeoutError, match=r"processes \[1\] of 2"):
    u.commit_step(storage_dir, 3, process_count=2, timeout_secs=0.3, attempt="retry")
  assert u.missing_parts(storage_dir, 3, "retry", 2) == [1]
  u.write_process_shards(storage_dir, *new[1], attempt="retry")
  u.commit_step(storage_dir, 3, process_count=2, timeout_secs=10, attempt="retry")
  np.testing.assert_array_equal(u.open_step(storage_dir, 3).read("w"), np.full(8, 2.0))
  assert u.committed_by(storage_dir, 3) == "retry"
  with pytest.raises(errors.StepExistsError, match="attempt 'retry'"):   # and never again
    u.commit_step(storage_dir, 3, process_count=2, timeout_secs=5, attempt="abandoned")
  with pytest.raises(errors.StepExistsError):
    u.write_process_shards(storage_dir, *old[0], attempt="retry")


def test_a_process_other_than_0_waits_for_the_commit_and_names_what_is_missing(storage_dir):
  # With parity, process 1's persist ends only once process 0 commits the step (until then
  # it holds its snapshot and parity); a commit that never comes is named with the parts
  # still missing, one by another attempt is refused as StepExistsError, and an attempt
  # process 0 gave up on (it removed the attempt's data) ends the wait at once.
  parts = _fixtures.host_snapshots(3, {"w": np.arange(8.0)}, process_count=2)
  u.write_process_shards(storage_dir, *parts[1], attempt="a")
  with pytest.raises(errors.SnapshotTimeoutError,
                     match=r"step 3 \(attempt 'a'\): it was not committed .* within 0.2 s of "
                           r"process 1's part; the parts of processes \[0\] are missing"):
    u.wait_committed(storage_dir, 3, "a", 1, 2, timeout_secs=0.2)
  with pytest.raises(KeyError):               # a fence ends the wait at once
    u.wait_committed(storage_dir, 3, "a", 1, 2, timeout_secs=30, check=lambda: {}["fenced"])
  u.write_process_shards(storage_dir, *parts[0], attempt="a")
  u.commit_step(storage_dir, 3, process_count=2, timeout_secs=10, attempt="a")
  u.wait_committed(storage_dir, 3, "a", 1, 2, timeout_secs=0.2)
  with pytest.raises(errors.StepExistsError, match="attempt 'a'"):
    u.wait_committed(storage_dir, 3, "b", 1, 2, timeout_secs=5)
  parts4 = _fixtures.host_snapshots(4, {"w": np.arange(8.0)}, process_count=2)
  u.write_process_shards(storage_dir, *parts4[1], attempt="c")
  u.discard_attempt(storage_dir, 4, "c")      # process 0 gave up on step 4's attempt "c"
  with pytest.raises(errors.StorageError, match="process 0 gave up on persist attempt 'c'") as e:
    u.wait_committed(storage_dir, 4, "c", 1, 2, timeout_secs=30)
  assert e.value.errno == errno.ECANCELED     # not worth writing again


def test_a_peer_fenced_while_it_waits_for_the_commit_removes_nothing(storage_dir):
  # Process 1 wrote its part and waits for process 0's commit; a delete fences it there.
  # The attempt's data is process 0's to remove (it may be committing right now): the
  # fenced peer leaves it, and process 0's commit makes the step whole and exact.
  parts = _fixtures.host_snapshots(3, {"w": np.arange(16.0)}, process_count=2)
  config = _persist.PersistConfig(storage_dir, 3, timeout_secs=60.0, hold_until_committed=True)
  released = []
  peer = _persist.Persister(config, lambda step, attempt: contextlib.nullcontext(parts[1]),
                            lambda step, attempt: released.append(step), storage=lambda: u)
  try:
    peer.submit(3, "a")
    _wait.until(lambda: u.missing_parts(storage_dir, 3, "a", of=[1]) == [], timeout_secs=60,
                late=lambda: "process 1 did not write its part")
    assert peer.busy(3)                       # written, and waiting for the commit
    u.write_process_shards(storage_dir, *parts[0], attempt="a")
    peer.fence(3)
    assert peer.wait_idle(60, step=3) and peer.take_errors() == [] and peer.cancelled == 1
    assert u.missing_parts(storage_dir, 3, "a", 2) == []        # nothing removed
    u.commit_step(storage_dir, 3, process_count=2, timeout_secs=10, attempt="a")
    np.testing.assert_array_equal(u.open_step(storage_dir, 3).read("w"), np.arange(16.0))
  finally:
    peer.close(10)


WRITER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxckpt as jc
    from jaxckpt import errors
    d, value = sys.argv[1], float(sys.argv[2])
    mesh = jax.make_mesh((8,), ("x",))
    state = {"w": jax.device_put(np.full((256, 256), value, np.float32),
                                 NamedSharding(mesh, P("x"))),
             "b": np.full(3, value)}
    with jc.CheckpointManager(d) as mgr:
      print("ready", flush=True)
      sys.stdin.readline()                       # both start together
      mgr.save(7, state)
      try:
        mgr.wait_until_persisted(7)
        print("won", flush=True)
      except errors.StepExistsError as e:
        print("lost", e, flush=True)
""")


@pytest.mark.slow
def test_two_concurrent_writers_of_one_step_one_wins_whole_the_other_learns_it(storage_dir):
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  procs = [subprocess.Popen([sys.executable, "-c", WRITER, storage_dir, str(v)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
           for v in (1.0, 2.0)]
  try:
    for p in procs:
      assert p.stdout.readline().strip() == "ready"
    for p in procs:
      p.stdin.write("go\n")
      p.stdin.flush()
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
  assert all(p.returncode == 0 for p in procs), outs
  verdicts = sorted(o.strip().split()[0] for o in outs)
  assert verdicts == ["lost", "won"], outs
  winner = 1.0 if outs[0].startswith("won") else 2.0
  got = _stored(storage_dir, 7)
  np.testing.assert_array_equal(got["['w']"], np.full((256, 256), winner, np.float32))
  np.testing.assert_array_equal(got["['b']"], np.full(3, winner))    # no mix of the two
  assert u.all_steps(storage_dir) == [7]


def test_a_directory_that_cannot_be_written_fails_at_creation(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(errors.StorageError, match=r"cannot be written .*Not a directory") as e:
    jc.CheckpointManager(str(f / "ckpt"))
  assert isinstance(e.value, OSError) and str(f / "ckpt") in str(e.value)
  with pytest.raises(errors.InvalidArgumentError, match="directory='' is empty"):
    jc.CheckpointManager("")


def test_a_read_only_filesystem_fails_at_creation(tmp_path):
  with processes.tmpfs(tmp_path / "ro", "ro,size=1m") as d:
    with pytest.raises(errors.StorageError, match=r"Read-only file system"):
      jc.CheckpointManager(d)


@pytest.mark.parametrize("agent", [False, True])
def test_a_full_disk_is_raised_by_wait_and_close_naming_the_path(tmp_path, agent):
  big = {"w": jax.device_put(np.ones((512, 1024), np.float32),   # 2 MiB > the 1 MiB disk
                             NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))}
  with processes.tmpfs(tmp_path / "small", "size=1m") as d, \
      (_agent_opts(tmp_path) if agent else contextlib.nullcontext(jc.CheckpointOptions())) as o:
    mgr = jc.CheckpointManager(d, o)
    try:
      assert mgr.save(1, big)
      with pytest.raises(errors.StorageError, match=r"No space left on device") as e:
        mgr.wait_until_persisted(1)
      assert "persisting step 1" in str(e.value) and d in str(e.value)
      assert ("snapshot agent" in str(e.value)) == agent
      assert mgr.save(2, big)
    finally:
      with pytest.raises(errors.StorageError, match="No space left on device"):
        mgr.close()                                        # step 2's failure, at close
    assert u.all_steps(d) == []


def test_an_unreachable_object_store_fails_within_the_timeout(monkeypatch):
  monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")   # nothing listens on port 9
  monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
  monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
  with pytest.raises(errors.StorageError, match=r"s3://nobody/ckpt"):
    jc.CheckpointManager("s3://nobody/ckpt", jc.CheckpointOptions(timeout_secs=20))


def test_gc_keeps_the_newest_and_a_restore_onto_another_mesh_is_exact(storage_dir):
  with jc.CheckpointManager(storage_dir, jc.CheckpointOptions(max_to_keep=2)) as mgr:
    for step in (1, 2, 3, 4):
      mgr.save(step, _state(step))
      mgr.wait_until_persisted(step)
  assert u.all_steps(storage_dir) == [3, 4]
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  target = {"w": jax.ShapeDtypeStruct((16, 4), np.float32,
                                      sharding=NamedSharding(mesh, P("b", "a"))),
            "b": np.zeros(3, np.int64)}
  with jc.CheckpointManager(storage_dir) as mgr:
    out = mgr.restore(step=4, target=target)
    assert mgr.last_restore.tier == "storage"
  np.testing.assert_array_equal(np.asarray(out["w"]), np.full((16, 4), 4.0, np.float32))
  np.testing.assert_array_equal(out["b"], np.full(3, 4))
  assert u.verify_step(u.open_step(storage_dir, 3)) == []


def test_an_earlier_runs_failed_persist_is_logged_not_raised_to_the_next_run(tmp_path, caplog):
  # The agent outlives its trainer: the persist of step 5 by run A fails after A stopped
  # asking. Run B (a relaunch on the same agent) never saved step 5: its restore and its
  # own saves go on, and A's failure is logged, naming the step and the earlier run.
  d = str(tmp_path / "ckpt")
  with _agent_opts(tmp_path, persist_interval_steps=5, timeout_secs=5.0) as opts:
    a = jc.CheckpointManager(d, opts)
    try:
      assert a.save(5, _state(5.0))
      a.wait_until_snapshotted()
      os.rename(d, d + ".away")                      # its writes now fail: not a directory
      with open(d, "w") as f:
        f.write("x")
      _wait.until(lambda: not a._core._store.persist_status().pending,   # pylint: disable=protected-access
                  timeout_secs=60, late=lambda: "run A's persist of step 5 did not end")
      os.unlink(d)
      os.rename(d + ".away", d)
      a._core._store.close()        # pylint: disable=protected-access  (run A's trainer is gone: its
      with jc.CheckpointManager(d, opts) as b:   # lease passes on; one manager per job and host)
        np.testing.assert_array_equal(b.restore(5)["w"], np.full((16, 4), 5.0, np.float32))
        assert b.save(10, _state(10.0))
        b.wait_until_finished()
        assert u.all_steps(d) == [10]
      assert any("by an earlier run" in r.getMessage() and "step 5" in r.getMessage()
                 for r in caplog.records)
    finally:
      with contextlib.suppress(errors.JaxckptError):
        a.close()


def test_a_persist_status_names_each_attempts_directory_and_reads_an_older_agents():
  st = _persist.PersistStatus((5,), 1.5, (4,), (_persist.PendingAttempt(5, "r1-s5-1", "s3://b/run"),))
  wire = msgspec.msgpack.decode(msgspec.msgpack.encode(st))    # as a reply's field travels
  assert wire["attempts"] == [[5, "r1-s5-1", "s3://b/run"]]
  assert msgspec.convert(wire, _persist.PersistStatus) == st
  # An agent of an older jaxckpt (still holding a job's snapshots) sends (step, attempt):
  # its directory is unknown, which recover_persists reads as the asking trainer's own.
  old = msgspec.convert({"pending": [5], "attempts": [[5, "r1-s5-1"]]}, _persist.PersistStatus)
  assert old.attempts == (_persist.PendingAttempt(5, "r1-s5-1", ""),)


class _CountingStorage:
  """The universal format, as a persister is handed it, counting the calls it gets."""

  def __init__(self):
    self.calls = []

  def __getattr__(self, name):
    fn = getattr(u, name)

    def call(*args, **kw):
      self.calls.append(name)
      return fn(*args, **kw)
    return call


def test_a_persister_writes_through_the_storage_handed_in_and_loads_it_only_to_persist(tmp_path):
  # The host tier imports nothing above it: its writer is handed in, and loaded only
  # when a persist runs (an agent that never persists never imports JAX for it).
  d = str(tmp_path / "ckpt")
  storage, loads = _CountingStorage(), []
  w = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  part = _fixtures.host_snapshots(7, {"w": w})[0]
  persister = _persist.Persister(_persist.PersistConfig(d, 1, max_to_keep=1),
                                 lambda step, attempt: contextlib.nullcontext(part),
                                 storage=lambda: loads.append(1) or storage)
  try:
    assert loads == []
    persister.submit(7, "r1-s7-0")
    assert persister.wait_idle(60) and persister.take_errors() == []
    assert loads and storage.calls == ["write_process_shards", "commit_step", "gc_steps"]
    assert u.committed_by(d, 7) == "r1-s7-0"
    stored = u.open_step(d, 7).read("w")
    assert stored.dtype == w.dtype and stored.tobytes() == w.tobytes()
  finally:
    persister.close(10)


def test_an_in_process_store_made_without_storage_refuses_to_persist_and_says_how(tmp_path):
  from jaxckpt.host.store import InProcessStore  # pylint: disable=import-outside-toplevel
  d = str(tmp_path / "ckpt")
  bare = InProcessStore(max_snapshots=1, host_memory_limit_bytes=1 << 20)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"made without storage, so it cannot persist to '.*ckpt': make it with "
                           r"InProcessStore\(\.\.\., storage=jaxckpt\.universal\)"):
    bare.persist_to(_persist.PersistConfig(d, 1))
  bare.close()
  opts = jc.CheckpointOptions(max_snapshots=1, timeout_secs=60)
  store = InProcessStore(max_snapshots=1, host_memory_limit_bytes=1 << 26, storage=u)
  with jc.CheckpointManager(d, opts, store=store) as mgr:
    mgr.save(3, {"w": np.arange(6.0)})
    mgr.wait_until_finished()
  np.testing.assert_array_equal(u.open_step(d, 3).read("['w']"), np.arange(6.0))
