"""Whether a request comes from this machine is decided by the connection it came on,
never by a field it sends: over tcp a pin is always leased and
closed by its reader id, and a trainer's requests (hello, reserve, commit, bye, stop...)
are refused, so a peer naming pid 1 (which never dies here) cannot hold a slot or the
job's lease forever; over the local socket a pin is its caller's, whatever lease it asks."""

from __future__ import annotations

import time

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.agent import _requests
from jaxckpt.testing import processes
from jaxckpt.util import _wait

W = np.arange(512, dtype=np.float32).reshape(64, 8)


@pytest.fixture
def agent():
  """A running agent of a one-snapshot job (two slots) holding step 1, and clients of it
  over tcp (as another machine reaches it) and ipc; yields (options, tcp, ipc)."""
  with processes.agent_sandbox("jtq") as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                max_snapshots=1, handle_sigterm=False)
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": W})
      m.wait_until_finished()
    with processes.agent_client(root, job, who="another machine") as tcp, \
        processes.agent_client(root, job, who="this machine", tcp=False) as ipc:
      yield opts, tcp, ipc


@pytest.mark.parametrize("op,args", [
    ("reserve", {"pid": 1, "step": 9, "nbytes": 64}),
    ("hello", {"pid": 1}),
    ("bye", {"pid": 1}),
    ("abort", {"index": 0}),
    ("preallocate", {"nbytes": 64}),
    ("stop", {}),
])
def test_a_trainer_s_request_over_tcp_is_refused_and_changes_nothing(agent, op, args):
  opts, tcp, ipc = agent
  with pytest.raises(errors.PermissionDeniedError, match=f"'{op}' is a trainer's request"):
    tcp.call(_requests.REQUESTS[op](**args))
  st = ipc.call(_requests.Status())[0]
  assert st.lease is None and 1 not in st.trainers, st
  assert all(s["state"] != "writing" for s in st.slots), st.slots
  with jc.CheckpointManager(options=opts) as m:         # the next trainer gets its lease
    for step in range(2, 6):                            # and every save a slot
      assert m.save(step, {"w": W + step}), step
      m.wait_until_finished()
    np.testing.assert_array_equal(m.restore(5)["w"], W + 5)


def test_an_open_over_tcp_is_leased_whatever_pid_it_names(agent):
  _, tcp, ipc = agent
  for pid in (1, ipc.call(_requests.Status())[0].pid):    # pid 1, or the agent's own
    r = tcp.call(_requests.Open(pid=pid, step=1))[0]
    assert r.reader is not None and r.reader < 0, r
    with pytest.raises(errors.InvalidArgumentError, match="names no reader"):
      tcp.call(_requests.Close(pid=pid, step=1, index=r.index))
    tcp.call(_requests.Close(pid=pid, step=1, index=r.index, reader=r.reader))
  assert all(s["readers"] == 0 for s in ipc.call(_requests.Status())[0].slots)


def test_an_open_over_the_local_socket_is_its_caller_s_whatever_lease_it_asks(agent):
  _, _, ipc = agent
  r = ipc.call(_requests.Open(pid=1, step=1, lease_secs=0.5))[0]
  assert r.reader is None, r                    # pinned by this process (the kernel's pid)
  ipc.call(_requests.Close(pid=1, step=1, index=r.index))
  assert all(s["readers"] == 0 for s in ipc.call(_requests.Status())[0].slots)


def test_a_pin_over_tcp_that_asks_no_lease_lapses_within_seconds(agent):
  # The case: a sealed open over tcp without lease_secs, naming pid 1, from a
  # reader that never reads nor closes: the one-snapshot job saves again within seconds.
  opts, tcp, _ = agent
  tcp.call(_requests.Open(pid=1, step=1))
  with jc.CheckpointManager(options=opts) as m:
    assert m.save(2, {"w": W + 2})                   # step 1 dropped, its slot pinned
    m.wait_until_finished()
    t0 = time.monotonic()
    _wait.until(lambda: m.save(3, {"w": W + 3}), timeout_secs=120, poll_secs=0.2,
                late=lambda: "save(3) was still skipped: the stray pin holds its slot")
    m.wait_until_finished()
    took = time.monotonic() - t0
    np.testing.assert_array_equal(m.restore(3)["w"], W + 3)
  assert took < 30, f"the stray pin held the slot {took:.0f} s"
