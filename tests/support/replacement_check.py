"""A check for the chaos soak: a replacement replica group on a skewed clock (issue 32, item 8).

:func:`replacement_on_skewed_clock` runs an in-process lighthouse and a few
simulated groups (each a socket that seals its own heartbeats and quorum
requests, as :class:`~jaxckpt.ft.lighthouse.LighthouseClient` does) for some
quorums. Then the last group dies, and a replacement with the same group id
takes its place from a machine whose clock is ``skew_secs`` off (45 s behind by
default): a new incarnation (:mod:`jaxckpt.ft._replay`). The lighthouse must
admit it, and must still refuse every message of the dead group and of the
replacement when replayed. It returns counts, so a soak can add them up.

>>> counts = replacement_on_skewed_clock(rounds=2)
>>> counts["replacement_quorums"], counts["replays_accepted"], counts["stalls"]
(2, 0, 0)
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta
from typing import Any

import zmq

from jaxckpt import errors
from jaxckpt.ft import _replay
from jaxckpt.ft._quorum import Member, Quorum, View
from jaxckpt.ft.lighthouse import Lighthouse, LighthouseOptions
from jaxckpt.net import _wire


class _Group:
  """A simulated group: its heartbeats and quorum requests, sealed on its own clock."""

  def __init__(self, ctx: zmq.Context, lh: Lighthouse, key: bytes, gid: str, skew_secs: float) -> None:
    self.gid, self._key, self._skew = gid, key, skew_secs
    self._sock = _wire.socket(ctx, zmq.DEALER)
    self._sock.connect(f"tcp://{lh.address}")
    self._stamp = _replay.Stamp()
    self.view = View()
    self.sent: list[list[bytes]] = []          # every message, as captured on the wire

  def _send(self, header: dict[str, Any]) -> None:
    body = _wire.pack(dict(self._stamp(header), ts=time.time() + self._skew, nonce=os.urandom(8)))
    frames = [_wire.sign(self._key, body), body]
    self.sent.append(frames)
    self._sock.send_multipart(frames)

  def ask(self, step: int) -> int:
    self._send({"op": "heartbeat", "group": self.gid})
    rid = secrets.randbits(48)
    member = Member(group_id=self.gid, address=f"127.0.0.1:{1 + int(self.gid[1:])}", step=step, digest=step)
    self._send({"op": "quorum", "request_id": rid, "member": member.to_wire(), "view": self.view.key,
                "ask": rid, "held": len(self.view.members) or None})
    return rid

  def reply(self, rid: int, deadline: float) -> Quorum | None:
    while (left := deadline - time.monotonic()) > 0:
      frames = _wire.recv(self._sock, left)
      if frames is None:
        return None
      try:
        header, raw = _wire.open_(self._key, frames)
      except errors.PermissionDeniedError:
        return None                              # (refused: the replacement was taken for a replay)
      if header.get("op") == "quorum" and header.get("request_id") == rid:
        wire = dict(header["quorum"], delta=bytes(raw[0]) if raw else None)
        return self.view.resolve(self.gid, wire)
    return None

  def close(self) -> None:
    self._sock.close(linger=0)


def replacement_on_skewed_clock(*, skew_secs: float = -45.0, groups: int = 3, rounds: int = 3,
                                timeout_secs: float = 10.0) -> dict[str, int]:
  """Quorums with a replacement group on a clock ``skew_secs`` off, then replays of its and its
  dead predecessor's messages.

  Returns:
    ``quorums`` (formed), ``replacement_quorums`` (those the replacement was in; ``rounds``
    when it is admitted), ``replays`` (messages replayed), ``replays_refused``,
    ``replays_accepted`` (0 unless a replay fooled the lighthouse) and ``stalls`` (rounds
    with no quorum within ``timeout_secs``).
  """
  if groups < 2 or rounds < 1:
    raise errors.InvalidArgumentError(f"replacement_on_skewed_clock needs groups >= 2 and rounds >= 1, "
                                      f"got {groups=} {rounds=}")
  opts = LighthouseOptions(min_replicas=groups, heartbeat_timeout=timedelta(seconds=timeout_secs),
                           join_timeout=timedelta(milliseconds=10))
  counts = dict.fromkeys(("quorums", "replacement_quorums", "replays", "replays_refused",
                          "replays_accepted", "stalls"), 0)
  ctx = zmq.Context()
  with Lighthouse("127.0.0.1:0", opts, private_port=None) as lh:
    key = lh.secret.encode()
    members = [_Group(ctx, lh, key, f"g{k}", 0.0) for k in range(groups)]
    dead = None
    try:
      for step in range(2 * rounds):
        if step == rounds:                       # the last group dies; its replacement is skewed
          dead = members[-1]
          members[-1] = _Group(ctx, lh, key, dead.gid, skew_secs)
        asked = [(m, m.ask(step)) for m in members]
        deadline = time.monotonic() + timeout_secs
        got = [m.reply(rid, deadline) for m, rid in asked]
        if any(q is None for q in got):
          counts["stalls"] += 1
          continue
        counts["quorums"] += 1
        counts["replacement_quorums"] += step >= rounds and members[-1].gid in got[0].members
      replays = [f for m in (dead, members[-1]) if m is not None for f in m.sent]
      refused = lh.refused
      with _wire.socket(ctx, zmq.DEALER) as thief:
        thief.connect(f"tcp://{lh.address}")
        for frames in replays:
          thief.send_multipart(frames)
        deadline = time.monotonic() + timeout_secs
        while lh.refused - refused < len(replays) and time.monotonic() < deadline:
          time.sleep(0.005)
      counts["replays"] = len(replays)
      counts["replays_refused"] = lh.refused - refused
      counts["replays_accepted"] = len(replays) - counts["replays_refused"]
    finally:
      for m in members + ([dead] if dead is not None else []):
        m.close()
  ctx.term()
  return counts
