"""What a server does with messages before it trusts them: cheap drops, counted, logged sparingly.

Anyone who can reach a port can send to it as fast as a core allows. So a
server's receive loop (the lighthouse's) must spend little on a message that
cannot be the job's:

* :func:`drain` takes what is queued in one batch (bounded, so the loop still
  does its own work between batches however fast messages arrive);
* :func:`looks_sealed` tells, from frame counts and lengths alone (no decoding,
  no MAC), whether a message can be sealed at all; the rest is dropped unread;
* :class:`Refusals` counts what was refused and logs one line per
  ``every_secs`` with the count and the last reason, never one per message;
* :class:`AnswerLimiter` answers each sender's refusals at most once per
  ``every_secs`` (a misconfigured group learns why; a flood gets no echo).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import zmq

MAC_BYTES = 32               # HMAC-SHA256 (jaxckpt.net._wire)


def drain(sock: zmq.Socket, timeout_secs: float, limit: int) -> list[tuple[list[bytes], int]]:
  """Up to ``limit`` messages queued on ``sock`` (waiting up to ``timeout_secs`` for the first),
  each with the file descriptor of the connection it came on (-1 if unknown)."""
  if not sock.poll(max(0, int(timeout_secs * 1000)), zmq.POLLIN):
    return []
  out = []
  while len(out) < limit:
    try:
      first = sock.recv(zmq.NOBLOCK, copy=False)
    except zmq.Again:
      break
    frames = [first.bytes]
    while sock.rcvmore:                      # (a multipart message arrives whole)
      frames.append(sock.recv(zmq.NOBLOCK))
    out.append((frames, first.get(zmq.SRCFD)))
  return out


def looks_sealed(frames: list[bytes]) -> bool:
  """Whether a ROUTER message ``[identity, mac, header, ...]`` can be sealed (its mac has the size of one)."""
  return len(frames) >= 3 and len(frames[1]) == MAC_BYTES


class Refusals:
  """A counter of refused messages and a log line at most every ``every_secs``.

  >>> r = Refusals(logging.getLogger("doc"), "the lighthouse", "not sealed with the job's secret")
  >>> r.add("no mac"); r.add("no mac"); r.count
  2
  """

  def __init__(self, logger: logging.Logger, who: str, what: str, every_secs: float = 10.0) -> None:
    self.count = 0
    self._logger, self._who, self._what, self._every = logger, who, what, every_secs
    self._unlogged = 0
    self._last_reason = ""
    self._logged_at = -math.inf

  def add(self, reason: str) -> None:
    self.count += 1
    self._unlogged += 1
    self._last_reason = reason

  def maybe_log(self, now: float | None = None) -> None:
    """Logs the refusals since the last line, if any, once ``every_secs`` have passed since it."""
    now = time.monotonic() if now is None else now
    if not self._unlogged or now - self._logged_at < self._every:
      return
    since = "" if self._logged_at == -math.inf else f" in the last {now - self._logged_at:.0f} s"
    self._logger.warning("%s refused %d message(s) %s%s (%d in all; the last: %s)", self._who,
                         self._unlogged, self._what, since, self.count, self._last_reason)
    self._unlogged, self._logged_at = 0, now


class AnswerLimiter:
  """Whether to answer a sender (by its ZeroMQ identity) now: at most once per ``every_secs`` each."""

  def __init__(self, every_secs: float = 1.0, max_senders: int = 4096) -> None:
    self._every, self._max = every_secs, max_senders
    self._last: dict[Any, float] = {}

  def allow(self, sender: Any, now: float) -> bool:
    if now - self._last.get(sender, -math.inf) < self._every:
      return False
    if len(self._last) >= self._max:      # (a flood from many connections: forget, stay bounded)
      self._last.clear()
    self._last[sender] = now
    return True
