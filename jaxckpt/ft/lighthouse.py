"""The lighthouse: membership by heartbeat and one quorum per step.

Replica groups (their process 0) send heartbeats and, at the start of every
step attempt, a quorum request carrying their committed step and state digest.
The lighthouse answers all pending requests at once (each member gets its own
view of the quorum, :class:`jaxckpt.ft._quorum.Quorum`: O(1) bytes in steady
state, whatever the number of groups) when

* at least ``min_replicas`` groups are pending, and
* no live member of the previous quorum is still busy with its step (waited for
  at most ``straggler_timeout``: a stuck group never blocks for longer), and
* every live group is pending, or ``join_timeout`` passed since the first request.

A group is live while its heartbeats arrive within ``heartbeat_timeout``; a dead
group is simply not waited for. The state is soft: after a restart the
lighthouse waits ``join_timeout`` for heartbeats to rebuild membership and
carries on, or forms at once when every member of the view the requests hold is
asking again (each request says how many members its view has), so a
lighthouse restart does not lose the job and costs it little more than the
outage (groups resend their requests until a lighthouse answers).

Failures end an attempt for every member at once. A member of the attempt in
flight whose heartbeat connection closes (its process died, or stopped: the
lighthouse pings every connection and closes one silent for
``connection_timeout``, see :class:`LighthouseOptions`) or whose heartbeats stop
for ``heartbeat_timeout`` is declared out of it, and a member that fails its
attempt reports why and whom it blames (a closed stream, a refused connection:
:mod:`jaxckpt.ft._links`).
Either way the lighthouse tells every other member still in the attempt to
abort it (a sealed ``abort`` on its heartbeat connection), so no member waits
out its ring timeout for a piece that cannot come, and a failure reaches every
live member whoever its ring neighbours are. A group out of the attempt is not
waited for by the next quorum, and until it asks again each of its heartbeats
is answered with an ``abort`` of its stale attempt: a stopped group that
resumes learns at once that the job moved on, and catches up without holding
a healthy quorum.

Every message is sealed with the job's secret (:mod:`jaxckpt.net._wire`). One that
cannot be (no mac of the right size) is dropped unread; one whose mac does not
verify is refused; both are counted (``refused``, also in :meth:`Lighthouse.status`),
logged one line per 10 s with the count, and answered at most once a second per
sender, so a flood costs little and gets no echo. A sealed message is checked
field by field (:mod:`jaxckpt.ft._requests`) before anything uses it: a
malformed one is refused, counted (``malformed``) and answered with the reason,
and changes nothing. The loop takes what is queued in bounded batches, handles
the sealed messages of a batch before it answers anyone else, and checks for a
quorum after every batch, so no flood keeps it from forming one.

The job's own traffic moves to a second, *private* port (:mod:`jaxckpt.ft._route`:
a CURVE handshake keyed by the secret, so nothing a stranger sends there reaches
Python); the public address stays open to anyone, and while a flood fills it,
it is read at a bounded rate and the private port is served first.

A member of a quorum that was behind (catching up) is never waited for when the
next quorum forms: it joins one once it has caught up.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from jaxckpt import errors
from jaxckpt.ft import _intake, _quorum, _replay, _replicas, _requests, _route, _terms
from jaxckpt.ft._clients import MAX_WHY, Heartbeat, LighthouseClient, Notice
from jaxckpt.ft._quorum import Member, Quorum, View

__all__ = ["Heartbeat", "Lighthouse", "LighthouseClient", "LighthouseOptions", "Member", "Notice", "Quorum",
           "View"]
from jaxckpt.net import _wire

logger = logging.getLogger(__name__)

_POLL_SECS = 0.01
_BATCH = 256                       # messages handled before the next quorum check
_PUBLIC_BATCH = 64                 # messages read from the public port at a time
_FLOOD_PAUSE_SECS = 0.005          # after a public batch mostly refused: read only the private port
_MAX_MESSAGE_BYTES = 1 << 16       # every lighthouse message is far smaller
_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)
_RESCAN_SECS = 0.01                # how stale the set of live groups not yet asking may be
_CHECK_SECS = 0.05                 # how often the members of the attempt in flight are checked for heartbeats
_NOTICE_SECS = 0.25                # a group out of the attempt is told so at most this often
_CLOSE_GRACE_SECS = 0.05           # a closed heartbeat connection counts unless its group left in this time
_BEAT_LAG_STEPS = 8                # steps a ring that goes on without asking may be ahead of its heartbeats
Peer = tuple  # (socket, ZeroMQ identity, connection fd): where a message came from, where its answer goes


@dataclasses.dataclass(frozen=True, kw_only=True)
class LighthouseOptions:
  """Options of a :class:`Lighthouse`.

  Attributes:
    min_replicas: fewest groups a quorum may have. Below the number of groups,
      the first quorums may form before every group has started: those steps
      average fewer gradients (fewer batches) than the job's full width, and the
      late groups catch up to them.
    heartbeat_timeout: a group whose last heartbeat is older is dropped; a
      member of the attempt in flight, also out of that attempt (every other
      member is told to abort it at once). Long enough for a pause of the
      group's Python (a garbage collection holds every thread for up to
      seconds in a large process): the connection timeout catches a dead or
      stopped process sooner.
    connection_timeout: the lighthouse pings every connection (ZeroMQ's own
      heartbeats, answered by the peer's I/O thread whatever its Python is
      doing) and closes one that stays silent this long. When a group's
      heartbeat connection closes (its process died, stopped, or its host is
      unreachable) the group is not live, and out of the attempt in flight.
    join_timeout: how long pending requests wait for live groups that have not
      asked yet; also the grace period after a (re)start.
    straggler_timeout: how long members of the previous quorum that are still
      live but have not asked again are waited for.
    etcd_endpoints: the etcd cluster (``http://HOST:PORT`` of each member) that
      this lighthouse is a replica on: empty for a lighthouse of its own (one
      machine, tests). With it, several replicas serve one job and one of them
      leads (:mod:`jaxckpt.ft._replicas`); give every group all their addresses.
    job_name: the job the replicas serve (its keys in etcd: ``/jaxckpt/<job_name>/``).
    leader_lease: the leader's etcd lease: a leader that dies leads until it
      expires (a clean exit hands over at once). Whole seconds, at least etcd's
      shortest lease (1.5 election timeouts, rounded up).
  """
  min_replicas: int = 1
  heartbeat_timeout: timedelta = timedelta(seconds=5)
  join_timeout: timedelta = timedelta(seconds=1)
  straggler_timeout: timedelta = timedelta(seconds=60)
  connection_timeout: timedelta = timedelta(milliseconds=750)
  etcd_endpoints: tuple[str, ...] = ()
  job_name: str = ""
  leader_lease: timedelta = timedelta(seconds=2)

  def __post_init__(self):
    if self.min_replicas < 1:
      raise errors.InvalidArgumentError(f"LighthouseOptions.min_replicas must be >= 1, got {self.min_replicas=}")
    if self.etcd_endpoints and not self.job_name:
      raise errors.InvalidArgumentError(
          "LighthouseOptions.job_name is needed with etcd_endpoints (the job's keys in etcd: "
          f"/jaxckpt/<job_name>/), got {self.job_name=}")
    if isinstance(self.etcd_endpoints, str):
      raise errors.InvalidArgumentError(
          f"LighthouseOptions.etcd_endpoints must be a tuple of URLs, got the string {self.etcd_endpoints!r}")
    for name in ("heartbeat_timeout", "join_timeout", "straggler_timeout", "connection_timeout", "leader_lease"):
      value = getattr(self, name)
      if not isinstance(value, timedelta) or value <= timedelta(0):
        raise errors.InvalidArgumentError(f"LighthouseOptions.{name} must be a positive timedelta, got {value!r}")


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


class Lighthouse:
  """The lighthouse server, run on a background thread of this process.

  ``secret`` is the job's secret (else ``$JAXCKPT_JOB_SECRET``, else a new
  random one): hand ``lighthouse.secret`` to every group of the job.
  ``private_port`` is the port of the job's private door on the same interface
  (0: any free one, told to the groups in every sealed reply; None: none, all
  traffic on ``bind``).

  >>> with Lighthouse("127.0.0.1:0", LighthouseOptions(min_replicas=1)) as lh:
  ...   lh.address.startswith("127.0.0.1:")
  True
  """

  def __init__(self, bind: str = "127.0.0.1:0", options: LighthouseOptions | None = None, *,
               secret: str | None = None, private_port: int | None = 0):
    self.options = options or LighthouseOptions()
    self.secret = secret or os.environ.get(_wire.SECRET_ENV) or _wire.new_secret()
    self._key = _wire.secret_bytes(self.secret, who="the lighthouse")
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
      raise errors.InvalidArgumentError(f"Lighthouse bind must be HOST:PORT, got {bind=}")
    self._ctx = zmq.Context()
    self._sock = _wire.socket(self._ctx, zmq.ROUTER)
    self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)   # (a larger one drops its connection)
    # The job's own door (see ft/_route.py): a CURVE handshake keyed by the secret keeps floods out.
    self._private, self.private_port = None, None
    if _route.HAS_CURVE and private_port is not None:
      self._private = _route.private_socket(self._ctx, self._key)
      self._private.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
    # Every connection is pinged, and its close reported, so a dead or stopped group is known
    # at once whatever its Python is doing (a peer's I/O thread answers the pings). On the
    # private port only, when there is one: a flood of the public port could hold the answers
    # back there (a connection whose queue is full is not read) and close good ones. (Before
    # binding: a listener's connections take the options it had when it was bound.)
    ping_ms = int(1000 * self.options.connection_timeout.total_seconds())
    pinged = self._private if self._private is not None else self._sock
    pinged.setsockopt(zmq.HEARTBEAT_IVL, max(10, min(100, ping_ms // 4)))
    pinged.setsockopt(zmq.HEARTBEAT_TIMEOUT, ping_ms)
    self._monitors = [(pinged.get_monitor_socket(zmq.EVENT_DISCONNECTED), pinged)]
    try:
      if port == "0":
        port = str(self._sock.bind_to_random_port(f"tcp://{host}"))
      else:
        self._sock.bind(f"tcp://{host}:{port}")
      if self._private is not None:
        if private_port == 0:
          self.private_port = self._private.bind_to_random_port(f"tcp://{host}")
        else:
          self._private.bind(f"tcp://{host}:{private_port}")
          self.private_port = private_port
    except zmq.ZMQError:
      self._close_sockets()
      raise
    self.address = f"{host}:{port}"
    who = f"the lighthouse at {self.address}"
    self._refusals = _intake.Refusals(logger, who, "not sealed with the job's secret")
    # A group's heartbeats, quorum requests, readiness and failure reports each
    # supersede its last one (by a sequence number per incarnation, see
    # ft/_replay.py): a captured message replayed (or overtaken) is refused, in
    # memory that grows with groups, not messages. Status requests change nothing.
    self._replays = _replay.Incarnations(_sender_of)
    self._malformed = _intake.Refusals(logger, who, "sealed but malformed")
    self._answers = _intake.AnswerLimiter()
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
    self._cpu_secs = 0.0                        # CPU time of the serving thread so far
    self._first_pending: float | None = None    # when the oldest pending request came
    self._waiting: set[str] | None = None       # live groups that neither asked nor catch up (last scan)
    self._scanned_at = 0.0
    self._quorum_id: str | None = None    # of the quorum formed last (its attempt is in flight)
    self._out: dict[str, str] = {}        # groups out of that attempt (and why), until they ask
    # The attempt in flight's abort, once it is ended: (quorum id, why, blame, its reporter).
    self._aborted: tuple[str | None, str, tuple[str, ...], str | None] | None = None
    self._beat_peers: dict[str, Peer] = {}  # where each group's heartbeats come from (its notices go)
    self._beat_conn: dict[str, tuple[zmq.Socket, int]] = {}   # each group's heartbeat connection
    self._conn_group: dict[tuple[zmq.Socket, int], str] = {}  # and back
    self._closing: dict[str, float] = {}   # groups whose heartbeat connection closed, and when
    self._notices = _intake.AnswerLimiter(_NOTICE_SECS)
    self._called_back_at = -math.inf      # when the ring in flight was last called back
    self._called_back = False             # whether the ring in flight was asked to ask again
    self._beat_steps: dict[str, int] = {} # the step each group's last heartbeat named
    self._lineage_of: dict[str, str] = {} # the quorum each group goes on with (its heartbeats, or formed here)
    self._adopted = False                 # whether the ring in flight's quorum was formed by another lighthouse
    self._terms: _terms.Terms | None = None   # what every group of the job must hold the same
    self._reported: dict[tuple[str, str], str] = {}   # failures reported for an unknown attempt
    self.on_terms: Callable[[_terms.Terms], _terms.Terms] | None = None   # (the job's terms fixed)
    self.before_form: Callable[[str], bool] | None = None   # (may this lighthouse form quorum q now?)
    # A replica on etcd follows (hears, answers nobody) until it leads (see ft/_replicas.py).
    self._passive = bool(self.options.etcd_endpoints)
    self._candidacy: _replicas.Candidacy | None = None
    self._checked_at = 0.0
    self._flooded_at = -math.inf          # when the public port last had more queued than was read
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._started_at = time.monotonic()
    self._thread = threading.Thread(target=self._run, name=f"lighthouse-{self.address}", daemon=True)

  @property
  def refused(self) -> int:
    """Messages refused because they were not sealed with the job's secret."""
    return self._refusals.count

  @property
  def malformed(self) -> int:
    """Messages sealed with the job's secret but refused as malformed."""
    return self._malformed.count

  def start(self) -> Lighthouse:
    self._started_at = time.monotonic()
    self._thread.start()
    if self.options.etcd_endpoints:
      self._candidacy = _replicas.Candidacy(
          list(self.options.etcd_endpoints), self.options.job_name, self.address,
          lease_ttl_secs=math.ceil(self.options.leader_lease.total_seconds()),
          on_elected=self._elected, on_deposed=self._deposed)
      self.before_form, self.on_terms = self._candidacy.fence, self._candidacy.terms
      self._candidacy.start()
    logger.info("lighthouse serving on %s", self.address, extra={"address": self.address})
    return self

  def stop(self) -> None:
    """Stops serving and releases the port (a new lighthouse may bind it at once); a
    replica that leads hands over at once (it revokes its etcd lease)."""
    if self._candidacy is not None:
      self._candidacy.stop()
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=5)
    self._close_sockets()

  @property
  def leading(self) -> bool:
    """Whether this lighthouse forms the job's quorums (always, without etcd)."""
    return not self._passive

  def _elected(self) -> None:
    """This replica leads from now: the job's terms from etcd, and the quorum the groups
    go on with adopted from their heartbeats (a follower heard them all along)."""
    terms = self._candidacy.stored_terms() if self._candidacy is not None else None
    with self._lock:
      now = time.monotonic()
      self._passive, self._started_at = False, now
      self._terms = terms or self._terms
      self._quorum_id, self._inflight, self._last_members, self._adopted = None, {}, (), False
      self._aborted, self._called_back, self._out = None, False, {}
      ring = [(self._beat_steps.get(g, 0), self._lineage_of[g], g) for g in self._live(now)
              if g in self._lineage_of and g not in self._pending]
      if ring:
        step, lineage, _ = max(ring)
        for s, q, g in ring:
          if q == lineage:
            self._adopt(g, q, s, now)

  def _deposed(self) -> None:
    with self._lock:
      self._passive = True

  def _close_sockets(self) -> None:
    for monitor, sock in self._monitors:
      sock.disable_monitor()
      monitor.close(linger=0)
    self._sock.close(linger=0)
    if self._private is not None:
      self._private.close(linger=0)
    self._ctx.term()

  def __enter__(self) -> Lighthouse:
    return self.start()

  def __exit__(self, *exc: Any) -> None:
    self.stop()

  def status(self) -> dict[str, Any]:
    """Live groups, pending requests, the last quorum's members, and the counters."""
    with self._lock:
      return self._status(time.monotonic())

  # ---- the loop: a batch from each door, sealed messages first, then maybe a quorum ----------------

  def _run(self) -> None:
    both, private_only = zmq.Poller(), zmq.Poller()
    both.register(self._sock, zmq.POLLIN)
    if self._private is not None:
      both.register(self._private, zmq.POLLIN)
      private_only.register(self._private, zmq.POLLIN)
    for monitor, _ in self._monitors:
      both.register(monitor, zmq.POLLIN)
      private_only.register(monitor, zmq.POLLIN)
    quiet_until = 0.0                 # the public port is not read before (it was flooded)
    while not self._stop.is_set():
      now = time.monotonic()
      paused = self._private is not None and now < quiet_until
      ready = dict((private_only if paused else both).poll(
          1000 * (min(_POLL_SECS, quiet_until - now) if paused else _POLL_SECS)))
      self._closed_connections(ready)             # (before reading: a closed fd may be reused)
      batch = [((self._private, f[0], fd), f) for f, fd in self._read(self._private, ready, _BATCH)]
      public = [((self._sock, f[0], fd), f) for f, fd in self._read(self._sock, ready, _PUBLIC_BATCH)]
      refused = self._refusals.count
      # Messages left unread (a full batch, or a flood's pause) may hold heartbeats: a member
      # is not declared dead for what the lighthouse has not read yet.
      lagging = paused or len(batch) >= _BATCH or len(public) >= _PUBLIC_BATCH
      if paused or len(public) >= _PUBLIC_BATCH:
        self._flooded_at = now
      self._serve(batch + public, lagging)
      if self._refusals.count - refused > _PUBLIC_BATCH // 2:
        quiet_until = time.monotonic() + _FLOOD_PAUSE_SECS   # (so a flood costs a bounded share of a core)

  @staticmethod
  def _read(sock: zmq.Socket | None, ready: dict[Any, int], limit: int) -> list[tuple[list[bytes], int]]:
    return _intake.drain(sock, 0, limit) if sock is not None and sock in ready else []

  def _closed_connections(self, ready: dict[Any, int]) -> None:
    """A group whose heartbeat connection closed is not live, and out of the attempt in flight."""
    for monitor, sock in self._monitors:
      while monitor in ready and monitor.poll(0):
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_DISCONNECTED:
          with self._lock:
            self._guarded(self._connection_closed, sock, event["value"], time.monotonic())

  def _connection_closed(self, sock: zmq.Socket, fd: int, now: float) -> None:
    gid = self._conn_group.pop((sock, fd), None)
    if gid is None or self._beat_conn.get(gid) != (sock, fd):
      return
    del self._beat_conn[gid]
    if sock is self._sock and now - self._flooded_at < 2 * self.options.connection_timeout.total_seconds():
      return    # (a flood of the public port can hold its pings' answers back: not evidence)
    self._closing[gid] = now        # (unless it left: its leave may be read just after the close)

  def _gone(self, now: float) -> None:
    """Groups whose heartbeat connection closed (and that did not leave): not live, and out of
    the attempt in flight."""
    for gid in [g for g, t in self._closing.items() if now - t >= _CLOSE_GRACE_SECS]:
      del self._closing[gid]
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

  def _serve(self, batch: list[tuple[Peer, list[bytes]]], lagging: bool = False) -> None:
    """Handles the sealed messages of ``batch``, checks the attempt in flight (unless
    ``lagging``: more is queued than was read) and for a quorum, then refuses the rest."""
    with self._lock:
      for peer, frames in batch:
        if _intake.looks_sealed(frames):
          self._guarded(self._handle, peer, frames)
      if self._closing:
        self._guarded(self._gone, time.monotonic())
      if not lagging:
        self._guarded(self._check_in_flight, time.monotonic())
      self._guarded(self._maybe_form, time.monotonic())
      self._cpu_secs = time.thread_time()
    now = time.monotonic()
    for peer, frames in batch:             # dropped unread: counted, and answered sparingly
      if not _intake.looks_sealed(frames):
        self._refuse(peer, "a message without the job's secret was refused", now)
    self._refusals.maybe_log(now)
    self._malformed.maybe_log(now)

  def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)``; a bug in it is logged and counted, never the end of the loop."""
    try:
      fn(*args)
    except Exception as e:  # pylint: disable=broad-except  (the lighthouse must outlive any message)
      self._malformed.add(f"internal error {type(e).__name__}: {e}")
      logger.exception("lighthouse at %s: internal error (serving on)", self.address)

  def _refuse(self, peer: Peer, reason: str, now: float) -> None:
    self._refusals.add(reason)
    if self._answers.allow(peer, now):
      _wire.send(peer[0], [peer[1], *_wire.refusal(
          f"the lighthouse at {self.address} refused a message: {reason}")])

  def _handle(self, peer: Peer, frames: list[bytes]) -> None:
    now = time.monotonic()
    try:
      header, _ = _wire.open_(self._key, frames[1:], replays=self._replays)
    except errors.PermissionDeniedError as e:
      self._refuse(peer, str(e), now)
      return
    except Exception:  # pylint: disable=broad-except  (a header that verifies but does not decode)
      self._refuse(peer, "malformed", now)
      return
    try:
      request = _requests.parse(header)
    except errors.InvalidArgumentError as e:
      self._malformed.add(str(e))
      self._reply(peer, {"op": "refused", "request_id": _requests.request_id_of(header),
                         "error": f"the lighthouse at {self.address} refused a message: {e}"})
      return
    self._apply(peer, request, now)

  def _reply(self, peer: Peer, header: dict[str, Any], attachment: bytes | None = None) -> None:
    """Sends ``header`` sealed, and ``attachment`` (authenticated by a hash in the header) as a raw frame."""
    if peer[0] is self._sock and self.private_port is not None:
      header = dict(header, private=self.private_port)    # (where the job's own traffic goes)
    mac, body = _wire.seal(self._key, header)
    sock = peer[0]
    # Frame by frame with int flags, copied: send_multipart's flag arithmetic and zero-copy
    # frames cost more than the send itself on frames this small (a quorum sends G replies).
    # A ROUTER never blocks: it drops what a peer that stopped reading has no room for.
    sock.send(peer[1], _MORE)
    sock.send(mac, _MORE)
    if attachment is None:
      sock.send(body, _LAST)
    else:
      sock.send(body, _MORE)
      sock.send(attachment, _LAST)

  def _apply(self, peer: Peer, request: _requests.Request, now: float) -> None:
    if isinstance(request, _requests.Heartbeat):
      gid = request.group
      if self._last_seen.setdefault(gid, now) == now:
        self._waiting = None            # (a group not seen before: who is waited for changes)
      self._last_seen[gid] = now
      self._beat_peers[gid] = peer
      if request.step is not None:
        self._beat_steps[gid] = request.step
      if request.lineage is not None:
        self._lineage_of[gid] = request.lineage
        self._adopt(gid, request.lineage, request.step, now)
      conn = (peer[0], peer[2])
      if peer[2] >= 0 and self._beat_conn.get(gid) != conn:
        self._conn_group.pop(self._beat_conn.get(gid), None)
        self._beat_conn[gid], self._conn_group[conn] = conn, gid
        self._closing.pop(gid, None)             # (back on a new connection)
      if gid in self._out and self._notices.allow(gid, now):
        self._notify(gid, self._out[gid], ())    # (its attempt is stale: it learns at once)
      elif (self._aborted is not None and gid in self._inflight and gid != self._aborted[3]
            and self._notices.allow(gid, now)):
        self._notify(gid, *self._aborted[1:3])   # (again: a notice may have gone to an old socket)
    elif isinstance(request, _requests.QuorumRequest):
      self._ask(peer, request, now)
    elif isinstance(request, _requests.Ready):   # a member catching up is about to ask in sync
      self._behind.discard(request.group)
      self._out.pop(request.group, None)
      self._last_seen[request.group] = now
      self._waiting = None
      self._call_back(now)                       # (the ring asks again: it joins them there)
    elif isinstance(request, _requests.Failed):
      self._failed(request)
    elif isinstance(request, _requests.Leave):  # a group closing: not live, nobody waits for it
      gid = request.group
      self._closing.pop(gid, None)
      self._conn_group.pop(self._beat_conn.pop(gid, None), None)
      self._last_seen[gid] = -math.inf
      self._inflight.pop(gid, None)
      self._behind.discard(gid)
      self._out.pop(gid, None)
      if self._pending.pop(gid, None) is not None and not self._pending:
        self._first_pending = None
      self._waiting = None
      logger.info("lighthouse at %s: group %s left", self.address, gid, extra={"group_id": gid})
    else:
      self._reply(peer, dict(self._status(now), op="status", request_id=request.request_id))

  def _ask(self, peer: Peer, request: _requests.QuorumRequest, now: float) -> None:
    member = request.member
    newest = self._newest_step()
    if not self._passive and newest is not None and member.step > newest + 1:
      # Members advance one step per quorum: a claim beyond that is a bug or a lie,
      # and admitting it would make every honest group look behind (a stalled job).
      self._malformed.add(f"group {member.group_id!r} claims step {member.step}, the job is at "
                          f"{newest}")
      self._reply(peer, {
          "op": "refused", "request_id": request.request_id,
          "error": f"step {member.step} claimed, but the job is at step "
                   f"{newest}: a group can be at most one step ahead"})
      return
    if request.terms is not None and self._terms is not None and not self._passive:
      why = self._refused_terms(member.group_id, request.terms)
      if why is not None:
        self._reply(peer, {"op": "refused", "request_id": request.request_id, "terms": True, "error": why})
        return
    gid = member.group_id
    answered = self._answered.get(gid)
    if answered is not None and request.ask is not None and answered[0] == request.ask and not self._passive:
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
                                  request.view, request.ask, request.held, request.terms)

  # ---- ending an attempt for every member --------------------------------------------------------------

  def _check_in_flight(self, now: float) -> None:
    """Members of the attempt in flight whose heartbeats stopped are out of it: the others abort it."""
    if self._passive or not self._inflight or now - self._checked_at < _CHECK_SECS:
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

  def _failed(self, report: _requests.Failed) -> None:
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
    if self._aborted is not None or self._passive:
      return
    self._aborted = (self._quorum_id, why, tuple(blame), skip)
    for g in self._inflight:
      if g != skip:
        self._notify(g, why, blame)

  def _notify(self, gid: str, why: str, blame: Any) -> None:
    """An ``abort`` of ``gid``'s last attempt, on its heartbeat connection."""
    if self._passive:
      return
    peer, answered = self._beat_peers.get(gid), self._answered.get(gid)
    lineage = self._lineage_of.get(gid) or (answered[1]["quorum"]["id"] if answered else None)
    if peer is None or lineage is None:
      return
    _wire.send(peer[0], [peer[1], *_wire.seal(self._key, {
        "op": "abort", "q": lineage, "why": why[:MAX_WHY], "blame": list(blame)[:8]})])

  def _status(self, now: float) -> dict[str, Any]:
    return {"live": sorted(self._live(now)), "pending": sorted(self._pending),
            "last_members": list(self._last_members), "quorums_formed": self._quorums_formed,
            "out": sorted(self._out), "terms": None if self._terms is None else self._terms.to_wire(),
            "leading": not self._passive, "lineage": self._quorum_id,
            "reported_failures": [[g, q, why] for (g, q), why in self._reported.items()],
            "last_form_secs": self._last_form_secs, "cpu_secs": self._cpu_secs,
            "refused": self._refusals.count,
            "malformed": self._malformed.count}

  def _live(self, now: float) -> set[str]:
    limit = self.options.heartbeat_timeout.total_seconds()
    return {g for g, t in self._last_seen.items() if now - t <= limit}

  def _is_live(self, group: str, now: float) -> bool:
    return now - self._last_seen.get(group, -math.inf) <= self.options.heartbeat_timeout.total_seconds()

  # ---- the job's terms, the ring's step, calling the ring back ---------------------------------------

  def _refused_terms(self, gid: str, terms: _terms.Terms) -> str | None:
    """Why ``gid`` cannot join under ``terms`` (None if it can; an unknown layout of the
    job's is taken from it)."""
    why = _terms.differ(terms, self._terms, gid)
    if why is not None:
      self._malformed.add(why)
      logger.warning("lighthouse at %s refused group %s: %s", self.address, gid, why,
                     extra={"group_id": gid})
      return why
    if self._terms.layout is None and terms.layout is not None:
      self._set_terms(dataclasses.replace(self._terms, layout=terms.layout))
    return None

  def _set_terms(self, terms: _terms.Terms) -> None:
    self._terms = terms if self.on_terms is None else self.on_terms(terms)

  def _fix_terms(self) -> None:
    """The job's terms, from the first quorum's requests if not fixed yet; pending members
    whose terms differ are refused (with the field and both values) and not in the quorum."""
    asking = [(g, bool(p.view), p.terms) for g, p in sorted(self._pending.items()) if p.terms is not None]
    if self._terms is None and asking:
      self._set_terms(_terms.chosen(asking))
      logger.info("lighthouse at %s: the job's terms are %s", self.address, self._terms)
    if self._terms is None:
      return
    for gid, _, terms in asking:
      why = self._refused_terms(gid, terms)
      if why is not None:
        p = self._pending.pop(gid)
        self._reply(p.peer, {"op": "refused", "request_id": p.request_id, "terms": True, "error": why})
    if not self._pending:
      self._first_pending = None

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
    if (self._passive or not self._inflight or self._quorum_id is None
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
        peer = self._beat_peers.get(g)
        if peer is not None:
          _wire.send(peer[0], [peer[1], *_wire.seal(self._key, {"op": "call_back", "q": self._quorum_id})])

  # ---- forming a quorum ------------------------------------------------------------------------------

  def _maybe_form(self, now: float) -> None:
    """Forms a quorum when it is due. Cheap while it is not: the checks that look
    at every group run only once the cheap ones pass."""
    if self._passive:
      return
    opts = self.options
    join = opts.join_timeout.total_seconds()
    if not self._pending or (now - self._started_at < join and not self._whole_view_asks()):
      return
    self._call_back(now)
    if len(self._pending) < opts.min_replicas:
      return
    straggler = opts.straggler_timeout.total_seconds()
    if any(now - t < straggler and self._is_live(g, now) for g, t in self._inflight.items()):
      return                                  # (the first busy one ends the scan)
    first = min(p.since for p in self._pending.values()) if self._first_pending is None else self._first_pending
    if now - first < join and self._waiting_for(now):
      return
    self._form(now)

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


def _sender_of(header: dict[str, Any]) -> Any:
  """(op, group) of a message that changes the lighthouse's state; None for the rest."""
  op = header.get("op")
  if op in ("heartbeat", "ready", "failed", "leave"):
    return (op, _hashable(header.get("group")))
  if op == "quorum":
    member = header.get("member")
    return (op, _hashable(member[0] if isinstance(member, (list, tuple)) and member else None))
  return None


def _hashable(x: Any) -> Any:
  return x if isinstance(x, (str, int, float, bool, type(None))) else repr(x)
