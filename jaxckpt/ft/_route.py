"""The lighthouse's two doors: a public port for anyone, a private one only the job can open.

Anyone who reaches the lighthouse's public address can send to it as fast as a
core allows, and a server must read a message to learn it is garbage. So the
lighthouse also listens on a *private* port secured with ZeroMQ's CURVE
handshake, whose server key is derived from the job's secret (HMAC-SHA256 of a
fixed label): a process without the secret cannot complete the handshake, and
what it sends there never reaches Python. Messages on both ports are sealed and
checked the same way (:mod:`jaxckpt.net._wire`); the private port only keeps the
job's own traffic apart from a flood, which the lighthouse reads on the public
port at a bounded rate.

A client (:class:`Route`) starts on the public address, learns the private port
from the first sealed reply (its ``private`` field) and moves there once its
handshake completes (a port that does not answer, say behind a firewall, is not
tried again: the client stays on the public address); when a send to the
private port cannot go out (the lighthouse restarted: another private port), it
moves back and learns the new one. A client with a wrong secret never moves: the
public port answers it with the reason.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from typing import Any

import zmq
from zmq.utils import z85

from jaxckpt.net import _wire

logger = logging.getLogger(__name__)

_LABEL = b"jaxckpt lighthouse private port (CURVE server key)"
_CONNECT_SECS = 2.0               # how long a new connection may take to complete its handshake

HAS_CURVE = zmq.has("curve")


def curve_keys(key: bytes) -> tuple[bytes, bytes]:
  """The private port's CURVE (public, secret) server keys (z85) for the job's secret ``key``."""
  secret = z85.encode(hmac.new(key, _LABEL, hashlib.sha256).digest())
  return zmq.curve_public(secret), secret


def private_socket(ctx: zmq.Context, key: bytes) -> zmq.Socket:
  """The lighthouse's private ROUTER socket (not bound yet)."""
  sock = _wire.socket(ctx, zmq.ROUTER)
  sock.curve_server = True
  sock.curve_secretkey = curve_keys(key)[1]
  return sock


class Route:
  """A client's DEALER socket to the lighthouse: the public address, or its private port once known."""

  def __init__(self, ctx: zmq.Context, address: str, key: bytes) -> None:
    self._ctx, self.address, self._key = ctx, address, key
    self._host = address.rpartition(":")[0]
    self.private: int | None = None
    self._connected_by = 0.0              # a new connection's handshake is waited for until then
    self._up = False                      # whether this socket's connection was up once
    self._unreachable: int | None = None  # a private port whose handshake never completed
    self.sock = self._open(None)

  def learn(self, header: dict[str, Any]) -> bool:
    """Moves to the private port a sealed reply names, if not there yet; whether it moved."""
    port = header.get("private")
    if (not HAS_CURVE or self.private is not None or not isinstance(port, int) or not 0 < port < 65536
        or port == self._unreachable):
      return False
    self._move(port)
    if not self.sock.poll(int(_CONNECT_SECS * 1000), zmq.POLLOUT):   # its handshake (a firewall?)
      logger.warning("the lighthouse's private port %s:%d did not answer within %.0f s: staying on "
                     "its public address %s", self._host, port, _CONNECT_SECS, self.address)
      self._unreachable = port
      self._move(None)
      return False
    self._up = True
    return True

  def send(self, frames: list[Any], deadline: float | None = None) -> bool:
    """Sends without blocking, but for a new connection's handshake (until ``deadline``
    at the latest); False if it could not go out."""
    if self._sent(frames):
      return True
    if not self._up:                      # a new connection: its handshake may take a moment
      left = min(self._connected_by, math.inf if deadline is None else deadline) - time.monotonic()
      if left > 0 and self.sock.poll(int(left * 1000) + 1, zmq.POLLOUT) and self._sent(frames):
        return True
    if self.private is None:
      return False
    self._move(None)                      # the private port is gone: back to the public one
    return self.send(frames, deadline)

  def _sent(self, frames: list[Any]) -> bool:
    ok = _wire.send(self.sock, frames)
    self._up = self._up or ok             # (it was up once: a later failure means it is gone)
    return ok

  def recv(self, timeout_secs: float) -> list[Any] | None:
    return _wire.recv(self.sock, timeout_secs)

  def close(self) -> None:
    self.sock.close(linger=0)

  def _move(self, port: int | None) -> None:
    self.sock.close(linger=0)
    self.private = port
    self.sock = self._open(port)

  def _open(self, port: int | None) -> zmq.Socket:
    self._connected_by, self._up = time.monotonic() + _CONNECT_SECS, False
    return dealer(self._ctx, self.address, self._key, port)


def dealer(ctx: zmq.Context, address: str, key: bytes, port: int | None) -> zmq.Socket:
  """A DEALER socket connecting to the lighthouse at ``address``, or to its private ``port``."""
  sock = _wire.socket(ctx, zmq.DEALER, immediate=True)
  if port is not None:
    sock.curve_serverkey = curve_keys(key)[0]
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
  host = address.rpartition(":")[0]
  sock.connect(f"tcp://{address}" if port is None else f"tcp://{host}:{port}")
  return sock


class BeatRoute:
  """A heartbeat's way to the lighthouse: the public address, and its private port once
  known and connected. Never blocks: a heartbeat is not held up by a handshake, so the
  beats keep coming while the private connection opens (and after a lighthouse restart,
  through the public address until the new private port is known). The public socket
  stays open, idle, once the private one carries the beats."""

  def __init__(self, ctx: zmq.Context, address: str, key: bytes) -> None:
    self._ctx, self._address, self._key = ctx, address, key
    self._public = dealer(ctx, address, key, None)
    self._private: zmq.Socket | None = None
    self.private: int | None = None

  def want(self, port: int | None) -> None:
    """Opens a connection to the private ``port`` (a group's client learned it), unless open."""
    if not HAS_CURVE or port is None or port == self.private:
      return
    if self._private is not None:
      self._private.close(linger=0)
    self._private, self.private = dealer(self._ctx, self._address, self._key, port), port

  def send(self, frames: list[Any]) -> bool:
    if self._private is not None and self._private.poll(0, zmq.POLLOUT) and _wire.send(self._private, frames):
      return True
    return _wire.send(self._public, frames)

  def recv(self, timeout_secs: float) -> list[Any] | None:
    socks = [s for s in (self._private, self._public) if s is not None]
    ready = zmq.select(socks, [], [], timeout_secs)[0]
    return ready[0].recv_multipart(copy=False) if ready else None

  def close(self, last: list[Any] | None = None) -> None:
    """Closes; ``last``, if given, is sent first (and given a moment to go out)."""
    sent = self.send(last) if last is not None else False
    for sock in (self._private, self._public):
      if sock is not None:
        sock.close(linger=200 if sent else 0)


def addresses(address: str) -> list[str]:
  """The lighthouse replicas' addresses in ``address`` (``HOST:PORT[,HOST:PORT...]``)."""
  out = [a.strip() for a in address.split(",") if a.strip()]
  if not out or any(not a.rpartition(":")[0] or not a.rpartition(":")[2].isdigit() for a in out):
    from jaxckpt import errors  # pylint: disable=import-outside-toplevel
    raise errors.InvalidArgumentError(
        f"a lighthouse address must be HOST:PORT, or several separated by commas (the replicas "
        f"of a control plane on etcd), got {address!r}")
  return out


class Routes:
  """A client's way to every lighthouse replica (``HOST:PORT,...``): each message goes to
  all of them (only the leader answers; a follower keeps what it hears, so it can take
  over warm), and a reply is read from whichever sends it. With one address: one
  :class:`Route`, as before."""

  def __init__(self, ctx: zmq.Context, address: str, key: bytes) -> None:
    self.address = address
    self._routes = [Route(ctx, a, key) for a in addresses(address)]
    self._last: Route = self._routes[0]

  @property
  def private(self) -> dict[str, int | None]:
    """Each replica's private port, once learned."""
    return {r.address: r.private for r in self._routes}

  def send(self, frames: list[Any], deadline: float | None = None) -> bool:
    if len(self._routes) == 1:
      return self._routes[0].send(frames, deadline)
    sent = False
    for r in self._routes:       # (never held up by a replica that is down: no handshake wait)
      sent = r.send(frames, time.monotonic()) or sent
    return sent

  def recv(self, timeout_secs: float) -> list[Any] | None:
    if len(self._routes) == 1:
      return self._routes[0].recv(timeout_secs)
    ready = zmq.select([r.sock for r in self._routes], [], [], max(0.0, timeout_secs))[0]
    for r in self._routes:
      if r.sock in ready:
        self._last = r
        return _wire.recv(r.sock, 0)
    return None

  def learn(self, header: dict[str, Any]) -> bool:
    """Moves the route the last reply came on to the private port it names."""
    return self._last.learn(header)

  def close(self) -> None:
    for r in self._routes:
      r.close()


class BeatRoutes:
  """A heartbeat's way to every lighthouse replica (see :class:`Routes`)."""

  def __init__(self, ctx: zmq.Context, address: str, key: bytes) -> None:
    self._routes = {a: BeatRoute(ctx, a, key) for a in addresses(address)}

  def want(self, ports: dict[str, int | None] | int | None) -> None:
    if not isinstance(ports, dict):
      ports = {a: ports for a in self._routes}
    for a, r in self._routes.items():
      r.want(ports.get(a))

  def send(self, frames: list[Any]) -> bool:
    sent = False
    for r in self._routes.values():
      sent = r.send(frames) or sent
    return sent

  def recv(self, timeout_secs: float) -> list[Any] | None:
    if len(self._routes) == 1:
      return next(iter(self._routes.values())).recv(timeout_secs)
    socks = [s for r in self._routes.values() for s in (r._private, r._public) if s is not None]  # pylint: disable=protected-access
    ready = zmq.select(socks, [], [], max(0.0, timeout_secs))[0]
    return ready[0].recv_multipart(copy=False) if ready else None

  def close(self, last: list[Any] | None = None) -> None:
    for r in self._routes.values():
      r.close(last)
