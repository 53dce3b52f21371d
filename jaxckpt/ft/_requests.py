"""The lighthouse's requests, checked field by field before anything uses them.

A sealed message proves only that its sender holds the job's secret, not that it
is well formed: a buggy (or compromised) member could send a heartbeat without a
group or a step that is not an int. :func:`parse` turns a verified header into
one typed request, or raises InvalidArgumentError naming the field, what it
should be and what came; the lighthouse refuses such a message with that reason
and changes nothing. Names (group ids, addresses) are printable text, and a failure's
reason is escaped (:func:`jaxckpt.util._text.shown`): the lighthouse logs and relays
them to terminals.

>>> parse({"op": "heartbeat", "group": "g0", "step": 7, "q": "5b12a215-4"})
Heartbeat(group='g0', step=7, lineage='5b12a215-4')
>>> parse({"op": "ready", "group": 3})
Traceback (most recent call last):
...
jaxckpt.errors.InvalidArgumentError: 'ready' needs group: a string of 1 to 256 printable characters, got 3
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from jaxckpt import errors
from jaxckpt.ft._quorum import Member
from jaxckpt.ft._terms import Terms
from jaxckpt.util._text import shown

_MAX_NAME = 256                 # group ids, addresses
_MAX_VIEW = 64                  # a view key (see _quorum.view_key: 32 hex digits)
_MAX_INT = (1 << 63) - 1        # steps and request ids
_MAX_DIGEST = (1 << 64) - 1     # xxh3_64 digests
_MAX_QUORUM_ID = 64             # "<epoch hex>-<counter>"
_MAX_WHY = 1000                 # characters of a failure's reason
_MAX_BLAME = 8                  # groups a failure report names


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
  group: str
  step: int | None = None       # the step the group is at (it goes on without asking while its quorum holds)
  lineage: str | None = None    # the quorum it goes on with (its id at the lighthouse that formed it)


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
  group: str


@dataclasses.dataclass(frozen=True, slots=True)
class Leave:
  """A group closing (on its heartbeat connection, just before that closes)."""
  group: str


@dataclasses.dataclass(frozen=True, slots=True)
class QuorumRequest:
  request_id: int
  member: Member
  view: str
  ask: int | None               # the first request id of the member's ask (its resends repeat it)
  held: int | None = None       # how many members the view it holds has (None: not said)
  terms: Terms | None = None    # what it must agree on with the job (None: an older client)


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
  """A member's report that its attempt in quorum ``q`` failed: why, and the groups
  that failure shows to be out of the attempt (a closed stream, a refused connection)."""
  group: str
  q: str
  why: str
  blame: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Status:
  request_id: int | None


Request = Union[Heartbeat, Ready, QuorumRequest, Status, Failed, Leave]


def parse(header: Any) -> Request:
  """The request ``header`` (an opened, verified message header) stands for."""
  if not isinstance(header, dict):
    raise errors.InvalidArgumentError(f"a message header must be a map, got {type(header).__name__}")
  op = header.get("op")
  parser = _PARSERS.get(op) if isinstance(op, str) else None
  if parser is None:
    raise errors.InvalidArgumentError(
        f"unknown op {_show(op)}: the lighthouse handles {sorted(_PARSERS)}")
  return parser(header)


def request_id_of(header: Any) -> int | None:
  """The header's request id if it is a valid one (to answer a refusal with), else None."""
  rid = header.get("request_id") if isinstance(header, dict) else None
  return rid if _is_int(rid, 0, _MAX_INT) else None


def _heartbeat(h: dict[str, Any]) -> Heartbeat:
  step = h.get("step")
  if step is not None and not _is_int(step, 0, _MAX_INT):
    raise _bad("heartbeat", "step", "absent or an int in [0, 2**63)", step)
  lineage = h.get("q")
  if lineage is not None and not (isinstance(lineage, str) and 1 <= len(lineage) <= _MAX_QUORUM_ID):
    raise _bad("heartbeat", "q", f"absent or a string of 1 to {_MAX_QUORUM_ID} characters", lineage)
  return Heartbeat(_name(h, "heartbeat", "group"), step, lineage)


def _ready(h: dict[str, Any]) -> Ready:
  return Ready(_name(h, "ready", "group"))


def _leave(h: dict[str, Any]) -> Leave:
  return Leave(_name(h, "leave", "group"))


def _status(h: dict[str, Any]) -> Status:
  rid = h.get("request_id")
  if rid is not None and not _is_int(rid, 0, _MAX_INT):
    raise _bad("status", "request_id", "absent or an int in [0, 2**63)", rid)
  return Status(rid)


def _quorum(h: dict[str, Any]) -> QuorumRequest:
  rid = h.get("request_id")
  if not _is_int(rid, 0, _MAX_INT):
    raise _bad("quorum", "request_id", "an int in [0, 2**63)", rid)
  view = h.get("view", "")
  if not isinstance(view, str) or len(view) > _MAX_VIEW or not view.isprintable():
    raise _bad("quorum", "view", f"a string of at most {_MAX_VIEW} printable characters", view)
  ask = h.get("ask")
  if ask is not None and not _is_int(ask, 0, _MAX_INT):
    raise _bad("quorum", "ask", "absent or an int in [0, 2**63)", ask)
  held = h.get("held")
  if held is not None and not _is_int(held, 0, _MAX_INT):
    raise _bad("quorum", "held", "absent or an int in [0, 2**63)", held)
  terms = h.get("terms")
  if terms is not None:
    try:
      terms = Terms.from_wire(terms)
    except errors.InvalidArgumentError as e:
      raise _bad("quorum", "terms", str(e), terms) from None
  return QuorumRequest(rid, _member(h.get("member")), view, ask, held, terms)


def _failed(h: dict[str, Any]) -> Failed:
  q, why, blame = h.get("q"), h.get("why"), h.get("blame")
  if not (isinstance(q, str) and 1 <= len(q) <= _MAX_QUORUM_ID and q.isprintable()):
    raise _bad("failed", "q", f"a string of 1 to {_MAX_QUORUM_ID} printable characters", q)
  if not (isinstance(why, str) and len(why) <= _MAX_WHY):
    raise _bad("failed", "why", f"a string of at most {_MAX_WHY} characters", why)
  if not (isinstance(blame, (list, tuple)) and len(blame) <= _MAX_BLAME
          and all(isinstance(g, str) and 1 <= len(g) <= _MAX_NAME and g.isprintable()
                  for g in blame)):
    raise _bad("failed", "blame",
               f"a list of at most {_MAX_BLAME} group ids of printable characters", blame)
  # the reason is free text the lighthouse logs and relays to every member: escaped
  return Failed(_name(h, "failed", "group"), q, shown(why), tuple(blame))


def _member(obj: Any) -> Member:
  want = "a list [group_id, address, step, digest, ring_address, batches]"
  if not isinstance(obj, (list, tuple)) or len(obj) not in (4, 5, 6):
    raise _bad("quorum", "member", want, obj)
  fields = list(obj) + [""] * (5 - min(5, len(obj))) + [0] * (6 - max(5, len(obj)))
  gid, address, step, digest, ring, batches = fields
  for name, value, lo in (("group_id", gid, 1), ("address", address, 1), ("ring_address", ring, 0)):
    if not (isinstance(value, str) and lo <= len(value) <= _MAX_NAME and value.isprintable()):
      raise _bad("quorum", f"member.{name}",
                 f"a string of {lo} to {_MAX_NAME} printable characters", value)
  if not _is_int(step, 0, _MAX_INT):
    raise _bad("quorum", "member.step", "an int in [0, 2**63)", step)
  if not _is_int(digest, 0, _MAX_DIGEST):
    raise _bad("quorum", "member.digest", "an int in [0, 2**64)", digest)
  if not _is_int(batches, 0, _MAX_INT):
    raise _bad("quorum", "member.batches", "an int in [0, 2**63)", batches)
  return Member(group_id=gid, address=address, step=step, digest=digest, ring_address=ring, batches=batches)


def _name(h: dict[str, Any], op: str, field: str) -> str:
  value = h.get(field)
  if not (isinstance(value, str) and 1 <= len(value) <= _MAX_NAME and value.isprintable()):
    raise _bad(op, field, f"a string of 1 to {_MAX_NAME} printable characters", value)
  return value


def _is_int(value: Any, lo: int, hi: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _bad(op: str, field: str, want: str, got: Any) -> errors.InvalidArgumentError:
  return errors.InvalidArgumentError(f"{op!r} needs {field}: {want}, got {_show(got)}")


def _show(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


_PARSERS = {"heartbeat": _heartbeat, "ready": _ready, "quorum": _quorum, "status": _status,
            "failed": _failed, "leave": _leave}
