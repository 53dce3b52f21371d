"""What every replica group of a job must hold the same: part of the quorum.

Groups that differ in any of these mix their data silently: two groups with
another ``max_groups`` draw the same batch (``step * max_groups + rank``), two
data orders train on unrelated batches, two tree layouts average unrelated
numbers, a sum and a mean disagree on every update. So each quorum request
carries the group's :class:`Terms`; the lighthouse fixes the job's terms at its
first quorum (kept in etcd when the control plane has one) and refuses a group
whose terms differ when it joins, naming the field and both values
(:func:`differ`).

>>> job = Terms(max_groups=5, data_order="c4-seed17", averaging="mean")
>>> differ(Terms(max_groups=4, data_order="c4-seed17", averaging="mean"), job, "g2")
"group g2's max_groups is 4, the job's is 5: every group of a job must use the same max_groups (ReplicaGroupOptions.max_groups); relaunch g2 with max_groups=5"
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from jaxckpt.net import _schema
from jaxckpt.net._schema import Digest

AVERAGING = ("mean", "sum")
_MAX_ORDER = 256
_MAX_DESCRIPTION = 300


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Terms:
  """A group's values of what the job must agree on.

  Attributes:
    max_groups: batch slots per step (``ReplicaGroupOptions.max_groups``).
    data_order: the name of the order batches are drawn in (the dataset and its
      shuffle seed, ``ReplicaGroupOptions.data_order``).
    averaging: how gradients combine across groups: ``"mean"`` or ``"sum"``.
    layout: the gradient's tree layout (:meth:`jaxckpt.ft._layout.Layout.to_wire`),
      None while the group does not know it yet (then it is checked on the ring).
  """
  max_groups: int
  data_order: str
  averaging: str
  layout: tuple[Any, ...] | None = None

  def to_wire(self) -> list[Any]:
    return [self.max_groups, self.data_order, self.averaging,
            None if self.layout is None else list(self.layout)]

  @classmethod
  def from_wire(cls, obj: Any) -> Terms:
    """The terms ``obj`` (a request's field, or what etcd keeps) stands for, checked against
    :class:`TermsWire`; InvalidArgumentError naming what is wrong."""
    try:
      return msgspec.convert(obj, TermsWire).to_terms()
    except msgspec.ValidationError as e:
      raise _schema.refused(e, obj, "terms", tail="", positions=POSITIONS) from None


class LayoutWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
  """A gradient layout (:meth:`jaxckpt.ft._layout.Layout.to_wire`) as terms carry it."""
  a: Digest
  b: Digest
  c: Digest
  d: Digest
  description: Annotated[str, Meta(max_length=_MAX_DESCRIPTION)]

  def __post_init__(self) -> None:
    _schema.check_u64(a=self.a, b=self.b, c=self.c, d=self.d)


class TermsWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
  """:class:`Terms` as a quorum request carries them: [max_groups, data_order, averaging, layout]."""
  max_groups: Annotated[int, Meta(ge=1, lt=1 << 31)]
  data_order: Annotated[str, Meta(max_length=_MAX_ORDER)]
  averaging: Literal["mean", "sum"]           # AVERAGING
  layout: LayoutWire | None

  @classmethod
  def of(cls, t: Terms) -> TermsWire:
    return msgspec.convert(t.to_wire(), cls)

  def to_terms(self) -> Terms:
    return Terms(max_groups=self.max_groups, data_order=self.data_order,
                 averaging=self.averaging,
                 layout=None if self.layout is None else msgspec.structs.astuple(self.layout))


# the fields of TermsWire and its layout, by where they sit (see _schema.refused)
POSITIONS = {"": TermsWire.__struct_fields__, "layout": LayoutWire.__struct_fields__}


_FIX = {"max_groups": "ReplicaGroupOptions.max_groups", "data_order": "ReplicaGroupOptions.data_order",
        "averaging": "ReplicaGroupOptions.averaging"}


def differ(theirs: Terms, job: Terms, group: str) -> str | None:
  """Why ``group``, of terms ``theirs``, cannot join a job of terms ``job``; None if it can.
  An unknown layout (None on either side) is no difference: the ring checks it."""
  for field in ("max_groups", "data_order", "averaging"):
    a, b = getattr(theirs, field), getattr(job, field)
    if a != b:
      return (f"group {group}'s {field} is {a!r}, the job's is {b!r}: every group of a job must use "
              f"the same {field} ({_FIX[field]}); relaunch {group} with {field}={b!r}")
  if theirs.layout is not None and job.layout is not None and theirs.layout[:3] != job.layout[:3]:
    return (f"group {group}'s tree layout is {theirs.layout[4]}, the job's is {job.layout[4]}: every "
            f"group of a job must average gradients of the same tree (shapes and dtypes)")
  return None


def chosen(candidates: list[tuple[str, bool, Terms]]) -> Terms:
  """The job's terms from the first quorum's requests ``(group, holds a view, terms)``: those
  of groups that were in a quorum before (a restarted lighthouse's job) count first, then the
  most common terms, then the smallest group id's."""
  pool = [c for c in candidates if c[1]] or candidates
  counts: dict[tuple[Any, ...], int] = {}
  for _, _, t in pool:
    key = (t.max_groups, t.data_order, t.averaging)
    counts[key] = counts.get(key, 0) + 1
  best = max(counts.values())
  gid, _, terms = min((c for c in pool if counts[(c[2].max_groups, c[2].data_order, c[2].averaging)] == best),
                      key=lambda c: c[0])
  del gid
  layouts = [t.layout for _, _, t in pool if t.layout is not None
             and (t.max_groups, t.data_order, t.averaging) == (terms.max_groups, terms.data_order, terms.averaging)]
  return dataclasses.replace(terms, layout=terms.layout or (layouts[0] if layouts else None))
