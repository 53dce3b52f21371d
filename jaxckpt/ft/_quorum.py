"""What a quorum is, on both sides: the lighthouse's replies and each member's view.

The lighthouse forms a quorum from its members' requests (:class:`Member`
records). Each member then needs little of it: the quorum id, the newest step
and the healthy members' digest, its own rank, its ring neighbours (when it is
healthy) or a few healthy peers to catch up from (when it is not), and the
group ids of the members, for its batch index and its step metrics. So a reply
carries only what that member needs, and the membership travels as a *view*:

* a view is the sorted list of member ids, each flagged healthy or not, named by
  a hash of that list (its ``key``);
* a member's quorum request names the view it holds; the reply names the new
  view and, only when the two differ, attaches the difference (ids added,
  changed and removed; the groups dropped since the last quorum) as one raw
  frame, authenticated by its hash in the sealed header;
* the lighthouse packs each difference once per quorum (every member that held
  the same view gets the same bytes, sent without a copy), and remembers the
  last few views, so a member that missed some quorums still gets a short
  difference; one it does not know gets the whole view.

In steady state a reply is a few hundred bytes whatever the number of groups G,
and a quorum costs the lighthouse O(G); a new member gets the whole view once.

>>> a = Member(group_id="g0", address="h:1", step=3, digest=7, ring_address="h:2")
>>> b = Member(group_id="g1", address="h:3", step=3, digest=7, ring_address="h:4")
>>> formed = Formation(max_views=4)
>>> view = View()
>>> gid, reply, blob = formed.replies("q-0", [a, b], {"g0": "", "g1": ""})[1]
>>> q = view.resolve("g1", dict(reply, delta=blob))
>>> q.members, q.healthy, q.rank("g1"), q.left.group_id, q.max_step
(('g0', 'g1'), ('g0', 'g1'), 1, 'g0', 3)
>>> gid, reply, blob = formed.replies("q-1", [a, b], {"g0": view.key, "g1": view.key})[1]
>>> blob is None, view.resolve("g1", reply).members         # nothing changed: no membership sent
(True, ('g0', 'g1'))
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any, Sequence

import msgspec

from jaxckpt import errors

#: Healthy peers a member that is behind is told about (it asks the next one on each failed try).
CATCH_UP_PEERS = 4


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Member:
  """A replica group as it asks for a quorum: where it serves, its step and digest."""
  group_id: str
  address: str
  step: int
  digest: int
  ring_address: str = ""          # where its all-reduce streams arrive (see ft/_links.py)
  batches: int = 0                # batches the job's commits before ``step`` consumed

  def to_wire(self) -> list[Any]:
    return [self.group_id, self.address, self.step, self.digest, self.ring_address, self.batches]

  @classmethod
  def from_wire(cls, obj: Sequence[Any]) -> Member:
    return cls(group_id=obj[0], address=obj[1], step=int(obj[2]), digest=int(obj[3]),
               ring_address=str(obj[4]) if len(obj) > 4 else "",
               batches=int(obj[5]) if len(obj) > 5 else 0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Quorum:
  """One member's view of the quorum of a step attempt.

  Attributes:
    quorum_id: unique id of this quorum's attempt (``lineage`` itself, or, for a
      quorum the ring went on with without asking, ``lineage@step``).
    group_id: the member this view belongs to.
    max_step: the newest step among the members.
    digest: the digest the healthy members share (see :func:`healthy_of`).
    members: every member's group id, sorted (the batch ranks).
    healthy: the healthy members' ids, sorted: the ring of this attempt.
    left, right: this member's ring neighbours (None when it is not healthy).
    peers: healthy members to catch up from (empty when this member is healthy).
    dropped: members of the previous quorum that are not in this one.
    lineage: the id of the quorum the lighthouse formed (which the ring goes on
      with, step after step, while every member commits).
    batches: batches the job consumed before ``max_step`` (the healthy members'
      count): this attempt's ring draws batches ``batches .. batches + len(healthy) - 1``.
  """
  quorum_id: str
  group_id: str
  max_step: int
  digest: int
  members: tuple[str, ...]
  healthy: tuple[str, ...]
  left: Member | None = None
  right: Member | None = None
  peers: tuple[Member, ...] = ()
  dropped: tuple[str, ...] = ()
  lineage: str = ""
  batches: int = 0

  @property
  def leader(self) -> str:
    """The smallest healthy group id (first in the ring)."""
    return self.healthy[0]

  @property
  def in_ring(self) -> bool:
    """Whether this member is healthy, so takes part in the attempt's all-reduce."""
    return self.right is not None

  def continued(self, digest: int, batches: int) -> Quorum:
    """The quorum of the next step when every member of this one committed this one's
    step with every healthy member: the same members, ring and ranks, one step on, named
    ``lineage@step``. Every member derives the same one, and asks nobody."""
    step = self.max_step + 1
    return dataclasses.replace(self, quorum_id=f"{self.lineage}@{step}", max_step=step, digest=digest,
                               batches=batches, dropped=())

  def rank(self, group_id: str) -> int:
    """Position of ``group_id`` among the members (sorted by group id)."""
    try:
      return self.members.index(group_id)
    except ValueError:
      raise KeyError(f"group {group_id!r} is not in quorum {self.quorum_id} "
                     f"({len(self.members)} members)") from None


def healthy_of(members: Sequence[Member]) -> list[Member]:
  """Members at the newest step with the digest most of them share (ties: the digest
  of the smallest group id among the tied), so one member with a wrong digest cannot
  make the others look diverged. ``members`` sorted by group id; so is the result."""
  top_step = max(m.step for m in members)
  top = [m for m in members if m.step == top_step]
  counts = collections.Counter(m.digest for m in top)
  most = max(counts.values())
  digest = next(m.digest for m in top if counts[m.digest] == most)
  return [m for m in top if m.digest == digest]


def view_key(flags: dict[str, bool]) -> str:
  """The name of a view: a hash of its sorted ids and their healthy flags."""
  text = "\n".join(f"{gid}\t{int(flags[gid])}" for gid in sorted(flags))
  return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class Formation:
  """The lighthouse's side: per-member replies of each quorum it forms, and the
  last ``max_views`` views (so members that held one get only the difference)."""

  def __init__(self, max_views: int = 8) -> None:
    self._views: collections.OrderedDict[str, dict[str, bool]] = collections.OrderedDict()
    self._max_views = max_views
    self._last_ids: tuple[str, ...] = ()

  def replies(self, quorum_id: str, members: Sequence[Member], held: dict[str, str], *,
              healthy: Sequence[Member] | None = None
              ) -> list[tuple[str, dict[str, Any], bytes | None]]:
    """``(group_id, reply, attachment)`` for every member: ``members`` sorted by
    id, ``held`` maps each to the view key it holds ("" for none), ``healthy`` is
    :func:`healthy_of` the members (computed here if not given)."""
    healthy = healthy_of(members) if healthy is None else healthy
    flags = {m.group_id: False for m in members}
    flags.update((m.group_id, True) for m in healthy)
    key = view_key(flags)
    ids = tuple(flags)                         # (members are sorted, and so is a dict built in order)
    dropped = [g for g in self._last_ids if g not in flags]
    self._last_ids = ids
    attachments: dict[str, tuple[bytes, bytes] | None] = {}   # per view held: (difference, its hash)
    ring = {m.group_id: i for i, m in enumerate(healthy)}
    out = []
    head = {"id": quorum_id, "step": healthy[0].step, "digest": healthy[0].digest, "n": len(ids),
            "view": key, "batches": healthy[0].batches}
    for rank, m in enumerate(members):
      base = held.get(m.group_id, "")
      if base not in attachments:
        blob = self._difference(base, flags, key, dropped)
        attachments[base] = None if blob is None else (blob, hashlib.sha256(blob).digest())
      attached = attachments[base]
      reply = dict(head, rank=rank)
      if attached is not None:
        reply["sha"] = attached[1]
      pos = ring.get(m.group_id)
      if pos is not None:
        reply["left"] = healthy[pos - 1].to_wire()
        reply["right"] = healthy[(pos + 1) % len(healthy)].to_wire()
      else:
        reply["peers"] = [p.to_wire() for p in _peers(healthy, rank)]
      out.append((m.group_id, reply, None if attached is None else attached[0]))
    self._remember(key, flags)
    return out

  def _difference(self, base: str, flags: dict[str, bool], key: str, dropped: list[str]) -> bytes | None:
    old = self._views.get(base)
    if old is None:
      base, old = "", {}
    if base == key and not dropped:
      return None
    add = [[g, f] for g, f in flags.items() if old.get(g) is not f]
    gone = [g for g in old if g not in flags]
    return msgspec.msgpack.encode({"base": base, "add": add, "del": gone, "dropped": dropped})

  def _remember(self, key: str, flags: dict[str, bool]) -> None:
    self._views[key] = flags
    self._views.move_to_end(key)
    while len(self._views) > self._max_views:
      self._views.popitem(last=False)


def _peers(healthy: Sequence[Member], rank: int) -> list[Member]:
  """Up to CATCH_UP_PEERS healthy members for the member at ``rank`` (not healthy
  itself), from the end of the ring, shifted by its rank so that several members
  catching up at once do not all ask the same peer first."""
  n = len(healthy)
  return [healthy[(n - 1 - rank - j) % n] for j in range(min(n, CATCH_UP_PEERS))]


class View:
  """A member's side: the view it holds, and the :class:`Quorum` of each reply."""

  def __init__(self) -> None:
    self.key = ""
    self._flags: dict[str, bool] = {}
    self._members: tuple[str, ...] = ()
    self._healthy: tuple[str, ...] = ()

  @property
  def members(self) -> tuple[str, ...]:
    """The member ids of the view held (empty when none is)."""
    return self._members

  def resolve(self, group_id: str, wire: dict[str, Any]) -> Quorum:
    """The quorum a reply stands for (``wire``: the reply, with its attachment
    as ``delta``); QuorumError if it does not fit the view held (then none is held,
    and the next request gets the whole view)."""
    try:
      dropped = self._apply(wire)
      quorum = Quorum(
          quorum_id=str(wire["id"]), group_id=group_id, max_step=int(wire["step"]),
          digest=int(wire["digest"]), members=self._members, healthy=self._healthy,
          left=_member_or_none(wire.get("left")), right=_member_or_none(wire.get("right")),
          peers=tuple(Member.from_wire(p) for p in wire.get("peers", ())), dropped=dropped,
          lineage=str(wire["id"]), batches=int(wire.get("batches", 0)))
      if len(self._members) != wire["n"] or self._members[wire["rank"]] != group_id:
        raise ValueError(f"{len(self._members)} members held, {wire['n']} in the reply, rank "
                         f"{wire['rank']} for {group_id!r}")
      return quorum
    except (KeyError, IndexError, TypeError, ValueError) as e:
      self.__init__()
      raise errors.QuorumError(f"group {group_id!r} could not read the lighthouse's quorum reply "
                               f"against the view it held: {type(e).__name__}: {e}") from None

  def _apply(self, wire: dict[str, Any]) -> tuple[str, ...]:
    blob = wire.get("delta")
    if blob is None:
      if wire["view"] != self.key:
        raise ValueError(f"the reply names view {wire['view']}, this member holds {self.key or 'none'}")
      return ()
    if hashlib.sha256(blob).digest() != wire.get("sha"):
      raise ValueError("the view's difference does not match the hash in the sealed reply")
    delta = msgspec.msgpack.decode(blob)
    if delta["base"] not in ("", self.key):
      raise ValueError(f"the difference is against view {delta['base']}, this member holds {self.key}")
    flags = {} if delta["base"] == "" else dict(self._flags)
    for gid in delta["del"]:
      flags.pop(gid, None)
    flags.update((g, bool(f)) for g, f in delta["add"])
    if view_key(flags) != wire["view"]:
      raise ValueError("the view after the difference is not the one the reply names")
    self.key, self._flags = wire["view"], flags
    self._members = tuple(sorted(flags))
    self._healthy = tuple(g for g in self._members if flags[g])
    return tuple(delta["dropped"])


def _member_or_none(obj: Any) -> Member | None:
  return None if obj is None else Member.from_wire(obj)
