"""Request/reply with the agent over ZeroMQ; every wait has a timeout.

A request is a message of :mod:`jaxckpt.net._wire` (sealed with the job's secret,
see ``_paths.job_secret``, and carrying its deadline); the agent refuses one
whose mac does not verify and does not apply one whose caller gave up; the
caller gets the request's typed reply (``_requests.X.Reply``) or an error. Raw
frames are snapshot bytes whose checksums are in an authenticated header (a
commit's manifest), so forged bytes are refused when verified. A reply is
``[msgpack({"ok": True, ...} | {"ok": False, "error": str, "type": str}), *raw]``
on the caller's own connection. Tensor bytes travel only as raw frames (remote
fetches), never inside msgpack.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import zmq

from jaxckpt import errors
from jaxckpt.agent import _paths, _requests
from jaxckpt.host.snapshot import aligned_empty
from jaxckpt.net import _bulk, _wire
from jaxckpt.net._wire import expired, pack, sign, unpack  # noqa: F401  (the agent's names)


logger = logging.getLogger("jaxckpt.agent.trainer.client")

# How often a request to an agent on this machine checks that its pid still runs.
_PID_POLL_SECS = 0.25
# Agents asked at once by :func:`each`, at most.
_AT_ONCE = 32

T = TypeVar("T")
R = TypeVar("R", bound=_requests.Reply)


def request(secret: bytes, req: _requests.Request, timeout_secs: float | None = None) -> list[Any]:
  """The sealed frames of ``req`` (one of :mod:`jaxckpt.agent._requests`) before its
  raw frames; InvalidArgumentError, and nothing sent, if a field is not what the
  schema says (the agent checks it again when it decodes it: the caller is not
  trusted there). A request with a ``timeout_secs`` carries its deadline: an agent
  that gets to it later (it was stopped, or hung) does not apply it, since the
  caller has given up."""
  header = _requests.encode(req)
  _requests.decode(header)
  return _wire.seal(secret, header, timeout_secs=timeout_secs)


def verify(secret: bytes, frames: list[Any], replays: _wire.Replays | None = None) -> dict[str, Any]:
  """The request's header if its mac verifies and (given ``replays``) it was not
  seen before; else PermissionDeniedError."""
  return _wire.open_(secret, frames, replays=replays)[0]


class Client:
  """A thread-safe request/reply client of one agent (a fresh REQ socket per
  failure, so a timed-out request never leaves the socket stuck). An agent on
  this machine (an ipc endpoint, its ``pid`` known) that exits before it answers
  is named at once, not at the request's timeout."""

  def __init__(self, endpoint: str, *, who: str, timeout_secs: float, secret: bytes,
               host: int | None = None, pid: int | None = None, bulk: str | None = None) -> None:
    self.endpoint = endpoint
    self.bulk = bulk                      # the agent's bulk-transfer address (jaxckpt.net._bulk)
    self.host, self.pid = host, pid       # the agent's host id and pid, where known
    self._secret = secret
    self.who = who
    self.timeout_secs = timeout_secs
    self._ctx = zmq.Context.instance()
    self._lock = threading.Lock()
    self._sock: zmq.Socket | None = None
    self._posted: tuple[str, float] | None = None    # a posted request's op and timeout

  @classmethod
  def of(cls, info: dict[str, Any], *, who: str, timeout_secs: float, secret: bytes,
         endpoint: str | None = None) -> "Client":
    """A client of the agent that address record ``info`` (its address file, or
    what the job published) describes, at its tcp endpoint unless ``endpoint``."""
    return cls(endpoint or info["tcp"], who=who, timeout_secs=timeout_secs, secret=secret,
               host=info.get("host"), pid=info.get("pid"), bulk=info.get("bulk"))

  def _socket(self) -> zmq.Socket:
    if self._sock is None:
      s = self._ctx.socket(zmq.REQ)
      s.setsockopt(zmq.LINGER, 0)
      s.connect(self.endpoint)
      self._sock = s
    return self._sock

  def call(self, req: _requests.Request[R], *frames: Any,
           timeout_secs: float | None = None) -> tuple[R, list[zmq.Frame]]:
    """Sends ``req`` (``_requests.Reserve(...)``, ...) and returns its typed reply
    (``_requests.Reserve.Reply``), with any raw frames that followed it."""
    timeout = self.timeout_secs if timeout_secs is None else timeout_secs
    sealed = request(self._secret, req, timeout)
    op = req.op
    with self._lock:
      sock = self._socket()
      try:
        self._settle(sock)
        sock.send_multipart([*sealed, *frames], copy=False)
        self._await(sock, op, timeout)
        parts = sock.recv_multipart(copy=False)
      except BaseException:
        self._reset()
        raise
    reply = self._reply(parts[0].bytes, op)
    return _requests.decode_reply(type(req), reply, self.who, self.endpoint), parts[1:]

  def _reply(self, frame: bytes, op: str) -> dict[str, Any]:
    """The reply header in ``frame`` to ``op``; the agent's error, typed, if it refused."""
    reply = _wire.reply_of(frame, self.who, self.endpoint)
    if not reply["ok"]:
      raise _wire.remote_error(reply, self.who, op)
    return reply

  def post(self, req: _requests.Request) -> None:
    """Sends ``req`` without waiting for its reply: the next request on this
    client (or :meth:`close`) takes it first and raises its error, if any. For a
    request whose effect no caller waits on (a restore's unpin of its slot): the
    agent applies it before any later request of this client. It carries no
    deadline: its caller never gives up on it (an unpin that reaches a paused
    agent late is still applied, never left pinning its slot)."""
    sealed = request(self._secret, req)
    with self._lock:
      sock = self._socket()
      try:
        self._settle(sock)
        sock.send_multipart(sealed, copy=False)
        self._posted = (req.op, self.timeout_secs)
      except BaseException:
        self._reset()
        raise

  def _settle(self, sock: zmq.Socket) -> None:
    """Takes the reply of the request :meth:`post` sent, if any; raises its error."""
    if self._posted is None:
      return
    op, timeout = self._posted
    self._posted = None
    self._await(sock, op, timeout)
    self._reply(sock.recv_multipart(copy=False)[0].bytes, op)

  def _await(self, sock: zmq.Socket, op: str, timeout: float) -> None:
    """Waits for the reply to ``op``; AgentUnavailableError after ``timeout``, or as
    soon as a local agent's pid has gone."""
    local = self.pid is not None and self.endpoint.startswith("ipc://")
    deadline = time.monotonic() + timeout
    while True:
      left = deadline - time.monotonic()
      if sock.poll(int(max(0.0, min(left, _PID_POLL_SECS if local else left)) * 1000),
                   zmq.POLLIN):
        return
      if local and not _paths.pid_alive(self.pid):
        raise errors.AgentUnavailableError(
            f"{self.who} exited before it answered {op!r} (pid {self.pid} is gone; the "
            "snapshots it held are lost)")
      if time.monotonic() >= deadline:
        raise errors.AgentUnavailableError(
            f"{self.who} did not answer {op!r} within {timeout} s at {self.endpoint}; "
            "is it alive? (`jaxckpt agent status`)")

  def read(self, what: str, step: int, ranges: Sequence[tuple[int, int]], *,
           on_done: Callable[[int, np.ndarray], None] | None = None,
           **args: Any) -> list[np.ndarray]:
    """Byte ``ranges`` of the agent's ``what`` (``"snapshot"`` of ``step``, or
    ``"parity"`` of ``step`` and ``stripe=``) over the bulk path, each into a
    fresh aligned array; ``on_done(i, array)`` runs once range ``i`` has
    arrived, while later ones still arrive (see :func:`jaxckpt.net._bulk.fetch`)."""
    if self.bulk is None:
      raise errors.AgentUnavailableError(
          f"{self.who} published no bulk-transfer address; is it an agent of this jaxckpt version?")
    into = [aligned_empty((n,), np.uint8) for _, n in ranges]
    _bulk.fetch(self.bulk, self._secret, dict(args, what=what, step=step), ranges, into,
                timeout_secs=self.timeout_secs, who=self.who,
                on_done=None if on_done is None else lambda i: on_done(i, into[i]))
    return into

  def _reset(self) -> None:
    self._posted = None
    if self._sock is not None:
      self._sock.close(linger=0)
      self._sock = None

  def close(self) -> None:
    """Takes a posted request's reply (at most its timeout; the agent's refusal is
    raised), then closes the connection. An agent that is gone or silent has nothing
    left to answer: its pins went with it, or go when this process does."""
    with self._lock:
      try:
        if self._sock is not None:
          self._settle(self._sock)
      except errors.AgentUnavailableError:
        pass
      finally:
        self._reset()


def each(clients: dict[int, Client], ask: Callable[[Client], T], *,
         skipped: list[str] | None = None) -> dict[int, T]:
  """``ask(client)`` of every client at once (a restore asks each agent of the job:
  one after another, each round trip would add up). An agent that does not answer
  (AgentUnavailableError) is left out with a warning: what it holds counts as lost;
  ``skipped`` (when given) gets one line per agent left out, naming it and why."""
  if not clients:
    return {}

  def one(c: Client) -> tuple[bool, Any]:
    try:
      return True, ask(c)
    except errors.AgentUnavailableError as e:
      logger.warning("skipping %s: %s", c.who, e)
      if skipped is not None:
        skipped.append(str(e))
      return False, None
  with concurrent.futures.ThreadPoolExecutor(min(_AT_ONCE, len(clients)),
                                             thread_name_prefix="jaxckpt-ask") as pool:
    got = dict(zip(clients, pool.map(one, clients.values())))
  return {k: v for k, (ok, v) in got.items() if ok}
