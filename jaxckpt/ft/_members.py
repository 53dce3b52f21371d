"""The lighthouse's state: who is live, who asks, the attempt in flight, and forming a quorum.

:class:`Members` is held by :class:`jaxckpt.ft.lighthouse.Lighthouse`, which reads the sockets, checks every
message (:mod:`jaxckpt.ft._requests`) and hands each request here, under its lock, with the time it was
read; what is answered goes out through the lighthouse's ``reply`` (and, for notices on a group's heartbeat
connection, sealed with the job's key). The rules (when a quorum forms, who is out of the attempt in flight,
who is told to abort it) are the lighthouse's docstring's. :class:`BeatConnections` keeps where each group's
heartbeats come from; the job's terms are :class:`jaxckpt.ft._job_terms.JobTerms`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import time
from typing import Any, Callable

import zmq

from jaxckpt.ft import _intake, _job_terms, _quorum, _requests, _terms
from jaxckpt.ft._clients import MAX_WHY
from jaxckpt.ft._quorum import Member
from jaxckpt.net import _wire

logger = logging.getLogger("jaxckpt.ft.lighthouse")   # (its owner's log, as before the split)

_RESCAN_SECS = 0.01                # how stale the set of live groups not yet asking may be
_CHECK_SECS = 0.05                 # how often the members of the attempt in flight are checked for heartbeats
_NOTICE_SECS = 0.25                # a group out of the attempt is told so at most this often
_CLOSE_GRACE_SECS = 0.05           # a closed heartbeat connection counts unless its group left in this time
_SHORT_NOTE_SECS = 1.0             # a request held for min_replicas is told why at most this often,
_SHORT_AFTER_SECS = 0.5            # from when it has waited this long (before its group calls the plane slow)
_NOTE_NAMES = 16                   # the groups a 'waiting' note names (then '...')
_BEAT_LAG_STEPS = 8                # steps a ring that goes on without asking may be ahead of its heartbeats
Peer = tuple  # (socket, ZeroMQ identity, connection fd): where a message came from, where its answer goes


@dataclasses.dataclass(slots=True)
class _Pending:
  peer: Peer
  request_id: int
  member: Member
  since: float
  view: str                             # the view key the member holds (see _quorum)
  ask: int | None                       # which ask of the member this is (its resends repeat it)
  held: int | None = None               # how many members that view has
  terms: _terms.Terms | None = None     # what it must agree on with the job
  lineage: str | None = None            # the quorum the group went on with when it asked


class BeatConnections:
  """Where each group's heartbeats come from (its notices go there), and the connection they
  use: when it closes, the group is not live (unless it left just before)."""

  def __init__(self):
    self.peers: dict[str, Peer] = {}       # where each group's heartbeats come from (its notices go)
    self._conn: dict[str, tuple[zmq.Socket, int]] = {}   # each group's heartbeat connection
    self._group: dict[tuple[zmq.Socket, int], str] = {}  # and back
    self.closing: dict[str, float] = {}    # groups whose heartbeat connection closed, and when

  def heard(self, gid: str, peer: Peer) -> None:
    """A heartbeat of ``gid`` came from ``peer``."""
    self.peers[gid] = peer
    conn = (peer[0], peer[2])
    if peer[2] >= 0 and self._conn.get(gid) != conn:
      self._group.pop(self._conn.get(gid), None)
      self._conn[gid], self._group[conn] = conn, gid
      self.closing.pop(gid, None)             # (back on a new connection)

  def closed(self, sock: zmq.Socket, fd: int, now: float, flooded: bool) -> None:
    """Connection ``fd`` of ``sock`` closed (``flooded``: its port was flooded just now)."""
    gid = self._group.pop((sock, fd), None)
    if gid is None or self._conn.get(gid) != (sock, fd):
      return
    del self._conn[gid]
    if flooded:
      return    # (a flood of the public port can hold its pings' answers back: not evidence)
    self.closing[gid] = now        # (unless it left: its leave may be read just after the close)

  def due(self, now: float) -> list[str]:
    """The groups whose heartbeat connection closed a grace period ago (and that did not leave)."""
    gone = [g for g, t in self.closing.items() if now - t >= _CLOSE_GRACE_SECS]
    for gid in gone:
      del self.closing[gid]
    return gone

  def left(self, gid: str) -> None:
    self.closing.pop(gid, None)
    self._group.pop(self._conn.pop(gid, None), None)


class Members:
  """The lighthouse's state (see the module's docstring).

  Args:
    options: the lighthouse's :class:`~jaxckpt.ft.lighthouse.LighthouseOptions`.
    address: the lighthouse's address (its log lines name it).
    key: the job's key (the notices on heartbeat connections are sealed with it).
    reply: ``reply(peer, header, attachment=None)``: the lighthouse's sealed answer to ``peer``.
    malformed: the lighthouse's count of sealed messages it refused.
  """

  def __init__(self, options: Any, address: str, key: bytes,
               reply: Callable[..., None], malformed: _intake.Refusals):
    self.options, self.address, self._key = options, address, key
    self._reply, self._malformed = reply, malformed
    self._epoch = os.urandom(4).hex()
    self._counter = itertools.count()
    self._formation = _quorum.Formation()
    self._last_seen: dict[str, float] = {}
    self._pending: dict[str, _Pending] = {}
    self._answered: dict[str, tuple[int | None, dict[str, Any], bytes | None]] = {}   # each group's last answer
    self._inflight: dict[str, float] = {}
    self._last_members: tuple[str, ...] = ()
    self._behind: set[str] = set()        # members of the last quorum that were catching up
    self._last_step: int | None = None    # the newest step a formed quorum was at
    self._quorums_formed = 0
    self._last_form_secs = 0.0
    self._first_pending: float | None = None    # when the oldest pending request came
    self._waiting: set[str] | None = None       # live groups that neither asked nor catch up (last scan)
    self._scanned_at = 0.0
    self._quorum_id: str | None = None    # of the quorum formed last (its attempt is in flight)
    self._out: dict[str, str] = {}        # groups out of that attempt (and why), until they ask
    # The attempt in flight's abort, once it is ended: (quorum id, why, blame, its reporter).
    self._aborted: tuple[str | None, str, tuple[str, ...], str | None] | None = None
    self.conns = BeatConnections()
    self._notices = _intake.AnswerLimiter(_NOTICE_SECS)
    self._short_notes = _intake.AnswerLimiter(_SHORT_NOTE_SECS)
    self._notes_at = 0.0                      # when _too_few next looks (its notes go out together)
    self._called_back_at = -math.inf      # when the ring in flight was last called back
    self._called_back = False             # whether the ring in flight was asked to ask again
    self._beat_steps: dict[str, int] = {} # the step each group's last heartbeat named
    self._lineage_of: dict[str, str] = {} # the quorum each group goes on with (its heartbeats, or formed here)
    self._adopted = False                 # whether the ring in flight's quorum was formed by another lighthouse
    self.job = _job_terms.JobTerms(address, malformed)   # what every group of the job must hold the same
    self._reported: dict[tuple[str, str], str] = {}   # failures reported for an unknown attempt
    self.before_form: Callable[[str], bool] | None = None   # (may this lighthouse form quorum q now?)
    # A replica on etcd follows (hears, answers nobody) until it leads (see ft/_replicas.py).
    self.passive = bool(options.etcd_endpoints)
    self._checked_at = 0.0
    self.started_at = time.monotonic()

  # ---- what the groups send ------------------------------------------------------------------------

  def heartbeat(self, peer: Peer, request: _requests.Heartbeat, now: float) -> None:
    gid = request.group
    if self._last_seen.setdefault(gid, now) == now:
      self._waiting = None            # (a group not seen before: who is waited for changes)
    self._last_seen[gid] = now
    if request.step is not None:
      self._beat_steps[gid] = request.step
    if request.lineage is not None:
      asked = self._pending.get(gid)
      if asked is not None and asked.lineage != request.lineage and (asked.lineage or not asked.view):
        # It asked, and goes on with a quorum formed since (by another lighthouse: this one
        # followed, or was away): that request is answered, nobody waits on it.
        del self._pending[gid]
        if not self._pending:
          self._first_pending = None
      self._lineage_of[gid] = request.lineage
      self._adopt(gid, request.lineage, request.step, now)
    elif gid not in self._inflight:
      self._lineage_of.pop(gid, None)     # (a new process of the group: it holds no quorum yet)
    self.conns.heard(gid, peer)
    if gid in self._out and self._notices.allow(gid, now):
      self._notify(gid, self._out[gid], ())    # (its attempt is stale: it learns at once)
    elif (self._aborted is not None and gid in self._inflight and gid != self._aborted[3]
          and self._notices.allow(gid, now)):
      self._notify(gid, *self._aborted[1:3])   # (again: a notice may have gone to an old socket)

  def ready(self, gid: str, now: float) -> None:
    """A member catching up is about to ask in sync."""
    self._behind.discard(gid)
    self._out.pop(gid, None)
    self._last_seen[gid] = now
    self._waiting = None
    self._call_back(now)                       # (the ring asks again: it joins them there)

  def leave(self, gid: str) -> None:
    """A group closing: not live, nobody waits for it."""
    self.conns.left(gid)
    self._last_seen[gid] = -math.inf
    self._inflight.pop(gid, None)
    self._behind.discard(gid)
    self._out.pop(gid, None)
    if self._pending.pop(gid, None) is not None and not self._pending:
      self._first_pending = None
    self._waiting = None
    logger.info("lighthouse at %s: group %s left", self.address, gid, extra={"group_id": gid})

  def ask(self, peer: Peer, request: _requests.QuorumRequest, now: float) -> None:
    member = request.member
    newest = self._newest_step()
    if not self.passive and newest is not None and member.step > newest + 1:
      # Members advance one step per quorum: a claim beyond that is a bug or a lie,
      # and admitting it would make every honest group look behind (a stalled job).
      self._malformed.add(f"group {member.group_id!r} claims step {member.step}, the job is at "
                          f"{newest}")
      self._reply(peer, {
          "op": "refused", "request_id": request.request_id,
          "error": f"step {member.step} claimed, but the job is at step "
                   f"{newest}: a group can be at most one step ahead"})
      return
    if (request.terms is not None and self.job.terms is not None and not self.passive
        and (request.view or self._run_live(now, but=member.group_id))):
      # (A group of no quorum, while no group of the run is left, may start a new run: its
      # first quorum decides, see _fix_terms.)
      why = self.job.refused(member.group_id, request.terms)
      if why is not None:
        self._reply(peer, {"op": "refused", "request_id": request.request_id, "terms": True, "error": why})
        return
    gid = member.group_id
    answered = self._answered.get(gid)
    if answered is not None and request.ask is not None and answered[0] == request.ask and not self.passive:
      # A resend of an ask already answered (its reply crossed it, or was lost): the same
      # answer again, never a new pending request that the next quorum would count on.
      self._reply(peer, dict(answered[1], request_id=request.request_id), answered[2])
      return
    self._last_seen[gid] = now
    self._inflight.pop(gid, None)
    self._behind.discard(gid)
    self._out.pop(gid, None)
    old = self._pending.get(gid)
    if old is None and self._waiting is not None:
      self._waiting.discard(gid)
    if not self._pending:
      self._first_pending = now
    self._pending[gid] = _Pending(peer, request.request_id, member, old.since if old else now,
                                  request.view, request.ask, request.held, request.terms,
                                  self._lineage_of.get(gid))

  def status(self, now: float) -> dict[str, Any]:
    """What :meth:`jaxckpt.ft.lighthouse.Lighthouse.status` says of the state (its counters aside)."""
    return {"live": sorted(self._live(now)), "pending": sorted(self._pending),
            "last_members": list(self._last_members), "quorums_formed": self._quorums_formed,
            "out": sorted(self._out), "terms": None if self.job.terms is None else self.job.terms.to_wire(),
            "run": self.job.run,
            "leading": not self.passive, "lineage": self._quorum_id,
            "reported_failures": [[g, q, why] for (g, q), why in self._reported.items()],
            "last_form_secs": self._last_form_secs}

  # ---- leading (a replica on etcd) -----------------------------------------------------------------

  def elected(self, stored: tuple[_terms.Terms, str | None] | None, now: float) -> None:
    """This replica leads from now: the job's terms and their run from etcd (``stored``), and
    the quorum the groups go on with adopted from their heartbeats (a follower heard them all
    along)."""
    self.passive, self.started_at = False, now
    if stored is not None:
      self.job.terms, self.job.run = stored
    self._quorum_id, self._inflight, self._last_members, self._adopted = None, {}, (), False
    self._aborted, self._called_back, self._out = None, False, {}
    ring = [(self._beat_steps.get(g, 0), self._lineage_of[g], g) for g in self._live(now)
            if g in self._lineage_of and g not in self._pending]
    if ring:
      step, lineage, _ = max(ring)
      for s, q, g in ring:
        if q == lineage:
          self._adopt(g, q, s, now)

  # ---- ending an attempt for every member ----------------------------------------------------------

  def gone(self, now: float) -> None:
    """Groups whose heartbeat connection closed (and that did not leave): not live, and out of
    the attempt in flight."""
    for gid in self.conns.due(now):
      self._connection_lost(gid)

  def _connection_lost(self, gid: str) -> None:
    self._last_seen[gid] = -math.inf
    self._waiting = None
    if self._pending.pop(gid, None) is not None and not self._pending:
      self._first_pending = None
    if gid in self._inflight:
      del self._inflight[gid]
      self._out[gid] = (f"group {gid}'s connection to the lighthouse closed during quorum {self._quorum_id}'s "
                        f"attempt (its process ended, or stopped: no answer to pings for "
                        f"{self.options.connection_timeout.total_seconds():g} s)")
      logger.warning("lighthouse at %s: %s; the other members abort that attempt", self.address,
                     self._out[gid], extra={"dropped_groups": [gid]})
      self._abort_attempt(self._out[gid], (gid,))

  def check_in_flight(self, now: float) -> None:
    """Members of the attempt in flight whose heartbeats stopped are out of it: the others abort it."""
    if self.passive or not self._inflight or now - self._checked_at < _CHECK_SECS:
      return
    self._checked_at = now
    dead = sorted(g for g in self._inflight if not self._is_live(g, now))
    if not dead:
      return
    secs = self.options.heartbeat_timeout.total_seconds()
    for g in dead:
      del self._inflight[g]
      self._out[g] = (f"group {g} sent the lighthouse no heartbeat for {secs:g} s during quorum "
                      f"{self._quorum_id}'s attempt (dead or stopped)")
    self._waiting = None
    logger.warning("lighthouse at %s: %s; the other members abort that attempt", self.address,
                   "; ".join(self._out[g] for g in dead), extra={"dropped_groups": dead})
    self._abort_attempt(self._out[dead[0]], dead)

  def failed(self, report: _requests.Failed) -> None:
    """A member failed the attempt in flight: whom it blames is out of it, and the rest abort it.
    (The attempt is named ``lineage`` or ``lineage@step``: the ring goes on with the quorum
    this lighthouse formed, step after step, without asking.)"""
    lineage = report.q.partition("@")[0]
    known = lineage == self._quorum_id and report.group in self._last_members
    key = (report.group, report.q)
    if (not known or self._adopted) and key not in self._reported:
      # Found while this lighthouse was away or did not lead (an outage, a new leader).
      self._reported[key] = report.why
      while len(self._reported) > 256:
        self._reported.pop(next(iter(self._reported)))
      logger.warning("lighthouse at %s: group %s reports a failure of quorum %s's attempt, which "
                     "this lighthouse did not see (the control plane was away, or another "
                     "lighthouse led): %s; out: %s", self.address, report.group, report.q, report.why,
                     list(report.blame))
      for g in report.blame:              # (not waited for by the next quorum)
        if g != report.group and g not in self._pending:
          self._last_seen[g] = -math.inf
      self._waiting = None
    if not known:
      return                              # (an older attempt's report: nothing left to end)
    why = f"group {report.group} failed quorum {report.q}'s attempt: {report.why}"
    for g in report.blame:
      if g in self._inflight:
        del self._inflight[g]
        self._out[g] = why
        self._waiting = None
    self._abort_attempt(why, report.blame, skip=report.group)

  def _abort_attempt(self, why: str, blame: Any, skip: str | None = None) -> None:
    """Tells every member still in the attempt in flight to abort it (at once, and on each
    of its heartbeats until it asks again)."""
    if self._aborted is not None or self.passive:
      return
    self._aborted = (self._quorum_id, why, tuple(blame), skip)
    for g in self._inflight:
      if g != skip:
        self._notify(g, why, blame)

  def _notify(self, gid: str, why: str, blame: Any) -> None:
    """An ``abort`` of ``gid``'s last attempt, on its heartbeat connection."""
    if self.passive:
      return
    peer, answered = self.conns.peers.get(gid), self._answered.get(gid)
    lineage = self._lineage_of.get(gid) or (answered[1]["quorum"]["id"] if answered else None)
    if peer is None or lineage is None:
      return
    _wire.send(peer[0], [peer[1], *_wire.seal(self._key, {
        "op": "abort", "q": lineage, "why": why[:MAX_WHY], "blame": list(blame)[:8]})])

  def _run_live(self, now: float, but: str | None = None) -> bool:
    """Whether a group of the run the job's terms are of is still here: a pending request that
    holds a view, or a live group (not ``but``, not asking without a view) that goes on with a
    quorum (its heartbeats name one, or it is in the attempt in flight)."""
    if any(p.view for p in self._pending.values()):
      return True
    return any(g != but and (g not in self._pending) and self._is_live(g, now)
               for g in (*self._lineage_of, *self._inflight))

  def _live(self, now: float) -> set[str]:
    limit = self.options.heartbeat_timeout.total_seconds()
    return {g for g, t in self._last_seen.items() if now - t <= limit}

  def _is_live(self, group: str, now: float) -> bool:
    return now - self._last_seen.get(group, -math.inf) <= self.options.heartbeat_timeout.total_seconds()

  # ---- the ring's step, calling the ring back ------------------------------------------------------

  def _adopt(self, gid: str, lineage: str, step: int | None, now: float) -> None:
    """A group goes on with quorum ``lineage`` that another lighthouse formed (this one
    restarted, or took over as leader): its ring is in flight here too, so a group that
    asks is not formed into a quorum without it (its members are called back first), and
    a failure ends the attempt for every member of it."""
    if gid in self._pending or gid in self._out:
      return
    if self._quorum_id is None or (self._adopted and lineage != self._quorum_id and step is not None
                                   and step > (self._last_step or 0)):
      self._quorum_id, self._adopted, self._aborted, self._called_back = lineage, True, None, False
      self._inflight, self._last_members = {}, ()
    if not self._adopted or lineage != self._quorum_id or gid in self._inflight:
      return
    self._inflight[gid] = now
    self._last_members = tuple(sorted({*self._last_members, gid}))
    if step is not None:
      self._last_step = max(step, self._last_step or 0)
    self._waiting = None

  def _newest_step(self) -> int | None:
    """The newest step a group may claim, less one: the last quorum's step, or, while the
    ring in flight goes on without asking, the newest its members name in their heartbeats
    (which lag the ring by up to a few steps: ``_BEAT_LAG_STEPS``)."""
    beat = max((self._beat_steps[g] for g in self._inflight if g in self._beat_steps), default=None)
    if beat is not None and (self._last_step is None or beat > self._last_step):
      return beat + _BEAT_LAG_STEPS
    return self._last_step

  def _call_back(self, now: float) -> None:
    """While a group waits to join (a request pending, or a member catching up is ready),
    tells the members of the ring in flight, which go on with their quorum without asking,
    to ask again (a ``call_back`` on each one's heartbeat connection, until it asks)."""
    if (self.passive or not self._inflight or self._quorum_id is None
        or now - self._called_back_at < _NOTICE_SECS):      # (cheap: runs after every batch)
      return
    if not self._pending and not any(g not in self._behind for g in self._last_members
                                     if g not in self._inflight and self._is_live(g, now)):
      return
    self._called_back_at = now
    if not self._called_back:             # (the stragglers' wait counts from now)
      self._called_back = True
      for g in self._inflight:
        self._inflight[g] = now
    for g in self._inflight:
      if g not in self._pending:
        peer = self.conns.peers.get(g)
        if peer is not None:
          _wire.send(peer[0], [peer[1], *_wire.seal(self._key, {"op": "call_back", "q": self._quorum_id})])

  # ---- forming a quorum ----------------------------------------------------------------------------

  def maybe_form(self, now: float) -> None:
    """Forms a quorum when it is due. Cheap while it is not: the checks that look
    at every group run only once the cheap ones pass."""
    if self.passive:
      return
    opts = self.options
    join = opts.join_timeout.total_seconds()
    if not self._pending or (now - self.started_at < join and not self._whole_view_asks()):
      return
    self._call_back(now)
    if len(self._pending) < opts.min_replicas:
      self._too_few(now)
      return
    straggler = opts.straggler_timeout.total_seconds()
    if any(now - t < straggler and self._is_live(g, now) for g, t in self._inflight.items()):
      return                                  # (the first busy one ends the scan)
    first = min(p.since for p in self._pending.values()) if self._first_pending is None else self._first_pending
    if now - first < join and self._waiting_for(now):
      return
    self._form(now)

  def _too_few(self, now: float) -> None:
    """Tells each request pending for _SHORT_AFTER_SECS, and again every _SHORT_NOTE_SECS, that it
    waits for ``min_replicas``, not for the lighthouse: a ``waiting`` answer with the counts
    (its group says so, and goes on asking). (Not sooner: groups that start together ask
    within that time, and a quorum that forms at once needs no note.) The notes go out
    together, at most every _SHORT_NOTE_SECS: a scan in between costs nothing, whatever the
    number of groups asking."""
    if now < self._notes_at:
      return
    oldest = min(p.since for p in self._pending.values())
    if now - oldest < _SHORT_AFTER_SECS:
      self._notes_at = oldest + _SHORT_AFTER_SECS
      return
    n, need = len(self._pending), self.options.min_replicas
    asking = ", ".join(sorted(self._pending)[:_NOTE_NAMES]) + (", ..." if n > _NOTE_NAMES else "")
    others = sorted(self._live(now) - self._pending.keys())
    why = (f"the lighthouse at {self.address} has {n} of the {need} groups a quorum needs "
           f"(min_replicas={need}): {asking} ask{'s' if n == 1 else ''}"
           + (f", {', '.join(others[:_NOTE_NAMES])}{', ...' if len(others) > _NOTE_NAMES else ''}"
              " live but not asking" if others else "")
           + "; it forms one when enough groups ask (a group that died, once it is back), "
             f"or, to go on with fewer, a lighthouse with min_replicas={n} (--min-replicas {n})")
    for gid, p in self._pending.items():
      if now - p.since >= _SHORT_AFTER_SECS and self._short_notes.allow(gid, now):
        self._reply(p.peer, {"op": "waiting", "request_id": p.request_id, "why": why[:MAX_WHY]})
    self._notes_at = now + _SHORT_NOTE_SECS

  def _waiting_for(self, now: float) -> bool:
    """Whether a live group has neither asked nor is catching up. The full scan runs
    at most every _RESCAN_SECS and after membership changes; in between, each
    request only takes its group off the set the last scan found."""
    if self._waiting is None or now - self._scanned_at >= _RESCAN_SECS:
      self._waiting = self._live(now) - self._pending.keys() - self._behind - self._out.keys()
      self._scanned_at = now
    return bool(self._waiting)

  def _whole_view_asks(self) -> bool:
    """Whether the pending requests are every member of the one view they hold (after a
    restart: the whole last quorum is back, so there is no membership left to wait for)."""
    first = next(iter(self._pending.values()))
    return (bool(first.view) and first.held == len(self._pending)
            and all(p.view == first.view and p.held == first.held for p in self._pending.values()))

  def _fix_terms(self) -> None:
    """The job's terms, from the first quorum's requests if not fixed yet; pending members
    whose terms differ are refused (with the field and both values) and not in the quorum."""
    asking = [(g, bool(p.view), p.terms) for g, p in sorted(self._pending.items()) if p.terms is not None]
    for gid, why in self.job.fix(asking, self._run_live(time.monotonic())):
      p = self._pending.pop(gid)
      self._reply(p.peer, {"op": "refused", "request_id": p.request_id, "terms": True, "error": why})
    if self.job.terms is not None and not self._pending:
      self._first_pending = None

  def _form(self, now: float) -> None:
    t0 = time.perf_counter()
    self._fix_terms()
    if len(self._pending) < self.options.min_replicas:
      return
    quorum_id = f"{self._epoch}-{next(self._counter)}"
    if self.before_form is not None and not self.before_form(quorum_id):
      return                              # (not the leader any more: another lighthouse forms it)
    pending = [self._pending[g] for g in sorted(self._pending)]
    members = [p.member for p in pending]
    healthy = _quorum.healthy_of(members)
    held = {p.member.group_id: p.view for p in pending}
    dropped = [g for g in self._last_members if g not in self._pending]
    for p, (_, reply, blob) in zip(pending, self._formation.replies(quorum_id, members, held,
                                                                      healthy=healthy)):
      header = {"op": "quorum", "request_id": p.request_id, "quorum": reply}
      self._reply(p.peer, header, blob)
      self._answered[p.member.group_id] = (p.ask, header, blob)
    for g in self._inflight:              # ring members of the last attempt that never came back
      if g not in held:
        self._out.setdefault(g, f"the job formed quorum {quorum_id} without group {g}, whose attempt "
                                f"in quorum {self._quorum_id} had not ended")
    self._pending.clear()
    self._first_pending, self._waiting = None, None
    self._quorum_id, self._aborted, self._called_back, self._adopted = quorum_id, None, False, False
    ids = tuple(m.group_id for m in members)
    self._lineage_of.update((g, quorum_id) for g in ids)
    self._inflight = {m.group_id: now for m in healthy}   # members that are behind catch up first:
    self._behind = set(ids) - self._inflight.keys()         # neither is waited for
    self._last_members = ids
    self._last_step = healthy[0].step
    self._quorums_formed += 1
    self._last_form_secs = time.perf_counter() - t0
    logger.info("quorum %s formed: %d members (%d healthy) at step %d, dropped %s in %.1f ms",
                quorum_id, len(ids), len(healthy), self._last_step, dropped,
                1e3 * self._last_form_secs,
                extra={"quorum_id": quorum_id, "quorum_size": len(ids), "step": self._last_step,
                       "dropped_groups": dropped})
