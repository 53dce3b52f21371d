"""A replica group's catch-up path: what a group that is behind fetches from a healthy peer, and replays.

:class:`Recovery` is held by :class:`jaxckpt.ft.replica_group.ReplicaGroup`. It fetches (on process 0 of the
group, shared with the others: :mod:`jaxckpt.ft._group_comm`) the missed ring entries, or a snapshot and the
entries after it, from a healthy peer's serving thread (or its snapshot agents), replays them, then waits for
the step the healthy members reduce now and replays it too. It never touches the group's own step, ring or
digests: the group applies what :meth:`Recovery.replay_to` returns.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable

import jax

from jaxckpt import errors
from jaxckpt.ft import _address, _group_comm, _peer
from jaxckpt.ft._clients import LighthouseClient
from jaxckpt.ft._quorum import Member, Quorum
from jaxckpt.ft.agent_source import AgentSnapshotSource
from jaxckpt.ft.catch_up import RemoteSnapshotSource, SnapshotSource, fetch_ring, rebuild_leaf, rebuild_state
from jaxckpt.ft.metrics import FtCounters
from jaxckpt.ft.ring import RingEntry

logger = logging.getLogger("jaxckpt.ft.replica_group")   # (its owner's log, as before the split)

ApplyFn = Callable[[Any, Any], Any]
PeerSourceFactory = Callable[[Member], SnapshotSource]
Like = tuple[list[Any], Any]     # the gradient's leaves (ShapeDtypeStructs) and tree structure


class Recovery:
  """Catch-up for one replica group (see the module's docstring).

  Args:
    group_id: the group's name (logs, and which peer is not itself).
    timeout_secs: the bound of every fetch, and of the wait for the step in flight.
    comm: the group's processes (process 0 fetches, the others get its plan).
    sender: process 0's requests to peers (None on the others).
    lighthouse: process 0's client of the lighthouse, told when the group is ready (None on the others).
    peer_source: how a recovering group reaches a healthy peer's snapshots (None: the peer's
      snapshot agents when it advertises them, else its serving thread).
    extra: the group's log fields.
  """

  def __init__(self, *, group_id: str, timeout_secs: float, comm: _group_comm.GroupComm,
               sender: _peer.PeerSender | None, lighthouse: LighthouseClient | None,
               peer_source: PeerSourceFactory | None, extra: Callable[[], dict[str, Any]]):
    self.group_id, self.timeout_secs = group_id, timeout_secs
    self._comm, self._sender, self._lighthouse = comm, sender, lighthouse
    self._extra = extra
    self.peer_source = peer_source or self.default_peer_source

  def replay_to(self, quorum: Quorum, state: Any, apply_fn: ApplyFn, like: Like, attempt: Any, *,
                at: tuple[int, int], retries: int, counters: FtCounters
                ) -> tuple[Any, list[RingEntry], int, int, int]:
    """Replays what the group missed (at step and digest ``at``: a snapshot and ring entries),
    then the step the healthy members reduce now, once one of them has committed it. Returns
    the state, the entries replayed, and the step, digest and batch count reached (the
    quorum's, in sync with the next quorum's); ``attempt`` gets the snapshot's step, and
    ``counters`` the fetch. Raises OSError, KeyError, ValueError or QuorumError when it cannot."""
    plan = self._talker_plan(lambda: self._fetch_plan(quorum, at, retries), state, like)
    state, step, digest = self._replay(plan, state, apply_fn, like)
    if plan["snapshot"] is not None:
      attempt.snapshot_step = plan["step"]
      counters.snapshot_fetches += 1
      # A group that needed a snapshot (a restarted process: JAX, its compiles) holds many
      # new objects; Python's next full collection would pause it for a large fraction of
      # a second in its first steps back, which the healthy groups would wait for. Now,
      # while nobody waits for it, is the time.
      gc.collect()
    if (step, digest) != (quorum.max_step, quorum.digest):
      raise errors.QuorumError(f"catch-up reached step {step} digest {digest:#x}, not the quorum's "
                               f"step {quorum.max_step} digest {quorum.digest:#x}")
    # Replayed up to the step in flight: tell the lighthouse to wait for us next, then take
    # that step's result from a peer once it has committed it.
    last = self._talker_plan(lambda: self._await_entry(quorum, retries), state, like)
    state, step, digest = self._replay(last, state, apply_fn, like)
    entries = plan["entries"] + last["entries"]
    # (the healthy members' count at the quorum's step, then the step in flight's own)
    batches = last["entries"][-1].batches_after if last["entries"] else quorum.batches
    return state, entries, step, digest, batches

  def _talker_plan(self, fetch: Callable[[], dict[str, Any]], state: Any, like: Like) -> dict[str, Any]:
    """``fetch()`` on process 0 of the group, shared with the others."""
    plan, error = None, None
    if self._comm.is_talker:
      try:
        plan = fetch()
      except (OSError, KeyError, ValueError) as e:
        error = e
    plan = self._share_plan(plan, state, like)
    if plan is None:
      raise error or KeyError("process 0 of the group could not fetch the catch-up data")
    return plan

  @staticmethod
  def _replay(plan: dict[str, Any], state: Any, apply_fn: ApplyFn, like: Like) -> tuple[Any, int, int]:
    """``state`` after the plan's snapshot and entries, with its step and digest."""
    step, digest = plan["step"], plan["digest"]
    if plan["snapshot"] is not None:
      state = rebuild_state(state, plan["snapshot"])
    for entry in plan["entries"]:
      grads = jax.tree_util.tree_unflatten(like[1], [rebuild_leaf(l, h) for l, h in zip(like[0], entry.leaves)])
      state = apply_fn(state, grads)
      step, digest = entry.step + 1, entry.digest_after
    return state, step, digest

  def _catch_up_peer(self, quorum: Quorum, retries: int) -> Member:
    healthy = [m for m in quorum.peers if m.group_id != self.group_id]
    if not healthy:
      raise KeyError(f"quorum {quorum.quorum_id} names no healthy peer for group {self.group_id} to "
                     "catch up from")
    # Each failed attempt in a row asks the next healthy peer, so one that is slow to answer
    # (busy serving someone else, or gone) delays catch-up by one attempt, never for good.
    return healthy[retries % len(healthy)]

  def _fetch_plan(self, quorum: Quorum, at: tuple[int, int], retries: int) -> dict[str, Any]:
    my_step, my_digest = at
    peer = self._catch_up_peer(quorum, retries)
    logger.info("group %s catches up from %s (%s) to step %d", self.group_id, peer.group_id,
                peer.address, quorum.max_step, extra=self._extra())
    secs = self.timeout_secs
    entries = None
    if my_step < quorum.max_step:
      entries = fetch_ring(self._sender, peer.address, my_step, my_digest, quorum.max_step, secs)
    if entries is not None:
      return {"step": my_step, "digest": my_digest, "snapshot": None, "entries": entries}
    source = self.peer_source(peer)
    snap_step = source.latest_step()
    if snap_step is None:
      raise KeyError(f"peer {peer.group_id} serves no snapshot and its ring does not reach back to "
                     f"step {my_step}: give it a snapshot_source or a larger ring_size")
    reply = self._sender.request(peer.address, {"op": "digest", "step": snap_step}, secs)
    if reply is None or reply[0].get("digest") is None:
      raise KeyError(f"peer {peer.group_id} knows no digest of its snapshot step {snap_step}")
    snap_digest = int(reply[0]["digest"])
    entries = fetch_ring(self._sender, peer.address, snap_step, snap_digest, quorum.max_step, secs)
    if entries is None:
      raise KeyError(f"peer {peer.group_id}'s ring does not cover steps {snap_step}..{quorum.max_step}")
    return {"step": snap_step, "digest": snap_digest, "snapshot": source.fetch(snap_step),
            "entries": entries}

  def _await_entry(self, quorum: Quorum, retries: int) -> dict[str, Any]:
    """A plan of the step the healthy members reduce now, once a peer has
    committed it (within ``timeout``; no entry if none did), so this group asks
    for the next quorum in sync. The lighthouse learns first that it will."""
    self._lighthouse.ready(self.group_id)
    peer = self._catch_up_peer(quorum, retries)
    deadline = time.monotonic() + self.timeout_secs
    entries: list[RingEntry] = []
    while (left := deadline - time.monotonic()) > 0:
      got = fetch_ring(self._sender, peer.address, quorum.max_step, quorum.digest,
                       quorum.max_step + 1, min(left, 1.0), wait_secs=left)   # (held until committed)
      if got is not None:
        entries = got
        break
      time.sleep(0.005)
    return {"step": quorum.max_step, "digest": quorum.digest, "snapshot": None,
            "entries": entries}

  def default_peer_source(self, peer: Member) -> SnapshotSource:
    """The peer's snapshot agents when it advertises them (``snap_where``) and is on this machine
    (their address files are under its run root here), else its serving thread."""
    secs = self.timeout_secs
    reply = self._sender.request(peer.address, {"op": "snap_where"}, secs)
    if reply is not None and reply[0].get("agent") and not _address.on_this_machine(peer.address):
      logger.info("group %s fetches its snapshot through the serving thread of group %s, which is on "
                  "another machine (%s)", self.group_id, peer.group_id, peer.address, extra=self._extra())
    elif reply is not None and reply[0].get("agent"):
      source = AgentSnapshotSource(**reply[0]["agent"], timeout_secs=secs)
      try:
        if source.latest_step() is None:
          # (Address files found here whose agents do not answer from here, such as another
          # machine's on loopback through a run root both see, or none that holds a step:
          # the peer's serving thread reads its own agents.)
          raise KeyError("none that answers from this machine holds a complete step")
      except (OSError, KeyError) as e:
        logger.warning("group %s cannot reach the snapshot agents of group %s (%s): %s; asking "
                       "its serving thread instead", self.group_id, peer.group_id,
                       reply[0]["agent"], e, extra=self._extra())
      else:
        logger.info("group %s fetches its snapshot from the snapshot agents of group %s (%s)",
                    self.group_id, peer.group_id, reply[0]["agent"], extra=self._extra())
        return source
    return RemoteSnapshotSource(self._sender, peer.address, secs)

  def _share_plan(self, plan: dict[str, Any] | None, state: Any, like: Like) -> dict[str, Any] | None:
    if self._comm.size == 1:
      return plan
    head = None
    if plan is not None:
      head = {"step": plan["step"], "digest": plan["digest"], "snapshot": plan["snapshot"] is not None,
              "entries": [[e.step, e.digest_before, e.digest_after, e.batches_after]
                          for e in plan["entries"]]}
    head = self._comm.share(head)
    if head is None:
      return None
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    snapshot = None
    if head["snapshot"]:
      arrays = self._comm.share_arrays([plan["snapshot"][p] for p in paths] if plan else None,
                                       [(x.shape, x.dtype) for _, x in flat])
      snapshot = dict(zip(paths, arrays))
    entries = []
    for i, (s, before, after, batches) in enumerate(head["entries"]):
      arrays = self._comm.share_arrays(plan["entries"][i].leaves if plan else None,
                                       [(x.shape, x.dtype) for x in like[0]])
      entries.append(RingEntry(step=s, digest_before=before, digest_after=after, leaves=tuple(arrays),
                               batches_after=batches))
    return {"step": head["step"], "digest": head["digest"], "snapshot": snapshot, "entries": entries}
