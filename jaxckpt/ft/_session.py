"""A replica group's session with the control plane: its heartbeats, its quorum requests, its lineage.

:class:`LighthouseSession` is held by :class:`jaxckpt.ft.replica_group.ReplicaGroup`. It owns the group's
lighthouse client and heartbeat (process 0 only), the quorum membership the group holds (``view``, see
:mod:`jaxckpt.ft._quorum`), and what decides whether a step asks the lighthouse at all: the quorum the ring
goes on with after a step every member committed (``next``), the lineages the lighthouse ended (an abort), and
whether the lighthouse called the ring back (a group joins).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable

import zmq

from jaxckpt import errors
from jaxckpt.ft import _group_comm, _terms
from jaxckpt.ft._clients import Heartbeat, LighthouseClient
from jaxckpt.ft._quorum import Member, Quorum, View

logger = logging.getLogger("jaxckpt.ft.replica_group")   # (its owner's log, as before the split)

_SLOW_PLANE_SECS = 1.0   # a quorum request unanswered this long: the wait is said at WARNING


class LighthouseSession:
  """One group's session with the lighthouse (see the module's docstring).

  Args:
    ctx: process 0's ZeroMQ context (None on the group's other processes: no client, no heartbeat).
    lighthouse: ``HOST:PORT`` of the lighthouse (or several, comma-separated).
    group_id: the group's name.
    key: the job's secret.
    heartbeat_interval: period of the heartbeats.
    timeout_secs: the group's timeout (the wait for a quorum: at most twice it).
    lighthouse_timeout: after this long without any quorum, QuorumError.
    comm: the group's processes (process 0 asks, the others get its answer).
    drop: whether the fault injector cuts the group off now.
    on_abort: ``on_abort(quorum_id, why, blame)`` when the lighthouse ends an attempt.
    step: the group's committed step (its heartbeats carry it).
    extra: the group's log fields.
  """

  def __init__(self, ctx: zmq.Context | None, lighthouse: str, *, group_id: str, key: bytes,
               heartbeat_interval: timedelta, timeout_secs: float, lighthouse_timeout: timedelta,
               comm: _group_comm.GroupComm, drop: Callable[[], bool],
               on_abort: Callable[[str, str, tuple[str, ...]], None], step: Callable[[], int],
               extra: Callable[[], dict[str, Any]]):
    self.group_id, self._comm, self._drop, self._extra = group_id, comm, drop, extra
    self._timeout_secs, self._lighthouse_timeout = timeout_secs, lighthouse_timeout
    self._no_quorum_since: float | None = None
    self.next: Quorum | None = None       # the quorum to go on with, after a step every member committed
    self.lineage: str | None = None       # the lighthouse's id of the quorum the ring goes on with
    self.ended: set[str] = set()          # lineages the lighthouse ended (an abort): ask again
    self.called_back = False              # the lighthouse wants this ring to ask again (a group joins)
    self.why_ask = "it joins the job"     # why the next start_step asks the lighthouse
    self.view = View()            # the quorum membership this group holds (see ft/_quorum.py)
    self._on_abort = on_abort
    self.client: LighthouseClient | None = None
    self._heartbeat: Heartbeat | None = None
    if ctx is not None:
      self.client = LighthouseClient(ctx, lighthouse, secret=key, drop=drop)
      self._heartbeat = Heartbeat(ctx, lighthouse, group_id, heartbeat_interval,
                                  secret=key, drop=drop, on_abort=self._aborted,
                                  private_port=lambda: self.client.private_ports,
                                  step=lambda: (step(), self.lineage),
                                  on_call_back=self._call_back)

  def join(self, me: Callable[[], Member], terms: Callable[[], _terms.Terms]) -> Quorum | None:
    """The quorum of this attempt: the last one, one step on, when every member of the
    ring committed the last step and none asked to change it (no lighthouse is asked, so
    the ring trains through a control-plane outage); else the lighthouse's."""
    limit = self._lighthouse_timeout.total_seconds()
    go_on, wire, waited, refused = False, None, 0.0, None
    if self._comm.is_talker:
      # (A group the fault injector cuts off hears nothing, its ring included: it asks, in vain.)
      go_on = self.next is not None and self.next.lineage not in self.ended and not self._drop()
      if not go_on:
        now = time.monotonic()
        since = self._no_quorum_since if self._no_quorum_since is not None else now
        # The others may still be waiting out the last attempt's ring (up to
        # ``timeout``) before they ask: a shorter wait would keep a group that failed
        # fast one attempt out of phase with them for good. Never past lighthouse_timeout.
        wait = min(2 * self._timeout_secs, max(1e-3, since + limit - now))
        try:
          wire = self.client.ask(me(), timedelta(seconds=wait), self.view.key,
                                 len(self.view.members) or None, terms=terms(),
                                 slow=self._plane_slow, slow_secs=_SLOW_PLANE_SECS,
                                 waiting=self._held)
        except errors.TermsMismatchError as e:
          refused = str(e)
        self._no_quorum_since = None if wire is not None else since
        waited = time.monotonic() - since
    go_on, wire, waited, refused = self._comm.share([go_on, wire, waited, refused])
    if refused is not None:
      raise errors.TermsMismatchError(refused)
    nxt, self.next = self.next, None
    if go_on:
      return nxt
    quorum = None
    if wire is not None:
      try:
        quorum = self.view.resolve(self.group_id, wire)
      except errors.QuorumError as e:     # (the next request asks for the whole view)
        logger.warning("%s", e, extra=self._extra())
    if quorum is not None:
      self.lineage, self.called_back = quorum.lineage, False
      return quorum
    logger.warning("group %s got no quorum from lighthouse %s for %.1fs", self.group_id,
                   self.address(), waited, extra=self._extra())
    if waited >= limit:
      self._no_quorum_since = None
      held = self.client.waiting if self.client is not None else None
      raise errors.QuorumError(
          f"group {self.group_id!r} got no quorum from the lighthouse at "
          f"{self.address()} for {waited:.1f}s (lighthouse_timeout="
          f"{self._lighthouse_timeout}): "
          + (held if held else "is the lighthouse running, and do at least min_replicas groups reach it?"))
    return None

  def take_called_back(self) -> bool:
    """Whether the lighthouse called the ring back since the last ask (cleared)."""
    called, self.called_back = bool(self.called_back), False
    return called

  def _aborted(self, quorum_id: str, why: str, blame: tuple[str, ...]) -> None:
    """The lighthouse ended the attempt of ``quorum_id``: the next step asks again, and the
    group ends that attempt (``on_abort``)."""
    if len(self.ended) >= 64:            # (the lineages of long ago cannot come back)
      self.ended.clear()
    self.ended.add(quorum_id)
    self._on_abort(quorum_id, why, blame)

  def address(self) -> str:
    return self.client.address if self._comm.is_talker else "?"

  def close(self) -> None:
    """Stops the heartbeat (the lighthouse drops the group). Not the client: see :meth:`close_client`."""
    if self._heartbeat is not None:
      self._heartbeat.stop()

  def close_client(self) -> None:
    if self.client is not None:
      self.client.close()

  def _plane_slow(self, secs: float) -> None:
    # (A group's first join waits for the others to start: said, but no warning.)
    logger.log(logging.WARNING if self.lineage is not None else logging.INFO,
               "group %s waits for the control plane (the lighthouse at %s has not answered for "
               "%.1f s) because %s: a change of membership waits for it, while a ring whose "
               "members all commit goes on without it", self.group_id, self.address(),
               secs, self.why_ask, extra=self._extra())

  def _held(self, why: str) -> None:
    """The lighthouse answers that it holds this group's request: too few groups ask."""
    logger.log(logging.WARNING if self.lineage is not None else logging.INFO,
               "group %s waits for a quorum because %s: %s", self.group_id, self.why_ask, why,
               extra=self._extra())

  def _call_back(self, lineage: str) -> None:
    """The lighthouse wants the members of quorum ``lineage`` to ask again (a group joins)."""
    if lineage == self.lineage:
      self.called_back = True
