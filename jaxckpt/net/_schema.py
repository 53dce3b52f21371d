"""The one way jaxckpt declares what crosses its sockets: msgspec Structs whose
fields carry their bounds (``msgspec.Meta``), tagged by their ``op``, checked
once, when a sealed header is decoded (:func:`decode`), never again by hand.

The agent's requests (:mod:`jaxckpt.agent._requests`) and the lighthouse's
(:mod:`jaxckpt.ft._requests`) are declared with the bounded types below; the
sealing and framing stay :mod:`jaxckpt.net._wire`'s: a Struct is what a sealed
header carries. What a type cannot say (a cross-field rule, printable text) is
the Struct's ``__post_init__``, which msgspec runs while it decodes (and when a
sender builds one): it raises InvalidArgumentError.

>>> class Ping(Message, tag="ping"):
...   step: Step
>>> decode({"op": "ping", "step": 3}, {"ping": Ping}, "request")
Ping(step=3)
>>> decode({"op": "ping", "step": -1}, {"ping": Ping}, "request")
Traceback (most recent call last):
...
jaxckpt.errors.InvalidArgumentError: request 'ping': field step=-1 is refused: Expected `int` >= 0; nothing was applied
>>> encode(Ping(step=3))
{'op': 'ping', 'step': 3}
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, ClassVar, Mapping, TypeVar

import msgspec
import msgspec.inspect
from msgspec import Meta

from jaxckpt import errors

# -- the bounded types every message is made of -----------------------------------

INT64 = 2**63 - 1
#: A step number.
Step = Annotated[int, Meta(ge=0, le=INT64)]
#: A size in bytes.
Bytes = Annotated[int, Meta(ge=0, le=INT64)]
#: A process id (of the machine it came from).
Pid = Annotated[int, Meta(ge=1, le=2**31 - 1)]
#: A slot, a process index, a host id.
Index = Annotated[int, Meta(ge=0, le=2**20)]
#: A duration a request may ask for (a timeout, a poll).
Secs = Annotated[float, Meta(ge=1e-6, le=1e7)]
#: A 64-bit digest: msgpack carries none above 2**64 - 1 (msgspec bounds only int64);
#: a Struct given one from elsewhere checks it with :func:`check_u64`.
Digest = Annotated[int, Meta(ge=0)]
U64 = 2**64 - 1
#: A directory or a run's name: text a path is made of.
PathText = Annotated[str, Meta(min_length=1, max_length=4096)]

T = TypeVar("T", bound="Message")


class _Tag:
  """``cls.op`` and ``message.op``: the Struct's tag (declared once, in its class line)."""

  def __get__(self, obj: Any, owner: type) -> str:
    return owner.__struct_config__.tag


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
  """A message: its fields, and its ``op`` (the Struct's tag: ``Ping.op == "ping"``)."""

  op: ClassVar[str] = _Tag()  # type: ignore[assignment]


def check_u64(**named: int) -> None:
  """InvalidArgumentError naming the first of ``named`` above 2**64 - 1 (see ``Digest``)."""
  for name, value in named.items():
    if value > U64:
      raise errors.InvalidArgumentError(f"{name}={value} is above 2**64 - 1")


def table(*classes: type[T]) -> dict[str, type[T]]:
  """The messages ``classes`` by their op (a tagged union, looked up by its tag)."""
  out = {cls.op: cls for cls in classes}
  if len(out) != len(classes):
    raise TypeError(f"two messages share an op among {[c.__name__ for c in classes]}")
  return out


def decode(header: Mapping[str, Any], by_op: Mapping[str, type[T]], what: str, *,
           unknown_op: Callable[[Any], str] | None = None) -> T:
  """The message of ``by_op`` that an opened header (msgpack's dict) carries, every
  field of it checked against its type and bounds; InvalidArgumentError naming the
  field, what it must be and what came (``unknown_op(op)`` words an op ``by_op``
  lacks)."""
  op = header.get("op") if isinstance(header, Mapping) else None
  cls = by_op.get(op) if isinstance(op, str) else None
  if cls is None:
    raise errors.InvalidArgumentError(
        unknown_op(op) if unknown_op is not None else f"unknown {what} op={op!r}")
  try:
    return msgspec.convert(header, cls)
  except msgspec.ValidationError as e:
    raise refused(e, header, f"{what} {op!r}") from None


def encode(message: msgspec.Struct) -> dict[str, Any]:
  """The header ``message`` travels as (its fields, and its op if it is a Message)."""
  return msgspec.to_builtins(message)


def fields(message: msgspec.Struct) -> dict[str, Any]:
  """``message``'s fields by name, as they are (nested Structs stay Structs)."""
  return {name: getattr(message, name) for name in message.__struct_fields__}


def unbounded(cls: type[msgspec.Struct]) -> list[str]:
  """The fields of ``cls`` (``op.field``, nested ones dotted) whose values its schema does
  not bound: a number without both ends of its range, text without a length or pattern."""
  return _unbounded(msgspec.inspect.type_info(cls), getattr(cls, "op", None) or cls.__name__)


def _unbounded(t: Any, where: str) -> list[str]:
  ti = msgspec.inspect
  if isinstance(t, ti.UnionType):
    return [w for u in t.types for w in _unbounded(u, where)]
  if isinstance(t, (ti.IntType, ti.FloatType)):
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    return [] if lo is not None and hi is not None else [where]
  if isinstance(t, ti.StrType):
    return [] if t.max_length is not None or t.pattern is not None else [where]
  if isinstance(t, ti.DictType):
    return _unbounded(t.key_type, where + "{key}") + _unbounded(t.value_type, where + "{}")
  if isinstance(t, (ti.ListType, ti.VarTupleType)):
    return _unbounded(t.item_type, where + "[]")
  if isinstance(t, ti.TupleType):
    return [w for u in t.item_types for w in _unbounded(u, where + "[]")]
  if isinstance(t, ti.StructType):
    return [w for f in t.fields for w in _unbounded(f.type, f"{where}.{f.name}")]
  return []


_AT = re.compile(r"(.*) - at `\$(.*)`$", re.S)
_KEY = re.compile(r"(.*) - at `key` in `\$(.*)`$", re.S)
_WHOLE = ((r"Object contains unknown field `(.*)`", "has no field"),
          (r"Object missing required field `(.*)`", "lacks the required field"))
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[(.*?)\]")


def refused(e: msgspec.ValidationError, given: Any, what: str, *,
            tail: str = "; nothing was applied",
            positions: Mapping[str, tuple[str, ...]] | None = None) -> errors.InvalidArgumentError:
  """InvalidArgumentError for msgspec's ``e`` on ``given``: the field (its path) and the
  value that came, then msgspec's words for what it must be. ``positions`` names the
  fields of array-like Structs by the path they sit at ("" the whole; "terms", ...):
  msgspec counts them (``terms[2]``), the message names them (``terms.averaging``)."""
  text = str(e)
  key = _KEY.fullmatch(text)
  if key is not None:                           # a mapping's key
    return errors.InvalidArgumentError(f"{what}: field {key.group(2).lstrip('.')} has a key "
                                       f"that is refused: {key.group(1)}{tail}")
  m = _AT.fullmatch(text)
  if m is None:                     # the whole message: a field missing or unknown
    for pattern, says in _WHOLE:
      got = re.fullmatch(pattern, text)
      if got:
        return errors.InvalidArgumentError(f"{what} {says} {got.group(1)!r}{tail}")
    return errors.InvalidArgumentError(f"{what}: {text}{tail}")
  why, path = m.groups()
  value, found, named = given, True, ""
  for name, index, key in _STEP.findall(path):
    fields = (positions or {}).get(named)
    if index and fields is not None and int(index) < len(fields):
      named = f"{named}.{fields[int(index)]}".lstrip(".")
    else:
      named += f".{name}" if name else f"[{index or key}]"
      named = named.lstrip(".")
    if found:
      try:
        value = value[int(index)] if index else value[name or _key(key)]
      except (KeyError, IndexError, TypeError, ValueError):
        found = False
  shown = f"={brief(value)}" if found else ""
  return errors.InvalidArgumentError(f"{what}: field {named or '(the whole)'}{shown} is "
                                     f"refused: {why}{tail}")


def _key(text: str) -> Any:
  return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == "'" else text


def brief(value: Any) -> str:
  """``value``'s repr, cut to 80 characters (a value that came: data, shown briefly)."""
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."
