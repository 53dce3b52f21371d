"""A replica group's side of the lighthouse: its quorum requests and its heartbeats.

Every message is sealed with the job's secret and stamped with the client's
incarnation and sequence number (:mod:`jaxckpt.ft._replay`). Re-exported by
:mod:`jaxckpt.ft.lighthouse`.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import zmq

from jaxckpt import errors
from jaxckpt.ft import _replay, _requests, _route
from jaxckpt.ft._quorum import Member, Quorum, View
from jaxckpt.ft._terms import Terms
from jaxckpt.net import _schema, _wire

logger = logging.getLogger(__name__)

MAX_WHY = 1000                     # characters of a reason sent to (and by) the lighthouse


class LighthouseClient:
  """A replica group's requests to the lighthouse (used from one thread only)."""

  def __init__(self, ctx: zmq.Context, address: str, *, secret: str | bytes | None = None,
               drop: Callable[[], bool] = lambda: False, resend_secs: float = 0.25):
    self.address = address
    self._secret = _wire.secret_bytes(secret, who="a lighthouse client")
    self._ctx = ctx
    self._drop = drop
    self._resend_secs = resend_secs
    # Request ids start at random: an ask is named by its first one, and a restarted
    # group's asks must not look like resends of its previous life's.
    self._ids = itertools.count(secrets.randbits(48) + 1)
    self._stamp = _replay.Stamp()       # this client's incarnation and sequence (see ft/_replay.py)
    # The public port, then the private one; of every replica when the address names several.
    self._route = _route.Routes(ctx, address, self._secret)
    self.view = View()
    self._unheard: list[dict[str, Any]] = []   # the last failure report, until a quorum reply came
    self.waiting: str | None = None    # why the lighthouse holds this member's asks (until a quorum comes)

  @property
  def private_port(self) -> int | None:
    """The lighthouse's private port this client sends through, once it learned it (of the
    first replica, when the address names several: :attr:`private_ports`)."""
    return next(iter(self._route.private.values()))

  @property
  def private_ports(self) -> dict[str, int | None]:
    """Each lighthouse replica's private port, once learned."""
    return self._route.private

  def quorum(self, member: Member, timeout: timedelta, terms: Terms | None = None) -> Quorum | None:
    """This member's view of the quorum of the next step attempt, or None if none formed within ``timeout``."""
    wire = self.ask(member, timeout, self.view.key, len(self.view.members) or None, terms=terms)
    return None if wire is None else self.view.resolve(member.group_id, wire)

  def ask(self, member: Member, timeout: timedelta, view: str = "",
          held: int | None = None, *, terms: Terms | None = None,
          slow: Callable[[float], None] | None = None, slow_secs: float = 1.0,
          waiting: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The lighthouse's reply to a quorum request (for :meth:`View.resolve`, with the
    view difference it attached as ``delta``), or None if none came within ``timeout``.
    ``view`` is the key of the view the member holds, ``held`` how many members it has,
    ``terms`` what it must agree on with the job. ``slow(secs)`` is called once when no
    reply came within ``slow_secs``; ``waiting(why)`` when the lighthouse first answers that it
    holds the member's requests (fewer groups ask than its ``min_replicas``; kept in
    :attr:`waiting` until a quorum comes). A failure reported while the lighthouse could not
    be reached (:meth:`failed`) is sent again with the request.

    Raises:
      TermsMismatchError: the lighthouse refused this member's terms (the message names
        the field and both values).
    """
    wire_member = _requests.MemberWire.of(member)
    wire_terms = None if terms is None else _requests.TermsWire.of(terms)
    deadline = time.monotonic() + timeout.total_seconds()
    started = time.monotonic()
    sent: set[int] = set()
    next_send = 0.0
    ask = None
    while (now := time.monotonic()) < deadline:
      if slow is not None and now - started >= slow_secs:
        slow(now - started)
        slow = None
      if now >= next_send:
        request_id = next(self._ids)
        ask = request_id if ask is None else ask
        sent.add(request_id)
        if not self._drop():
          for report in self._unheard:        # (the lighthouse may have missed it: its outage)
            self._route.send(_wire.seal(self._secret, self._stamp(report)), deadline)
          header = _schema.encode(_requests.QuorumRequest(
              request_id=request_id, wire_member=wire_member, view=view, ask=ask, held=held,
              wire_terms=wire_terms))
          self._route.send(_wire.seal(self._secret, self._stamp(header)), deadline)
        next_send = now + self._resend_secs
      wait = min(deadline, next_send) - now
      if slow is not None:
        wait = min(wait, max(0.0, started + slow_secs - now))
      frames = self._route.recv(wait)
      if frames is None or self._drop():
        continue
      try:
        header, raw = _wire.open_(self._secret, frames)
      except errors.PermissionDeniedError as e:
        raise errors.PermissionDeniedError(
            f"group {member.group_id!r}: {e}; give every group the lighthouse's secret "
            f"(ReplicaGroup(secret=...) or ${_wire.SECRET_ENV})") from None
      if self._route.learn(header):
        next_send = 0.0                   # (asks again at once, through the private port)
      if header.get("op") == "refused" and header.get("request_id") in sent and header.get("terms"):
        raise errors.TermsMismatchError(str(header.get("error"))[:MAX_WHY])
      if header.get("op") == "waiting" and header.get("request_id") in sent:
        first = self.waiting is None
        self.waiting = str(header.get("why"))[:MAX_WHY]
        if first and waiting is not None:
          waiting(self.waiting)
        slow = None                       # (the lighthouse answers: it is not the one that is slow)
      if header.get("op") == "quorum" and header.get("request_id") in sent:
        self._unheard.clear()
        self.waiting = None
        wire = dict(header["quorum"])
        if raw:
          wire["delta"] = raw[0].bytes if isinstance(raw[0], zmq.Frame) else bytes(raw[0])
        return wire
    return None

  def ready(self, group_id: str) -> None:
    """Tells the lighthouse that ``group_id`` (catching up) asks in sync next."""
    if not self._drop():
      self._route.send(_wire.seal(self._secret, self._stamp(
          _schema.encode(_requests.Ready(group=group_id)))))

  def failed(self, group_id: str, quorum_id: str, why: str, blame: tuple[str, ...]) -> None:
    """Tells the lighthouse that ``group_id`` failed quorum ``quorum_id``'s attempt, why,
    and whom that shows out of it: the lighthouse has every other member abort it. The
    report goes again with this member's next quorum request (until one is answered),
    so a failure found while the control plane was away reaches it once it is back."""
    report = _schema.encode(_requests.Failed(group=group_id, q=quorum_id, why=why[:MAX_WHY],
                                             blame=tuple(blame)[:8]))
    self._unheard[:] = [report]
    if not self._drop():
      self._route.send(_wire.seal(self._secret, self._stamp(report)))

  def close(self) -> None:
    self._route.close()


Notice = Callable[[str, str, tuple[str, ...]], None]   # (quorum id, why, blamed groups)


class Heartbeat:
  """Sends ``{"op": "heartbeat"}`` (with the group's ``step()``) every ``interval`` from a
  daemon thread, and hands the lighthouse's answers on that connection to
  ``on_abort(quorum_id, why, blame)`` (an abort of an attempt, see the module docstring)
  and ``on_call_back(quorum_id)`` (the lighthouse wants the members of that quorum, who
  go on with it without asking, to ask again: a group waits to join). The beats go to the lighthouse's
  private port once ``private_port()`` (the group's :attr:`LighthouseClient.private_port`)
  names it and its connection is up (there, the lighthouse pings the connection and
  a stopped group is known in ``connection_timeout``), else to its public address."""

  def __init__(self, ctx: zmq.Context, address: str, group_id: str, interval: timedelta, *,
               secret: str | bytes | None = None, drop: Callable[[], bool] = lambda: False,
               on_abort: Notice | None = None,
               private_port: Callable[[], dict[str, int | None] | int | None] = lambda: None,
               step: Callable[[], tuple[int, str | None] | None] = lambda: None,
               on_call_back: Callable[[str], None] | None = None):
    self._secret = _wire.secret_bytes(secret, who="a lighthouse heartbeat")
    self._route = _route.BeatRoutes(ctx, address, self._secret)
    self._private = private_port
    self._group_id = group_id
    self._interval = interval.total_seconds()
    self._drop = drop
    self._on_abort = on_abort
    self._on_call_back = on_call_back
    self._step = step
    self._stamp = _replay.Stamp()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"heartbeat-{group_id}", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.is_set():
      self._route.want(self._private())
      if not self._drop():
        where = self._step()                        # (step, the quorum it goes on with)
        beat = _requests.Heartbeat(group=self._group_id,
                                   step=None if where is None else where[0],
                                   lineage=where[1] if where is not None and where[1] else None)
        self._route.send(_wire.seal(self._secret, self._stamp(_schema.encode(beat))))
      until = time.monotonic() + self._interval
      while not self._stop.is_set() and (left := until - time.monotonic()) > 0:
        frames = self._route.recv(left)
        if frames is not None and not self._drop():
          self._heard(frames)
    leave = self._stamp(_schema.encode(_requests.Leave(group=self._group_id)))
    self._route.close(None if self._drop() else _wire.seal(self._secret, leave))

  def _heard(self, frames: list[Any]) -> None:
    try:
      header, _ = _wire.open_(self._secret, frames)
    except errors.PermissionDeniedError as e:
      logger.warning("group %s: the lighthouse refused a heartbeat: %s", self._group_id, e)
      return
    q, why, blame = header.get("q"), header.get("why"), header.get("blame")
    if header.get("op") == "call_back" and self._on_call_back is not None and isinstance(q, str):
      self._on_call_back(q)
    if (header.get("op") == "abort" and self._on_abort is not None and isinstance(q, str)
        and isinstance(why, str) and isinstance(blame, list)):
      self._on_abort(q, why, tuple(g for g in blame if isinstance(g, str)))

  def stop(self) -> None:
    """Stops the beats; the lighthouse is told the group leaves (it waits for it no more)."""
    self._stop.set()
    self._thread.join(timeout=5)
