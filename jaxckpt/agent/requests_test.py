"""The agent's requests and replies: one table, each request's handler found by
its type and returning that request's typed reply; a malformed reply from a
peer is an error that names it."""

from __future__ import annotations

import contextlib
import threading
import typing

import pytest
import zmq

from jaxckpt import errors
from jaxckpt.agent import _protocol, _requests, _server
from jaxckpt.net import _wire


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

