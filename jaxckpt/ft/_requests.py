"""The lighthouse's requests, one msgspec Struct each (see :mod:`jaxckpt.net._schema`),
every field checked against its type and bounds once, when decoded, before anything
uses it.

A sealed message proves only that its sender holds the job's secret, not that it
is well formed: a buggy (or compromised) member could send a heartbeat without a
group or a step that is not an int. :func:`parse` turns a verified header into
one typed request, or raises InvalidArgumentError naming the field, what it
should be and what came; the lighthouse refuses such a message with that reason
and changes nothing. Names (group ids, addresses) are printable text, and a failure's
reason is escaped (:func:`jaxckpt.util._text.shown`): the lighthouse logs and relays
them to terminals. A header may carry fields a request does not declare (the
replay stamp ``inc``/``seq``, a newer member's): they are left out. Members send
the same Structs (``_schema.encode(Ready(group=...))``).

>>> parse({"op": "heartbeat", "group": "g0", "step": 7, "q": "5b12a215-4"})
Heartbeat(group='g0', step=7, lineage='5b12a215-4')
>>> parse({"op": "ready", "group": 3})
Traceback (most recent call last):
...
jaxckpt.errors.InvalidArgumentError: 'ready' needs group (Expected `str`, got `int`), got 3
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from jaxckpt import errors
from jaxckpt.ft._quorum import Member
from jaxckpt.ft import _terms
from jaxckpt.ft._terms import Terms, TermsWire
from jaxckpt.net import _schema
from jaxckpt.net._schema import INT64, Digest, Step
from jaxckpt.util._text import shown

_MAX_NAME = 256                 # group ids, addresses
_MAX_VIEW = 64                  # a view key (see _quorum.view_key: 32 hex digits)
_MAX_QUORUM_ID = 64             # "<epoch hex>-<counter>"
_MAX_WHY = 1000                 # characters of a failure's reason
_MAX_BLAME = 8                  # groups a failure report names

Name = Annotated[str, Meta(min_length=1, max_length=_MAX_NAME)]     # printable: see _printable
RequestId = Annotated[int, Meta(ge=0, le=INT64)]
QuorumId = Annotated[str, Meta(min_length=1, max_length=_MAX_QUORUM_ID)]


def _printable(op: str, **named: Any) -> None:
  """InvalidArgumentError naming the first of ``named`` (field -> text, or texts) that holds a
  character that is not printable (a control, an escape, a newline, a bidi override)."""
  for field, value in named.items():
    for text in (value,) if isinstance(value, str) else value:
      if not text.isprintable():
        raise errors.InvalidArgumentError(f"{field}: printable characters only (names reach logs and "
                         f"terminals), got {_schema.brief(text)}")


class Request(_schema.Message, frozen=True, kw_only=True, omit_defaults=True):
  """A request to the lighthouse (a field at its default is left out of the header)."""


class Heartbeat(Request, tag="heartbeat"):
  group: Name
  step: Step | None = None       # the step the group is at (it goes on without asking while its quorum holds)
  # the quorum it goes on with (its id at the lighthouse that formed it)
  lineage: QuorumId | None = msgspec.field(default=None, name="q")

  def __post_init__(self) -> None:
    _printable("heartbeat", group=self.group)


class Ready(Request, tag="ready"):
  group: Name

  def __post_init__(self) -> None:
    _printable("ready", group=self.group)


class Leave(Request, tag="leave"):
  """A group closing (on its heartbeat connection, just before that closes)."""
  group: Name

  def __post_init__(self) -> None:
    _printable("leave", group=self.group)


class MemberWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
  """A :class:`Member` as a quorum request carries it: [group_id, address, step, digest,
  ring_address, batches] (an older member sends the first four or five)."""
  group_id: Name
  address: Name
  step: Step
  digest: Digest
  ring_address: Annotated[str, Meta(max_length=_MAX_NAME)] = ""
  batches: Step = 0

  def __post_init__(self) -> None:
    _printable("quorum", group_id=self.group_id, address=self.address,
               ring_address=self.ring_address)
    _schema.check_u64(digest=self.digest)

  @classmethod
  def of(cls, m: Member) -> MemberWire:
    return cls(m.group_id, m.address, m.step, m.digest, m.ring_address, m.batches)

  def to_member(self) -> Member:
    return Member(group_id=self.group_id, address=self.address, step=self.step,
                  digest=self.digest, ring_address=self.ring_address, batches=self.batches)


class QuorumRequest(Request, tag="quorum"):
  request_id: RequestId
  wire_member: MemberWire = msgspec.field(name="member")
  view: Annotated[str, Meta(max_length=_MAX_VIEW)] = ""
  ask: RequestId | None = None   # the first request id of the member's ask (its resends repeat it)
  held: RequestId | None = None  # how many members the view it holds has (None: not said)
  # what it must agree on with the job (None: an older client)
  wire_terms: TermsWire | None = msgspec.field(default=None, name="terms")

  def __post_init__(self) -> None:
    _printable("quorum", view=self.view)

  @property
  def member(self) -> Member:
    return self.wire_member.to_member()

  @property
  def terms(self) -> Terms | None:
    return None if self.wire_terms is None else self.wire_terms.to_terms()


class Failed(Request, tag="failed"):
  """A member's report that its attempt in quorum ``q`` failed: why, and the groups
  that failure shows to be out of the attempt (a closed stream, a refused connection).
  The reason is free text the lighthouse logs and relays to every member: escaped."""
  group: Name
  q: QuorumId
  why: Annotated[str, Meta(max_length=_MAX_WHY)]
  blame: Annotated[tuple[Name, ...], Meta(max_length=_MAX_BLAME)]

  def __post_init__(self) -> None:
    _printable("failed", group=self.group, q=self.q, blame=self.blame)
    msgspec.structs.force_setattr(self, "why", shown(self.why))


class Status(Request, tag="status"):
  request_id: RequestId | None = None


REQUESTS = _schema.table(Heartbeat, Ready, QuorumRequest, Status, Failed, Leave)
AnyRequest = Union[Heartbeat, Ready, QuorumRequest, Status, Failed, Leave]
# a field of an array-like Struct is reported by its position: named here
_POSITIONS = {"member": MemberWire.__struct_fields__,
              **{"terms" + (f".{k}" if k else ""): v for k, v in _terms.POSITIONS.items()}}


def parse(header: Any) -> AnyRequest:
  """The request ``header`` (an opened, verified message header) stands for."""
  if not isinstance(header, dict):
    raise errors.InvalidArgumentError(f"a message header must be a map, got {type(header).__name__}")
  op = header.get("op")
  cls = REQUESTS.get(op) if isinstance(op, str) else None
  if cls is None:
    raise errors.InvalidArgumentError(
        f"unknown op {_schema.brief(op)}: the lighthouse handles {sorted(REQUESTS)}")
  try:
    return msgspec.convert(header, cls)
  except msgspec.ValidationError as e:
    raise _needs(op, header, e) from None


def request_id_of(header: Any) -> int | None:
  """The header's request id if it is a valid one (to answer a refusal with), else None."""
  rid = header.get("request_id") if isinstance(header, dict) else None
  return rid if type(rid) is int and 0 <= rid <= INT64 else None


def _needs(op: str, header: dict[str, Any], e: msgspec.ValidationError) -> errors.InvalidArgumentError:
  """``'op' needs FIELD (what it must be), got VALUE``: msgspec's ``e`` in the words
  members and the lighthouse's log have used, an array's position named by its field."""
  text = str(_schema.refused(e, header, "", tail="", positions=_POSITIONS)).removeprefix(": ")
  if text.startswith("field "):
    where, _, why = text[len("field "):].partition(" is refused: ")
    path, _, got = where.partition("=")
    return errors.InvalidArgumentError(f"{op!r} needs {path} ({why})"
                                       + (f", got {got}" if got else ""))
  missing = text.strip().removeprefix("lacks the required field ")
  if missing != text.strip():
    return errors.InvalidArgumentError(f"{op!r} needs {missing.strip(chr(39))} (it is missing)")
  return errors.InvalidArgumentError(f"{op!r} needs {text.strip()}")
