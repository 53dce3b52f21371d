"""Replica groups and the lighthouse refuse anyone without the job's secret."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from jaxckpt import errors
from jaxckpt.ft import Lighthouse, LighthouseOptions, ReplicaGroup, ReplicaGroupOptions
from jaxckpt.ft import _peer, _route
from tests.support.replacement_check import replacement_on_skewed_clock
from jaxckpt.net import _wire

OPTS = ReplicaGroupOptions(heartbeat_interval=timedelta(milliseconds=50))
LH = LighthouseOptions(min_replicas=1, heartbeat_timeout=timedelta(seconds=0.5),
                       join_timeout=timedelta(seconds=0.1), straggler_timeout=timedelta(seconds=2))


def test_a_group_with_another_secret_is_refused_with_the_reason():
  with Lighthouse("127.0.0.1:0", LH, secret="the-job") as lh:
    with ReplicaGroup(lighthouse=lh.address, group_id="evil", timeout=timedelta(seconds=2),
                      options=OPTS, secret="a-guess") as ft:
      with pytest.raises(errors.PermissionDeniedError, match=r"refused.*wrong mac.*secret"):
        ft.start_step()
    assert lh.refused >= 1
    assert "evil" not in lh.status()["live"]


def test_forged_claims_do_not_stop_an_honest_group(monkeypatch):
  monkeypatch.delenv(_wire.SECRET_ENV, raising=False)
  with Lighthouse("127.0.0.1:0", LH) as lh:
    ctx = zmq.Context()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.connect(f"tcp://{lh.address}")
    forged = _wire.pack({"op": "quorum", "request_id": 1,
                         "member": ["aaa", "127.0.0.1:1", 10**6, 0]})
    committed = []
    with ReplicaGroup(lighthouse=lh.address, group_id="g0", timeout=timedelta(seconds=2),
                      options=OPTS, secret=lh.secret) as ft:
      for _ in range(4):
        for mac in (b"", b"x" * 32, _wire.sign(b"not-the-secret", forged)):
          evil.send_multipart([mac, forged])
        ft.start_step()
        ft.allreduce(np.ones(4, np.float32))
        committed.append(ft.should_commit())
    evil.close()
    ctx.term()
    assert committed == [True] * 4
    assert lh.refused >= 12 and "aaa" not in lh.status()["live"]


def test_a_peer_refuses_requests_not_sealed_with_the_secret():
  ctx = zmq.Context()
  server = _peer.PeerServer(ctx, "127.0.0.1", lambda h: ({"op": "pong"}, ()), secret=b"the-job")
  try:
    liar = _peer.PeerSender(ctx, secret=b"a-guess")
    assert liar.request(server.address, {"op": "ping"}, 2.0) is None
    honest = _peer.PeerSender(ctx, secret=b"the-job")
    reply = honest.request(server.address, {"op": "ping"}, 2.0)
    assert reply is not None and reply[0]["op"] == "pong"
    assert server.refused == 1
  finally:
    server.stop()
    ctx.term()


def test_a_group_without_any_secret_is_told_how_to_give_it(monkeypatch):
  monkeypatch.delenv(_wire.SECRET_ENV, raising=False)
  with pytest.raises(errors.InvalidArgumentError, match=r"JAXCKPT_JOB_SECRET"):
    ReplicaGroup(lighthouse="127.0.0.1:1", group_id="g0")


# ---- a flood from a process without the secret --------------------------------------------------

ROGUE = r"""
import os, sys, time, msgspec, zmq
address, secs = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
socks = []
for _ in range(4):
  s = ctx.socket(zmq.DEALER)
  s.setsockopt(zmq.LINGER, 0)
  s.connect(f"tcp://{address}")
  socks.append(s)
head = lambda h: msgspec.msgpack.encode(dict(h, ts=time.time(), nonce=os.urandom(8)))
quorum = head({"op": "quorum", "request_id": 1, "member": ["rogue", "127.0.0.1:1", 0, 0, ""]})
beat = head({"op": "heartbeat", "group": "rogue"})
messages = [[b"", quorum], [b"", beat], [os.urandom(32), quorum], [os.urandom(32), beat]]
print("flooding", flush=True)
sent, end = 0, time.monotonic() + secs
while time.monotonic() < end:          # as fast as it can: a full queue drops, never waits
  for s in socks:
    for m in messages:
      try:
        s.send_multipart(m, zmq.NOBLOCK)
        sent += 1
      except zmq.Again:
        pass
print(sent, flush=True)
"""


def _commit_until(lh, gid, stop, log):
  with ReplicaGroup(lighthouse=lh.address, group_id=gid, timeout=timedelta(seconds=5), options=OPTS,
                    secret=lh.secret) as ft:
    while not stop.is_set():
      ft.start_step()
      ft.allreduce(np.ones(4, np.float32))
      if ft.should_commit():
        log.append(time.monotonic())


def _wait_for(condition, secs, what):
  deadline = time.monotonic() + secs
  while not condition():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.01)


@pytest.mark.slow
def test_an_unsealed_flood_neither_stalls_honest_groups_nor_floods_the_log(caplog):
  flood_secs = 10.0
  caplog.set_level(logging.WARNING, logger="jaxckpt.ft.lighthouse")
  opts = dataclasses.replace(LH, min_replicas=2, heartbeat_timeout=timedelta(seconds=2))
  with Lighthouse("127.0.0.1:0", opts) as lh:
    stop, logs = threading.Event(), {"g0": [], "g1": []}
    groups = [threading.Thread(target=_commit_until, args=(lh, g, stop, logs[g])) for g in logs]
    rogue = None
    try:
      for t in groups:
        t.start()
      _wait_for(lambda: len(logs["g0"]) >= 20, 60, "the first commits")
      n0, t0 = len(logs["g0"]), time.monotonic()        # the rate without a flood, in this run
      _wait_for(lambda: len(logs["g0"]) >= n0 + 200, 60, "200 commits")
      calm = (len(logs["g0"]) - n0) / (time.monotonic() - t0)
      rogue = subprocess.Popen([sys.executable, "-c", ROGUE, lh.address, str(flood_secs)],
                               stdout=subprocess.PIPE, text=True)
      assert rogue.stdout.readline().strip() == "flooding"
      n1, t1 = len(logs["g0"]), time.monotonic()
      sent = int(rogue.stdout.readline())            # (the rogue stops by itself)
      flooded = (len(logs["g0"]) - n1) / (time.monotonic() - t1)
      assert rogue.wait(timeout=30) == 0
    finally:
      stop.set()
      for t in groups:
        t.join(timeout=30)
      if rogue is not None and rogue.poll() is None:
        rogue.kill()
        rogue.wait()
    refused = lh.status()["refused"]
  assert not any(t.is_alive() for t in groups)
  assert sent > 10_000 and refused > 10_000, (sent, refused)
  # The ring goes on without the lighthouse: its calm rate is bound by the CPU, of
  # which the rogue process takes one of this machine's two cores.
  assert flooded >= 0.3 * calm, f"{flooded=:.1f} commits/s under the flood, {calm=:.1f} without"
  warnings = [r for r in caplog.records if r.name == "jaxckpt.ft.lighthouse" and r.levelno >= logging.WARNING]
  assert 1 <= len(warnings) <= flood_secs / 10 + 2, [r.getMessage() for r in warnings]
  assert "refused" in warnings[-1].getMessage()


def _handshake_failed(sock):
  """Waits for ``sock``'s connection to fail its handshake (what a CURVE server does to a stranger)."""
  monitor = sock.get_monitor_socket()
  failed = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_DISCONNECTED}
  try:
    while monitor.poll(10_000):
      if recv_monitor_message(monitor)["event"] in failed:
        return True
    return False
  finally:
    sock.disable_monitor()
    monitor.close(linger=0)


def test_the_private_port_opens_only_to_holders_of_the_secret():
  with Lighthouse("127.0.0.1:0", LH, secret="the-job") as lh:
    assert lh.private_port is not None
    ctx = zmq.Context()
    try:
      quorum = _wire.seal(b"the-job", {"op": "quorum", "request_id": 1, "member": ["intruder", "h:1", 0, 0, ""]})
      plain = ctx.socket(zmq.DEALER)                           # no CURVE at all
      guess = ctx.socket(zmq.DEALER)                           # CURVE, with the key of another secret
      guess.curve_serverkey = _route.curve_keys(b"a-guess")[0]
      guess.curve_publickey, guess.curve_secretkey = zmq.curve_keypair()
      for sock in (plain, guess):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{lh.private_port}")
        sock.send_multipart(quorum)                            # (even sealed: it never arrives)
        assert _handshake_failed(sock)
        sock.close()
      status = lh.status()
      assert "intruder" not in status["pending"] and status["refused"] == 0 and status["malformed"] == 0
      route = _route.Route(ctx, lh.address, b"the-job")       # the job's own client moves there
      route.send(_wire.seal(b"the-job", {"op": "status", "request_id": 1}))
      reply, _ = _wire.open_(b"the-job", route.recv(5.0))
      assert route.learn(reply) and route.private == lh.private_port
      route.send(_wire.seal(b"the-job", {"op": "status", "request_id": 2}))
      reply, _ = _wire.open_(b"the-job", route.recv(5.0))
      assert reply["request_id"] == 2 and "private" not in reply   # (answered on the private port)
      route.close()
    finally:
      ctx.destroy(linger=0)        # (closes whatever a failed assertion left open)


def _until(cond, what, timeout_secs=30.0):
  deadline = time.monotonic() + timeout_secs
  while not cond():
    assert time.monotonic() < deadline, f"waited {timeout_secs} s for {what}"
    time.sleep(0.01)


def test_a_captured_sealed_message_replayed_to_the_lighthouse_is_refused():
  """A dead group's heartbeat replayed (it would keep the group live) is refused with
  the reason; the group's next real message still counts."""
  key = b"the-job"
  with Lighthouse("127.0.0.1:0", LH, secret="the-job") as lh:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{lh.address}")
    try:
      beat = _wire.seal(key, {"op": "heartbeat", "group": "gX"})
      sock.send_multipart(beat)
      _until(lambda: "gX" in lh.status()["live"], "the first heartbeat")
      sock.send_multipart(beat)                        # the captured frames, again
      assert sock.poll(10000), "the replay was not answered"
      with pytest.raises(errors.PermissionDeniedError, match="replayed"):
        _wire.open_(key, sock.recv_multipart())
      _until(lambda: "gX" not in lh.status()["live"], "gX to be dropped")  # replays keep nobody live
      sock.send_multipart(_wire.seal(key, {"op": "heartbeat", "group": "gX"}))
      _until(lambda: "gX" in lh.status()["live"], "a fresh heartbeat")
    finally:
      sock.close()
      ctx.term()


def test_a_replacement_group_on_a_clock_45_s_behind_is_admitted_and_replays_are_still_refused():
  # The replay check compared a group's messages with its dead predecessor's
  # clock, so a replacement 45 s behind was refused (advised to check its secret) until the
  # job stalled. It is ordered per incarnation now, and still refuses every replay.
  counts = replacement_on_skewed_clock(skew_secs=-45.0, rounds=3)
  assert counts == {"quorums": 6, "replacement_quorums": 3, "replays": 12, "replays_refused": 12,
                    "replays_accepted": 0, "stalls": 0}
  ahead = replacement_on_skewed_clock(skew_secs=+45.0, rounds=2)      # (and one ahead)
  assert ahead["replacement_quorums"] == 2 and ahead["replays_accepted"] == 0 and ahead["stalls"] == 0


def test_a_message_with_a_malformed_incarnation_is_refused_and_changes_nothing():
  key = b"the-job"
  with Lighthouse("127.0.0.1:0", LH, secret="the-job") as lh:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{lh.address}")
    try:
      sock.send_multipart(_wire.seal(key, {"op": "heartbeat", "group": "gX", "inc": b"short", "seq": 1}))
      assert sock.poll(10000), "the message was not answered"
      with pytest.raises(errors.PermissionDeniedError, match="malformed incarnation"):
        _wire.open_(key, sock.recv_multipart())
      assert "gX" not in lh.status()["live"] and lh.refused == 1
    finally:
      sock.close()
      ctx.term()
