"""A replica group: one JAX program (its own mesh, FSDP inside) as a unit of fault tolerance.

>>> ft = ReplicaGroup(lighthouse="127.0.0.1:29510", group_id="g0",
...                   timeout=timedelta(seconds=30))          # doctest: +SKIP
>>> while ft.step < num_steps:                                 # doctest: +SKIP
...   state = ft.start_step(state, apply_fn, grads_like=state.params)
...   grads = grad_fn(state, batches[ft.batch_index()])
...   grads = ft.allreduce(grads)     # mean over this step's contributors
...   if ft.should_commit():          # the group got the step's agreed average
...     state = apply_fn(state, grads)

Each step attempt: (1) the lighthouse forms a quorum; (2) its healthy members
(at the newest step, on the majority's digest lineage) average their gradients
(host copies) with a ring all-reduce (:mod:`jaxckpt.ft._allreduce`: a
reduce-scatter and an all-gather in group-id order, float32 or wider
accumulators, every chunk summed once in a fixed order, so every member commits
bit-identical bytes, and each sends about ``2 (G - 1) / G`` of the gradient).
Members agree on what they average as well as on the step: every ring piece
carries the gradient's layout (tree structure, shapes, dtypes:
:mod:`jaxckpt.ft._layout`), a piece of another layout is refused naming its
sender and what differs, and a member that fails an attempt tells its right
neighbour why (an abort), so no member commits a mixed average and all of them
know the first cause (``metrics.failure``) at once.

A failed group costs the others about a step, not a timeout. Its streams
closing (a process that died) or its ring port refusing a connection fail the
attempt at once for its neighbours; a group that stops (no heartbeat for the
lighthouse's ``heartbeat_timeout``) is declared out of the attempt by the
lighthouse, which has every other member abort it; and every member that fails
reports why to the lighthouse, which relays the abort to every live member, so
it never depends on a dead neighbour passing it on (:mod:`jaxckpt.ft.lighthouse`).
``timeout`` remains the bound for a member that is live but slow.
A member that is behind does not hold the healthy ones up: it fetches the
missed steps (or a snapshot and the steps after it) from a healthy peer's
serving thread while they commit, replays them, also replays the step they are
reducing once a peer has committed it, and joins the next quorum in sync; the
lighthouse never waits for it. A ring hop that does not arrive within
``timeout`` (a member died mid-ring) ends the attempt uncommitted for that
member; the lighthouse drops the dead one and the step is retried without it,
and a member that committed while another did not is the newer lineage the
other catches up to. No wait in here is unbounded.

Data: in each attempt the group uses batch ``step * max_groups + rank``, where
``rank`` is its position in the quorum. Within a committed step the ranks
differ, and steps differ across commits, so no batch is consumed twice by any
group; a retried attempt reuses its batch only because the failed attempt did
not consume it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from typing import Any, Sequence

import jax
import numpy as np
import zmq

from jaxckpt import errors
from jaxckpt.ft import _address, _allreduce, _group_comm, _layout, _links, _peer, _recovery, _session, _terms
from jaxckpt.ft._recovery import ApplyFn, PeerSourceFactory
from jaxckpt.ft.catch_up import CatchUpServer, SnapshotSource, rebuild_leaf
from jaxckpt.ft.lighthouse import Member, Quorum
from jaxckpt.ft.metrics import FtCounters, StepMetrics
from jaxckpt.ft.ring import INITIAL_DIGEST, DigestLog, GradientRing, RingEntry, chain_digest
from jaxckpt.net import _wire

logger = logging.getLogger(__name__)

_CHASES = 4          # catch-ups in one start_step before the group sits the attempt out
_SETTLE_SECS = 2.0   # after a failed attempt, the longest its queued sends (the abort) may take


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaGroupOptions:
  """Options of a :class:`ReplicaGroup` besides its timeout.

  Attributes:
    host: the address the group's peers reach it at, which its peer server and
      ring port bind and which its quorum record advertises. None (default): the
      address this machine reaches the lighthouse from (loopback when the
      lighthouse is on loopback; on a cluster, the interface the job's network is
      on), see :mod:`jaxckpt.ft._address`. ``"0.0.0.0"``: bind every interface,
      advertise that address. A loopback address beside a lighthouse on another
      machine is refused (InvalidArgumentError): peers there could not reach it.
    heartbeat_interval: period of heartbeats to the lighthouse (keep it well
      under the lighthouse's ``heartbeat_timeout``).
    ring_size: averaged gradients of this many recent steps are kept for peers.
    max_groups: batch slots per step (an upper bound on the quorum size).
    data_order: the name of the order the job draws its batches in (the dataset
      and its shuffle seed, e.g. ``"c4-seed17"``).
    averaging: how the step's contributions combine: ``"mean"`` (their mean) or
      ``"sum"``.
    lighthouse_timeout: after this long without any quorum (waiting for one
      in ``start_step``, from the first request that got none), QuorumError.

  ``max_groups``, ``data_order`` and ``averaging`` (and the gradient's tree
  layout) must be the same in every group of a job: they are part of the quorum,
  and the lighthouse refuses a group whose values differ when it joins
  (:class:`~jaxckpt.errors.TermsMismatchError`, naming the field and both values).
  """
  host: str | None = None
  heartbeat_interval: timedelta = timedelta(milliseconds=250)
  ring_size: int = 16
  max_groups: int = 64
  data_order: str = "default"
  averaging: str = "mean"
  lighthouse_timeout: timedelta = timedelta(minutes=5)

  def __post_init__(self):
    if self.averaging not in _terms.AVERAGING:
      raise errors.InvalidArgumentError(
          f"ReplicaGroupOptions.averaging must be one of {_terms.AVERAGING}, got {self.averaging!r}")
    if not isinstance(self.data_order, str) or len(self.data_order) > 256:
      raise errors.InvalidArgumentError(
          f"ReplicaGroupOptions.data_order must be a string of at most 256 characters, got {self.data_order!r:.80}")
    for name in ("ring_size", "max_groups"):
      if getattr(self, name) < 1:
        raise errors.InvalidArgumentError(f"ReplicaGroupOptions.{name} must be >= 1, got {getattr(self, name)!r}")
    for name in ("heartbeat_interval", "lighthouse_timeout"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, timedelta) or value <= timedelta(0)):
        raise errors.InvalidArgumentError(f"ReplicaGroupOptions.{name} must be a positive timedelta, got {value!r}")


def batch_index(step: int, rank: int, max_groups: int) -> int:
  """The batch a group of quorum position ``rank`` uses at ``step``: ``step * max_groups + rank``."""
  if not 0 <= rank < max_groups:
    raise errors.InvalidArgumentError(f"quorum {rank=} is outside [0, {max_groups=}): raise "
                     "ReplicaGroupOptions.max_groups above the number of groups")
  return step * max_groups + rank


@dataclasses.dataclass
class _Attempt:
  index: int
  step: int
  quorum: Quorum | None
  quorum_secs: float
  participating: bool = False
  failure: str | None = None      # why the all-reduce did not complete
  catch_up_secs: float = 0.0
  caught_up_steps: int = 0
  snapshot_step: int | None = None


class ReplicaGroup:
  """This process's view of its replica group in a fault-tolerant data-parallel job.

  Args:
    lighthouse: ``HOST:PORT`` of the lighthouse.
    group_id: unique name of this group (orders the reduction and the leader).
    timeout: the longest any single wait of a step may take (the wait for a
      quorum: twice this, as the others may first wait out a failed attempt).
    options: see :class:`ReplicaGroupOptions`.
    snapshot_source: what this group serves to recovering peers as snapshots.
    injector: a ``jaxckpt.testing.fault_injection.EventInjector``.
    peer_source: how a recovering group reaches a healthy peer's snapshots
      (default: that peer's serving thread, which serves its ``snapshot_source``).
    secret: the job's secret (the lighthouse's ``.secret``); None:
      ``$JAXCKPT_JOB_SECRET``. Every message to the lighthouse and to peers is
      sealed with it, and messages that are not are refused.
  """

  def __init__(self, *, lighthouse: str, group_id: str,
               timeout: timedelta = timedelta(seconds=30), options: ReplicaGroupOptions | None = None,
               snapshot_source: SnapshotSource | None = None, injector: Any = None,
               peer_source: PeerSourceFactory | None = None, secret: str | None = None):
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
      raise errors.InvalidArgumentError(f"ReplicaGroup timeout must be a positive timedelta, got {timeout!r}")
    key = _wire.secret_bytes(secret, who=f"ReplicaGroup {group_id!r}")
    self.group_id, self.timeout = group_id, timeout
    self.options = options or ReplicaGroupOptions()
    self.snapshot_source = snapshot_source
    self.step, self.digest = 0, INITIAL_DIGEST
    self.batches = 0               # batches the job's commits before ``step`` consumed
    self.ring = GradientRing(self.options.ring_size)
    self.digests = DigestLog()
    self.digests.record(0, INITIAL_DIGEST)
    self.counters = FtCounters()
    self.metrics: StepMetrics | None = None
    self._injector = injector
    self._attempts = 0
    self._attempt_index = 0  # of the attempt begun last: what the injector's drops key on
    self._current: _Attempt | None = None
    self._committed = False
    self._retries = 0
    self._layout: tuple[list[Any], Any] | None = None
    self._layout_wire: tuple[Any, ...] | None = None    # the layout of start_step's grads_like
    self._comm = _group_comm.GroupComm()
    self._ctx = zmq.Context() if self._comm.is_talker else None
    if self._ctx is not None:
      bind, advertise = _address.choose(self.options.host, lighthouse)
      self._server = _peer.PeerServer(
          self._ctx, bind, CatchUpServer(self.ring, self.digests, lambda: self.snapshot_source),
          secret=key, drop=self._dropping, advertise=advertise)
      self.address = self._server.address
      self._sender = _peer.PeerSender(self._ctx, secret=key, drop=self._dropping)
      self._links = _links.Links(bind, key, group_id=group_id, timeout_secs=timeout.total_seconds(),
                                 advertise=advertise)
      logger.info("group %s serves its peers at %s and its ring at %s (bound on %s)", group_id, self.address,
                  self._links.address, bind, extra={"group_id": group_id})
    # Its heartbeats, quorum requests and lineage (ft/_session.py; a client and heartbeat on process 0).
    self._plane = _session.LighthouseSession(
        self._ctx, lighthouse, group_id=group_id, key=key, heartbeat_interval=self.options.heartbeat_interval,
        timeout_secs=timeout.total_seconds(), lighthouse_timeout=self.options.lighthouse_timeout,
        comm=self._comm, drop=self._dropping, on_abort=self._aborted_by_lighthouse, step=lambda: self.step,
        extra=self._extra)
    self.bytes_sent = 0          # gradient bytes this group sent in all-reduces
    # Flat all-reduce buffers, reused once no ring entry or result refers to them.
    self._buffers = _allreduce.BufferPool(self.options.ring_size + 2)
    # The catch-up path (ft/_recovery.py): fetches from a healthy peer, and replays.
    self._recovery = _recovery.Recovery(
        group_id=group_id, timeout_secs=timeout.total_seconds(), comm=self._comm,
        sender=self._sender if self._ctx is not None else None, lighthouse=self._plane.client,
        peer_source=peer_source, extra=self._extra)

  # ---- the training-loop API --------------------------------------------------------------------

  def start_step(self, state: Any = None, apply_fn: ApplyFn | None = None, *,
                 grads_like: Any = None) -> Any:
    """Joins the next quorum; catches up first when behind. Returns the (maybe replaced) state.

    Args:
      state: the group's train state (template for a fetched snapshot).
      apply_fn: ``apply_fn(state, averaged_grads) -> state``, the update a commit applies;
        needed to replay missed steps (without it a group that is behind sits the step out).
      grads_like: a pytree like the gradients (jax.Arrays or ShapeDtypeStructs with shardings);
        defaults to the layout of the last ``allreduce`` input.
    """
    index, self._attempts = self._attempts, self._attempts + 1
    self._attempt_index = index  # before _join: the quorum request belongs to this attempt too
    self.counters.attempts += 1
    self._committed = False
    if self._injector is not None:
      self._injector.on_attempt(self.group_id, self.step)
    if grads_like is not None and self._layout_wire is None:
      leaves, treedef = jax.tree_util.tree_flatten(grads_like)
      self._layout_wire = tuple(_layout.of(treedef, leaves).to_wire())
    t0 = time.monotonic()
    quorum = self._join()
    attempt = _Attempt(index=index, step=self.step, quorum=quorum, quorum_secs=time.monotonic() - t0)
    self._current = attempt
    # Behind: catch up while the healthy members reduce without us (up to the step they
    # reduce now), then join the next quorum in sync. A replay slower than their step
    # leaves us behind again: chase (one ring entry each time) a bounded number of times.
    for _ in range(_CHASES):
      if quorum is None:
        attempt.failure = "no quorum"
        return state
      if self._in_sync(quorum):
        attempt.participating = True
        if self._comm.is_talker and quorum.right is not None:   # (its handshake overlaps the compute)
          self._links.prepare(quorum.right.group_id, quorum.right.ring_address)
        return state
      attempt.failure = (f"behind the quorum (step {self.step}, digest {self.digest:#x}; the quorum's "
                         f"step {quorum.max_step}, digest {quorum.digest:#x})")
      if apply_fn is None:
        logger.warning("group %s is behind (step %d < %d) and start_step got no apply_fn: sitting "
                       "out", self.group_id, self.step, quorum.max_step, extra=self._extra())
        return state
      before = self.step
      state = self._catch_up(state, apply_fn, grads_like, attempt)
      if self.step == before:
        return state                  # could not catch up: sit this attempt out
      t0 = time.monotonic()
      quorum = attempt.quorum = self._join()
      attempt.quorum_secs += time.monotonic() - t0
    return state

  def batch_index(self) -> int:
    """This attempt's batch: the batches the job's commits consumed so far plus this
    group's rank in the attempt's ring. Every committed step consumes one batch per
    contributor, so no batch is trained twice or skipped, whoever drops out or joins;
    with every one of ``max_groups`` groups in every step it is ``step * max_groups + rank``.
    A group that is not in the ring (catching up) gets a batch after the ring's, which
    it does not contribute; a retried attempt reuses its batches (nothing was consumed)."""
    attempt = self._current
    if attempt is None:
      raise RuntimeError(f"group {self.group_id}: call start_step() before batch_index()")
    quorum = attempt.quorum
    if quorum is None:
      return self.batches
    ring = quorum.healthy
    if self.group_id in ring:
      rank = ring.index(self.group_id)
    else:
      rank = len(ring) + [g for g in quorum.members if g not in ring].index(self.group_id)
    if not 0 <= rank < self.options.max_groups:
      raise errors.InvalidArgumentError(
          f"quorum {rank=} is outside [0, max_groups={self.options.max_groups}): raise "
          "ReplicaGroupOptions.max_groups above the number of groups (in every group)")
    return quorum.batches + rank

  def allreduce(self, grads: Any) -> Any:
    """The mean of ``grads`` over this step's contributors, on the input leaves' shardings.

    If the step cannot commit (no quorum, behind, leader lost), returns ``grads``
    unchanged and :meth:`should_commit` is False. Numpy leaves come back
    read-only: they are the step's ring entry, which peers catch up from.
    """
    if self._current is None:
      self.start_step()
    attempt, self._current = self._current, None
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    self._layout = ([_like(x) for x in leaves], treedef)
    layout = _layout.of(treedef, leaves)
    t0 = time.monotonic()
    outcome = self._exchange(attempt, leaves, layout) if attempt.participating else None
    result = grads
    if outcome is not None:
      out, contributors, digest_after, _ = outcome
      self._commit(RingEntry(step=self.step, digest_before=self.digest, digest_after=digest_after,
                             leaves=tuple(out), batches_after=self.batches + len(contributors)))
      result = jax.tree_util.tree_unflatten(treedef, [rebuild_leaf(l, h) for l, h in zip(leaves, out)])
    self._finish(attempt, contributors=outcome[1] if outcome else (),
                 allreduce_secs=time.monotonic() - t0, go_on=bool(outcome and outcome[3]))
    return result

  def should_commit(self) -> bool:
    """Whether the last ``allreduce`` returned the step's agreed average (apply it if so)."""
    return self._committed

  def close(self) -> None:
    """Stops the heartbeat and the serving thread; the lighthouse drops the group.

    All-reduce pieces still queued for the right neighbour are sent first (for up
    to ``timeout``, the longest it waits for them): a group that closes right
    after a step does not drop the last hop its neighbour is owed.
    """
    if self._ctx is None:
      return
    self._plane.close()
    self._server.stop()
    self._links.close(linger_secs=self.timeout.total_seconds())
    self._plane.close_client()
    self._ctx.term()
    self._ctx = None

  def __enter__(self) -> ReplicaGroup:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  # ---- quorum --------------------------------------------------------------------------------------

  def _dropping(self) -> bool:
    """Whether the injector cuts this group off in the attempt begun last (join, catch-up, reduce)."""
    if self._injector is None:
      return False
    return self._injector.drops(self.group_id, self._attempt_index)

  def _me(self) -> Member:
    return Member(group_id=self.group_id, address=self.address, step=self.step, digest=self.digest,
                  ring_address=self._links.address, batches=self.batches)

  def _terms(self) -> _terms.Terms:
    o = self.options
    return _terms.Terms(max_groups=o.max_groups, data_order=o.data_order, averaging=o.averaging,
                        layout=self._layout_wire)

  def _join(self) -> Quorum | None:
    """The quorum of this attempt (ft/_session.py: the ring's own, one step on, or the lighthouse's)."""
    return self._plane.join(self._me, self._terms)

  def _in_sync(self, quorum: Quorum) -> bool:
    return self.step == quorum.max_step and self.digest == quorum.digest and quorum.in_ring

  # ---- the fault-tolerant all-reduce ---------------------------------------------------------------

  def _exchange(self, attempt: _Attempt, leaves: Sequence[Any], layout: _layout.Layout
                ) -> tuple[list[np.ndarray], tuple[str, ...], int, bool] | None:
    host = self._comm.to_host(leaves)
    outcome: Any = None
    if self._comm.is_talker:
      outcome = self._ring(attempt.quorum, host, layout)
    wire = self._comm.share(outcome if isinstance(outcome, str) or outcome is None
                            else [list(outcome[1]), outcome[2], outcome[3]])
    if wire is None or isinstance(wire, str):
      attempt.failure = wire or attempt.failure
      return None
    out = self._comm.share_arrays(outcome[0] if outcome else None, [(h.shape, h.dtype) for h in host])
    return out, tuple(wire[0]), int(wire[1]), bool(wire[2])

  def _ring(self, quorum: Quorum, host: list[np.ndarray], layout: _layout.Layout
            ) -> tuple[list[np.ndarray], tuple[str, ...], int, bool] | str:
    """The ring all-reduce among the quorum's healthy members (this group is one): the
    result, the contributors, the digest after it and whether the ring goes on with this
    quorum (no member asked to change it); why not, if it did not complete."""
    ids = quorum.healthy
    rank, size = ids.index(self.group_id), len(ids)
    right, left = quorum.right, quorum.left
    deadline = time.monotonic() + self.timeout.total_seconds()
    expect = {"q": quorum.quorum_id, "step": self.step, "digest": self.digest, "layout": layout.to_wire()}

    lost: list[_links.Failure] = []              # why a piece for the right neighbour was lost
    failed: list[_links.Failure] = []            # why a piece from the left one was not taken
    # Whether any member wants the lighthouse asked before the next step (it called them back):
    # each piece carries the OR of its sender's wish and what the sender heard, so after
    # the reduce-scatter's G - 1 hops every member knows every member's wish at its start.
    asked = [self._plane.take_called_back()]

    def send(tag: int, segments: list[np.ndarray]) -> None:
      if not self._dropping() and not lost:
        why = self._links.send(right.group_id, right.ring_address, dict(expect, tag=tag, ask=asked[0]),
                               segments, deadline)
        if why is None:
          self.bytes_sent += sum(s.nbytes for s in segments)
        else:
          lost.append(why)

    def recv(tag: int, into: np.ndarray) -> bool:
      if self._dropping():                       # cut off: hears nothing until the timeout
        time.sleep(max(0.0, deadline - time.monotonic()))
        failed.append(_links.Failure("cut off by the fault injector"))
        return False
      if lost:                                   # the sum cannot complete without this group's piece
        failed.append(_links.Failure(f"step {self.step}'s piece for group {right.group_id} was lost "
                                     f"({lost[0]})", lost[0].blame))
      else:
        why = self._links.recv(left.group_id, expect, tag, into, deadline, address=left.ring_address,
                               heard=lambda head: asked.__setitem__(0, asked[0] or bool(head.get("ask"))))
        if why is None:
          return True
        failed.append(why if str(why).startswith("the lighthouse") else
                      _links.Failure(f"piece {tag} from group {left.group_id}: {why}", why.blame))
      logger.warning("group %s does not commit step %d: %s", self.group_id, self.step, failed[-1],
                     extra=self._extra())
      return False

    result = _allreduce.ring_mean(host, rank, size, send, recv, self._buffers,
                                  average=self.options.averaging == "mean")
    if result is None:
      why = failed[-1]
      if not self._dropping():
        # The right neighbour cannot complete either: tell it why (unless it is the one
        # out), and the lighthouse, which has every other member still in the attempt
        # abort it too (so it never hangs on a dead neighbour passing it on).
        if not lost and right.group_id not in why.blame:
          self._links.abort(right.group_id, right.ring_address, expect, why, why.blame)
          # Members that did commit go on to the next step without asking: its attempt ends too.
          following = dict(expect, q=f"{quorum.lineage}@{self.step + 1}", step=self.step + 1)
          self._links.abort(right.group_id, right.ring_address, following, why, why.blame)
        self._plane.client.failed(self.group_id, quorum.quorum_id, why, why.blame)
      # The first hop goes out of the caller's own arrays: none may still be read
      # once allreduce returns them (on success the ring itself proves it). The
      # abort gets a bound of its own (the attempt's deadline may have passed);
      # a neighbour that is out gets none.
      grace = 0.0 if right.group_id in why.blame else min(self.timeout.total_seconds(), _SETTLE_SECS)
      self._links.settle(right.group_id, time.monotonic() + grace)
      return str(why)
    go_on = not asked[0] and quorum.members == quorum.healthy
    return result, ids, chain_digest(self.digest, result), go_on

  def _aborted_by_lighthouse(self, quorum_id: str, why: str, blame: tuple[str, ...]) -> None:
    """The lighthouse ended the attempt of ``quorum_id`` (a member is out, or the job moved
    on): the attempt in flight of that quorum and the next one it would go on with."""
    reason = f"the lighthouse ended quorum {quorum_id}'s attempt: {why}"
    self._links.fail(quorum_id, reason, blame)
    step = self.step
    for s in (step, step + 1):
      self._links.fail(f"{quorum_id}@{s}", reason, blame)

  def _commit(self, entry: RingEntry) -> None:
    self.ring.put(entry)
    self.step, self.digest, self.batches = entry.step + 1, entry.digest_after, entry.batches_after
    self.digests.record(self.step, self.digest)

  def _finish(self, attempt: _Attempt, *, contributors: tuple[str, ...], allreduce_secs: float,
              go_on: bool = False) -> None:
    committed = bool(contributors)
    self._committed = committed
    quorum = attempt.quorum
    if committed and go_on:
      self._plane.next = quorum.continued(self.digest, self.batches)
    elif quorum is None:
      self._plane.why_ask = "it has no quorum"
    elif not committed:
      self._plane.why_ask = f"step {attempt.step}'s attempt failed ({attempt.failure or 'no reason given'})"
    elif quorum.members != quorum.healthy:
      self._plane.why_ask = "groups of its quorum catch up"
    else:
      self._plane.why_ask = "the lighthouse called the ring back (a group joins)"
    members = quorum.members if quorum is not None else ()
    dropped = tuple(sorted(set(quorum.dropped if quorum else ()) |
                           (set(members) - set(contributors) if committed else set())))
    self.metrics = StepMetrics(
        step=attempt.step, attempt=attempt.index, quorum_id=quorum.quorum_id if quorum else None,
        quorum_size=len(members), contributors=contributors, dropped_groups=dropped,
        committed=committed, failure=None if committed else attempt.failure,
        retries=self._retries, quorum_secs=attempt.quorum_secs,
        allreduce_secs=allreduce_secs, catch_up_secs=attempt.catch_up_secs,
        caught_up_steps=attempt.caught_up_steps, snapshot_step=attempt.snapshot_step)
    self._retries = 0 if committed else self._retries + 1
    self.counters.commits += committed
    self.counters.failed_attempts += not committed
    self.counters.dropped_groups += len(dropped)
    logger.info("group %s step %d %s: quorum %s contributors %s dropped %s", self.group_id,
                attempt.step, "committed" if committed else "not committed", members, contributors,
                dropped, extra=dict(self._extra(), **dataclasses.asdict(self.metrics)))

  def _extra(self) -> dict[str, Any]:
    return {"group_id": self.group_id, "step": self.step, "jax_process": jax.process_index()}

  # ---- catch-up (ft/_recovery.py fetches and replays) --------------------------------------------

  def _catch_up(self, state: Any, apply_fn: ApplyFn, grads_like: Any, attempt: _Attempt) -> Any:
    """Replays what this group missed (a snapshot and ring entries), then the step
    the healthy members reduce now, once one of them has committed it. Never a
    ring member this attempt, so the healthy groups never wait for it; the
    state it returns is in sync with the next quorum's."""
    t0 = time.monotonic()
    quorum, before = attempt.quorum, state
    try:
      like = self._grads_like(grads_like)
      state, entries, step, digest, batches = self._recovery.replay_to(
          quorum, state, apply_fn, like, attempt, at=(self.step, self.digest), retries=self._retries,
          counters=self.counters)
    except (OSError, KeyError, ValueError, errors.QuorumError) as e:
      logger.warning("group %s could not catch up to step %d: %s; sitting this attempt out",
                     self.group_id, quorum.max_step, e, extra=self._extra())
      attempt.catch_up_secs += time.monotonic() - t0
      return before
    for entry in entries:
      self.ring.put(entry)
      self.digests.record(entry.step + 1, entry.digest_after)
    self.step, self.digest, self.batches = step, digest, batches
    self.digests.record(step, digest)
    secs = time.monotonic() - t0
    attempt.step = step
    attempt.caught_up_steps += len(entries)
    attempt.catch_up_secs += secs
    self.counters.catch_ups += 1
    self.counters.catch_up_secs += secs
    logger.info("group %s caught up to step %d in %.3fs (%d steps replayed, snapshot %s)",
                self.group_id, step, secs, len(entries), attempt.snapshot_step,
                extra=dict(self._extra(), catch_up_secs=secs))
    return state

  def _grads_like(self, grads_like: Any) -> tuple[list[Any], Any]:
    if grads_like is not None:
      leaves, treedef = jax.tree_util.tree_flatten(grads_like)
      return [_like(x) for x in leaves], treedef
    if self._layout is not None:
      return self._layout
    raise errors.InvalidArgumentError(f"group {self.group_id} must replay averaged gradients but does not know their "
                     "layout: pass grads_like= (e.g. the params) to start_step()")


def _like(x: Any) -> Any:
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x
