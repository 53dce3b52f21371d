"""Request/reply over ZeroMQ with msgpack bodies; every wait has a timeout.

A request is ``[mac, msgpack({"op": ..., "ts": ..., "nonce": ..., **args}), *raw_frames]``
where ``mac`` is the HMAC-SHA256 of the header under the job's secret (see
``_paths.job_secret``): the agent refuses a request whose mac does not verify
(compared in constant time) or whose ``ts`` is more than ``MAX_SKEW_SECS`` off.
The raw frames are not in the mac: they are snapshot bytes whose checksums are
in an authenticated header (a commit's manifest), so forged bytes are refused
when they are verified. A reply is
``[msgpack({"ok": True, ...} | {"ok": False, "error": str, "type": str}), *raw]``.
Tensor bytes travel only as raw frames (remote fetches), never inside msgpack.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from typing import Any

import msgpack
import zmq

from jaxckpt import errors


def pack(obj: dict[str, Any]) -> bytes:
  return msgpack.packb(obj, use_bin_type=True)


def unpack(b: bytes) -> dict[str, Any]:
  return msgpack.unpackb(b, raw=False, strict_map_key=False)


MAX_SKEW_SECS = 300.0


def sign(secret: bytes, header: bytes) -> bytes:
  return hmac.new(secret, header, hashlib.sha256).digest()


def request(secret: bytes, op: str, args: dict[str, Any],
            timeout_secs: float | None = None) -> list[bytes]:
  """The signed frames of a request (before its raw frames). A request with a
  ``timeout_secs`` carries its deadline: an agent that gets to it later (it was
  stopped, or hung) does not apply it, since the caller has given up."""
  now = time.time()
  header = pack({"op": op, "ts": now, "nonce": os.urandom(8),
                 "deadline": None if timeout_secs is None else now + timeout_secs, **args})
  return [sign(secret, header), header]


def expired(req: dict[str, Any]) -> bool:
  """Whether the caller of ``req`` has given up on it (its deadline passed)."""
  deadline = req.pop("deadline", None)
  return deadline is not None and time.time() > float(deadline)


def verify(secret: bytes, frames: list[bytes]) -> dict[str, Any]:
  """The request's header if its mac verifies; else PermissionDeniedError."""
  if len(frames) < 2 or len(frames[0]) != hashlib.sha256().digest_size:
    raise errors.PermissionDeniedError("request without the job's secret refused")
  if not hmac.compare_digest(sign(secret, frames[1]), frames[0]):
    raise errors.PermissionDeniedError("request with a wrong mac refused (not the job's secret)")
  req = unpack(frames[1])
  if not isinstance(req, dict) or abs(time.time() - float(req.pop("ts", 0))) > MAX_SKEW_SECS:
    raise errors.PermissionDeniedError("request too old or from the future refused (a replay?)")
  req.pop("nonce", None)
  return req


class Client:
  """A thread-safe request/reply client of one agent (a fresh REQ socket per
  failure, so a timed-out request never leaves the socket stuck)."""

  def __init__(self, endpoint: str, *, who: str, timeout_secs: float, secret: bytes) -> None:
    self.endpoint = endpoint
    self._secret = secret
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
        sock.send_multipart([*request(self._secret, op, args, timeout), *frames], copy=False)
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
