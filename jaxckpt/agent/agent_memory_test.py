"""The snapshot agent under a careless user and a hostile peer."""

from __future__ import annotations

import contextlib
import os
import resource
import signal

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.agent.trainer.client import wait_exited
from jaxckpt.testing import processes


@pytest.fixture
def sandbox():
  with processes.agent_sandbox() as (root, job):
    yield root, job


@pytest.mark.timeout(180)
def test_an_agent_killed_during_a_snapshot_is_named_at_once_not_after_the_request_timeout(
    sandbox):
  # The trainer's commit waited the whole request_timeout_secs (60 s by default) for the
  # reply of an agent whose pid had gone; a due save waits on that copy meanwhile.
  root, job = sandbox
  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
  s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  big = jax.device_put(np.ones((64 << 20) // 4, np.float32), s)
  with jc.CheckpointManager(options=opts) as m:
    m.prepare({"w": big})
    pid = m._core._store.pid    # pylint: disable=protected-access  (the agent to kill)
    assert m.save(1, {"w": big})
    os.kill(pid, signal.SIGKILL)          # while step 1 is copied into its slot
    with pytest.raises(errors.AgentUnavailableError, match=rf"pid {pid}.*exited"):
      m.wait_until_snapshotted(timeout_secs=30)
    assert m.save(2, {"w": big})          # a new agent takes the next save
    m.wait_until_finished()
    assert m.all_steps() == [2] and m.stats.agent_restarts == 1


def _free_mib(path):
  st = os.statvfs(path)
  return st.f_bavail * st.f_frsize / 2**20


@contextlib.contextmanager
def _three_steps_on_a_small_run_root(tmp_path, job: str):
  """A manager whose agent's run root is a 72 MiB tmpfs (room for 3 slots of a 20 MiB
  state) holding steps 1-3; yields (manager, the tmpfs, state(v), its restore target).
  The agent is killed at the end."""
  with processes.tmpfs(str(tmp_path / "shm"), "size=72m,mode=0700") as shm:
    root = os.path.join(shm, "run")
    opts = jc.CheckpointOptions(max_snapshots=2, agent=jc.AgentOptions(job_name=job,
                                                                        run_root=root))
    s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    n = (20 << 20) // 4
    state = lambda v: {"w": jax.device_put(np.full(n, v, np.float32), s)}
    target = {"w": jax.ShapeDtypeStruct((n,), np.float32, sharding=s)}
    try:
      with jc.CheckpointManager(options=opts) as m:
        for step in (1, 2, 3):
          assert m.save(step, state(step))
          m.wait_until_finished()
        yield m, shm, state, target
    finally:
      for pid in processes.agent_pids(root):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_a_lent_slot_gives_its_memory_back_once_the_restored_arrays_are_gone(tmp_path):
  # A restore lends a slot (its arrays view the agent's memory); that slot's next save
  # gets a new file. The trainer's map of the old file must not keep its memory once the
  # restored arrays are gone: on a run root with room for 3 slots, it did, and every
  # save into that slot failed in the background (HostMemoryBudgetError), for good.
  with _three_steps_on_a_small_run_root(tmp_path, "lend") as (m, shm, state, target):
    out = m.restore(target=target)
    assert m.last_restore.step == 3 and float(np.asarray(out["w"])[0]) == 3.0
    del out
    for step in range(4, 9):                  # every slot is written again
      assert m.save(step, state(step))
      m.wait_until_finished()
    assert m.all_steps() == [7, 8]
    assert _free_mib(shm) > 8                 # 3 slots of 20 MiB, nothing else


@pytest.mark.timeout(180)
def test_a_save_that_cannot_have_its_slots_memory_is_refused_by_save_itself(tmp_path):
  # While restored arrays keep a lent slot's memory, the run root has no room for a new
  # file of that slot. The agent counted the new file's size as memory it holds (it is
  # sparse: the trainer allocates it in the background copy), so save() said True and
  # the snapshot failed later, at the next save.
  with _three_steps_on_a_small_run_root(tmp_path, "tight") as (m, shm, state, target):
    out = m.restore(target=target)
    for step in (4, 5):                     # the slots not lent
      assert m.save(step, state(step))
      m.wait_until_finished()
    with pytest.raises(errors.HostMemoryBudgetError, match=r"does not fit in .*restored"):
      m.save(6, state(6))                   # the lent slot's turn: no room for its file
    m.wait_until_finished()
    assert m.all_steps() == [4, 5]
    assert float(np.asarray(out["w"])[0]) == 3.0
    del out                                 # the lent memory goes back
    assert m.save(7, state(7))
    m.wait_until_finished()
    assert m.all_steps() == [5, 7]


def test_a_second_restore_of_a_step_reads_the_memory_the_first_one_lent():
  # A restore lends its slot (the restored arrays view the agent's memory). A fresh map
  # of that file pays a page fault per 64 KiB (~4 s/GiB on this machine's VM); the
  # second restore of the step reads through the map the first one kept: no faults.
  nbytes = 128 << 20
  s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  values = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
  state = {"w": jax.device_put(values, s)}
  target = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=s)}
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, state)
      m.wait_until_finished()
      faults = []
      for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = m.restore(step=1, target=target)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        assert m.last_restore.tier == "host"
        np.testing.assert_array_equal(np.asarray(out["w"]), values)
        del out
      assert max(faults[1:]) < nbytes // (64 << 10) // 4, faults
      assert m.save(2, state)                 # a reservation lets the lent map go
      m.wait_until_finished()
      assert not m._core._store.maps.lent


def test_prepare_maps_every_slot_for_writing_so_no_save_faults_a_page():
  # prepare() allocates the agent's slots and maps their pages for writing. It asked the
  # kernel through an attribute numpy's view does not have, fell back to assigning each
  # page to itself (which numpy skips), and each slot's first save took a page fault per
  # 4 KiB: 0.25 s of a 512 MiB snapshot's 0.33 s on this machine.
  nbytes = 64 << 20
  s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  state = lambda v: {"w": jax.device_put(np.full(nbytes // 4, v, np.float32), s)}
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(max_snapshots=2, agent=jc.AgentOptions(job_name=job,
                                                                        run_root=root))
    with jc.CheckpointManager(options=opts) as m:
      m.prepare(state(0))
      faults = []
      for step in (1, 2, 3):                    # one save into each of the 3 slots
        x = jax.block_until_ready(state(step))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        assert m.save(step, x)
        m.wait_until_finished()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
      assert max(faults) < nbytes // 4096 // 8, faults


@pytest.mark.timeout(120)
def test_an_agent_that_dies_before_answering_a_posted_unpin_is_replaced_by_the_next_save():
  # A restore posts its unpin and does not wait for the reply. The agent died before it
  # answered: the next save's liveness check closed the old connection, which raised the
  # posted unpin's "exited before it answered 'close'" instead of starting a new agent,
  # and so did the manager's close() (the dead agent's pins went with it: nothing to say).
  W = np.arange(512, dtype=np.float32).reshape(64, 8)
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                handle_sigterm=False)
    for then in ("save", "close"):
      m = jc.CheckpointManager(options=opts)
      try:
        assert m.save(1, {"w": W})
        m.wait_until_finished()
        store = m._core._store      # pylint: disable=protected-access  (its agent, to stop mid-unpin)
        pid = store.pid
        with store.read(1):
          os.kill(pid, signal.SIGSTOP)      # the unpin is posted to an agent that never answers
        os.kill(pid, signal.SIGKILL)
        assert wait_exited(pid, 30)
        if then == "save":
          assert m.save(2, {"w": W + 1})
          m.wait_until_finished()
          assert m.all_steps() == [2] and m.stats.agent_restarts == 1
      finally:
        m.close()
