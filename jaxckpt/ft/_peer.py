"""Point-to-point messages between replica groups (their process 0).

Every group binds one ROUTER socket, served by a background thread:

* pushes (``ring`` hops of the all-reduce) land in an :class:`Inbox` that the
  training thread waits on, keyed by quorum id and hop;
* requests (``ring_get``, ``snap_latest``, ``snap_fetch``) are answered on the
  serving thread by a handler, so a healthy trainer never pauses to serve a
  recovering peer.

Every message is sealed with the job's secret (:mod:`jaxckpt._wire`); one that
is not is refused, logged, and never reaches the inbox or the handler.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from jaxckpt import _wire, errors

logger = logging.getLogger(__name__)

PUSH_OPS = frozenset({"ring"})
Message = tuple[_wire.Header, list[np.ndarray]]
Handler = Callable[[_wire.Header], tuple[_wire.Header, Sequence[np.ndarray]]]


class Inbox:
  """Pushed messages of the current quorum, by op, hop and sender group."""

  def __init__(self):
    self._cond = threading.Condition()
    self._qid: str | None = None
    self._messages: dict[tuple[str, str, int], dict[str, Message]] = {}

  def put(self, header: _wire.Header, arrays: list[np.ndarray]) -> None:
    with self._cond:
      key = (header["op"], header["quorum_id"], int(header.get("hop", 0)))
      self._messages.setdefault(key, {})[header["group"]] = (header, arrays)
      self._cond.notify_all()

  def retain(self, quorum_id: str) -> None:
    """Forgets messages of every other quorum."""
    with self._cond:
      self._qid = quorum_id
      self._messages = {k: v for k, v in self._messages.items() if k[1] == quorum_id}

  def wait(self, ops: Sequence[str], quorum_id: str, done: Callable[[dict[str, Message]], bool],
           deadline: float, *, hop: int = 0) -> dict[str, Message]:
    """Messages of ``ops`` (and ``hop``) for ``quorum_id`` once ``done`` holds
    for them or at ``deadline``; the messages returned are forgotten."""
    with self._cond:
      while True:
        got: dict[str, Message] = {}
        for op in ops:
          got.update(self._messages.get((op, quorum_id, hop), {}))
        remaining = deadline - time.monotonic()
        if done(got) or remaining <= 0:
          for op in ops:
            self._messages.pop((op, quorum_id, hop), None)
          return got
        self._cond.wait(remaining)


class PeerServer:
  """The ROUTER socket of one replica group and its serving thread."""

  def __init__(self, ctx: zmq.Context, host: str, handler: Handler, *, secret: bytes,
               drop: Callable[[], bool] = lambda: False):
    self.inbox = Inbox()
    self._secret = secret
    self.refused = 0            # messages not sealed with the job's secret
    self._sock = _wire.socket(ctx, zmq.ROUTER)
    self.address = f"{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
    self._handler = handler
    self._drop = drop
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"peer-{self.address}", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.is_set():
      frames = _wire.recv(self._sock, 0.02)
      if frames is None or self._drop():
        continue
      try:
        header, raw = _wire.open_(self._secret, frames[1:])
      except errors.PermissionDeniedError as e:
        self.refused += 1
        logger.warning("peer %s refused a message: %s", self.address, e)
        _wire.send(self._sock, [frames[0], *_wire.refusal(str(e))])
        continue
      try:
        arrays = _wire.arrays_of(header, raw)
        if header.get("op") in PUSH_OPS:
          self.inbox.put(header, arrays)
          continue
        reply, out = self._handler(header)
      except Exception as e:  # pylint: disable=broad-except
        logger.warning("peer %s failed to serve a message: %s", self.address, e, exc_info=True)
        reply, out = {"op": "error", "error": f"{type(e).__name__}: {e}"}, ()
      reply = dict(reply, request_id=header.get("request_id"))
      _wire.send(self._sock, [frames[0]] + _wire.seal(self._secret, reply, out))
    self._sock.close(linger=0)

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=5)


class PeerSender:
  """Sends pushes and requests to other groups (used from one thread only)."""

  def __init__(self, ctx: zmq.Context, *, secret: bytes,
               drop: Callable[[], bool] = lambda: False):
    self._ctx = ctx
    self._secret = secret
    self._drop = drop
    self._socks: dict[str, zmq.Socket] = {}
    self._ids = 0

  def push(self, address: str, header: _wire.Header, arrays: Sequence[np.ndarray] = ()) -> None:
    """Queues a message for ``address``; lost silently if the peer is gone (receivers time out)."""
    if self._drop():
      return
    sock = self._socks.get(address)
    if sock is None:
      sock = self._socks[address] = _wire.socket(self._ctx, zmq.DEALER)
      sock.connect(f"tcp://{address}")
    if not _wire.send(sock, _wire.seal(self._secret, header, arrays)):
      logger.warning("could not queue %r for peer %s", header.get("op"), address)

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

  def close(self, linger_secs: float = 0.0) -> None:
    """Closes every socket; queued pushes still reach live peers for up to ``linger_secs``.

    The wait happens in the context's ``term()``, which returns as soon as every
    queued message is sent (a dead peer costs at most ``linger_secs``).
    """
    for sock in self._socks.values():
      sock.close(linger=max(0, int(linger_secs * 1000)))
    self._socks.clear()
