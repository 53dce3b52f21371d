"""The all-reduce's ring streams: pieces arrive bit-exact, in step, and only from the job."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from jaxckpt.util import _wait
from jaxckpt.ft import _links
from jaxckpt.net import _bulk, _wire

SECRET = b"the-job-secret-for-ring-links"
LONG = 60.0      # a wait that succeeds (generous: a loaded machine is slow, never this slow)
SHORT = 0.3      # a wait that is meant to run out


@contextlib.contextmanager
def _links_of(*groups: str, secret: bytes = SECRET, timeout_secs: float = LONG):
  made = [_links.Links("127.0.0.1", secret, group_id=g, timeout_secs=timeout_secs) for g in groups]
  try:
    yield made
  finally:
    for link in made:
      link.close()


def _head(tag: int, *, q: str = "q1", step: int = 5, digest: int = 0xABC) -> dict:
  return {"q": q, "step": step, "digest": digest, "tag": tag}


def _expect(**kw) -> dict:
  head = _head(0, **kw)
  del head["tag"]
  return head


def _soon(secs: float = LONG) -> float:
  return time.monotonic() + secs


def _raw_stream(address: str, group: str, secret: bytes = SECRET) -> socket.socket:
  """A stream opened by hand (as a neighbour would), to write pieces byte by byte."""
  conn = _bulk.connect(address, LONG, "the test's listener")
  conn.settimeout(LONG)
  challenge = bytearray(16)
  _bulk.recv_exact(conn, memoryview(challenge))
  _bulk.send_frames(conn, _wire.seal(secret, {"op": "ring_link", "group": group,
                                              "challenge": bytes(challenge)}))
  assert _wire.unpack(_bulk.recv_frame(conn, 4096)) == {"ok": True}
  return conn


def _raw_piece(conn: socket.socket, head: dict, data: bytes) -> None:
  _bulk.send_frame(conn, _wire.pack(dict(head, n=len(data))))
  conn.sendall(data)


def test_a_piece_of_several_segments_arrives_bit_exact_and_the_segments_stay_untouched():
  rng = np.random.default_rng(0)
  segments = [rng.standard_normal(1000).astype(np.float32),
              rng.standard_normal((64, 1024)).astype(np.float32)[:, :512],   # strided view
              np.array([np.nan, -0.0, np.inf], np.float32)]
  before = [s.copy() for s in segments]
  with _links_of("a", "b") as (a, b):
    assert a.send("b", b.address, _head(3), [np.ascontiguousarray(s) for s in segments], _soon()) is None
    a.send("b", b.address, _head(4), [segments[0][:10]], _soon())
    into = np.empty(sum(s.size for s in segments), np.float32)
    assert b.recv("a", _expect(), 3, into, _soon()) is None
    second = np.empty(10, np.float32)
    assert b.recv("a", _expect(), 4, second, _soon()) is None
  want = np.concatenate([s.reshape(-1) for s in segments])
  assert into.view(np.uint32).tolist() == want.view(np.uint32).tolist()
  assert second.tobytes() == segments[0][:10].tobytes()
  for s, b4 in zip(segments, before):
    assert s.tobytes() == b4.tobytes()


def test_pieces_of_an_abandoned_attempt_are_skipped():
  with _links_of("a", "b") as (a, b):
    a.send("b", b.address, _head(0, q="q0"), [np.full(1 << 16, 7, np.uint8)], _soon())
    a.send("b", b.address, _head(0, q="q1", step=4), [np.full(100, 8, np.uint8)], _soon())
    a.send("b", b.address, _head(0), [np.full(100, 9, np.uint8)], _soon())
    into = np.zeros(100, np.uint8)
    assert b.recv("a", _expect(), 0, into, _soon()) is None
  assert (into == 9).all()


def test_a_piece_cut_short_by_the_timeout_is_skipped_and_the_next_one_arrives_whole():
  with _links_of("b") as (b,):
    conn = _raw_stream(b.address, "a")
    try:
      _bulk.send_frame(conn, _wire.pack(dict(_head(0, q="q0"), n=1000)))
      conn.sendall(b"\x01" * 400)                      # the sender stalls mid-piece
      into = np.zeros(1000, np.uint8)
      why = b.recv("a", _expect(q="q0"), 0, into, _soon(SHORT))
      assert why == "group a sent nothing more within the timeout"
      conn.sendall(b"\x01" * 600)                      # the rest, late
      _raw_piece(conn, _head(0), b"\x02" * 1000)       # the next attempt's piece
      assert b.recv("a", _expect(), 0, into, _soon()) is None
      assert (into == 2).all()
    finally:
      conn.close()


def test_a_silent_neighbour_is_named_within_the_timeout():
  with _links_of("a", "b") as (a, b):
    start = time.monotonic()
    why = b.recv("a", _expect(), 0, np.empty(4, np.uint8), _soon(SHORT))
    assert why == "no stream from group a within the timeout"
    a.send("b", b.address, _head(0, q="q0"), [np.ones(4, np.uint8)], _soon())   # another attempt's
    why = b.recv("a", _expect(), 0, np.empty(4, np.uint8), _soon(SHORT))
    assert why == "group a sent nothing more within the timeout"
    assert time.monotonic() - start < 2 * SHORT + 5


def test_a_neighbour_at_another_digest_or_sending_another_piece_is_named():
  with _links_of("a", "b") as (a, b):
    a.send("b", b.address, _head(0, digest=0x1), [np.ones(4, np.uint8)], _soon())
    why = b.recv("a", _expect(), 0, np.empty(4, np.uint8), _soon())
    assert why == "group a is at digest 0x1 of step 5, this group at 0xabc"
    a.send("b", b.address, _head(2), [np.ones(4, np.uint8)], _soon())
    why = b.recv("a", _expect(), 1, np.empty(8, np.uint8), _soon())
    assert why == "group a sent piece 2 of 4 bytes where 1 of 8 was due"


def test_a_neighbour_dying_mid_piece_fails_the_attempt_and_its_next_stream_is_heard():
  with _links_of("b") as (b,):
    conn = _raw_stream(b.address, "a")
    _bulk.send_frame(conn, _wire.pack(dict(_head(0), n=1000)))
    conn.sendall(b"\x01" * 10)
    conn.close()                                       # killed mid-piece
    into = np.zeros(1000, np.uint8)
    why = b.recv("a", _expect(), 0, into, _soon())
    assert why.startswith("the stream from group a broke: ConnectionError")
    conn = _raw_stream(b.address, "a")                 # the restarted neighbour
    try:
      _raw_piece(conn, _head(1), b"\x03" * 1000)
      assert b.recv("a", _expect(), 1, into, _soon()) is None
      assert (into == 3).all()
    finally:
      conn.close()


def test_a_header_claiming_negative_bytes_breaks_the_stream_not_the_reader():
  with _links_of("b") as (b,):
    conn = _raw_stream(b.address, "a")
    try:
      _bulk.send_frame(conn, _wire.pack(dict(_head(0, q="q0"), n=-5)))
      why = b.recv("a", _expect(), 0, np.empty(4, np.uint8), _soon())
      assert why == "the stream from group a broke: ValueError: a piece header claims -5 bytes"
    finally:
      conn.close()


def test_a_restarted_neighbour_takes_over_from_its_old_stream():
  with _links_of("b") as (b,):
    with _links_of("a") as (old,):
      old.send("b", b.address, _head(0), [np.full(8, 1, np.uint8)], _soon())
      into = np.zeros(8, np.uint8)
      assert b.recv("a", _expect(), 0, into, _soon()) is None
    # the old one closed cleanly between pieces; the new one is the same group, at the ring
    # address of this attempt (as the replica group asks: the old stream's end, read before
    # the new one is taken on a loaded machine, then gives way to it)
    with _links_of("a") as (new,):
      new.send("b", b.address, _head(0, q="q2"), [np.full(8, 2, np.uint8)], _soon())
      assert b.recv("a", _expect(q="q2"), 0, into, _soon(), address=new.address) is None
      assert (into == 2).all()


def test_a_new_stream_that_replaces_one_being_read_is_read_instead():
  # A restarted neighbour's new stream arrives while this group waits on its old one (still
  # open: the old process hangs). The wait moves to the new stream; it does not fail the
  # attempt on the old one being closed under it ("Bad file descriptor", seen in the suite).
  with _links_of("b") as (b,):
    old = _raw_stream(b.address, "a")
    into = np.zeros(8, np.uint8)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(b.recv("a", _expect(), 0, into,
                                                                  _soon(10.0))))
    reader.start()
    _wait.until(lambda: b._incoming.get("a") is not None, timeout_secs=LONG,  # pylint: disable=protected-access
                late=lambda: "the old stream was not taken")
    time.sleep(0.2)     # (likely blocked on the old stream by now; the test holds either way)
    new = _raw_stream(b.address, "a")
    _raw_piece(new, _head(0), bytes(range(8)))
    reader.join(LONG)
    assert got == [None] and into.tolist() == list(range(8))
    old.close()
    new.close()


def test_close_sends_what_is_queued_before_it_returns():
  data = np.random.default_rng(1).integers(0, 255, 32 << 20, dtype=np.uint8)
  into = np.zeros_like(data)
  got = []
  with _links_of("b") as (b,):
    a = _links.Links("127.0.0.1", SECRET, group_id="a", timeout_secs=LONG)
    a.send("b", b.address, _head(0), [data], _soon())
    reader = threading.Thread(target=lambda: got.append(b.recv("a", _expect(), 0, into, _soon())))
    reader.start()
    a.close(linger_secs=LONG)          # right after the step, as a leaving group does
    reader.join(LONG)
  assert got == [None]
  assert into.tobytes() == data.tobytes()


def test_a_stream_from_outside_the_job_is_refused_and_counted():
  with _links_of("b") as (b,), _links_of("a", secret=b"a-guess") as (liar,):
    lost = liar.send("b", b.address, _head(0), [np.ones(4, np.uint8)], _soon())
    assert lost.startswith(f"could not open a ring stream to group b at {b.address}: group b refused "
                           "the ring stream:") and "wrong mac" in lost
    why = b.recv("a", _expect(), 0, np.empty(4, np.uint8), _soon(SHORT))
    assert why == "no stream from group a within the timeout"
    _wait_for(lambda: b.refused == 1)
    with _links_of("a") as (honest,):
      honest.send("b", b.address, _head(0), [np.full(4, 5, np.uint8)], _soon())
      into = np.empty(4, np.uint8)
      assert b.recv("a", _expect(), 0, into, _soon()) is None
      assert (into == 5).all() and b.refused == 1


def test_a_replayed_hello_does_not_answer_a_new_challenge():
  with _links_of("b") as (b,):
    conn = _bulk.connect(b.address, LONG, "the test's listener")
    conn.settimeout(LONG)
    try:
      fresh = bytearray(16)
      _bulk.recv_exact(conn, memoryview(fresh))
      recorded = bytes(16)                             # a hello that answered another challenge
      _bulk.send_frames(conn, _wire.seal(SECRET, {"op": "ring_link", "group": "a",
                                                  "challenge": recorded}))
      reply = _wire.unpack(_bulk.recv_frame(conn, 4096))
      assert reply["ok"] is False and "challenge" in reply["error"]
      assert conn.recv(1) == b""                       # and the listener hung up
    finally:
      conn.close()
    assert b.refused == 1
    why = b.recv("a", _expect(), 0, np.empty(4, np.uint8), _soon(SHORT))
    assert why == "no stream from group a within the timeout"


def test_a_hello_that_never_comes_does_not_hold_the_listener():
  with _links_of("a", "b") as (a, b):
    host, port = b.address.rsplit(":", 1)
    mute = socket.create_connection((host, int(port)))    # connects, says nothing
    try:
      a.send("b", b.address, _head(0), [np.full(4, 6, np.uint8)], _soon())
      into = np.empty(4, np.uint8)
      assert b.recv("a", _expect(), 0, into, _soon()) is None
      assert (into == 6).all()
    finally:
      mute.close()


def _wait_for(cond, secs: float = LONG) -> None:
  end = time.monotonic() + secs
  while not cond():
    if time.monotonic() > end:
      pytest.fail(f"condition not met within {secs}s")
    time.sleep(0.01)


def test_settle_returns_once_nothing_queued_is_read_any_more():
  data = np.ones(16 << 20, np.uint8)
  with _links_of("b") as (b,):
    with _links_of("a") as (a,):
      a.send("b", b.address, _head(0), [data], _soon())
      a.settle("b", _soon(SHORT))     # b reads nothing: the 16 MiB cannot all be written
      data[:] = 2                     # the caller reuses its input
      into = np.zeros_like(data)
      why = b.recv("a", _expect(), 0, into, _soon())
      assert why is not None and why.startswith("the stream from group a broke")
      assert not (into == 2).any()    # not one byte written after settle
      a.send("b", b.address, _head(1), [data[:8]], _soon())   # a new stream for the next piece
      assert b.recv("a", _expect(), 1, into[:8], _soon()) is None and (into[:8] == 2).all()
      a.send("b", b.address, _head(2), [data[:8]], _soon())
      a.settle("b", _soon())          # written: the stream stays
      assert b.recv("a", _expect(), 2, into[:8], _soon()) is None


# ---- failures known at once ---------------------------------------------------------------------------


def test_the_stream_of_the_neighbours_incarnation_closing_fails_the_attempt_at_once():
  # A dead group's streams are closed by the kernel: that is a failure now, not a wait
  # for a new stream until the timeout (the end of an older incarnation's stream still
  # gives way to the newer one: test_a_restarted_neighbour_takes_over_from_its_old_stream).
  with _links_of("b") as (b,):
    a = _links.Links("127.0.0.1", SECRET, group_id="a", timeout_secs=LONG)
    address = a.address
    a.send("b", b.address, _head(0, q="q0"), [np.ones(4, np.uint8)], _soon())
    assert b.recv("a", _expect(q="q0"), 0, np.empty(4, np.uint8), _soon(), address=address) is None
    a.close()                                          # its process ended
    start = time.monotonic()
    why = b.recv("a", _expect(), 0, np.empty(4, np.uint8), _soon(), address=address)
    assert time.monotonic() - start < 5
    assert why == f"the stream from group a ({address}) closed: its process ended or left the ring"
    assert why.blame == ("a",)


def test_a_dead_groups_ring_port_is_named_as_such_and_blamed():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"           # nothing listens there once closed
  with _links_of("a") as (a,):
    why = a.send("b", dead, _head(0), [np.ones(4, np.uint8)], _soon())
  assert why.startswith(f"could not open a ring stream to group b at {dead}: the ring port of group b did "
                        "not take the connection ("), why
  assert "its process is gone, or it is restarting" in why and "agent" not in why
  assert why.blame == ("b",)


def test_fail_from_another_thread_ends_a_receive_blocked_on_a_silent_stream_at_once():
  # The lighthouse's word (a member stopped: no heartbeat) reaches a member waiting in the ring.
  with _links_of("a", "b") as (a, b):
    a.send("b", b.address, _head(0, q="q0"), [np.ones(4, np.uint8)], _soon())   # a stream, then silence
    threading.Timer(0.3, b.fail, args=("q1", "the lighthouse: group c stopped", ("c",))).start()
    start = time.monotonic()
    why = b.recv("a", _expect(), 0, np.empty(4, np.uint8), _soon(), address=a.address)
    assert time.monotonic() - start < 5
    assert why == "the lighthouse: group c stopped" and why.blame == ("c",)
    b.fail("q1", "a later word")                      # the first failure of an attempt is kept
    assert b.failure("q1") == "the lighthouse: group c stopped"


def test_an_abort_sent_after_the_attempts_deadline_reaches_a_neighbour_that_was_not_reading():
  # The lost abort, made deterministic: a member that failed by its own
  # deadline queued its abort behind a piece its (stopped) neighbour had not read, and then
  # waited for its queue with that passed deadline, so the stream was closed before the
  # abort went out. An abort and its settle have a bound of their own now.
  big = np.zeros(64 << 20, np.uint8)                   # more than loopback buffers hold
  with _links_of("a", "b") as (a, b):
    got: list = []

    def stopped_then_resumed() -> None:
      time.sleep(0.5)
      got.append(b.recv("a", _expect(), 0, np.empty_like(big), _soon(), address=a.address))
      got.append(b.recv("a", _expect(), 1, np.empty(4, np.uint8), _soon(), address=a.address))

    reader = threading.Thread(target=stopped_then_resumed)
    reader.start()
    assert a.send("b", b.address, _head(0), [big], _soon()) is None
    a.abort("b", b.address, _expect(), "a gave up: group c sent nothing", ("c",))
    a.settle("b", time.monotonic() + 10.0)             # (the ring's grace, not its passed deadline)
    reader.join(LONG)
  assert got[0] is None
  assert got[1] == "a gave up: group c sent nothing" and got[1].blame == ("c",)


def test_prepare_opens_the_stream_to_a_new_neighbour_before_its_first_piece():
  with _links_of("a", "b") as (a, b):
    a.prepare("b", b.address)
    _wait_for(lambda: b._incoming.get("a") is not None)   # pylint: disable=protected-access
    a.send("b", b.address, _head(0), [np.full(4, 7, np.uint8)], _soon())
    into = np.empty(4, np.uint8)
    assert b.recv("a", _expect(), 0, into, _soon(), address=a.address) is None and (into == 7).all()
