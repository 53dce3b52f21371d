"""The bulk path: exact bytes over several streams, typed refusals, named timeouts."""

from __future__ import annotations

import contextlib
import socket
import threading

import msgspec
import numpy as np
import pytest

from jaxckpt import errors
from jaxckpt.net import _bulk

SECRET = b"s" * 32


@contextlib.contextmanager
def _server(data: bytes, *, fail: Exception | None = None, served: list | None = None):
  @contextlib.contextmanager
  def provide(header):
    if fail is not None:
      raise fail
    if served is not None:
      served.append(header)
    view = memoryview(data)
    yield [view[o:o + n] for o, n in header["ranges"]]
  srv = _bulk.Server("127.0.0.1", SECRET, provide, name="test")
  try:
    yield srv
  finally:
    srv.close()


def _fetch(address, ranges, *, secret=SECRET, on_done=None, timeout_secs=10.0, streams=4):
  into = [np.zeros(n, np.uint8) for _, n in ranges]
  _bulk.fetch(address, secret, {"what": "x"}, ranges, into, timeout_secs=timeout_secs,
              who="the test server", on_done=on_done, streams=streams)
  return into


def test_ranges_split_over_streams_arrive_exact_each_announced_once(monkeypatch):
  monkeypatch.setattr(_bulk, "PIECE_BYTES", 1 << 10)
  data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
  ranges = [(5, 40000), (0, 0), (40000, 3), (1000, 20000), (65535, 1)]
  done, served = [], []
  with _server(data, served=served) as srv:
    got = _fetch(srv.address, ranges, on_done=done.append)
  for (o, n), g in zip(ranges, got):
    assert g.tobytes() == data[o:o + n]
  assert sorted(done) == list(range(len(ranges)))
  assert len(served) == 4                                  # four streams carried it
  assert sum(n for h in served for _, n in h["ranges"]) == sum(n for _, n in ranges)


def test_split_is_balanced_and_ordered():
  parts = _bulk._split([(0, 10), (100, 30)], 4)
  assert [sum(p[2] for p in part) for part in parts] == [10, 10, 10, 10]
  assert [p[:3] for part in parts for p in part] == [(0, 0, 10), (1, 100, 10), (1, 110, 10),
                                                     (1, 120, 10)]


def test_a_request_sealed_with_another_secret_is_refused_typed():
  with _server(b"x" * 100) as srv:
    with pytest.raises(errors.PermissionDeniedError, match="wrong mac"):
      _fetch(srv.address, [(0, 10)], secret=b"t" * 32)


def test_the_servers_error_reaches_the_caller_typed():
  with _server(b"", fail=errors.StepNotFoundError("no step 9 here")) as srv:
    with pytest.raises(errors.StepNotFoundError, match="no step 9 here"):
      _fetch(srv.address, [(0, 10)])


def test_a_failed_check_fails_the_fetch_and_stops_every_stream(monkeypatch):
  monkeypatch.setattr(_bulk, "PIECE_BYTES", 1 << 10)
  def check(i):
    if i == 1:
      raise errors.CorruptSnapshotError("range 1 does not match its checksum")
  with _server(bytes(1 << 16)) as srv:
    with pytest.raises(errors.CorruptSnapshotError, match="range 1"):
      _fetch(srv.address, [(0, 1 << 14), (1 << 14, 1 << 14), (1 << 15, 1 << 15)], on_done=check)


def test_a_silent_server_is_named_within_the_timeout():
  listener = socket.create_server(("127.0.0.1", 0))     # accepts, never answers
  try:
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(errors.AgentUnavailableError, match=r"the test server sent nothing for 0.5 s"):
      _fetch(address, [(0, 10)], timeout_secs=0.5)
  finally:
    listener.close()


def test_a_server_that_dies_mid_transfer_is_named():
  listener = socket.create_server(("127.0.0.1", 0))
  def serve_ok_then_die():
    conn, _ = listener.accept()
    with conn:
      conn.recv(1 << 16)
      ok = msgspec.msgpack.encode({"ok": True})
      conn.sendall(len(ok).to_bytes(4, "big") + ok + b"partial")
  t = threading.Thread(target=serve_ok_then_die, daemon=True)
  t.start()
  try:
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(errors.AgentUnavailableError, match=r"the test server broke off .* after 7 of 100"):
      _fetch(address, [(0, 100)])
  finally:
    t.join(5)
    listener.close()


def test_an_unreachable_server_is_named():
  listener = socket.create_server(("127.0.0.1", 0))
  address = f"127.0.0.1:{listener.getsockname()[1]}"
  listener.close()
  with pytest.raises(errors.AgentUnavailableError, match="the test server is not reachable"):
    _fetch(address, [(0, 10)])


@pytest.mark.parametrize("reply, why", [
    (b"\xc1\xc1garbage", "bytes that are not a reply"),                 # not msgpack
    (msgspec.msgpack.encode([1, 2, 3]), "a list that is not a reply"),           # msgpack, not a map
    (msgspec.msgpack.encode({"hello": 1}), "a dict that is not a reply"),        # a map without 'ok'
    (None, r"a bulk frame of 4294967295 bytes \(over 1048576\) was refused"),  # oversized
    (b"", "broke off"),                                                  # truncated frame
])
def test_a_peers_bad_reply_is_a_jaxckpt_error_naming_the_peer_and_address(reply, why):
  listener = socket.create_server(("127.0.0.1", 0))
  def serve_bad():
    conn, _ = listener.accept()
    with conn:
      conn.recv(1 << 16)
      if reply is None:
        conn.sendall(b"\xff\xff\xff\xff")
      elif reply == b"":
        conn.sendall((100).to_bytes(4, "big") + b"short")
      else:
        conn.sendall(len(reply).to_bytes(4, "big") + reply)
  t = threading.Thread(target=serve_bad, daemon=True)
  t.start()
  try:
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(errors.AgentUnavailableError) as e:
      _fetch(address, [(0, 10)])
    assert "the test server" in str(e.value) and address in str(e.value)
    assert __import__("re").search(why, str(e.value)), str(e.value)
  finally:
    t.join(5)
    listener.close()


def test_a_replayed_bulk_request_is_refused():
  sent = []
  with _server(bytes(range(64)), served=sent) as srv:
    host, port = srv.address.split(":")
    frames = _bulk._wire.seal(SECRET, {"op": "bulk", "what": "x", "ranges": [[0, 8]]})

    def send():
      with socket.create_connection((host, int(port)), timeout=10) as c:
        _bulk.send_frames(c, frames)
        return msgspec.msgpack.decode(_bulk.recv_frame(c, 1 << 20))
    assert send()["ok"]
    again = send()
    assert not again["ok"] and "replayed" in again["error"]
    assert len(sent) == 1                      # served once
