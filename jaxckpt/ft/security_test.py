"""Replica groups and the lighthouse refuse anyone without the job's secret."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import zmq

from jaxckpt import _wire, errors
from jaxckpt.ft import Lighthouse, LighthouseOptions, ReplicaGroup, ReplicaGroupOptions
from jaxckpt.ft import _peer

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
