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
from jaxckpt.ft import _intake, _job_terms, _members, _replay, _replicas, _requests, _route
from jaxckpt.ft._clients import Heartbeat, LighthouseClient, Notice
from jaxckpt.ft._members import Peer
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
    # Who is live, who asks, the attempt in flight, forming quorums (ft/_members.py).
    self._members = _members.Members(self.options, self.address, self._key, self._reply, self._malformed)
    self._cpu_secs = 0.0                        # CPU time of the serving thread so far
    self._candidacy: _replicas.Candidacy | None = None
    self._flooded_at = -math.inf          # when the public port last had more queued than was read
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"lighthouse-{self.address}", daemon=True)

  @property
  def refused(self) -> int:
    """Messages refused because they were not sealed with the job's secret."""
    return self._refusals.count

  @property
  def malformed(self) -> int:
    """Messages sealed with the job's secret but refused as malformed."""
    return self._malformed.count

  @property
  def on_terms(self) -> _job_terms.OnTerms | None:
    """Called when the job's terms are fixed (a replica on etcd stores them there):
    ``on_terms(terms, run, new) -> (terms, run)``, see :class:`jaxckpt.ft._job_terms.JobTerms`."""
    return self._members.job.on_terms

  @on_terms.setter
  def on_terms(self, fn: _job_terms.OnTerms | None) -> None:
    self._members.job.on_terms = fn

  @property
  def before_form(self) -> Callable[[str], bool] | None:
    """Asked before each quorum forms: may this lighthouse form quorum ``q`` now?"""
    return self._members.before_form

  @before_form.setter
  def before_form(self, fn: Callable[[str], bool] | None) -> None:
    self._members.before_form = fn

  def start(self) -> Lighthouse:
    self._members.started_at = time.monotonic()
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
    return not self._members.passive

  def _elected(self) -> None:
    """This replica leads from now: the job's terms from etcd, and the quorum the groups
    go on with adopted from their heartbeats (a follower heard them all along)."""
    stored = self._candidacy.stored_terms() if self._candidacy is not None else None
    with self._lock:
      self._members.elected(stored, time.monotonic())

  def _deposed(self) -> None:
    with self._lock:
      self._members.passive = True


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

  def _status(self, now: float) -> dict[str, Any]:
    return dict(self._members.status(now), cpu_secs=self._cpu_secs, refused=self._refusals.count,
                malformed=self._malformed.count)

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
    # (A flood of the public port can hold its pings' answers back: not evidence.)
    flooded = sock is self._sock and now - self._flooded_at < 2 * self.options.connection_timeout.total_seconds()
    self._members.conns.closed(sock, fd, now, flooded)

  def _serve(self, batch: list[tuple[Peer, list[bytes]]], lagging: bool = False) -> None:
    """Handles the sealed messages of ``batch``, checks the attempt in flight (unless
    ``lagging``: more is queued than was read) and for a quorum, then refuses the rest."""
    with self._lock:
      for peer, frames in batch:
        if _intake.looks_sealed(frames):
          self._guarded(self._handle, peer, frames)
      if self._members.conns.closing:
        self._guarded(self._members.gone, time.monotonic())
      if not lagging:
        self._guarded(self._members.check_in_flight, time.monotonic())
      self._guarded(self._members.maybe_form, time.monotonic())
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
    m = self._members
    if isinstance(request, _requests.Heartbeat):
      m.heartbeat(peer, request, now)
    elif isinstance(request, _requests.QuorumRequest):
      m.ask(peer, request, now)
    elif isinstance(request, _requests.Ready):   # a member catching up is about to ask in sync
      m.ready(request.group, now)
    elif isinstance(request, _requests.Failed):
      m.failed(request)
    elif isinstance(request, _requests.Leave):   # a group closing: not live, nobody waits for it
      m.leave(request.group)
    else:
      self._reply(peer, dict(self._status(now), op="status", request_id=request.request_id))


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
