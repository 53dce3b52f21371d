"""The all-reduce's data path between replica groups: one TCP stream per ring neighbour.

Each group (its process 0) listens on one TCP port, published as
``ring_address`` in its quorum member record. Before its first hop to a right
neighbour a group opens a stream to it, and the stream stays for later steps
while that neighbour does:

1. the listener sends a fresh random challenge;
2. the group answers with a hello sealed with the job's secret
   (:mod:`jaxckpt.net._wire`) that names itself and its own ring address (which
   tells its incarnations apart: a restarted group listens on another port) and
   repeats the challenge, so a recorded hello cannot be replayed;
3. the listener keeps the stream as the one from that group (replacing an
   older one) and acknowledges, or refuses with the reason and closes it.

A stream then carries pieces, each a length-prefixed msgpack header (quorum,
step, digest, the gradient's layout (:mod:`jaxckpt.ft._layout`), tag, byte
count) and the bytes, written straight from the
sender's arrays by a sending thread (the training thread never blocks on a
send: every member sends before it receives) and read straight into the
receiver's buffers (:mod:`jaxckpt.net._bulk`'s framing). A piece of an abandoned
attempt (another quorum or step) is skipped, and so is the rest of a piece
the receiver stopped waiting for, so a timeout leaves the stream in step with
its sender. A piece whose digest or layout is not the receiver's is refused
with the reason (naming the sender and what differs). A member that fails an
attempt sends its right neighbour an *abort* (a header with the reason, the
groups shown to be out of the attempt, and no bytes), so the failure goes
around the ring at once, with its first cause, instead of each member waiting
out its timeout; the abort is sent and waited for with a bound of its own, so a
member that failed by its deadline still delivers it.

Evidence of a failure ends a wait at once (:class:`Failure` says why and whom
it shows to be out of the attempt):

* the stream from the left neighbour's incarnation in this attempt closed or
  broke (its process died: the kernel closes its streams);
* the stream to the right neighbour could not be opened (connection refused)
  or broke (the writing thread fails the attempt it was writing for);
* :meth:`Links.fail` from another thread (the lighthouse's word that a member
  stopped sending heartbeats, or that the job moved on without this group).

Every wait of a receive polls its stream and a wake-up pipe, so it ends on the
first of these. A stream of an older incarnation of the neighbour that ended
(it restarted) gives way to the newer one; one that broke or carried anything
else unexpected is closed, and the sender opens a new one for its next piece.

This is the transport :func:`jaxckpt.ft._allreduce.ring_mean` needs: ``send``
that queues and ``recv`` that fills a buffer. A GPU backend (NCCL through a
binding, on device buffers) would replace this module and nothing above it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import queue
import select
import socket
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jaxckpt import errors
from jaxckpt.ft import _layout
from jaxckpt.net import _bulk, _wire

logger = logging.getLogger(__name__)

_CHALLENGE_BYTES = 16
_MAX_HEADER = 4096
_HANDSHAKE_SECS = 10.0
_MAX_REASON = 600                 # characters of an abort's reason (a header stays under _MAX_HEADER)
_MAX_BLAME = 8                    # group ids an abort names as out of the attempt
_ABORT_SECS = 2.0                 # the longest an abort may take to open its stream
_KEPT_FAILURES = 16               # attempts whose failure is remembered (by quorum id)


class Failure(str):
  """Why this group's attempt failed (the string), and ``blame``: the groups the
  failure shows to be out of the attempt (dead, stopped, or gone from the ring)."""

  blame: tuple[str, ...]

  def __new__(cls, reason: str, blame: Iterable[str] = ()) -> Failure:
    self = super().__new__(cls, reason)
    self.blame = tuple(blame)
    return self


class _Failed(Exception):
  """A wait ended by :meth:`Links.fail` (its attempt failed elsewhere)."""

  def __init__(self, failure: Failure) -> None:
    super().__init__(str(failure))
    self.failure = failure


@dataclasses.dataclass
class _Out:
  """A stream to one right neighbour and the thread that writes its pieces."""
  address: str
  sock: socket.socket | None
  queue: "queue.SimpleQueue[tuple[str, bytes, Sequence[np.ndarray]] | None]" = dataclasses.field(
      default_factory=queue.SimpleQueue)
  broken: Failure | None = None
  thread: threading.Thread | None = None
  pending: int = 0                         # pieces queued and not yet written (or skipped)
  idle: threading.Condition = dataclasses.field(default_factory=threading.Condition)


class Links:
  """This group's ring streams: a listener for its left neighbours' and the
  streams it opens to its right neighbours."""

  def __init__(self, host: str, secret: bytes, *, group_id: str, timeout_secs: float,
               advertise: str | None = None) -> None:
    self._secret, self.group_id, self._timeout = secret, group_id, timeout_secs
    self._cond = threading.Condition()
    self._incoming: dict[str, _In] = {}
    self._outgoing: dict[str, _Out] = {}
    self._opening: dict[str, tuple[threading.Thread, list[_Out]]] = {}   # streams prepare() opens
    self._closed = False
    self.refused = 0                 # streams whose hello did not verify
    self._failures: collections.OrderedDict[str, Failure] = collections.OrderedDict()  # by quorum id
    self._wake_r, self._wake_w = socket.socketpair()     # fail() wakes a receive blocked on a stream
    self._wake_r.setblocking(False)
    self._wake_w.setblocking(False)
    self._listener = _bulk.Listener(host, self._greet, name=f"ring-{group_id}")
    # (bound on ``host``; peers are told ``advertise``, see ft/_address.py)
    self.address = f"{advertise or host}:{self._listener.address.rsplit(':', 1)[1]}"

  # ---- failures learned elsewhere ---------------------------------------------------------------------

  def fail(self, q: str, reason: str, blame: Iterable[str] = ()) -> None:
    """Fails this group's attempt of quorum ``q`` (from any thread): a receive of
    it waiting now, or later, returns ``Failure(reason, blame)`` at once. The
    first failure of an attempt is the one kept."""
    with self._cond:
      if q in self._failures:
        return
      self._failures[q] = Failure(reason, blame)
      while len(self._failures) > _KEPT_FAILURES:
        self._failures.popitem(last=False)
      self._cond.notify_all()
    with contextlib.suppress(OSError):      # (full: a wake-up is pending already)
      self._wake_w.send(b"\0")

  def failure(self, q: str) -> Failure | None:
    """How the attempt of quorum ``q`` failed, if :meth:`fail` was told."""
    with self._cond:
      return self._failures.get(q)

  def _wait(self, inc: _In, deadline: float, q: str) -> None:
    """Returns once ``inc``'s stream has bytes (or its end) to read; _Failed if the
    attempt of ``q`` failed meanwhile; TimeoutError at ``deadline``."""
    while True:
      if (failure := self.failure(q)) is not None:
        raise _Failed(failure)
      left = deadline - time.monotonic()
      if left <= 0:
        raise TimeoutError("nothing to read by the deadline")
      ready = {fd for fd, _ in inc.poller.poll(math.ceil(1000 * left))}
      if self._wake_r.fileno() in ready:
        with contextlib.suppress(OSError):
          while self._wake_r.recv(4096):
            pass
      if inc.fd in ready:          # (bytes, its end, or closed under us: the read tells which)
        return

  # ---- the receiving side ---------------------------------------------------------------------------

  def _greet(self, conn: socket.socket) -> None:
    conn.settimeout(min(self._timeout, _HANDSHAKE_SECS))
    challenge = os.urandom(_CHALLENGE_BYTES)
    try:
      conn.sendall(challenge)
      header, _ = _wire.open_(self._secret, [_bulk.recv_frame(conn, 64),
                                             _bulk.recv_frame(conn, _MAX_HEADER)])
      if header.get("op") != "ring_link" or header.get("challenge") != challenge:
        raise errors.PermissionDeniedError("a ring stream's hello did not answer its challenge")
      group = str(header["group"])
      address = header.get("address") if isinstance(header.get("address"), str) else None
      _bulk.send_frame(conn, _wire.pack({"ok": True}))
    except errors.PermissionDeniedError as e:
      with self._cond:
        self.refused += 1
      logger.warning("group %s refused a ring stream: %s", self.group_id, e)
      try:
        _bulk.send_frame(conn, _wire.pack({"ok": False, "error": str(e)}))
      except OSError:
        pass
      conn.close()
      return
    except (OSError, KeyError, ValueError) as e:
      logger.warning("group %s: a ring stream broke off in its hello: %s", self.group_id, e)
      conn.close()
      return
    with self._cond:
      if self._closed:
        conn.close()
        return
      old = self._incoming.pop(group, None)
      self._incoming[group] = _In(conn, address, self._wake_r)
      self._cond.notify_all()
    if old is not None:            # (a recv blocked on it wakes to its end: _Ended)
      _bulk.shutdown(old.conn)
      old.conn.close()

  def recv(self, group: str, expect: dict[str, Any], tag: int, into: np.ndarray,
           deadline: float, *, address: str | None = None,
           heard: Callable[[dict[str, Any]], None] | None = None) -> Failure | None:
    """Reads piece ``tag`` of the attempt ``expect`` (quorum ``q``, ``step``,
    ``digest``) from ``group``'s stream into ``into``; None once it has, else why
    not. ``address`` is the ring address of ``group``'s incarnation in this
    attempt: its stream ending is a failure at once (blaming ``group``), while
    the end of an older incarnation's stream gives way to the newer one. A piece
    cut short by the timeout is skipped when the stream is read next, so the
    stream stays in step with its sender (closed only when broken). ``heard(header)``
    is called with the header of the piece taken."""
    q = expect["q"]
    while True:
      with self._cond:
        while (inc := self._incoming.get(group)) is None:
          if (failure := self._failures.get(q)) is not None:
            return failure
          remaining = deadline - time.monotonic()
          if remaining <= 0 or self._closed:
            return Failure(f"no stream from group {group} within the timeout")
          self._cond.wait(remaining)
      current = address is None or inc.address == address
      wait: Callable[[_In], None] = lambda i: self._wait(i, deadline, q)
      try:
        while True:
          inc.read(None, wait)                   # the rest of an earlier piece
          head = inc.header(wait)
          n = int(head["n"])
          if n < 0:
            raise ValueError(f"a piece header claims {n} bytes")
          inc.owed = n
          if (head["q"], head["step"]) != (q, expect["step"]):
            continue                             # a piece of an abandoned attempt
          if head["digest"] != expect["digest"]:
            return Failure(f"group {group} is at digest {head['digest']:#x} of step {head['step']}, "
                           f"this group at {expect['digest']:#x}")
          if "layout" in expect and head.get("layout") != expect["layout"]:
            return Failure(_layout.mismatch(group, head.get("layout"), expect["layout"], self.group_id))
          if head.get("abort") is not None:      # the sender failed this attempt: so must we
            return Failure(str(head["abort"]), _names(head.get("blame")))
          if head["tag"] != tag or n != into.nbytes:
            return Failure(f"group {group} sent piece {head['tag']} of {n} bytes where {tag} of "
                           f"{into.nbytes} was due")
          inc.read(into, wait)
          if heard is not None:
            heard(head)
          return None
      except _Failed as e:
        return e.failure
      except TimeoutError:
        return Failure(f"group {group} sent nothing more within the timeout")
      except _Ended:
        if self._drop(group, inc) or not current:
          continue                               # (a newer stream, or an older incarnation's end)
        return Failure(f"the stream from group {group} ({inc.address}) closed: its process ended or "
                       "left the ring", (group,))
      except (OSError, KeyError, ValueError, TypeError, errors.JaxckptError) as e:
        if self._drop(group, inc) or (not current and address is not None):
          continue                               # a restarted neighbour's new stream took
                                                 # its place (and closed it under us)
        return Failure(f"the stream from group {group} broke: {type(e).__name__}: {e}",
                       (group,) if address is not None else ())

  def _drop(self, group: str, inc: _In) -> bool:
    """Forgets ``inc``; True if a newer stream from ``group`` has replaced it already."""
    with self._cond:
      current = self._incoming.get(group)
      if current is inc:
        del self._incoming[group]
    inc.conn.close()
    return current is not None and current is not inc

  # ---- the sending side -----------------------------------------------------------------------------

  def send(self, group: str, address: str, header: dict[str, Any],
           segments: Sequence[np.ndarray], deadline: float) -> Failure | None:
    """Queues a piece (``header`` and the bytes of ``segments``, which stay
    untouched until sent) for ``group`` at ``address``; why not, if no stream
    to it could be opened (the piece is lost: the attempt cannot complete). A
    stream that breaks later fails the attempt of the piece it was writing
    (:meth:`fail`), blaming ``group``."""
    out = self._outgoing.get(group)
    if out is None or out.address != address or out.broken:
      if out is not None:
        self._retire(out)
      opened = self._opened(group)
      if opened is not None and opened.address != address:
        self._retire(opened)
        opened = None
      out = self._outgoing[group] = opened or self._open(group, address, deadline)
    if out.sock is None:
      return out.broken
    head = _wire.pack(dict(header, n=sum(s.nbytes for s in segments)))
    with out.idle:
      out.pending += 1
    out.queue.put((str(header.get("q")), head, segments))
    return None

  def prepare(self, group: str, address: str) -> None:
    """Opens the stream to ``group`` at ``address`` in the background unless one is
    open, so the attempt's first piece to a new right neighbour (one that joined, or
    a new ring order) does not wait for the handshake: it is done during the step's
    compute. Called by the training thread only, like :meth:`send`."""
    out = self._outgoing.get(group)
    if (out is not None and out.address == address and not out.broken) or group in self._opening:
      return
    box: list[_Out] = []
    secs = min(self._timeout, _HANDSHAKE_SECS)
    thread = threading.Thread(target=lambda: box.append(self._open(group, address, time.monotonic() + secs)),
                              name=f"ring-{self.group_id}-open-{group}", daemon=True)
    self._opening[group] = (thread, box)
    thread.start()

  def _opened(self, group: str) -> _Out | None:
    """The stream :meth:`prepare` opened to ``group`` (waiting for its bounded handshake), if any."""
    entry = self._opening.pop(group, None)
    if entry is None:
      return None
    thread, box = entry
    thread.join()
    return box[0] if box else None

  def abort(self, group: str, address: str, header: dict[str, Any], reason: str,
            blame: Iterable[str] = ()) -> None:
    """Tells ``group`` (the right neighbour) that this member failed the attempt of
    ``header``, why, and whom that shows out of it, so it fails at once with that
    reason instead of waiting out its timeout for a piece that will never come
    (and tells its own right neighbour, and so on around the ring). A stream to
    it is opened within a bound of its own, not the attempt's (which may have
    passed: that is how this member failed)."""
    fresh = time.monotonic() + min(self._timeout, _ABORT_SECS)
    self.send(group, address, dict(header, tag=-1, abort=reason[:_MAX_REASON],
                                   blame=list(blame)[:_MAX_BLAME]), (), fresh)

  def settle(self, group: str, deadline: float) -> None:
    """Returns once no queued piece for ``group`` is still being read from its
    segments: written by ``deadline``, or the stream is closed then (the
    neighbour's attempt fails). After a failed attempt the caller may reuse
    its input at once."""
    out = self._outgoing.get(group)
    if out is None:
      return
    with out.idle:
      out.idle.wait_for(lambda: out.pending == 0, max(0.0, deadline - time.monotonic()))
      settled = out.pending == 0
    if not settled:
      del self._outgoing[group]
      self._retire(out)

  def _open(self, group: str, address: str, deadline: float) -> _Out:
    secs = max(1e-3, min(deadline - time.monotonic(), _HANDSHAKE_SECS))
    try:
      with contextlib.ExitStack() as unless_open:
        conn = _connect(address, secs, group)
        unless_open.callback(conn.close)
        conn.settimeout(secs)
        challenge = _recv_bytes(conn, _CHALLENGE_BYTES)
        _bulk.send_frames(conn, _wire.seal(self._secret, {
            "op": "ring_link", "group": self.group_id, "address": self.address,
            "challenge": challenge}))
        reply = _wire.unpack(_bulk.recv_frame(conn, _MAX_HEADER))
        if not reply.get("ok"):
          raise errors.PermissionDeniedError(f"group {group} refused the ring stream: {reply.get('error')}")
        conn.settimeout(self._timeout)           # a stuck neighbour fails the sending thread
        unless_open.pop_all()
    except (OSError, errors.JaxckptError, ValueError) as e:
      why = Failure(f"could not open a ring stream to group {group} at {address}: {e}", (group,))
      logger.warning("group %s %s", self.group_id, why)
      return _Out(address=address, sock=None, broken=why)
    out = _Out(address=address, sock=conn)
    out.thread = threading.Thread(target=self._write, args=(group, out),
                                  name=f"ring-{self.group_id}-to-{group}", daemon=True)
    out.thread.start()
    return out

  def _write(self, group: str, out: _Out) -> None:
    while (item := out.queue.get()) is not None:
      q, head, segments = item
      if not out.broken:                         # (else drained: the attempt failed already)
        try:
          _bulk.send_frame(out.sock, head)
          for s in segments:
            out.sock.sendall(memoryview(s.reshape(-1).view(np.uint8)))
        except OSError as e:
          out.broken = Failure(f"the ring stream to group {group} broke: {type(e).__name__}: {e}",
                               (group,))
          logger.warning("group %s: %s", self.group_id, out.broken)
          self.fail(q, out.broken, out.broken.blame)
      item = head = segments = None              # (holds no buffer while it waits)
      with out.idle:
        out.pending -= 1
        out.idle.notify_all()

  def _retire(self, out: _Out, linger_secs: float = 0.0) -> None:
    """Lets ``out``'s thread send what is queued for up to ``linger_secs``, then closes it."""
    if out.thread is not None:
      out.queue.put(None)
      out.thread.join(linger_secs)
    if out.sock is not None:
      _bulk.shutdown(out.sock)
      out.sock.close()
    if out.thread is not None:
      out.thread.join(5)

  def close(self, linger_secs: float = 0.0) -> None:
    """Sends what is queued (for up to ``linger_secs``: the last hop a neighbour
    is owed), then closes every stream and the listener."""
    end = time.monotonic() + linger_secs
    for group in list(self._opening):
      if (opened := self._opened(group)) is not None:
        self._retire(opened)
    for out in self._outgoing.values():
      self._retire(out, max(0.0, end - time.monotonic()))
    self._outgoing.clear()
    with self._cond:
      self._closed = True
      incoming, self._incoming = list(self._incoming.values()), {}
      self._cond.notify_all()
    for inc in incoming:
      inc.conn.close()
    self._listener.close()
    self._wake_r.close()
    self._wake_w.close()


def _connect(address: str, timeout_secs: float, group: str) -> socket.socket:
  host, port = address.rsplit(":", 1)
  try:
    conn = socket.create_connection((host, int(port)), timeout=timeout_secs)
  except OSError as e:
    raise ConnectionError(f"the ring port of group {group} did not take the connection ({e}): its "
                          "process is gone, or it is restarting") from e
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return conn


def _names(obj: Any) -> tuple[str, ...]:
  """The group ids of an abort's ``blame`` (anything else in it is ignored)."""
  if not isinstance(obj, (list, tuple)):
    return ()
  return tuple(g for g in obj[:_MAX_BLAME] if isinstance(g, str) and 0 < len(g) <= 256)


def _recv_bytes(conn: socket.socket, n: int) -> bytes:
  buf = bytearray(n)
  _bulk.recv_exact(conn, memoryview(buf))
  return bytes(buf)


class _Ended(ConnectionError):
  """A stream closed cleanly between pieces: its sender is gone, a new one may follow."""


class _In:
  """A verified stream from a left neighbour (of the incarnation listening at
  ``address``), and the bytes of the current piece still owed. Non-blocking:
  every wait goes through the caller's ``wait`` (see :meth:`Links._wait`)."""

  def __init__(self, conn: socket.socket, address: str | None, wake: socket.socket) -> None:
    self.conn, self.address, self.owed = conn, address, 0
    self.fd = conn.fileno()                    # (fileno() is -1 once another thread closed it)
    conn.settimeout(0.0)
    self.poller = select.poll()
    self.poller.register(conn, select.POLLIN)
    self.poller.register(wake, select.POLLIN)
    self._sink = bytearray(0)

  def header(self, wait: Callable[[_In], None]) -> dict[str, Any]:
    """The next piece's header; TimeoutError or _Failed (the stream still in step)
    if none began before ``wait`` gave up; _Ended if the stream ended between pieces."""
    while True:
      wait(self)
      try:
        first = self.conn.recv(1, socket.MSG_PEEK)
        break
      except BlockingIOError:
        continue
    if not first:
      raise _Ended("the neighbour closed the stream between pieces")
    self.conn.settimeout(_HANDSHAKE_SECS)      # begun: it is written whole at once
    try:
      head = _wire.unpack(_bulk.recv_frame(self.conn, _MAX_HEADER))
    except TimeoutError as e:                  # (the stream is out of step now)
      raise ConnectionError("a piece header stalled half-written") from e
    finally:
      self.conn.settimeout(0.0)
    if not isinstance(head, dict):
      raise ValueError("a piece header is not a map")
    return head

  def read(self, into: np.ndarray | None, wait: Callable[[_In], None]) -> None:
    """The owed bytes into ``into`` (their size), or discarded (None)."""
    if into is None and self.owed and len(self._sink) < min(self.owed, 1 << 20):
      self._sink = bytearray(min(self.owed, 1 << 20))
    view = memoryview(into.reshape(-1).view(np.uint8)) if into is not None else None
    got = 0
    while self.owed:
      dest = view[got:] if view is not None else memoryview(self._sink)[:min(self.owed, len(self._sink))]
      try:
        r = self.conn.recv_into(dest)
      except BlockingIOError:
        wait(self)
        continue
      if not r:
        raise ConnectionError(f"the neighbour closed the stream with {self.owed} bytes of a piece owed")
      got += r
      self.owed -= r
