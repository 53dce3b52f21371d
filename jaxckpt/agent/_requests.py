"""Every request a snapshot agent takes, one frozen dataclass each: the one table
that the trainer's client (``agent/client.py``, ``agent/_parity.py``, ``jaxckpt
agent ...``) and the agent's server (``agent/_server.py``) share.

A request travels as its fields and its ``op`` in a sealed message
(:mod:`jaxckpt.net._wire`); :func:`decode` turns a header back into its request,
refusing an unknown op, a missing or unknown field, or a field of the wrong
kind, and the server finds its handler by the request's type
(``_server.HANDLERS``): ``Reserve`` is handled by ``Agent.op_reserve``, and so
on for each (the handler of ``X`` is ``Agent.op_`` + ``X.op``).

Each request declares its reply (``Reserve.Reply``; ``Done`` where the reply
only says it was applied): the handler returns one, it travels as its fields,
and the client gets it back through :func:`decode_reply`, which refuses a
missing or mistyped field as an error naming the agent (and leaves out a field
it does not know: a newer agent's).

>>> decode(encode(Reserve(pid=7, step=3, nbytes=64)))
Reserve(pid=7, step=3, nbytes=64)
>>> decode_reply(Reserve, {"ok": True, "index": 2, "path": "/dev/shm/s2", "size": 64}, "agent", "ipc://a")
Reserve.Reply(index=2, path='/dev/shm/s2', size=64, fresh=False)
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, Union

from jaxckpt import errors


@dataclasses.dataclass(frozen=True)
class Reply:
  """An agent's reply: its fields, read as attributes (``reply.index``), or as a
  mapping (``reply["index"]``, ``{**reply}``) by tools that print or merge one."""

  def __getitem__(self, name: str) -> Any:
    if name not in self.keys():
      raise KeyError(name)
    return getattr(self, name)

  def keys(self) -> list[str]:
    return [f.name for f in dataclasses.fields(self)]


@dataclasses.dataclass(frozen=True)
class Done(Reply):
  """The reply of a request that only says it was applied."""


@dataclasses.dataclass(frozen=True)
class Request:
  """A request to an agent; subclasses name their ``op`` and their ``Reply``."""

  op: ClassVar[str] = ""
  Reply: ClassVar[type[Reply]] = Done


def _request(op: str):
  def wrap(cls):
    cls.op = op
    if "Reply" in cls.__dict__:
      cls.Reply = dataclasses.dataclass(frozen=True)(cls.Reply)
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

  class Reply(Reply):
    pid: int
    steps: list
    slots: int
    generation: int


@_request("reserve")
class Reserve(Request):
  """A free slot of ``nbytes`` for ``step`` (``index`` None in the reply: none free;
  ``fresh``: its file is new and sparse, the trainer allocates its memory)."""
  pid: int
  step: int
  nbytes: int

  class Reply(Reply):
    index: int | None
    path: str | None = None
    size: int | None = None
    fresh: bool = False


@_request("preallocate")
class Preallocate(Request):
  """Size every free slot for snapshots of ``nbytes`` now (``prepare()``)."""
  nbytes: int

  class Reply(Reply):
    slots: list         # [index, path, size, fresh] of each free slot


@_request("commit")
class Commit(Request):
  """Slot ``index`` holds ``step`` (``nbytes`` of it): make it visible."""
  index: int
  manifest: str
  step: int
  nbytes: int
  process: list
  persist_attempt: str | None = None

  class Reply(Reply):
    steps: list
    persist: dict
    persist_errors: list


@_request("abort")
class Abort(Request):
  index: int


@_request("discard")
class Discard(Request):
  """Forget ``step`` and fence its persists (``persisting`` in the reply while one runs)."""
  step: int

  class Reply(Reply):
    discarded: bool
    persisting: bool


@_request("persisted")
class Persisted(Request):
  """The persist status (and, with ``errors``, the persist errors since the last ask)."""
  errors: bool = True

  class Reply(Reply):
    persist: dict
    persist_errors: list


@_request("bye")
class Bye(Request):
  """Trainer ``pid`` closed its manager: it gives up the lease and its pins."""
  pid: int


# -- reading a step ----------------------------------------------------------------

@_request("steps")
class Steps(Request):
  pass

  class Reply(Reply):
    steps: list
    free_slots: int
    protected: int | None


@_request("held")
class Held(Request):
  pass

  class Reply(Reply):
    held: list          # [step, saving process index, process count] each


@_request("open")
class Open(Request):
  """Pin ``step`` for reader ``pid`` (its slot file and manifest in the reply)."""
  pid: int
  step: int

  class Reply(Reply):
    path: str
    manifest: str
    index: int
    size: int


@_request("close")
class Close(Request):
  """Unpin what ``open`` pinned; ``lend``: the reader keeps views of the slot's
  memory (restored arrays), so it is never written again."""
  pid: int
  step: int
  index: int | None = None
  lend: bool = False


@_request("manifest")
class Manifest(Request):
  step: int

  class Reply(Reply):
    manifest: str


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

  class Reply(Reply):
    manifest: str | None
    newest: int | None


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

  class Reply(Reply):
    steps: list         # [step, state, secs, error, process count] each
    bytes: int
    config: dict | None


@_request("parity_info")
class ParityInfo(Request):
  step: int

  class Reply(Reply):
    process_count: int
    config: dict
    manifests: dict     # group host -> its manifest (JSON)
    checksums: list
    stripes: list


# -- the agent itself --------------------------------------------------------------

@_request("status")
class Status(Request):
  pass

  class Reply(Reply):
    pid: int
    job: str
    host: int
    steps: list
    slots: list
    bytes: int
    parity_bytes: int
    trainers: list
    max_snapshots: int
    limit_bytes: int
    lease: dict | None


@_request("stop")
class Stop(Request):
  pass


@_request("job_view")
class JobView(Request):
  """What ``jaxckpt status`` adds to ``status``: the job's agents as this one was told of
  them (by host id, as the job published them), where it persists, and how long the oldest
  step due for storage has waited (on the agent's clock: a caller's clock may differ)."""
  pass

  class Reply(Reply):
    peers: dict                  # host id (str) -> address record
    persist: dict | None         # the PersistConfig a trainer gave (directory, interval_steps)
    lag_secs: float | None       # since the oldest pending persist's step was committed


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
  return _build(cls, header, f"request {op!r}")


def encode_reply(reply: Reply) -> dict[str, Any]:
  """What a reply's frame carries (beside ``ok``)."""
  return {f.name: getattr(reply, f.name) for f in dataclasses.fields(reply)}


def decode_reply(request: type[Request], header: dict[str, Any], who: str, where: str) -> Reply:
  """``request``'s reply from the fields of an ``ok`` reply frame; one with a
  missing or mistyped field is an AgentUnavailableError naming the agent. A field
  this version does not know is left out (a newer agent may add one: a sidecar
  agent outlives its trainer's upgrade)."""
  fields = {k: v for k, v in header.items() if k in _hints(request.Reply)}
  try:
    return _build(request.Reply, fields, f"the reply to {request.op!r}")
  except errors.InvalidArgumentError as e:
    raise errors.AgentUnavailableError(
        f"{who} at {where} answered {request.op!r} with a malformed reply ({e}); is it an "
        "agent of this jaxckpt version?") from None


def _build(cls: type, given: dict[str, Any], what: str) -> Any:
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(given) - set(fields))
  if unknown:
    raise errors.InvalidArgumentError(f"{what} has no fields {unknown}")
  hints = _hints(cls)
  for name, value in given.items():
    if not _fits(value, hints[name]):
      raise errors.InvalidArgumentError(f"{what}: field {name}={value!r} is not a {hints[name]}")
  try:
    return cls(**given)
  except TypeError as e:            # a required field missing
    raise errors.InvalidArgumentError(f"{what}: {e}") from None


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
