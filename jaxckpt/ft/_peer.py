"""Requests between replica groups (their process 0).

Every group binds one ROUTER socket, served by a background thread: requests
(``ring_get``, ``digest``, ``snap_where``, ``snap_fetch``) are answered there by
a handler, so a healthy trainer never pauses to serve a recovering peer. (The
all-reduce's bytes travel on their own streams: :mod:`jaxckpt.ft._links`.)

Every message is sealed with the job's secret (:mod:`jaxckpt.net._wire`); one that
is not, or that was accepted before (a captured request replayed: each could make a
healthy group read and send its whole state again), is refused, logged, and never
reaches the handler.

A request may carry ``wait`` (seconds): a handler that cannot answer it yet
returns :data:`LATER`, and the serving thread asks it again (every millisecond
while one waits) until it answers or the wait is over, when it is asked once
more with ``wait`` 0. So a recovering group waits for a step's entry with one
request, not by polling.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np
import zmq

from jaxckpt import errors
from jaxckpt.net import _wire

logger = logging.getLogger(__name__)

Message = tuple[_wire.Header, list[np.ndarray]]
LATER = None           # what a handler returns for a request it cannot answer yet (see ``wait``)
Handler = Callable[[_wire.Header], "tuple[_wire.Header, Sequence[np.ndarray]] | None"]
_MAX_WAIT_SECS = 60.0  # the longest a request may be held
_MAX_HELD = 64         # requests held at once (more are answered at once)


class PeerServer:
  """The ROUTER socket of one replica group and its serving thread."""

  def __init__(self, ctx: zmq.Context, host: str, handler: Handler, *, secret: bytes,
               drop: Callable[[], bool] = lambda: False, advertise: str | None = None):
    self._secret = secret
    self.refused = 0            # messages not sealed with the job's secret, or replayed
    self._replays = _wire.Replays()   # each request is served at most once
    self._sock = _wire.socket(ctx, zmq.ROUTER)
    # (bound on ``host``; peers are told ``advertise``, see ft/_address.py)
    self.address = f"{advertise or host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
    self._handler = handler
    self._drop = drop
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"peer-{self.address}", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    held: list[tuple[bytes, _wire.Header, float]] = []     # (sender, request, until when)
    while not self._stop.is_set():
      frames = _wire.recv(self._sock, 0.001 if held else 0.02)
      now = time.monotonic()
      for sender, header, until in held:
        if self._serve(sender, header, last=now >= until):
          held.remove((sender, header, until))
      if frames is None or self._drop():
        continue
      try:
        header, raw = _wire.open_(self._secret, frames[1:], replays=self._replays)
      except errors.PermissionDeniedError as e:
        self.refused += 1
        logger.warning("peer %s refused a message: %s", self.address, e)
        _wire.send(self._sock, [frames[0], *_wire.refusal(str(e))])
        continue
      try:
        _wire.arrays_of(header, raw)           # (requests carry none; checks the framing)
      except Exception as e:  # pylint: disable=broad-except
        self._answer(frames[0], header, {"op": "error", "error": f"{type(e).__name__}: {e}"}, ())
        continue
      wait = header.get("wait")
      wait = min(float(wait), _MAX_WAIT_SECS) if isinstance(wait, (int, float)) and wait > 0 else 0.0
      if not self._serve(frames[0], header, last=not wait or len(held) >= _MAX_HELD):
        held.append((frames[0], header, now + wait))
    self._sock.close(linger=0)

  def _serve(self, sender: bytes, header: _wire.Header, *, last: bool) -> bool:
    """Answers ``header`` unless its handler says LATER (and this is not the ``last`` try)."""
    try:
      got = self._handler(dict(header, wait=0) if last else header)
      if got is LATER and last:
        raise RuntimeError(f"the handler held {header.get('op')!r} with no wait left")
    except Exception as e:  # pylint: disable=broad-except
      logger.warning("peer %s failed to serve a message: %s", self.address, e, exc_info=True)
      got = {"op": "error", "error": f"{type(e).__name__}: {e}"}, ()
    if got is LATER:
      return False
    self._answer(sender, header, *got)
    return True

  def _answer(self, sender: bytes, header: _wire.Header, reply: _wire.Header,
              out: Sequence[np.ndarray]) -> None:
    reply = dict(reply, request_id=header.get("request_id"))
    _wire.send(self._sock, [sender] + _wire.seal(self._secret, reply, out))

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=5)


class PeerSender:
  """Sends requests to other groups (used from one thread only)."""

  def __init__(self, ctx: zmq.Context, *, secret: bytes,
               drop: Callable[[], bool] = lambda: False):
    self._ctx = ctx
    self._secret = secret
    self._drop = drop
    self._ids = 0

  def request(self, address: str, header: _wire.Header, timeout_secs: float) -> Message | None:
    """The reply of ``address`` to ``header`` within ``timeout_secs``, or None."""
    if self._drop():
      return None
    self._ids += 1
    sock = _wire.socket(self._ctx, zmq.DEALER)
    try:
      sock.connect(f"tcp://{address}")
      _wire.send(sock, _wire.seal(self._secret, dict(header, request_id=self._ids)))
      deadline = time.monotonic() + timeout_secs
      while (remaining := deadline - time.monotonic()) > 0:
        frames = _wire.recv(sock, remaining)
        if frames is None:
          return None
        try:
          reply, raw = _wire.open_(self._secret, frames)
        except errors.PermissionDeniedError as e:
          logger.warning("peer %s: %s", address, e)
          return None
        if reply.get("request_id") == self._ids:
          return reply, _wire.arrays_of(reply, raw)
      return None
    finally:
      sock.close(linger=0)
