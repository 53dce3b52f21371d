"""Bulk bytes between jaxckpt processes: plain TCP streams, several at once.

Requests and replies travel as ZeroMQ messages (:mod:`jaxckpt.net._wire`); the
bytes of snapshots move here, because one ZeroMQ connection carries about a
third of what one TCP stream does (1.2 against 3.7 GB/s on loopback, measured).

A bulk request is one connection: the client sends the two frames of a sealed
:mod:`jaxckpt.net._wire` message (its header names what to send and the byte
ranges), each as a 4-byte length and its bytes; the server verifies the mac,
asks its ``provide`` callback for the buffers, and answers with one
length-prefixed msgpack frame (``{"ok": True}`` or the error, typed) followed by
the buffers' bytes, raw, sent from the memory ``provide`` returned (a slot of
shared memory: no copy in Python). The client reads them straight into its
destination buffers and calls ``on_done(i)`` once range ``i`` is whole, in the
thread that completed it, so checksums are verified while later bytes still
arrive. A fetch of more than :data:`PIECE_BYTES` spreads over up to
:data:`STREAMS` connections, as one stream does not fill a fast link (one
stream carried 3.0 GB/s on a 16-core host, eight 14 GB/s), and over no more
than this process may run on cores at once: each stream's thread copies and
verifies, and more of them than cores only contend (on a 2-core machine two
streams carried 2.0 to 2.3 GB/s, eight 1.5 to 2.3).

The bytes themselves carry no mac: the caller verifies them against the
checksums of a manifest, as every snapshot read path does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import struct
import threading
import time
from typing import Any, Callable, ContextManager, Sequence

from jaxckpt import errors
from jaxckpt.net import _wire

logger = logging.getLogger("jaxckpt.bulk")

STREAMS = 8               # connections of one fetch, at most (and at most one per usable core)
PIECE_BYTES = 4 << 20     # one more connection for each PIECE_BYTES fetched, up to STREAMS
_LEN = struct.Struct("!I")
_MAX_HEADER = 1 << 20
MAX_OPEN = 512            # connections a listener handles at once, at most
HELLO_SECS = 10.0         # a connection sends its request's header within this, or is closed


class Listener:
  """A TCP port on ``host`` (ephemeral; see ``address``) whose connections are
  each handed to ``handle`` on a thread of their own, until :meth:`close`.

  Anyone who reaches the port may connect: at most ``max_open`` connections are
  handled at once (default: a quarter of the files this process may open, at most
  :data:`MAX_OPEN`); more wait in the kernel's backlog until one ends, so idle
  connections never take the process's last file descriptors. Running out of them
  (EMFILE) pauses accepting; it never ends it.
  """

  def __init__(self, host: str, handle: Callable[[socket.socket], None], *, name: str,
               max_open: int | None = None) -> None:
    self._handle, self._name = handle, name
    self._sock = socket.create_server((host, 0), backlog=64)
    self._sock.settimeout(0.5)                   # (to see close() while waiting)
    self.address = f"{host}:{self._sock.getsockname()[1]}"
    self._closed = False
    self.max_open = max_open or _max_open()
    self._open = threading.BoundedSemaphore(self.max_open)
    self._thread = threading.Thread(target=self._accept, name=name, daemon=True)
    self._thread.start()

  def _accept(self) -> None:
    starved = 0.0
    while not self._closed:
      if not self._open.acquire(timeout=0.5):    # max_open being handled: the rest wait
        continue
      try:
        conn, _ = self._sock.accept()
      except socket.timeout:
        self._open.release()
        continue
      except OSError as e:
        self._open.release()
        if self._closed:
          return
        if time.monotonic() - starved > 60:      # (EMFILE, ENFILE, ENOBUFS: said once a minute)
          logger.warning("%s: cannot accept a connection (%s); retrying", self._name, e)
          starved = time.monotonic()
        time.sleep(0.1)
        continue
      conn.settimeout(None)
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      try:
        threading.Thread(target=self._run, args=(conn,), name=f"{self._name}-conn",
                         daemon=True).start()
      except RuntimeError as e:                  # (no thread to be had: as EMFILE)
        self._open.release()
        conn.close()
        logger.warning("%s: cannot serve a connection (%s)", self._name, e)
        time.sleep(0.1)

  def _run(self, conn: socket.socket) -> None:
    try:
      self._handle(conn)
    finally:
      self._open.release()

  def close(self) -> None:
    self._closed = True
    shutdown(self._sock)                         # wakes accept()
    self._sock.close()
    self._thread.join(timeout=5)


def _max_open() -> int:
  """Connections a listener handles at once by default: a quarter of this process's
  file limit, within [8, MAX_OPEN]."""
  try:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
  except (OSError, ValueError):
    soft = 1024
  if soft == resource.RLIM_INFINITY:
    return MAX_OPEN
  return max(8, min(MAX_OPEN, soft // 4))


class Server:
  """Serves bulk requests on ``host`` (an ephemeral port; see ``address``).

  ``provide(header)`` is a context manager, entered for each verified request
  (in the connection's thread), whose value is what to send, in order (a list
  of buffers); it is left once they are sent (e.g. to unpin them). An exception
  it raises on entry goes back to the client, typed.
  """

  def __init__(self, host: str, secret: bytes,
               provide: Callable[[dict[str, Any]], ContextManager[Sequence[Any]]],
               *, name: str, timeout_secs: float = 60.0) -> None:
    self._secret, self._provide, self._name = secret, provide, name
    self._timeout = timeout_secs
    self._replays = _wire.Replays()
    self._listener = Listener(host, self._serve, name=f"{name}-bulk")
    self.address = self._listener.address

  def _serve(self, conn: socket.socket) -> None:
    with conn, contextlib.ExitStack() as stack:
      conn.settimeout(min(HELLO_SECS, self._timeout))   # a silent connection is closed soon,
      try:                                              # a stalled reader within the timeout
        header, _ = _wire.open_(self._secret, [recv_frame(conn, 64), recv_frame(conn, _MAX_HEADER)],
                                replays=self._replays)
        conn.settimeout(self._timeout)
        if header.get("op") != "bulk":
          raise errors.PermissionDeniedError(f"op {header.get('op')!r} is not a bulk request")
        if _wire.expired(header):
          raise errors.AgentUnavailableError("the request arrived after its deadline; not served")
        buffers = stack.enter_context(self._provide(header))
      except errors.JaxckptError as e:           # (some are OSErrors too: first)
        logger.warning("%s: refused a bulk request: %s", self._name, e)
        _send_quietly(conn, {"ok": False, "error": str(e), "type": type(e).__name__})
        return
      except OSError as e:
        logger.warning("%s: a bulk request broke off: %s", self._name, e)
        return
      except Exception as e:  # pylint: disable=broad-except  (travels back, typed)
        logger.warning("%s: a bulk request failed: %s", self._name, e)
        _send_quietly(conn, {"ok": False, "error": f"{type(e).__name__}: {e}", "type": ""})
        return
      try:
        send_frame(conn, _wire.pack({"ok": True}))
        for b in buffers:
          conn.sendall(b)
      except OSError as e:
        logger.warning("%s: a bulk reader went away mid-transfer: %s", self._name, e)

  def close(self) -> None:
    self._listener.close()


def fetch(address: str, secret: bytes, header: dict[str, Any],
          ranges: Sequence[tuple[int, int]], into: Sequence[Any], *, timeout_secs: float,
          who: str, on_done: Callable[[int], None] | None = None,
          streams: int | None = None) -> None:
  """Reads byte ``ranges`` ``[(offset, nbytes)]`` of what ``header`` names from
  the server at ``address`` into ``into`` (one writable buffer of ``nbytes``
  per range), over up to ``streams`` connections at once (default: one per
  core this process may use, at most :data:`STREAMS`).

  ``on_done(i)`` runs once range ``i`` has arrived whole; an exception it
  raises fails the fetch. Raises AgentUnavailableError naming ``who`` when the
  server is unreachable or silent for ``timeout_secs``, and the server's own
  error (typed) when it refuses.
  """
  total = sum(n for _, n in ranges)
  parts = _split(ranges, max(1, min(streams or _cores(), STREAMS, total // PIECE_BYTES)))
  left = [0] * len(ranges)                     # pieces of each range still to arrive
  for part in parts:
    for i, *_ in part:
      left[i] += 1
  for j in range(len(ranges)):
    if left[j] == 0 and on_done is not None:   # nothing to read
      on_done(j)
  if not parts:
    return
  lock = threading.Lock()
  failures: list[BaseException] = []
  conns: list[socket.socket] = []

  def run(part: list[tuple[int, int, int, int]]) -> None:
    try:
      conn = connect(address, timeout_secs, who)
      with lock:
        conns.append(conn)
      with conn:
        send_frames(conn, _wire.seal(secret, dict(
            header, op="bulk", ranges=[[off, n] for _, off, n, _ in part]), timeout_secs=timeout_secs))
        reply = _recv_reply(conn, who, address)
        if not reply["ok"]:
          raise _wire.remote_error(reply, who, "bulk fetch")
        for i, _, n, start in part:
          with memoryview(into[i]) as mv, mv.cast("B") as raw:
            recv_exact(conn, raw[start:start + n])
          with lock:
            left[i] -= 1
            whole = left[i] == 0
          if whole and on_done is not None:
            on_done(i)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the caller)
      with lock:
        failures.append(e)
        for c in conns:                          # the other streams stop at once
          shutdown(c)

  threads = [threading.Thread(target=run, args=(p,), name="jaxckpt-bulk-fetch", daemon=True)
             for p in parts[1:]]
  for t in threads:
    t.start()
  run(parts[0])
  for t in threads:
    t.join()
  if failures:
    first = next((e for e in failures if isinstance(e, errors.JaxckptError)), None)
    if first is not None:                        # a refusal or a failed check, not a symptom
      raise first
    first = next((e for e in failures if not isinstance(e, OSError)), failures[0])
    if isinstance(first, TimeoutError):
      raise errors.AgentUnavailableError(
          f"{who} sent nothing for {timeout_secs} s in a bulk transfer at {address}; "
          "is it alive? (`jaxckpt agent status`)") from first
    if isinstance(first, OSError):
      raise errors.AgentUnavailableError(
          f"{who} broke off a bulk transfer at {address} ({type(first).__name__}: {first}); "
          f"is it alive? (`jaxckpt agent status`)") from first
    raise first


def _recv_reply(conn: socket.socket, who: str, address: str) -> dict[str, Any]:
  """The server's reply frame; whatever a peer sends instead (an oversized
  length, garbage, a msgpack that is not a reply) names the peer and address."""
  try:
    raw = recv_frame(conn, _MAX_HEADER)
  except errors.PermissionDeniedError as e:
    raise errors.AgentUnavailableError(
        f"{who} at {address}, answering a bulk fetch: {e} (is it a jaxckpt agent of this "
        "version?)") from None
  return _wire.reply_of(raw, who, address)


def _cores() -> int:
  """The cores this process may run on (its affinity mask: a container's CPU set)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:                         # (not Linux)
    return os.cpu_count() or 1


def _split(ranges: Sequence[tuple[int, int]], k: int) -> list[list[tuple[int, int, int, int]]]:
  """The non-empty ``ranges`` cut into at most ``k`` parts of about equal bytes,
  in order: each part a list of ``(range index, offset, nbytes, start within the range)``."""
  size = max(1, -(-sum(n for _, n in ranges) // k))
  parts: list[list[tuple[int, int, int, int]]] = [[] for _ in range(k)]
  pos = 0                                        # bytes assigned so far
  for i, (off, n) in enumerate(ranges):
    start = 0
    while start < n:
      p = min(pos // size, k - 1)
      take = n - start if p == k - 1 else min(n - start, (p + 1) * size - pos)
      parts[p].append((i, off + start, take, start))
      start, pos = start + take, pos + take
  return [p for p in parts if p]


def connect(address: str, timeout_secs: float, who: str) -> socket.socket:
  host, port = address.rsplit(":", 1)
  try:
    conn = socket.create_connection((host, int(port)), timeout=timeout_secs)
  except OSError as e:
    raise errors.AgentUnavailableError(
        f"{who} is not reachable for bulk transfers at {address} ({e}); is it alive? "
        "(`jaxckpt agent status`)") from e
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return conn


def send_frame(conn: socket.socket, data: bytes) -> None:
  conn.sendall(_LEN.pack(len(data)) + data)


def send_frames(conn: socket.socket, frames: Sequence[Any]) -> None:
  conn.sendall(b"".join(_LEN.pack(len(f)) + bytes(f) for f in frames))


def _send_quietly(conn: socket.socket, reply: dict[str, Any]) -> None:
  try:
    send_frame(conn, _wire.pack(reply))
  except OSError:
    pass


def recv_frame(conn: socket.socket, limit: int) -> bytes:
  head = bytearray(_LEN.size)
  recv_exact(conn, memoryview(head))
  (n,) = _LEN.unpack(head)
  if n > limit:
    raise errors.PermissionDeniedError(f"a bulk frame of {n} bytes (over {limit}) was refused")
  body = bytearray(n)
  recv_exact(conn, memoryview(body))
  return bytes(body)


def recv_exact(conn: socket.socket, view: memoryview) -> None:
  got = 0
  while got < len(view):
    r = conn.recv_into(view[got:])
    if not r:
      raise ConnectionError(f"the peer closed the stream after {got} of {len(view)} bytes")
    got += r


def shutdown(conn: socket.socket) -> None:
  try:
    conn.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
