"""Every request a snapshot agent takes, one frozen dataclass each: the one table
that the trainer's client (``agent/client.py``, ``agent/_parity.py``, ``jaxckpt
agent ...``) and the agent's server (``agent/_server.py``) share.

A request travels as its fields and its ``op`` in a sealed message
(:mod:`jaxckpt.net._wire`); :func:`decode` turns a header back into its request,
refusing an unknown op, a missing or unknown field, or a field of the wrong
kind, and the server finds its handler by the request's type
(``_server.HANDLERS``): ``Reserve`` is handled by ``Agent.op_reserve``, and so
on for each (the handler of ``X`` is ``Agent.op_`` + ``X.op``).

>>> decode(encode(Reserve(pid=7, step=3, nbytes=64)))
Reserve(pid=7, step=3, nbytes=64)
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, Union

from jaxckpt import errors


@dataclasses.dataclass(frozen=True)
class Request:
  """A request to an agent; subclasses name their ``op``."""

  op: ClassVar[str] = ""


def _request(op: str):
  def wrap(cls):
    cls.op = op
    return dataclasses.dataclass(frozen=True)(cls)
  return wrap


# -- a trainer and its agent ----------------------------------------------------

@_request("hello")
class Hello(Request):
  """A trainer takes the lease and tells its options (persist, parity)."""
  pid: int
  max_snapshots: int | None = None
  limit_bytes: int | None = None
  persist: dict | None = None
  parity: dict | None = None


@_request("reserve")
class Reserve(Request):
  """A free slot of ``nbytes`` for ``step`` (``index`` None in the reply: none free)."""
  pid: int
  step: int
  nbytes: int


@_request("written")
class Written(Request):
  """Shards ``[offset, nbytes, checksum]`` of slot ``index`` are written: verify them early."""
  index: int
  step: int
  shards: list


@_request("commit")
class Commit(Request):
  """Slot ``index`` holds ``step``: verify its span table and make it visible."""
  index: int
  manifest: str
  step: int
  nbytes: int
  spans: list
  process: list
  persist_attempt: str | None = None


@_request("abort")
class Abort(Request):
  index: int


@_request("discard")
class Discard(Request):
  """Forget ``step`` and fence its persists (``persisting`` in the reply while one runs)."""
  step: int


@_request("persisted")
class Persisted(Request):
  """The persist status (and, with ``errors``, the persist errors since the last ask)."""
  errors: bool = True


@_request("bye")
class Bye(Request):
  """Trainer ``pid`` closed its manager: it gives up the lease and its pins."""
  pid: int


# -- reading a step ----------------------------------------------------------------

@_request("steps")
class Steps(Request):
  pass


@_request("held")
class Held(Request):
  pass


@_request("open")
class Open(Request):
  """Pin ``step`` for reader ``pid`` (its slot file and manifest in the reply)."""
  pid: int
  step: int


@_request("close")
class Close(Request):
  pid: int
  step: int
  index: int | None = None


@_request("manifest")
class Manifest(Request):
  step: int


# -- the job's agents, parity ------------------------------------------------------

@_request("peers")
class Peers(Request):
  """The job's current agents by host id (their address records); with ``merge``,
  only the hosts named change (a host's agent was replaced)."""
  peers: dict
  merge: bool = False


@_request("peer_manifest")
class PeerManifest(Request):
  step: int


@_request("parity_done")
class ParityDone(Request):
  """A group peer's parity thread says: my parity of ``step`` is done (host ``peer``,
  over its snapshot whose manifest has ``digest``)."""
  step: int
  peer: int
  digest: str


@_request("parity_status")
class ParityStatus(Request):
  pass


@_request("parity_info")
class ParityInfo(Request):
  step: int


# -- the agent itself --------------------------------------------------------------

@_request("status")
class Status(Request):
  pass


@_request("stop")
class Stop(Request):
  pass


# Every request class above, by op: a new request is taken once it is declared.
REQUESTS: dict[str, type[Request]] = {cls.op: cls for cls in Request.__subclasses__()}


def of(op: str, **fields: Any) -> Request:
  """The request ``op`` with ``fields`` (InvalidArgumentError if it is no such request)."""
  return decode({"op": op, **fields})


def encode(req: Request) -> dict[str, Any]:
  """What a request's sealed header carries."""
  return {"op": req.op, **{f.name: getattr(req, f.name) for f in dataclasses.fields(req)}}


def decode(header: dict[str, Any]) -> Request:
  """The request a header carries; InvalidArgumentError naming what is wrong."""
  header = dict(header)
  op = header.pop("op", None)
  cls = REQUESTS.get(op) if isinstance(op, str) else None
  if cls is None:
    raise errors.InvalidArgumentError(f"unknown request op={op!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(header) - set(fields))
  if unknown:
    raise errors.InvalidArgumentError(f"request {op!r} has no fields {unknown}")
  hints = _hints(cls)
  for name, value in header.items():
    if not _fits(value, hints[name]):
      raise errors.InvalidArgumentError(
          f"request {op!r}: field {name}={value!r} is not a {hints[name]}")
  try:
    return cls(**header)
  except TypeError as e:            # a required field missing
    raise errors.InvalidArgumentError(f"request {op!r}: {e}") from None


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _fits(value: Any, hint: Any) -> bool:
  if typing.get_origin(hint) in (Union, types.UnionType):
    return any(_fits(value, h) for h in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, hint)
