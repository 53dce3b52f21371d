"""A replayed request to a replica group's peer: a peer's serving thread
answers a captured request once, never again for whoever replays it."""

from __future__ import annotations

import threading

import zmq

from jaxckpt.ft import _peer
from jaxckpt.net import _wire

SECRET = b"the-job"


def _raw(ctx: zmq.Context, address: str, frames: list, timeout_secs: float = 2.0) -> list | None:
  """Sends ``frames`` as they are (a replay: no new seal) and returns the reply, if any."""
  sock = _wire.socket(ctx, zmq.DEALER)
  try:
    sock.connect(f"tcp://{address}")
    sock.send_multipart(frames)
    return _wire.recv(sock, timeout_secs)
  finally:
    sock.close(linger=0)


def test_a_replayed_peer_request_is_refused_and_never_served_again():
  # A healthy group serves a recovering one its state (``snap_fetch``: the whole
  # state, from its agents) or a ring entry. An eavesdropper without the secret who
  # captured one such request must not make the group serve it again: each replay
  # would cost the group a full snapshot read and send (and queue it in memory).
  served = []
  lock = threading.Lock()

  def handler(header):
    with lock:
      served.append(header.get("op"))
    return {"op": "snapshot", "paths": []}, ()

  ctx = zmq.Context()
  server = _peer.PeerServer(ctx, "127.0.0.1", handler, secret=SECRET)
  try:
    captured = _wire.seal(SECRET, {"op": "snap_fetch", "step": 7, "request_id": 1})
    first = _raw(ctx, server.address, captured)
    assert first is not None and _wire.open_(SECRET, first)[0]["op"] == "snapshot"
    for _ in range(3):                               # the eavesdropper replays it
      _raw(ctx, server.address, captured, timeout_secs=0.5)
    with lock:
      assert served == ["snap_fetch"], served        # served once, for its sender only
    assert server.refused == 3
    honest = _peer.PeerSender(ctx, secret=SECRET)    # a fresh request is served as before
    reply = honest.request(server.address, {"op": "snap_fetch", "step": 7}, 2.0)
    assert reply is not None and reply[0]["op"] == "snapshot"
  finally:
    server.stop()
    ctx.term()
