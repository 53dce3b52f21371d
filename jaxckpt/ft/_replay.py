"""The lighthouse's replay check: a sequence number per incarnation of each sender.

Every message that changes the lighthouse's state (a heartbeat, a quorum
request, a readiness or failure report) names its sender (a replica group) and
carries ``inc``, 16 random bytes drawn once per client object (an *incarnation*
of the group's process), and ``seq``, that client's message counter. A message
is accepted only if its ``seq`` is above the last one accepted from the same
``(op, group, inc)``: a captured message replayed, or one overtaken by a newer
one, is refused.

Clocks play no part in the order: a replacement group (a new process, maybe on
a machine whose clock is 45 s behind its dead predecessor's) is a new
incarnation, so its messages are accepted, while its predecessor's can still
not be replayed: each incarnation's last ``seq`` is kept for as long as any
message of it can pass the sealed timestamp window
(:data:`jaxckpt.net._wire.MAX_SKEW_SECS` after its newest timestamp), and the
memory grows with groups and restarts, not messages. At most
``max_incarnations`` are kept per sender (a group restarting that often within
the window is a bug; the oldest is forgotten first).

A message without ``inc`` and ``seq`` (a client of an older version) must be
newer, by its timestamp, than the last such one of its ``(op, group)``.

>>> check, now = Incarnations(lambda h: (h["op"], h["group"])), time.time()
>>> check.check(b"n" * 8, now, {"op": "heartbeat", "group": "g0", "inc": b"a" * 16, "seq": 1})
>>> check.check(b"n" * 8, now - 45, {"op": "heartbeat", "group": "g0", "inc": b"b" * 16, "seq": 1})
>>> check.check(b"n" * 8, now, {"op": "heartbeat", "group": "g0", "inc": b"a" * 16, "seq": 1})
Traceback (most recent call last):
...
jaxckpt.errors.PermissionDeniedError: a replayed message was refused (sequence number 1 of its sender's incarnation was accepted before)
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from jaxckpt import errors
from jaxckpt.net import _wire

INC_BYTES = 16
_MAX_SEQ = (1 << 63) - 1


class Incarnations:
  """Refuses replays of the messages that name a sender (``sender(header)``; None: not checked)."""

  def __init__(self, sender: Callable[[dict[str, Any]], Any], max_incarnations: int = 64) -> None:
    self._sender = sender
    self._max = max_incarnations
    self._last: dict[Any, dict[Any, tuple[float, float]]] = {}   # sender -> inc -> (seq, newest ts)
    self._lock = threading.Lock()
    self.refused = 0

  def check(self, nonce: Any, ts: float, header: dict[str, Any]) -> None:
    """Records the message; PermissionDeniedError if it is a replay (or malformed for the check)."""
    del nonce
    key = self._sender(header)
    if key is None:
      return
    inc, seq = header.get("inc"), header.get("seq")
    if inc is None and seq is None:
      inc, order = None, float(ts)                    # (an older client: its clock orders)
    elif (isinstance(inc, bytes) and len(inc) == INC_BYTES and isinstance(seq, int)
          and not isinstance(seq, bool) and 0 <= seq <= _MAX_SEQ):
      order = float(seq)
    else:
      raise errors.PermissionDeniedError(
          f"a sealed message with a malformed incarnation was refused (inc must be {INC_BYTES} bytes "
          "and seq an int in [0, 2**63))")
    now = time.time()
    with self._lock:
      incs = self._last.setdefault(key, {})
      for old in [i for i, (_, newest) in incs.items() if newest + _wire.MAX_SKEW_SECS + 1.0 < now]:
        del incs[old]                                 # (none of its messages passes the window now)
      last = incs.get(inc)
      if last is not None and order <= last[0]:
        self.refused += 1
        raise errors.PermissionDeniedError(
            "a replayed message was refused (" + (
                f"sequence number {seq} of its sender's incarnation was accepted before)" if inc is not None
                else "not newer than the last one from its sender)"))
      if last is None and len(incs) >= self._max:
        del incs[min(incs, key=lambda i: incs[i][1])]
      incs[inc] = (order, max(float(ts), last[1] if last else float(ts)))


class Stamp:
  """A client's incarnation: ``stamp(header)`` adds its ``inc`` and the next ``seq``."""

  def __init__(self) -> None:
    self.inc = os.urandom(INC_BYTES)
    self._seq = 0
    self._lock = threading.Lock()

  def __call__(self, header: dict[str, Any]) -> dict[str, Any]:
    with self._lock:
      self._seq += 1
      return dict(header, inc=self.inc, seq=self._seq)
