"""Every value of a sealed request is range-checked before it changes anything, and
a relaunch that asks for fewer snapshots gets them.

The requests here are sealed with the job's secret and sent by hand, past the
client's own checks: a job member holding the secret must not be able to break
the agent by mistake either.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import msgspec
import numpy as np
import pytest
import zmq

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.agent import _paths, _protocol, _requests
from jaxckpt.net import _wire
from jaxckpt.testing import processes

W = np.arange(512, dtype=np.float32).reshape(64, 8)


@pytest.fixture
def held():
  """A running agent holding step 1; yields (opts, root, job, address record)."""
  with processes.agent_sandbox("jr") as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                handle_sigterm=False)
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": W})
      m.wait_until_finished()
    yield opts, root, job, processes.agent_address(root, job)


def _sealed(endpoint: str, secret: bytes, header: dict) -> dict:
  """One request sealed with the secret and sent by hand; its reply header."""
  sock = zmq.Context.instance().socket(zmq.REQ)
  sock.setsockopt(zmq.LINGER, 0)
  sock.connect(endpoint)
  try:
    sock.send_multipart(_wire.seal(secret, header, timeout_secs=20))
    assert sock.poll(20000), "the agent did not answer"
    return msgspec.msgpack.decode(sock.recv_multipart()[0])
  finally:
    sock.close()


PID = os.getpid()
OUT_OF_RANGE = [
    ({"op": "hello", "pid": PID, "limit_bytes": -1},
     r"field limit_bytes=-1 is refused: Expected `int` >= 1;"),
    ({"op": "hello", "pid": PID, "limit_bytes": 0},
     r"field limit_bytes=0 is refused: Expected `int` >= 1;"),
    ({"op": "hello", "pid": PID, "max_snapshots": 200000},
     r"field max_snapshots=200000 is refused: Expected `int` <= 1024;"),
    ({"op": "hello", "pid": PID, "max_snapshots": 0},
     r"field max_snapshots=0 is refused: Expected `int` >= 1;"),
    ({"op": "hello", "pid": -7}, r"field pid=-7 is refused: Expected `int` >= 1;"),
    ({"op": "hello", "pid": PID, "persist": {"directory": "/tmp/x", "interval_steps": 0}},
     r"field persist.interval_steps=0 is refused: Expected `int` >= 1;"),
    ({"op": "hello", "pid": PID, "persist": {"directory": "/tmp/x", "interval_steps": 1,
                                            "timeout_secs": float("nan")}},
     r"field persist.timeout_secs=nan is refused: Expected `float` >= 1e-06;"),
    ({"op": "hello", "pid": PID, "parity": {"group_size": 1, "parity": 1}},
     r"field parity.group_size=1 is refused: Expected `int` >= 2;"),
    ({"op": "hello", "pid": PID, "parity": {"group_size": 4, "parity": 4}},
     r"field parity=.* is refused: parity=4 must be in \[1, group_size - 1\]"),
    ({"op": "reserve", "pid": PID, "step": 2, "nbytes": -5},
     r"request 'reserve': field nbytes=-5 is refused: Expected `int` >= 0;"),
    ({"op": "reserve", "pid": PID, "step": -1, "nbytes": 8},
     r"request 'reserve': field step=-1 is refused: Expected `int` >= 0;"),
    ({"op": "preallocate", "nbytes": -64}, r"field nbytes=-64 is refused: Expected `int` >= 0;"),
    ({"op": "commit", "index": 0, "manifest": "{}", "step": 2, "nbytes": 8,
      "process": [3, 2]},
     r"request 'commit': process=\[3, 2\] must be \[index, count\], index < count"),
    ({"op": "commit", "index": 0, "manifest": "{}", "step": 2, "nbytes": 8,
      "process": [0, 1], "persist_attempt": "../../etc"},
     r"field persist_attempt='../../etc' is refused: Expected `str` matching regex"),
    ({"op": "discard", "step": -3},
     r"request 'discard': field step=-3 is refused: Expected `int` >= 0;"),
    ({"op": "open", "pid": 0, "step": 1},
     r"request 'open': field pid=0 is refused: Expected `int` >= 1;"),
    ({"op": "peers", "peers": {"0": {"tcp": "ipc:///tmp/evil"}}},
     r"field peers\[\.\.\.\]\.tcp is refused: Expected `str` matching regex '\\\\Atcp://'"),
]


@pytest.mark.parametrize("header, why", OUT_OF_RANGE, ids=[f"{h['op']}-{i}" for i, (h, _) in
                                                           enumerate(OUT_OF_RANGE)])
def test_an_out_of_range_value_is_refused_and_the_agent_stays_healthy(held, header, why):
  opts, root, job, info = held
  secret = _paths.job_secret(root, job)
  reply = _sealed(info["ipc"], secret, header)
  assert not reply["ok"] and reply["type"] == "InvalidArgumentError", reply
  assert __import__("re").search(why, reply["error"]), reply["error"]
  client = _protocol.Client(info["ipc"], who="test", timeout_secs=20, secret=secret)
  try:
    status = client.call(_requests.Status())[0]
  finally:
    client.close()
  assert (status.max_snapshots, status.steps, status.lease) == (2, [1], None)
  assert status.limit_bytes > 0
  with jc.CheckpointManager(options=opts) as m:        # saves and restores as before
    assert m.save(2, {"w": W + 1})
    m.wait_until_finished()
    out = m.restore(target={"w": np.zeros_like(W)})
    assert (m.last_restore.step, m.last_restore.tier) == (2, "host")
  np.testing.assert_array_equal(out["w"], W + 1)


@contextlib.contextmanager
def _client(root: str, job: str, info: dict, timeout_secs: float = 20.0):
  """A client of the held agent (closed after the body, whatever its outcome)."""
  client = _protocol.Client(info["ipc"], who="test", timeout_secs=timeout_secs,
                            secret=_paths.job_secret(root, job))
  try:
    yield client
  finally:
    client.close()


def test_the_client_refuses_an_out_of_range_value_before_sending_it(held):
  _, root, job, info = held
  with _client(root, job, info) as client:
    with pytest.raises(errors.InvalidArgumentError, match=r"^request 'hello': field "
                       r"max_snapshots=200000 is refused: Expected `int` <= 1024; nothing was "
                       r"applied$"):
      client.call(_requests.Hello(pid=PID, max_snapshots=200000))


def test_a_relaunch_with_fewer_snapshots_gets_them_and_their_memory_back(held):
  # The job ran with max_snapshots=4 (5 slots of 2 KiB); its relaunch asks for 1 within a
  # budget of 2 slots. The agent lowers its count: the budget holds, saves go on, and
  # the slots beyond 2 give their memory back once free.
  opts, root, job, info = held
  big = jc.CheckpointOptions(max_snapshots=4, agent=opts.agent, handle_sigterm=False)
  with jc.CheckpointManager(options=big) as m:
    for step in range(2, 7):
      assert m.save(step, {"w": W + step})
      m.wait_until_snapshotted()
    assert m.all_steps() == [3, 4, 5, 6]
  small = jc.CheckpointOptions(max_snapshots=1, host_memory_limit_bytes=2 * W.nbytes,
                               agent=opts.agent, handle_sigterm=False)
  with jc.CheckpointManager(options=small) as m:
    out = m.restore(target={"w": np.zeros_like(W)})
    assert m.last_restore.step == 6
    np.testing.assert_array_equal(out["w"], W + 6)
    for step in range(7, 10):
      assert m.save(step, {"w": W + step})
      m.wait_until_snapshotted()
    assert m.all_steps() == [9]
    out = m.restore(target={"w": np.zeros_like(W)})
    np.testing.assert_array_equal(out["w"], W + 9)
  with _client(root, job, info) as client:
    status = client.call(_requests.Status())[0]
  assert status.max_snapshots == 1
  assert status.bytes <= 2 * W.nbytes, status.slots          # the retired slots' memory is back
  files = [n for n in os.listdir(_paths.agent_dir(root, job, 0)) if n.startswith("slot")]
  assert len(files) <= 2, files


def test_a_posted_request_is_applied_before_the_next_and_its_error_raised_by_it(held):
  # A restore posts the unpin of its slot (it does not wait for the reply): the agent
  # applies it before this client's next request, and a posted request that failed is
  # raised by the next request, naming it, never dropped.
  _, root, job, info = held
  with _client(root, job, info) as client:
    opened = client.call(_requests.Open(pid=os.getpid(), step=1))[0]
    assert client.call(_requests.Status())[0].slots[opened.index]["readers"] == 1
    client.post(_requests.Close(pid=os.getpid(), step=1, index=opened.index))
    assert client.call(_requests.Status())[0].slots[opened.index]["readers"] == 0
    client.post(_requests.Open(pid=os.getpid(), step=99))
    with pytest.raises(errors.StepNotFoundError, match=r"test refused 'open': .*step 99"):
      client.call(_requests.Status())
    assert client.call(_requests.Status())[0].steps == [1]          # the client goes on


def test_a_posted_unpin_that_reaches_the_agent_late_is_still_applied(held):
  # A posted request's caller never waits for it, so it never gives up on it: it carried
  # the client's request deadline all the same, and an agent paused past it (a stopped or
  # swapped-out process) refused the restore's unpin. The slot stayed pinned for good and
  # the next request (the next restore's open) failed with "'close' arrived after its
  # deadline".
  _, root, job, info = held
  with _client(root, job, info, timeout_secs=1.0) as client:
    opened = client.call(_requests.Open(pid=os.getpid(), step=1))[0]
    os.kill(info["pid"], signal.SIGSTOP)
    try:
      client.post(_requests.Close(pid=os.getpid(), step=1, index=opened.index))
      time.sleep(1.5)                           # past the 1 s request deadline
    finally:
      os.kill(info["pid"], signal.SIGCONT)
    assert client.call(_requests.Status())[0].slots[opened.index]["readers"] == 0
