"""A remote reader's pin ends with its lease, renewed by its reads; its pid, which
means nothing on the agent's machine, is never looked up."""

from __future__ import annotations

import time

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt.util import _wait
from jaxckpt.agent import _requests
from jaxckpt.testing import processes

W = np.arange(512, dtype=np.float32).reshape(64, 8)


@pytest.fixture
def one_slot():
  """A manager keeping one snapshot (two slots) on a running agent; yields it and
  clients of its agent over tcp (as another machine reaches it) and ipc."""
  with processes.agent_sandbox("jp") as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                max_snapshots=1, handle_sigterm=False)
    with jc.CheckpointManager(options=opts) as mgr:
      assert mgr.save(1, {"w": W})
      mgr.wait_until_finished()
      with processes.agent_client(root, job, who="a remote reader") as tcp, \
          processes.agent_client(root, job, who="a local reader", tcp=False) as ipc:
        yield mgr, tcp, ipc


def _saves_again(mgr, step: int, timeout_secs: float = 60) -> None:
  _wait.until(lambda: mgr.save(step, {"w": W + step}), timeout_secs=timeout_secs,
              poll_secs=0.1, late=lambda: f"save({step}) was still skipped: the slot stays pinned")
  mgr.wait_until_finished()


def test_a_dead_remote_readers_pin_ends_with_its_lease_though_its_pid_lives_here(one_slot):
  mgr, tcp, _ = one_slot
  r = tcp.call(_requests.Open(pid=1, step=1, lease_secs=1.0))[0]   # pid 1 always runs here
  assert r.reader is not None and r.reader < 0              # its own id, not the pid
  assert mgr.save(2, {"w": W + 2})                           # step 1 dropped, its slot pinned
  mgr.wait_until_finished()
  assert not mgr.save(3, {"w": W + 3})                       # no slot: skipped while pinned
  _saves_again(mgr, 3)                                       # the reader never came back
  out = mgr.restore(target={"w": np.zeros_like(W)})
  assert mgr.last_restore.step == 3
  np.testing.assert_array_equal(out["w"], W + 3)


def _readers(ipc, step: int) -> int:
  slots = ipc.call(_requests.Status())[0].slots
  return sum(s["readers"] for s in slots if s["step"] == step)


def test_reads_renew_the_lease_and_close_ends_it(one_slot):
  _, tcp, ipc = one_slot
  tcp.call(_requests.Open(pid=1, step=1, lease_secs=2.0))          # (a loaded CI machine pauses)
  until = time.monotonic() + 5.0                             # 2.5 leases of reading
  while time.monotonic() < until:
    data, = tcp.read("snapshot", 1, [(0, 64)])
    np.testing.assert_array_equal(data.view(np.float32), W.reshape(-1)[:16])
    # the lease's pin, once the read's own pin is gone (the agent drops it after its
    # last byte is sent, which may be after this process got it): never none
    assert _readers(ipc, 1) >= 1
    _wait.until(lambda: _readers(ipc, 1) == 1, timeout_secs=30, late=lambda: (
        f"{_readers(ipc, 1)} pins of step 1, not the lease's alone"))
    time.sleep(0.2)
  _wait.until(lambda: _readers(ipc, 1) == 0, timeout_secs=30,
              late=lambda: "the pin outlived its lease once the reads stopped")
  r = tcp.call(_requests.Open(pid=1, step=1, lease_secs=600.0))[0]
  assert _readers(ipc, 1) == 1
  tcp.call(_requests.Close(pid=1, step=1, index=r.index, reader=r.reader))
  assert _readers(ipc, 1) == 0


def test_a_pin_over_tcp_is_leased_even_unasked_and_a_local_one_is_not(one_slot):
  _, tcp, ipc = one_slot
  remote = tcp.call(_requests.Open(pid=1, step=1))[0]
  local = ipc.call(_requests.Open(pid=1, step=1))[0]
  assert remote.reader is not None and local.reader is None
  tcp.call(_requests.Close(pid=1, step=1, index=remote.index, reader=remote.reader))
  ipc.call(_requests.Close(pid=1, step=1, index=local.index))
