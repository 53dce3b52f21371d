"""Every request a snapshot agent takes, one frozen dataclass each: the one table
that the trainer's client (``agent/client.py``, ``agent/_parity_*.py``, ``jaxckpt
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
Reserve.Reply(index=2, path='/dev/shm/s2', size=64, fresh=False, note=None)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
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
  """A request to an agent; subclasses name their ``op`` and their ``Reply``.

  ``bounds`` gives the range of each number field (checked, after its type, by
  :func:`decode`, on both sides: a caller holding the secret cannot make an
  agent apply a value out of range either); ``check`` what bounds cannot say.
  """

  op: ClassVar[str] = ""
  Reply: ClassVar[type[Reply]] = Done
  bounds: ClassVar[dict[str, tuple[float, float]]] = {}

  def check(self) -> None:
    """Raises InvalidArgumentError naming a field that ``bounds`` cannot check."""


def _request(op: str):
  def wrap(cls):
    cls.op = op
    if "Reply" in cls.__dict__:
      cls.Reply = dataclasses.dataclass(frozen=True)(cls.Reply)
    return dataclasses.dataclass(frozen=True)(cls)
  return wrap


# The ranges of what a request may carry.
STEP = (0, 2**63 - 1)
BYTES = (0, 2**63 - 1)
PID = (1, 2**31 - 1)
INDEX = (0, 2**20)          # a slot, a process, a host
#: The most snapshots one agent keeps (each is a whole state in host memory).
MAX_SNAPSHOTS = 1024
SECS = (1e-6, 1e7)


# -- a trainer and its agent ----------------------------------------------------

@_request("hello")
class Hello(Request):
  """A trainer takes the lease and tells its options (persist, parity)."""
  pid: int
  max_snapshots: int | None = None
  limit_bytes: int | None = None
  persist: dict | None = None
  parity: dict | None = None
  owner: str | None = None      # the manager asking (None: a bare store, known by its pid)
  run: str | None = None        # the run it saves (its directory; "": none; None: any)
  bounds = {"pid": PID, "max_snapshots": (1, MAX_SNAPSHOTS), "limit_bytes": (1, BYTES[1])}

  def check(self) -> None:
    _check_owner("hello", self.owner)
    if self.run is not None and len(self.run) > 4096:
      raise errors.InvalidArgumentError(
          f"request 'hello': run is {len(self.run)} characters long; a run is named by its "
          "directory (at most 4096 characters)")
    if self.persist is not None:
      _check_fields("hello", "persist", self.persist, _PERSIST)
    if self.parity is not None:
      _check_fields("hello", "parity", self.parity, _PARITY)
      if not 1 <= self.parity["parity"] < self.parity["group_size"]:
        raise errors.InvalidArgumentError(
            f"request 'hello': parity={self.parity['parity']} must be in [1, group_size - 1] "
            f"(group_size={self.parity['group_size']})")

  class Reply(Reply):
    pid: int
    steps: list
    slots: int
    generation: int


@_request("reserve")
class Reserve(Request):
  """A free slot of ``nbytes`` for ``step`` (``index`` None in the reply: none free;
  ``fresh``: its file is new and sparse, the trainer allocates its memory; ``note``:
  why steps held for their persists may take the loop's slots, for the trainer's log)."""
  pid: int
  step: int
  nbytes: int
  bounds = {"pid": PID, "step": STEP, "nbytes": BYTES}

  class Reply(Reply):
    index: int | None
    path: str | None = None
    size: int | None = None
    fresh: bool = False
    note: str | None = None


@_request("preallocate")
class Preallocate(Request):
  """Size every free slot for snapshots of ``nbytes`` now (``prepare()``)."""
  nbytes: int
  bounds = {"nbytes": BYTES}

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
  bounds = {"index": INDEX, "step": STEP, "nbytes": BYTES}

  def check(self) -> None:
    _check_ints("commit", "process", self.process, INDEX)
    if not (len(self.process) == 2 and self.process[0] < self.process[1]):
      raise errors.InvalidArgumentError(
          f"request 'commit': process={self.process!r} must be [index, count], index < count")
    if self.persist_attempt is not None and not _ATTEMPT.fullmatch(self.persist_attempt):
      raise errors.InvalidArgumentError(
          f"request 'commit': persist_attempt={self.persist_attempt!r} must be 1-128 letters, "
          "digits, '.', '_' or '-' (it names storage keys)")

  class Reply(Reply):
    steps: list
    persist: dict
    persist_errors: list


@_request("abort")
class Abort(Request):
  index: int
  bounds = {"index": INDEX}


@_request("discard")
class Discard(Request):
  """Forget ``step`` and fence its persists (``persisting`` in the reply while one runs),
  as the delete of host ``by`` (of the job's hosts, this one or another: ``deleted_by``
  in the reply names the host whose delete came first, if one did)."""
  step: int
  by: int | None = None
  bounds = {"step": STEP, "by": INDEX}

  class Reply(Reply):
    discarded: bool
    persisting: bool
    deleted_by: int | None = None


@_request("persisted")
class Persisted(Request):
  """The persist status (and, with ``errors``, the persist errors since the last ask)."""
  errors: bool = True

  class Reply(Reply):
    persist: dict
    persist_errors: list


@_request("bye")
class Bye(Request):
  """Trainer ``pid`` closed its manager (``owner``): it gives up the lease and its pins."""
  pid: int
  owner: str | None = None
  bounds = {"pid": PID}

  def check(self) -> None:
    _check_owner("bye", self.owner)


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
  """Pin ``step`` for reader ``pid`` (its slot file and manifest in the reply). A
  reader on another machine (over tcp) holds its pin for ``lease_secs`` (the
  agent's default when not given), renewed by its reads of the step: its pid
  means nothing on the agent's machine, so the pin never depends on it; the
  reply's ``reader`` names the pin to ``close``."""
  pid: int
  step: int
  lease_secs: float | None = None
  bounds = {"pid": PID, "step": STEP, "lease_secs": (1e-3, 3600.0)}

  class Reply(Reply):
    path: str
    manifest: str
    index: int
    size: int
    reader: int | None = None


@_request("close")
class Close(Request):
  """Unpin what ``open`` pinned; ``lend``: the reader keeps views of the slot's
  memory (restored arrays), so it is never written again."""
  pid: int
  step: int
  index: int | None = None
  lend: bool = False
  reader: int | None = None       # a leased pin (``Open.Reply.reader``)
  bounds = {"pid": PID, "step": STEP, "index": INDEX, "reader": (-2**62 + 1, -1)}


@_request("manifest")
class Manifest(Request):
  step: int
  bounds = {"step": STEP}

  class Reply(Reply):
    manifest: str


# -- the job's agents, parity ------------------------------------------------------

@_request("peers")
class Peers(Request):
  """The job's current agents by process index (their address records); with ``merge``,
  only the processes named change (a process's agent was replaced)."""
  peers: dict
  merge: bool = False

  def check(self) -> None:
    for host, info in self.peers.items():
      if not (isinstance(host, str) and host.isdigit() and int(host) <= INDEX[1]
              and isinstance(info, dict) and isinstance(info.get("tcp"), str)
              and info["tcp"].startswith("tcp://")):
        raise errors.InvalidArgumentError(
            f"request 'peers': entry {host!r}: {info!r} is not a host id and an agent's "
            "address record")


@_request("peer_manifest")
class PeerManifest(Request):
  step: int
  bounds = {"step": STEP}

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
  bounds = {"step": STEP, "peer": INDEX}


@_request("parity_status")
class ParityStatus(Request):
  pass

  class Reply(Reply):
    steps: list         # [step, state, secs, error, process count, the process that saved
                        # it here, group_size, parity] each (an older agent: the first five)
    bytes: int
    config: dict | None


@_request("parity_info")
class ParityInfo(Request):
  step: int
  bounds = {"step": STEP}

  class Reply(Reply):
    process_count: int
    config: dict
    manifests: dict     # group host -> its manifest (JSON)
    checksums: list
    stripes: list
    index: int | None = None   # the process that saved the step here (None: an older agent)


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
    served_bytes: int = 0        # snapshot and parity bytes sent to other processes so far
    idle_secs: float | None = None           # since its last use (None: a trainer uses it)
    idle_timeout_secs: float | None = None   # it exits once idle that long


@_request("stop")
class Stop(Request):
  pass


@_request("job_view")
class JobView(Request):
  """What ``jaxckpt status`` adds to ``status``: the job's agents as this one was told of
  them (by process index, as the job published them), where it persists, and how long the oldest
  step due for storage has waited (on the agent's clock: a caller's clock may differ)."""
  pass

  class Reply(Reply):
    peers: dict                  # process index (str) -> address record
    persist: dict | None         # the PersistConfig a trainer gave (directory, interval_steps)
    lag_secs: float | None       # since the oldest pending persist's step was committed
    directories: list = dataclasses.field(default_factory=list)   # every one it persists to


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
  req = _build(cls, header, f"request {op!r}")
  for name, (lo, hi) in cls.bounds.items():
    value = getattr(req, name)
    if value is not None and not lo <= value <= hi:
      raise errors.InvalidArgumentError(
          f"request {op!r}: field {name}={value!r} is out of range [{lo}, {hi}]; nothing "
          "was applied")
  req.check()
  return req


_ATTEMPT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# (type, range or None, required) of the options a hello carries
_PERSIST = {"directory": (str, None, True), "interval_steps": (int, (1, STEP[1]), True),
            "max_to_keep": (int, (1, STEP[1]), False), "timeout_secs": (float, SECS, False),
            "hold_until_committed": (bool, None, False)}
_PARITY = {"group_size": (int, (2, 255), True), "parity": (int, (1, 254), True),
           "timeout_secs": (float, SECS, False), "poll_secs": (float, (1e-6, 60.0), False),
           "sub_block_bytes": (int, (1, 1 << 40), False)}


def _check_fields(op: str, what: str, obj: dict, spec: dict[str, tuple[type, Any, bool]]) -> None:
  """Each field of ``obj`` is one ``spec`` knows, of its type and in its range."""
  unknown = sorted(set(obj) - set(spec))
  missing = sorted(n for n, (_, _, required) in spec.items() if required and n not in obj)
  if unknown or missing:
    raise errors.InvalidArgumentError(
        f"request {op!r}: {what} has unknown fields {unknown} or lacks {missing}")
  for name, value in obj.items():
    kind, bounds, required = spec[name]
    if value is None and not required:
      continue
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          if kind is float else _fits(value, kind))
    if ok and kind is str:
      ok = 0 < len(value) <= 4096
    if not ok or (bounds is not None and not bounds[0] <= value <= bounds[1]):
      raise errors.InvalidArgumentError(
          f"request {op!r}: {what}.{name}={value!r} is not a {kind.__name__}"
          + (f" in [{bounds[0]}, {bounds[1]}]" if bounds else "") + "; nothing was applied")


def _check_owner(op: str, owner: str | None) -> None:
  if owner is not None and not 0 < len(owner) <= 200:
    raise errors.InvalidArgumentError(f"request {op!r}: owner {owner[:40]!r}... is not 1-200 "
                                      "characters")


def _check_ints(op: str, what: str, values: list, bounds: tuple[int, int]) -> None:
  lo, hi = bounds
  if not values or (all(type(v) is int for v in values) and lo <= min(values)
                    and max(values) <= hi):
    return                                  # (a commit carries every shard's: kept fast)
  bad = next(v for v in values if not (_fits(v, int) and lo <= v <= hi))
  raise errors.InvalidArgumentError(
      f"request {op!r}: {what} holds {bad!r}, not an int in [{lo}, {hi}]")


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
