"""Nothing lost: due persists are kept until written, deletes stick, should_save tells the truth.

Storage slower than the loop is a real SeaweedFS server whose processes are
SIGSTOPped (``SeaweedS3.paused``); both host stores (in-process and agent) run
the same cases with the default options.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import uuid

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import processes

MiB = 1 << 20


@pytest.fixture(params=["in-process", "agent"])
def make_opts(request):
  """CheckpointOptions for one of the two host stores (an agent sandbox for the agent)."""
  with contextlib.ExitStack() as stack:
    agent = None
    if request.param == "agent":
      root, job = stack.enter_context(processes.agent_sandbox())
      agent = jc.AgentOptions(job_name=job, run_root=root)

    def make(**kw):
      return jc.CheckpointOptions(agent=agent, **kw)
    yield make


def _state(step: int) -> dict:
  rng = np.random.default_rng(step)
  mesh = jax.make_mesh((8,), ("x",))
  w = jax.device_put(rng.standard_normal((512, 512), dtype=np.float32),
                     NamedSharding(mesh, P("x")))
  return {"w": w, "b": rng.standard_normal(1000).astype(np.float32), "step": step}


def _target() -> dict:
  mesh = jax.make_mesh((8,), ("x",))
  return {"w": jax.ShapeDtypeStruct((512, 512), np.float32, sharding=NamedSharding(mesh, P("x"))),
          "b": np.zeros(1000, np.float32), "step": 0}


def _check(out: dict, step: int) -> None:
  want = _state(step)
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(want["w"]))
  np.testing.assert_array_equal(out["b"], want["b"])
  assert out["step"] == step


def _allocated(m) -> int:
  """Bytes of host memory the store's slots take: the agent's files in its run root (as
  the filesystem counts them), or the in-process store's buffers."""
  if m.options.agent is not None:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512
               for d, _, files in os.walk(m.options.agent.run_root) for f in files
               if f.startswith("slot"))
  return sum(s.memory.nbytes for s in m._core._store._table.slots if s.memory is not None)


def test_no_due_step_is_lost_and_no_save_skipped_while_storage_stops_answering(s3_server,
                                                                               make_opts):
  """Saves every step, persists every 5th (default max_snapshots=2, on_busy='skip')
  while the S3 server is stopped: the steps held for their persists take slots of
  their own, so the loop goes on snapshotting every step (nothing is skipped, the
  newest two steps stay restorable), and once storage answers again every due step
  is on it, bit-exact."""
  d = s3_server.url(uuid.uuid4().hex[:12])
  opts = make_opts(persist_interval_steps=5, timeout_secs=120)
  with jc.CheckpointManager(d, opts) as m:
    with s3_server.paused():
      for step in range(1, 15):                    # due: 5 and 10, neither can be written
        assert m.save(step, _state(step)), (step, m.stats)
        m.wait_until_snapshotted()
      # the loop ran to its end while storage was stopped: no save waited for it
      assert processes.pid_alive(s3_server.pid)
      assert m.stats.persists_pending == 2 and m.stats.oldest_unpersisted_step == 5
      assert m.stats.persist_lag_steps == 9 and m.stats.skipped_busy == 0
    assert {5, 10, 13, 14} <= set(m.all_steps())   # the newest two kept: a crash loses none
    _check(m.restore(13, _target()), 13)
    assert m.last_restore.tier == "host"
    for step in range(15, 21):
      assert m.save(step, _state(step))
      m.wait_until_snapshotted()
    m.wait_until_finished()                        # orbax's meaning: on storage
    assert jc.universal.all_steps(d) == [5, 10, 15, 20]
  with jc.CheckpointManager(d, jc.CheckpointOptions()) as fresh:
    for step in (5, 10, 15, 20):
      _check(fresh.restore(step, _target()), step)
      assert fresh.last_restore.tier == "storage"


def test_where_host_memory_is_too_small_a_warning_says_so_and_a_due_save_names_it(
    s3_server, make_opts, caplog):
  """Room for the loop's two slots only: steps held for their persists take them, which
  a WARNING says (why, and what to change) and a due save that finds both held names
  (the persists and the memory)."""
  d = s3_server.url(uuid.uuid4().hex[:12])
  nbytes = 512 * 512 * 4 + 1000 * 4
  limit = 2 * nbytes + nbytes // 2
  opts = make_opts(persist_interval_steps=1, max_snapshots=1, timeout_secs=3,
                   host_memory_limit_bytes=limit)
  with jc.CheckpointManager(d, opts) as m:
    with s3_server.paused():
      with caplog.at_level(logging.WARNING):
        assert m.save(1, _state(1)) and m.save(2, _state(2))   # two slots, both held
        m.wait_until_snapshotted()
        assert not caplog.records                # nothing taken from the loop yet
        with pytest.raises(errors.SnapshotTimeoutError,
                           match=r"save\(step=3\) \(due for storage: never skipped\): no slot "
                                 r"of the (in-process store|snapshot agent) freed up within 3 s: "
                                 r"every slot is held: persists of steps \[1, 2\] .*host memory "
                                 r"has room for no snapshot slot beside the loop's 2"):
          m.save(3, _state(3))
      said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and "host memory has room for" in r.getMessage()]
      m_ = re.search(
          r"host memory has room for no snapshot slot beside the loop's 2 \(1\.0 MiB each; "
          rf"host_memory_limit_bytes={limit}[;)].*a crash then loses more than one step; "
          r"raise host_memory_limit_bytes to at least (\d+) ", said[0] if said else "")
      assert len(said) == 1 and m_ and 3 * nbytes <= int(m_.group(1)) < 3 * nbytes + 4096, said
      assert 2 * nbytes <= _allocated(m) <= limit        # the loop's two slots, no more
    m.wait_until_finished()
    assert jc.universal.all_steps(d) == [1, 2]


def test_a_due_save_that_finds_every_slot_held_names_the_persists(s3_server, make_opts):
  """Memory has room: a slot more per held step, up to as many as the loop's (2 + 2
  here), and then no more."""
  d = s3_server.url(uuid.uuid4().hex[:12])
  opts = make_opts(persist_interval_steps=1, max_snapshots=1, timeout_secs=3)
  with jc.CheckpointManager(d, opts) as m:
    with s3_server.paused():
      for step in range(1, 5):
        assert m.save(step, _state(step))
        m.wait_until_snapshotted()
      with pytest.raises(errors.SnapshotTimeoutError,
                         match=r"save\(step=5\) \(due for storage: never skipped\): no slot of "
                               r"the (in-process store|snapshot agent) freed up within 3 s: every "
                               r"slot is held: persists of steps \[1, 2, 3, 4\]"):
        m.save(5, _state(5))
      nbytes = 512 * 512 * 4 + 1000 * 4
      assert 4 * nbytes <= _allocated(m) < 4 * nbytes + 4 * 8192   # 2 + 2 slots, no more
    m.wait_until_finished()
    assert jc.universal.all_steps(d) == [1, 2, 3, 4]


def test_a_step_deleted_while_its_persist_runs_never_comes_back(s3_server, make_opts):
  d = s3_server.url(uuid.uuid4().hex[:12])
  opts = make_opts(persist_interval_steps=1, timeout_secs=120)
  with jc.CheckpointManager(d, opts) as m:
    assert m.save(1, _state(1))
    m.wait_until_finished()
    with s3_server.paused():                       # step 2's persist cannot end
      assert m.save(2, _state(2))
      m.wait_until_snapshotted()
      assert 2 in m._core._store.persist_status().pending
      deleting = threading.Thread(target=m.delete, args=(2,))
      deleting.start()
    deleting.join(120)
    assert not deleting.is_alive()
    assert 2 not in m.all_steps()
    m.wait_until_finished()
    assert jc.universal.all_steps(d) == [1]
    assert m.latest_step() == 1
    _check(m.restore(None, _target()), 1)
  with jc.CheckpointManager(d, jc.CheckpointOptions()) as fresh:
    assert fresh.all_steps() == [1]


def test_delete_right_after_the_snapshot_is_final(tmp_path, make_opts):
  """save(1) due, wait_until_snapshotted(), delete(1) at once: no tier holds it, ever."""
  d = str(tmp_path / "ckpt")
  with jc.CheckpointManager(d, make_opts(persist_interval_steps=1)) as m:
    for step in (1, 2, 3):
      assert m.save(step, _state(step))
      m.wait_until_snapshotted()
      m.delete(step)
    m.wait_until_finished()
    assert m.all_steps() == [] and jc.universal.all_steps(d) == []
    with pytest.raises(errors.StepNotFoundError):
      m.restore(None, _target())
  with pytest.raises(errors.StepNotFoundError):
    with jc.CheckpointManager(d, jc.CheckpointOptions()) as fresh:
      fresh.restore(None, _target())


def test_should_save_agrees_with_save_in_every_mode(tmp_path, make_opts):
  cases = [dict(host_snapshots=False, persist_interval_steps=4),
           dict(persist_interval_steps=3, save_interval_steps=1),
           dict(save_interval_steps=2)]
  for i, kw in enumerate(cases):
    if not kw.get("host_snapshots", True) and make_opts().agent is not None:
      continue
    with jc.CheckpointManager(str(tmp_path / f"c{i}"), make_opts(**kw)) as m:
      for step in range(1, 10):
        predicted = m.should_save(step)
        assert m.save(step, _state(step)) == predicted, (kw, step)
        m.wait_until_finished()      # nothing in the background changes the answer meanwhile
  m = jc.CheckpointManager(str(tmp_path / "closed"), make_opts())
  m.close()
  assert not m.should_save(2)


@pytest.mark.parametrize("kw", [dict(persist_interval_steps=4), dict(max_to_keep=3)])
def test_storage_options_without_a_directory_are_refused_naming_them(kw):
  name, value = next(iter(kw.items()))
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"CheckpointOptions\({name}={value}\) .* no directory"):
    jc.CheckpointManager(None, jc.CheckpointOptions(**kw))


def test_a_loop_with_100ms_steps_and_a_small_state_is_never_skipped(make_opts):
  """The defaults (on_busy='skip', max_snapshots=2): a small state's snapshot takes
  a few ms, so with 100 ms steps no save is skipped, with or without the agent."""
  import time
  with jc.CheckpointManager(None, make_opts()) as m:
    for step in range(1, 31):
      assert m.save(step, _state(step)), m.stats
      time.sleep(0.1)
    m.wait_until_finished()
    assert m.stats.skipped_busy == 0 and m.stats.committed == 30
