"""The agent's requests and replies: one table, each request's handler found by
its type and returning that request's typed reply; a malformed reply from a
peer is an error that names it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import typing

import msgspec
import numpy as np
import pytest
import zmq

from jaxckpt import errors
from jaxckpt.agent import _protocol, _requests
from jaxckpt.agent.server import _server
from jaxckpt.agent._parity_config import ParityConfig
from jaxckpt.host._persist import PersistConfig
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, checksum
from jaxckpt.net import _schema, _wire


def test_every_request_has_a_handler_that_returns_its_reply():
  assert set(_server.HANDLERS) == set(_requests.REQUESTS.values())
  for cls in _requests.REQUESTS.values():
    handler = _server.HANDLERS[cls]
    assert handler.__name__ == "op_" + cls.op, cls
    assert typing.get_type_hints(handler)["return"] is cls.Reply, (cls, handler)
  assert _requests.Reserve.Reply is not _requests.Done and _requests.Abort.Reply is _requests.Done


def test_a_reply_reads_as_a_record_and_as_a_mapping():
  r = _requests.Reserve.Reply(index=3, path="/dev/shm/x", size=64)
  assert (r.index, r["path"], {**r}) == (3, "/dev/shm/x",
                                         {"index": 3, "path": "/dev/shm/x", "size": 64,
                                          "fresh": False, "note": None})
  with pytest.raises(KeyError):
    r["nope"]                                     # pylint: disable=pointless-statement


@contextlib.contextmanager
def _peer_answering(reply: dict):
  """A process-local stand-in for an agent (a REP socket) that answers every request with ``reply``."""
  ctx = zmq.Context.instance()
  sock = ctx.socket(zmq.REP)
  sock.setsockopt(zmq.LINGER, 0)
  port = sock.bind_to_random_port("tcp://127.0.0.1")
  stop = threading.Event()

  def serve():
    while not stop.is_set():
      if sock.poll(50):
        sock.recv_multipart()
        sock.send(_wire.pack(reply))

  t = threading.Thread(target=serve, daemon=True)
  t.start()
  try:
    yield f"tcp://127.0.0.1:{port}"
  finally:
    stop.set()
    t.join(10)
    sock.close(linger=0)


@pytest.mark.parametrize("op, args, reply, why", [
    ("reserve", {"pid": 1, "step": 1, "nbytes": 8}, {"ok": True, "index": "seven"},
     r"field index='seven' is refused: Expected `int \| null`, got `str`"),
    ("open", {"pid": 1, "step": 1}, {"ok": True, "path": "/dev/shm/x"},
     r"lacks the required field 'manifest'"),
    ("steps", {}, {"ok": True, "steps": "all of them", "free_slots": 1, "protected": None},
     r"field steps='all of them' is refused: Expected `array`, got `str`"),
    # the reply fields are typed, not bare lists (issue 49): each element is checked too
    ("steps", {}, {"ok": True, "steps": [3, "four"], "free_slots": 1, "protected": None},
     r"Expected `int`, got `str`"),
    ("held", {}, {"ok": True, "held": [[3, 0]]}, r"Expected `array` of length 3"),
    ("held", {}, {"ok": True, "held": [[3, 0, 0]]}, r"Expected `int` >= 1"),
    ("commit", {"index": 0, "manifest": "{}", "step": 1, "nbytes": 8, "process": [0, 1]},
     {"ok": True, "steps": [-1], "persist": {}, "persist_errors": []}, r"Expected `int` >= 0"),
    ("preallocate", {"nbytes": 8}, {"ok": True, "slots": [[0, "/dev/shm/x", 8, "yes"]]},
     r"Expected `bool`, got `str`"),
])
def test_a_malformed_reply_is_an_error_naming_the_agent_and_its_address(op, args, reply, why):
  with _peer_answering(reply) as address:
    client = _protocol.Client(address, who="agent pid 4242", timeout_secs=10, secret=b"s" * 32)
    try:
      with pytest.raises(errors.AgentUnavailableError,
                         match=rf"agent pid 4242 at {address} answered {op!r} with a malformed "
                               rf"reply \(.*{why}"):
        client.call(_requests.REQUESTS[op](**args))
    finally:
      client.close()


def test_a_reply_field_this_version_does_not_know_is_left_out():
  # A sidecar agent outlives its trainer's upgrade, and a newer one may add a field.
  reply = {"ok": True, "steps": [3], "free_slots": 1, "protected": None, "newer": {"x": 1}}
  with _peer_answering(reply) as address:
    client = _protocol.Client(address, who="agent pid 4242", timeout_secs=10, secret=b"s" * 32)
    try:
      got, _ = client.call(_requests.Steps())
      assert got == _requests.Steps.Reply(steps=[3], free_slots=1, protected=None)
    finally:
      client.close()



def test_every_value_a_request_carries_is_bounded_by_the_schema():
  # The ranges, sizes and lengths are the schema's (msgspec.Meta), checked when a request
  # is decoded: none is left to code beside it. A commit's manifest is its JSON text (its
  # numbers are checked when it is parsed: host.snapshot.check_numbers).
  unbounded = [w for cls in _requests.REQUESTS.values() for w in _schema.unbounded(cls)]
  assert unbounded == ["commit.manifest"]


@pytest.mark.parametrize("wire, config", [(_requests.PersistOptions, PersistConfig),
                                          (_requests.ParityOptions, ParityConfig)])
def test_the_options_a_hello_carries_are_the_trainer_s_config(wire, config):
  # A config field the wire does not know would be refused by every agent; a default that
  # differs would change what the agent runs with.
  got = {f.name: (f.required, None if f.required else f.default)
         for f in msgspec.inspect.type_info(wire).fields}
  want = {f.name: (f.default is dataclasses.MISSING,
                   None if f.default is dataclasses.MISSING else f.default)
          for f in dataclasses.fields(config)}
  assert got == want
  full = config(**{"directory": "/d", "interval_steps": 2} if config is PersistConfig
                else {"group_size": 4, "parity": 1})
  assert msgspec.structs.asdict(msgspec.convert(full.to_obj(), wire)) == full.to_obj()


def test_a_request_s_header_is_its_op_and_its_fields_and_decodes_to_itself():
  for req in (_requests.Reserve(pid=7, step=3, nbytes=64),
              _requests.Commit(index=1, manifest="{}", step=3, nbytes=0, process=[1, 4],
                               persist_attempt="a-1"),
              _requests.Hello(pid=7, persist=_requests.PersistOptions(directory="/d",
                                                                      interval_steps=1),
                              parity=_requests.ParityOptions(group_size=4, parity=1)),
              _requests.Close(pid=7, step=3, reader=-5), _requests.Steps()):
    header = _requests.encode(req)
    assert header["op"] == req.op == type(req).op
    assert _requests.decode(_wire.unpack(_wire.pack(header))) == req


def test_a_commit_s_manifest_is_parsed_once_for_every_use_on_the_agent(tmp_path):
  # The agent keeps the manifest's JSON (it serves it to readers and peers) and parses it
  # once, on first use: the persist thread's read of the step gets the same record.
  secret, directory = b"k" * 32, tmp_path / "j" / "host0"
  directory.mkdir(parents=True)
  agent = _server.Agent(job="j", host=0, directory=str(directory), max_snapshots=1,
                        limit_bytes=1 << 20, idle_timeout_secs=60.0, secret=secret)
  try:
    def ask(req):
      reply = _wire.unpack(_server.handle(agent, _protocol.request(secret, req, 10.0))[0])
      assert reply["ok"], reply
      return _requests.decode_reply(type(req), reply, "agent", "in-process")

    ask(_requests.Hello(pid=os.getpid()))
    slot = ask(_requests.Reserve(pid=os.getpid(), step=5, nbytes=64))
    with open(slot.path, "r+b") as f:
      f.truncate(slot.size)
    data = np.arange(16, dtype=np.float32)
    with open(slot.path, "r+b") as f:
      f.write(data.tobytes())
    leaf = LeafRecord(path="w", kind="numpy", shape=(16,), dtype="float32",
                      shards=(ShardRecord(((0, 16),), 0, 64, checksum(data.tobytes())),))
    manifest = SnapshotManifest(step=5, leaves=(leaf,), nbytes=64)
    ask(_requests.Commit(index=slot.index, manifest=manifest.to_json(), step=5, nbytes=64,
                         process=[0, 1]))
    first = agent.manifest_of(5)
    assert first == manifest and agent.manifest_of(5) is first
    with agent.durable.pinned(5) as (read, _):
      assert read is first
    index = agent.slot_of(5).index
    assert ask(_requests.Discard(step=5)).discarded
    freed = agent.table.slots[index]              # the record let go of its step's manifest
    assert freed.manifest is None and freed.process is None and freed.run is None
    with pytest.raises(errors.CorruptSnapshotError, match="holds no manifest"):
      freed.parsed()
    with pytest.raises(errors.StepNotFoundError):
      agent.manifest_of(5)
  finally:
    agent.cleanup()


def test_a_rollback_that_names_steps_but_no_id_is_refused():
  """Without an id a Rollback is only a query of the records: one that names steps (a
  buggy peer's) discarded nothing and answered ok, and a caller took it for done."""
  with pytest.raises(errors.InvalidArgumentError, match=r"rollback of steps \[1, 2\] names no id"):
    _requests.Rollback(steps=[1, 2])
  assert _requests.Rollback().steps == []
