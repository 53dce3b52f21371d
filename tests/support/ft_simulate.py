"""Many simulated replica groups asking one lighthouse for quorums (for scale tests and benchmarks).

A simulated group is only its quorum requests: G of them share a few DEALER
sockets (the lighthouse answers each request on the socket it came from), so
thousands of groups need no thousands of sockets or threads. A round is one
quorum of all G groups, timed from the last group's request to the moment every
group holds its reply (received, not yet verified: each real member verifies
its own in parallel), with the bytes of each reply.

>>> from datetime import timedelta
>>> from jaxckpt.ft.lighthouse import Lighthouse, LighthouseOptions
>>> opts = LighthouseOptions(min_replicas=4, join_timeout=timedelta(milliseconds=10))
>>> with Lighthouse("127.0.0.1:0", opts) as lh, SimulatedGroups(lh, 4) as groups:
...   first, second = groups.round(), groups.round()
>>> second.reply_bytes_max < first.reply_bytes_max     # (the first carries the whole view)
True
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import zmq

from jaxckpt import errors
from jaxckpt.ft._quorum import Member, View
from jaxckpt.net import _wire


@dataclasses.dataclass(frozen=True, slots=True)
class Round:
  """One quorum of all simulated groups."""
  groups: int
  quorum_secs: float          # the last request sent .. every reply received
  form_secs: float            # the lighthouse's own time forming it (replies sealed and queued)
  lighthouse_cpu_secs: float  # CPU time the lighthouse spent on the round (G requests, the quorum, G replies)
  reply_bytes_mean: float
  reply_bytes_max: int
  reply_bytes_total: int


class SimulatedGroups:
  """``n`` groups ``s0000 ..`` of one in-process :class:`~jaxckpt.ft.lighthouse.Lighthouse`
  ``lh`` (its ``min_replicas`` should be ``n``, so a quorum forms when the last asks)."""

  def __init__(self, lh: Any, n: int, *, sockets: int = 8, timeout_secs: float = 60.0) -> None:
    self._lh, self.n, self._timeout = lh, n, timeout_secs
    self._key = _wire.secret_bytes(lh.secret, who="simulated groups")
    self._ctx = zmq.Context()
    self._socks = []
    for _ in range(min(sockets, n)):
      sock = _wire.socket(self._ctx, zmq.DEALER)
      sock.setsockopt(zmq.RCVHWM, 0)          # (all replies of a round arrive at once)
      sock.connect(f"tcp://{lh.address}")
      self._socks.append(sock)
    self.ids = [f"s{i:04d}" for i in range(n)]
    self.step = 0
    self.views = [""] * n                      # the view key each group holds
    self._request_ids = iter(range(1, 1 << 62))
    self._check = View()                       # one group's view, resolved every round (a check)

  def round(self) -> Round:
    """One quorum: all groups ask at ``self.step``; returns its cost and advances the step."""
    asked = {}
    cpu = self._lh.status()["cpu_secs"]
    for i in range(self.n - 1):
      asked[self._ask(i)] = i
    self._wait_pending(self.n - 1)
    t0 = time.perf_counter()
    asked[self._ask(self.n - 1)] = self.n - 1
    replies = self._collect(len(asked))
    secs = time.perf_counter() - t0
    sizes = self._read(replies, asked)
    self.step += 1
    status = self._lh.status()
    return Round(groups=self.n, quorum_secs=secs, form_secs=status["last_form_secs"],
                 lighthouse_cpu_secs=status["cpu_secs"] - cpu,
                 reply_bytes_mean=sum(sizes) / len(sizes), reply_bytes_max=max(sizes),
                 reply_bytes_total=sum(sizes))

  def _ask(self, i: int) -> int:
    rid = next(self._request_ids)
    member = Member(group_id=self.ids[i], address=f"127.0.0.1:{10000 + i}", step=self.step, digest=self.step,
                    ring_address=f"127.0.0.1:{20000 + i}")
    self._socks[i % len(self._socks)].send_multipart(_wire.seal(self._key, {
        "op": "quorum", "request_id": rid, "member": member.to_wire(), "view": self.views[i]}))
    return rid

  def _wait_pending(self, n: int) -> None:
    deadline = time.monotonic() + self._timeout
    while len(self._lh.status()["pending"]) < n:
      if time.monotonic() > deadline:
        raise errors.QuorumError(f"the lighthouse got {len(self._lh.status()['pending'])} of {n} requests")
      time.sleep(0.001)

  def _collect(self, n: int) -> list[list[bytes]]:
    poller = zmq.Poller()
    for sock in self._socks:
      poller.register(sock, zmq.POLLIN)
    out: list[list[bytes]] = []
    deadline = time.monotonic() + self._timeout
    while len(out) < n:
      if time.monotonic() > deadline:
        raise errors.QuorumError(f"{len(out)} of {n} quorum replies arrived within {self._timeout} s")
      for sock, _ in poller.poll(100):
        while True:
          try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
          except zmq.Again:
            break
          if _wire.open_(self._key, frames)[0].get("op") != "waiting":
            out.append(frames)        # (a 'waiting' note: the member goes on waiting)
    return out

  def _read(self, replies: list[list[bytes]], asked: dict[int, int]) -> list[int]:
    """Each reply's size; verifies them all, records the view each group holds now, and
    resolves one group's (the first) as a member would."""
    sizes = []
    for frames in replies:
      header, raw = _wire.open_(self._key, frames)
      i = asked[header["request_id"]]
      wire = dict(header["quorum"], delta=raw[0] if raw else None)
      if i == 0:
        quorum = self._check.resolve(self.ids[0], wire)
        if len(quorum.members) != self.n or quorum.max_step != self.step:
          raise errors.QuorumError(f"simulated quorum of {len(quorum.members)} members at step "
                                   f"{quorum.max_step}, not {self.n} at {self.step}")
      self.views[i] = wire["view"]
      sizes.append(sum(len(f) for f in frames))
    return sizes

  def close(self) -> None:
    for sock in self._socks:
      sock.close(linger=0)
    self._ctx.term()

  def __enter__(self) -> SimulatedGroups:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

