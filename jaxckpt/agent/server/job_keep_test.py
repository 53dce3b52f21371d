"""The job's keep rule through its star (agent/server/_job_keep.py): one in-process agent among
fake agents of a job of many processes, each a real tcp socket that counts what it is told.
A host's change costs it a constant number of messages, all to the job's hub, whatever the
job's size; a reply naming a step the host does not hold, or holds of another run, drops
nothing; the hub answers with the job's whole step and tells nobody itself."""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import zmq

from jaxckpt.agent import _protocol, _requests

from jaxckpt.agent.server import _server
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, checksum
from jaxckpt.net import _wire

_SECRET = b"k" * 32
_WAIT_SECS = 60.0


class _FakeAgent:
  """A fake agent of process ``p``: it records each request it gets and answers
  ``peer_held`` with ``self.answer`` (a PeerHeldReply; None: it does not answer), the
  next one only once ``self.gate`` (an Event) is set, where one is."""

  def __init__(self, p: int) -> None:
    self.p = p
    self.got: list[_requests.Request] = []
    self.answer: _requests.PeerHeldReply | None = _requests.PeerHeldReply()
    self.gate: threading.Event | None = None
    self.cond = threading.Condition()
    self._sock = zmq.Context.instance().socket(zmq.ROUTER)
    self._sock.setsockopt(zmq.LINGER, 0)
    self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._serve, daemon=True)
    self._thread.start()

  def address(self, pid: int | None = None) -> _requests.AgentAddress:
    return _requests.AgentAddress(tcp=f"tcp://127.0.0.1:{self.port}",
                                  pid=2_000_000 + self.p if pid is None else pid, host=self.p)

  def _serve(self) -> None:
    while not self._stop.is_set():
      if not self._sock.poll(50):
        continue
      ident, empty, *frames = self._sock.recv_multipart()
      header = _protocol.verify(_SECRET, frames)
      _protocol.expired(header)            # (its deadline: what an agent takes off first)
      req = _requests.decode(header)
      with self.cond:
        self.got.append(req)
        answer, gate, self.gate = self.answer, self.gate, None
        self.cond.notify_all()
      if gate is not None:
        assert gate.wait(_WAIT_SECS), f"the fake agent of process {self.p} was never let answer"
      if answer is not None:
          self._sock.send_multipart([ident, empty, _wire.pack({"ok": True,
                                                             **_requests.encode_reply(answer)})])

  def wait_for(self, what: str, ok) -> None:
    """Waits until ``ok(self.got)``; names this fake agent and ``what`` if it does not come."""
    with self.cond:
      assert self.cond.wait_for(lambda: ok(self.got), _WAIT_SECS), (
          f"the fake agent of process {self.p} was never told {what} within {_WAIT_SECS} s "
          f"(it got {self.got})")

  def close(self) -> None:
    self._stop.set()
    self._thread.join(5)
    self._sock.close()


class _Host:
  """An in-process agent of process ``me`` of a job of ``n`` processes, the others fake."""

  def __init__(self, tmp: str, n: int, me: int, same_pid: tuple[int, ...] = ()) -> None:
    d = os.path.join(tmp, "j", f"host{me}")
    os.makedirs(d)
    self.agent = _server.Agent(job="j", host=me, directory=d, max_snapshots=2,
                               limit_bytes=1 << 24, idle_timeout_secs=60.0, secret=_SECRET)
    self.fakes = {p: _FakeAgent(p) for p in range(n) if p != me}
    self.ask(_requests.Hello(pid=os.getpid()))
    own = _requests.AgentAddress(tcp="tcp://127.0.0.1:1", pid=os.getpid(), host=me)
    self.agent.tcp_address = own.tcp       # (what a served agent learns when it binds)
    self.ask(_requests.Peers(peers={
        str(p): (own if p == me else
                 self.fakes[p].address(os.getpid() if p in same_pid else None))
        for p in range(n)}))

  def ask(self, req):
    reply = _wire.unpack(_server.handle(self.agent, _protocol.request(_SECRET, req, 10.0))[0])
    assert reply["ok"], reply
    return _requests.decode_reply(type(req), reply, "agent", "in-process")

  def save(self, step: int) -> None:
    slot = self.ask(_requests.Reserve(pid=os.getpid(), step=step, nbytes=64))
    assert slot.index is not None, f"no slot for step {step} (held: {self.steps()})"
    data = np.full(16, step, np.float32)
    with open(slot.path, "r+b") as f:
      f.truncate(slot.size)
      f.write(data.tobytes())
    leaf = LeafRecord(path="w", kind="numpy", shape=(16,), dtype="float32",
                      shards=(ShardRecord(((0, 16),), 0, 64, checksum(data.tobytes())),))
    manifest = SnapshotManifest(step=step, leaves=(leaf,), nbytes=64)
    self.ask(_requests.Commit(index=slot.index, manifest=manifest.to_json(), step=step, nbytes=64,
                              process=[0, 1]))

  def steps(self) -> list[int]:
    with self.agent.lock:
      return self.agent.steps()

  def close(self) -> None:
    self.agent.keep.close()
    for f in self.fakes.values():
      f.close()
    self.agent.cleanup()


@contextlib.contextmanager
def _host(tmp_path, n: int, me: int, same_pid: tuple[int, ...] = ()):
  host = _Host(str(tmp_path), n, me, same_pid)
  try:
    yield host
  finally:
    host.close()


def _said(steps):
  """Whether a fake agent's last request said the host holds ``steps``."""
  return lambda got: bool(got) and list(got[-1].steps) == list(steps)


def test_each_change_tells_only_the_hub_a_constant_number_of_times_whatever_the_jobs_size(tmp_path):
  # Process 5 of 16; the hub (process 0) answers that the newest step it is told is whole.
  # Before, each change was told to each of the 15 other agents (and repeated each second).
  with _host(tmp_path, 16, 5) as host:
    hub = host.fakes[0]
    for step in range(1, 9):
      with hub.cond:
        hub.answer = _requests.PeerHeldReply(whole=step, fresh=True)
      host.save(step)
      hub.wait_for(f"that host 5 holds step {step}", lambda got, s=step: any(
          s in r.steps for r in got))
    hub.wait_for("that host 5 holds [7, 8]", _said([7, 8]))
    assert host.steps() == [7, 8]          # the hub's word, applied: the keep rule dropped
    assert {p: len(f.got) for p, f in host.fakes.items() if f.got and p != 0} == {}
    # each save: its word, and the word after the keep rule dropped (the step before the
    # newest whole); a repeat only while a reply is late
    assert len(hub.got) <= 3 * 8, [list(r.steps) for r in hub.got]
    assert all(isinstance(r, _requests.PeerHeld) and r.peer == 5 for r in hub.got)


def test_a_reply_naming_a_step_the_host_does_not_hold_as_the_hubs_drops_nothing(tmp_path):
  with _host(tmp_path, 8, 3) as host:
    hub = host.fakes[0]
    for answer, what in [(_requests.PeerHeldReply(whole=99, fresh=True), "a step it lacks"),
                         (_requests.PeerHeldReply(whole=3, fresh=False), "another run's 3")]:
      with hub.cond:
        hub.answer, hub.got[:] = answer, []
      if not host.steps():
        for step in (1, 2, 3):
          host.save(step)
      else:
        host.agent.keep.changed()    # (what a change does: the host says its steps again)
      # the host repeats while no newer step than a whole one is known: a second word
      # after the reply came shows the reply was taken
      hub.wait_for("[1, 2, 3] twice", lambda got: sum(
          list(r.steps) == [1, 2, 3] for r in got) >= 2)
      assert host.steps() == [1, 2, 3], what
      assert host.agent.table.whole is None, what
    with hub.cond:
      hub.answer = _requests.PeerHeldReply(whole=3, fresh=True)
    hub.wait_for("[2, 3] once the hub says 3 is whole", _said([2, 3]))
    assert host.steps() == [2, 3]


def test_the_hub_answers_the_jobs_whole_step_and_tells_nobody(tmp_path):
  with _host(tmp_path, 8, 0) as hub:
    for step in (1, 2, 3):
      hub.save(step)

    def held(p, steps):
      return hub.ask(_requests.PeerHeld(peer=p, steps=steps, fresh=steps))

    for p in range(1, 7):
      assert held(p, [1, 2, 3]) == _requests.PeerHeldReply(), p   # process 7 has not said
    assert hub.steps() == [1, 2, 3]
    assert held(7, [1, 2]) == _requests.PeerHeldReply(whole=2, fresh=True)
    assert hub.steps() == [2, 3]
    assert held(7, [2, 3]) == _requests.PeerHeldReply(whole=3, fresh=True)
    # an earlier run's step 3 (not committed by this run's trainers) is not this run's
    assert held(7, []) == _requests.PeerHeldReply(whole=None)
    assert hub.ask(_requests.PeerHeld(peer=7, steps=[2, 3], fresh=[2])) == (
        _requests.PeerHeldReply(whole=2, fresh=True))
    assert hub.steps() == [2, 3]
    assert {p: f.got for p, f in hub.fakes.items() if f.got} == {}


def test_a_reply_to_a_word_said_before_a_step_was_saved_again_is_not_applied(tmp_path):
  # The hub's reply says 2 is whole, of the step 2 the host held when it spoke; the host
  # saved 2 again (a rollback to 1) before the reply came: the new 2 is not whole.
  with _host(tmp_path, 4, 2) as host:
    hub = host.fakes[0]
    host.save(1)
    host.save(2)
    hub.wait_for("[1, 2]", _said([1, 2]))
    gate = threading.Event()
    with hub.cond:
      hub.answer, hub.gate = _requests.PeerHeldReply(whole=2, fresh=True), gate
      assert hub.cond.wait_for(lambda: hub.gate is None, _WAIT_SECS), "host 2 never spoke again"
    host.save(2)
    with hub.cond:
      hub.answer, said = None, len(hub.got)     # (later words: no answer)
    gate.set()
    hub.wait_for("a word after the reply", lambda got: len(got) > said)
    assert host.steps() == [1, 2]
    assert host.agent.table.whole is None


def test_agents_of_other_machines_with_this_agents_pid_do_not_hide_it_from_the_job(tmp_path):
  # Agents on other machines (other pid namespaces: containers, pods) may have this
  # agent's pid: it found itself in the job's map by pid, found two, took itself for no
  # process of the job and kept by its own timing again (issue 46 (1) back), telling
  # the hub nothing. It finds itself by its own tcp address.
  with _host(tmp_path, 3, 2, same_pid=(0, 1)) as h:
    hub = h.fakes[0]
    h.save(1)
    hub.wait_for("that the host holds [1]", _said([1]))
    assert not h.fakes[1].got, h.fakes[1].got
