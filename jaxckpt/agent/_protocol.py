"""Request/reply over ZeroMQ with msgpack bodies; every wait has a timeout.

A request is ``[msgpack({"op": ..., **args}), *raw_frames]``; a reply is
``[msgpack({"ok": True, ...} | {"ok": False, "error": str, "type": str}), *raw]``.
Tensor bytes travel only as raw frames (remote fetches), never inside msgpack.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import zmq

from jaxckpt import errors


def pack(obj: dict[str, Any]) -> bytes:
  return msgpack.packb(obj, use_bin_type=True)


def unpack(b: bytes) -> dict[str, Any]:
  return msgpack.unpackb(b, raw=False, strict_map_key=False)


class Client:
  """A thread-safe request/reply client of one agent (a fresh REQ socket per
  failure, so a timed-out request never leaves the socket stuck)."""

  def __init__(self, endpoint: str, *, who: str, timeout_secs: float) -> None:
    self.endpoint = endpoint
    self.who = who
    self.timeout_secs = timeout_secs
    self._ctx = zmq.Context.instance()
    self._lock = threading.Lock()
    self._sock: zmq.Socket | None = None

  def _socket(self) -> zmq.Socket:
    if self._sock is None:
      s = self._ctx.socket(zmq.REQ)
      s.setsockopt(zmq.LINGER, 0)
      s.connect(self.endpoint)
      self._sock = s
    return self._sock

  def call(self, op: str, *frames: Any, timeout_secs: float | None = None,
           **args: Any) -> tuple[dict[str, Any], list[zmq.Frame]]:
    timeout = self.timeout_secs if timeout_secs is None else timeout_secs
    with self._lock:
      sock = self._socket()
      try:
        sock.send_multipart([pack({"op": op, **args}), *frames], copy=False)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
          raise errors.AgentUnavailableError(
              f"{self.who} did not answer {op!r} within {timeout} s at {self.endpoint}; "
              "is it alive? (`jaxckpt agent status`)")
        parts = sock.recv_multipart(copy=False)
      except BaseException:
        self._reset()
        raise
    reply = unpack(parts[0].bytes)
    if not reply.get("ok"):
      raise _remote_error(reply, self.who, op)
    return reply, parts[1:]

  def _reset(self) -> None:
    if self._sock is not None:
      self._sock.close(linger=0)
      self._sock = None

  def close(self) -> None:
    with self._lock:
      self._reset()


def _remote_error(reply: dict[str, Any], who: str, op: str) -> Exception:
  cls = getattr(errors, reply.get("type", ""), None)
  if not (isinstance(cls, type) and issubclass(cls, errors.JaxckptError)):
    cls = errors.AgentUnavailableError
  return cls(f"{who} refused {op!r}: {reply.get('error')}")
