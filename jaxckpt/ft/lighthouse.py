"""The lighthouse: membership by heartbeat and one quorum per step.

Replica groups (their process 0) send heartbeats and, at the start of every
step attempt, a quorum request carrying their committed step and state digest.
The lighthouse answers all pending requests at once with a :class:`Quorum` when

* at least ``min_replicas`` groups are pending, and
* no live member of the previous quorum is still busy with its step (waited for
  at most ``straggler_timeout``: a stuck group never blocks for longer), and
* every live group is pending, or ``join_timeout`` passed since the first request.

A group is live while its heartbeats arrive within ``heartbeat_timeout``; a dead
group is simply not waited for. The state is soft: after a restart the
lighthouse waits ``join_timeout`` for heartbeats to rebuild membership and
carries on, so a lighthouse restart does not lose the job (groups resend their
requests until a lighthouse answers).

Every message is sealed with the job's secret (:mod:`jaxckpt._wire`): a
request that is not is refused (logged, and answered with the reason) and
changes nothing. A member of a quorum that was behind (catching up) is never
waited for when the next quorum forms: it joins one once it has caught up.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import zmq

from jaxckpt import _wire, errors

logger = logging.getLogger(__name__)

_POLL_SECS = 0.01


@dataclasses.dataclass(frozen=True, kw_only=True)
class LighthouseOptions:
  """Options of a :class:`Lighthouse`.

  Attributes:
    min_replicas: fewest groups a quorum may have.
    heartbeat_timeout: a group whose last heartbeat is older is dropped.
    join_timeout: how long pending requests wait for live groups that have not
      asked yet; also the grace period after a (re)start.
    straggler_timeout: how long members of the previous quorum that are still
      live but have not asked again are waited for.
  """
  min_replicas: int = 1
  heartbeat_timeout: timedelta = timedelta(seconds=5)
  join_timeout: timedelta = timedelta(seconds=1)
  straggler_timeout: timedelta = timedelta(seconds=60)

  def __post_init__(self):
    if self.min_replicas < 1:
      raise errors.InvalidArgumentError(f"LighthouseOptions.min_replicas must be >= 1, got {self.min_replicas=}")
    for name in ("heartbeat_timeout", "join_timeout", "straggler_timeout"):
      value = getattr(self, name)
      if not isinstance(value, timedelta) or value <= timedelta(0):
        raise errors.InvalidArgumentError(f"LighthouseOptions.{name} must be a positive timedelta, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Member:
  """A replica group as seen in a quorum."""
  group_id: str
  address: str
  step: int
  digest: int
  ring_address: str = ""          # where its all-reduce streams arrive (see ft/_links.py)

  def to_wire(self) -> list[Any]:
    return [self.group_id, self.address, self.step, self.digest, self.ring_address]

  @classmethod
  def from_wire(cls, obj: list[Any]) -> Member:
    return cls(group_id=obj[0], address=obj[1], step=int(obj[2]), digest=int(obj[3]),
               ring_address=str(obj[4]) if len(obj) > 4 else "")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Quorum:
  """The groups that take part in one step attempt, sorted by group id."""
  quorum_id: str
  members: tuple[Member, ...]
  dropped: tuple[str, ...] = ()

  @property
  def max_step(self) -> int:
    return max(m.step for m in self.members)

  @property
  def healthy(self) -> tuple[Member, ...]:
    """Members at the newest step with the digest most of them share (ties: the digest
    of the smallest group id among the tied), so one member with a wrong digest
    cannot make the others look diverged."""
    top = [m for m in self.members if m.step == self.max_step]
    counts = collections.Counter(m.digest for m in top)
    most = max(counts.values())
    digest = next(m.digest for m in top if counts[m.digest] == most)
    return tuple(m for m in top if m.digest == digest)

  @property
  def leader(self) -> Member:
    """The group that reduces this step: the smallest healthy group id."""
    return self.healthy[0]

  def member(self, group_id: str) -> Member:
    for m in self.members:
      if m.group_id == group_id:
        return m
    raise KeyError(f"group {group_id!r} is not in quorum {self.quorum_id} "
                   f"(members {[m.group_id for m in self.members]})")

  def rank(self, group_id: str) -> int:
    """Position of ``group_id`` among the members (sorted by group id)."""
    return [m.group_id for m in self.members].index(group_id)

  def to_wire(self) -> dict[str, Any]:
    return {"quorum_id": self.quorum_id, "members": [m.to_wire() for m in self.members],
            "dropped": list(self.dropped)}

  @classmethod
  def from_wire(cls, obj: dict[str, Any]) -> Quorum:
    return cls(quorum_id=obj["quorum_id"], members=tuple(Member.from_wire(m) for m in obj["members"]),
               dropped=tuple(obj["dropped"]))


@dataclasses.dataclass(slots=True)
class _Pending:
  identity: bytes
  request_id: int
  member: Member
  since: float


class Lighthouse:
  """The lighthouse server, run on a background thread of this process.

  ``secret`` is the job's secret (else ``$JAXCKPT_JOB_SECRET``, else a new
  random one): hand ``lighthouse.secret`` to every group of the job.

  >>> with Lighthouse("127.0.0.1:0", LighthouseOptions(min_replicas=1)) as lh:
  ...   lh.address.startswith("127.0.0.1:")
  True
  """

  def __init__(self, bind: str = "127.0.0.1:0", options: LighthouseOptions | None = None, *,
               secret: str | None = None):
    self.options = options or LighthouseOptions()
    self.secret = secret or os.environ.get(_wire.SECRET_ENV) or _wire.new_secret()
    self._key = _wire.secret_bytes(self.secret, who="the lighthouse")
    self.refused = 0            # messages refused (not sealed with the job's secret)
    self._ctx = zmq.Context()
    self._sock = _wire.socket(self._ctx, zmq.ROUTER)
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
      raise errors.InvalidArgumentError(f"Lighthouse bind must be HOST:PORT, got {bind=}")
    if port == "0":
      port = str(self._sock.bind_to_random_port(f"tcp://{host}"))
    else:
      self._sock.bind(f"tcp://{host}:{port}")
    self.address = f"{host}:{port}"
    self._epoch = os.urandom(4).hex()
    self._counter = itertools.count()
    self._last_seen: dict[str, float] = {}
    self._pending: dict[str, _Pending] = {}
    self._inflight: dict[str, float] = {}
    self._last_members: tuple[str, ...] = ()
    self._behind: set[str] = set()        # members of the last quorum that were catching up
    self._last_step: int | None = None    # the newest step a formed quorum was at
    self._quorums_formed = 0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._started_at = time.monotonic()
    self._thread = threading.Thread(target=self._run, name=f"lighthouse-{self.address}", daemon=True)

  def start(self) -> Lighthouse:
    self._started_at = time.monotonic()
    self._thread.start()
    logger.info("lighthouse serving on %s", self.address, extra={"address": self.address})
    return self

  def stop(self) -> None:
    """Stops serving and releases the port (a new lighthouse may bind it at once)."""
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=5)
    self._sock.close(linger=0)
    self._ctx.term()

  def __enter__(self) -> Lighthouse:
    return self.start()

  def __exit__(self, *exc: Any) -> None:
    self.stop()

  def status(self) -> dict[str, Any]:
    """Live groups, pending requests and the last quorum's members."""
    with self._lock:
      return self._status(time.monotonic())

  def _run(self) -> None:
    while not self._stop.is_set():
      frames = _wire.recv(self._sock, _POLL_SECS)
      with self._lock:
        while frames is not None:
          self._handle(frames)
          frames = _wire.recv(self._sock, 0)
        self._maybe_form(time.monotonic())

  def _handle(self, frames: list[Any]) -> None:
    identity = frames[0].bytes
    try:
      header, _ = _wire.open_(self._key, frames[1:])
    except Exception as e:  # pylint: disable=broad-except  (refused, logged, never applied)
      self.refused += 1
      logger.warning("lighthouse refused a message: %s", e)
      _wire.send(self._sock, [identity, *_wire.refusal(
          f"the lighthouse at {self.address} refused a message: "
          f"{e if isinstance(e, errors.PermissionDeniedError) else 'malformed'}")])
      return
    op, now = header.get("op"), time.monotonic()
    if op == "heartbeat":
      self._last_seen[header["group"]] = now
    elif op == "quorum":
      member = Member.from_wire(header["member"])
      if self._last_step is not None and not 0 <= member.step <= self._last_step + 1:
        # Members advance one step per quorum: a claim beyond that is a bug or a lie,
        # and admitting it would make every honest group look behind (a stalled job).
        logger.warning("lighthouse refused group %r: it claims step %d, the job is at %d",
                       member.group_id, member.step, self._last_step)
        self._sock.send_multipart([identity] + _wire.seal(self._key, {
            "op": "refused", "request_id": header.get("request_id"),
            "error": f"step {member.step} claimed, but the job's newest quorum was at step "
                     f"{self._last_step}: a group can be at most one step ahead"}))
        return
      self._last_seen[member.group_id] = now
      self._inflight.pop(member.group_id, None)
      self._behind.discard(member.group_id)
      old = self._pending.get(member.group_id)
      self._pending[member.group_id] = _Pending(identity, header["request_id"], member,
                                                old.since if old else now)
    elif op == "ready":           # a member catching up is about to ask in sync: wait for it again
      self._behind.discard(header["group"])
      self._last_seen[header["group"]] = now
    elif op == "status":
      reply = dict(self._status(now), op="status", request_id=header.get("request_id"))
      self._sock.send_multipart([identity] + _wire.seal(self._key, reply))
    else:
      logger.warning("lighthouse got an unknown message op=%r", op)

  def _status(self, now: float) -> dict[str, Any]:
    return {"live": sorted(self._live(now)), "pending": sorted(self._pending),
            "last_members": list(self._last_members), "quorums_formed": self._quorums_formed}

  def _live(self, now: float) -> set[str]:
    limit = self.options.heartbeat_timeout.total_seconds()
    return {g for g, t in self._last_seen.items() if now - t <= limit}

  def _maybe_form(self, now: float) -> None:
    opts = self.options
    join = opts.join_timeout.total_seconds()
    if not self._pending or now - self._started_at < join:
      return
    if len(self._pending) < opts.min_replicas:
      return
    live = self._live(now)
    busy = [g for g, t in self._inflight.items()
            if g in live and now - t < opts.straggler_timeout.total_seconds()]
    if busy:
      return
    first = min(p.since for p in self._pending.values())
    if live - self._pending.keys() - self._behind and now - first < join:
      return
    self._form(now)

  def _form(self, now: float) -> None:
    members = tuple(self._pending[g].member for g in sorted(self._pending))
    ids = tuple(m.group_id for m in members)
    quorum = Quorum(quorum_id=f"{self._epoch}-{next(self._counter)}", members=members,
                    dropped=tuple(g for g in self._last_members if g not in ids))
    for pending in self._pending.values():
      reply = {"op": "quorum", "request_id": pending.request_id, "quorum": quorum.to_wire()}
      _wire.send(self._sock, [pending.identity] + _wire.seal(self._key, reply))
    self._pending.clear()
    healthy = {m.group_id for m in quorum.healthy}
    self._inflight = {g: now for g in healthy}      # members that are behind catch up first:
    self._behind = set(ids) - healthy               # neither is waited for
    self._last_members = ids
    self._last_step = quorum.max_step
    self._quorums_formed += 1
    logger.info("quorum %s formed: members=%s max_step=%d dropped=%s", quorum.quorum_id, list(ids),
                quorum.max_step, list(quorum.dropped),
                extra={"quorum_id": quorum.quorum_id, "quorum_size": len(ids),
                       "step": quorum.max_step, "dropped_groups": list(quorum.dropped)})


class LighthouseClient:
  """A replica group's requests to the lighthouse (used from one thread only)."""

  def __init__(self, ctx: zmq.Context, address: str, *, secret: str | bytes | None = None,
               drop: Callable[[], bool] = lambda: False, resend_secs: float = 0.5):
    self.address = address
    self._secret = _wire.secret_bytes(secret, who="a lighthouse client")
    self._ctx = ctx
    self._drop = drop
    self._resend_secs = resend_secs
    self._ids = itertools.count(1)
    self._sock = _wire.socket(ctx, zmq.DEALER, immediate=True)
    self._sock.connect(f"tcp://{address}")

  def quorum(self, member: Member, timeout: timedelta) -> Quorum | None:
    """The quorum of the next step attempt, or None if none formed within ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    sent: set[int] = set()
    next_send = 0.0
    while (now := time.monotonic()) < deadline:
      if now >= next_send:
        request_id = next(self._ids)
        sent.add(request_id)
        if not self._drop():
          _wire.send(self._sock, _wire.seal(self._secret, {
              "op": "quorum", "request_id": request_id, "member": member.to_wire()}))
        next_send = now + self._resend_secs
      frames = _wire.recv(self._sock, min(deadline, next_send) - now)
      if frames is None or self._drop():
        continue
      try:
        header, _ = _wire.open_(self._secret, frames)
      except errors.PermissionDeniedError as e:
        raise errors.PermissionDeniedError(
            f"group {member.group_id!r}: {e}; give every group the lighthouse's secret "
            f"(ReplicaGroup(secret=...) or ${_wire.SECRET_ENV})") from None
      if header.get("op") == "quorum" and header.get("request_id") in sent:
        return Quorum.from_wire(header["quorum"])
    return None

  def ready(self, group_id: str) -> None:
    """Tells the lighthouse that ``group_id`` (catching up) asks in sync next."""
    if not self._drop():
      _wire.send(self._sock, _wire.seal(self._secret, {"op": "ready", "group": group_id}))

  def close(self) -> None:
    self._sock.close(linger=0)


class Heartbeat:
  """Sends ``{"op": "heartbeat"}`` every ``interval`` from a daemon thread."""

  def __init__(self, ctx: zmq.Context, address: str, group_id: str, interval: timedelta, *,
               secret: str | bytes | None = None, drop: Callable[[], bool] = lambda: False):
    self._secret = _wire.secret_bytes(secret, who="a lighthouse heartbeat")
    self._sock = _wire.socket(ctx, zmq.DEALER, immediate=True)
    self._sock.connect(f"tcp://{address}")
    self._group_id = group_id
    self._interval = interval.total_seconds()
    self._drop = drop
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"heartbeat-{group_id}", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.is_set():
      if not self._drop():
        _wire.send(self._sock, _wire.seal(self._secret, {"op": "heartbeat",
                                                         "group": self._group_id}))
      self._stop.wait(self._interval)
    self._sock.close(linger=0)

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=5)
