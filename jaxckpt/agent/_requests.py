"""Every request a snapshot agent takes, one msgspec Struct each (see
:mod:`jaxckpt.net._schema`): the one table that the trainer's client
(``agent/trainer/client.py``, ``agent/_parity_*.py``, ``jaxckpt agent ...``) and the
agent's server (``agent/server/_server.py``) share.

A request's fields carry their bounds (``Step``, ``Pid``, ``Secs``, ...; a
``__post_init__`` says what a type cannot: a cross-field rule), and its ``op``
is its tag. It travels as its fields and its ``op`` in a sealed message
(:mod:`jaxckpt.net._wire`); :func:`decode` turns a header back into its request,
every field checked once, there: an unknown op, a missing, unknown or mistyped
field, or a value out of its range is refused (InvalidArgumentError naming the
field and what came), so a caller holding the secret cannot make an agent apply
a value out of range either. The server finds its handler by the request's
type (``_server.HANDLERS``): ``Reserve`` is handled by ``Agent.op_reserve``,
and so on for each (the handler of ``X`` is ``Agent.op_`` + ``X.op``).

Each request declares its reply (``Reserve.Reply``; ``Done`` where the reply
only says it was applied), also its type parameter, so a client's call is typed
(``client.call(Reserve(...))`` returns a ``Reserve.Reply``): the handler returns
one, it travels as its fields, and the client gets it back through
:func:`decode_reply`, which refuses a missing or mistyped field as an error naming
the agent (and leaves out a field it does not know: a newer agent's).

>>> decode(encode(Reserve(pid=7, step=3, nbytes=64)))
Reserve(pid=7, step=3, nbytes=64)
>>> decode_reply(Reserve, {"ok": True, "index": 2, "path": "/dev/shm/s2", "size": 64}, "agent", "ipc://a")
ReserveReply(index=2, path='/dev/shm/s2', size=64, fresh=False, note=None)
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Generic, TypeVar, Union

import msgspec
from msgspec import Meta

from jaxckpt import errors
from jaxckpt.host._persist import PersistError, PersistStatus
from jaxckpt.net import _schema
from jaxckpt.net._schema import INT64, Bytes, Index, PathText, Pid, Secs, Step

#: The most snapshots one agent keeps (each is a whole state in host memory).
MAX_SNAPSHOTS = 1024

Owner = Annotated[str, Meta(min_length=1, max_length=200)]     # the manager asking
# a persist's attempt id: it names storage keys
Attempt = Annotated[str, Meta(pattern=r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")]
Reader = Annotated[int, Meta(ge=-2**62 + 1, le=-1)]             # a leased pin's id
HostKey = Annotated[str, Meta(pattern=r"\A[0-9]{1,7}\Z")]       # a process index, as a map's key


class Reply(msgspec.Struct, frozen=True, kw_only=True):
  """An agent's reply: its fields, read as attributes (``reply.index``), or as a
  mapping (``reply["index"]``, ``{**reply}``) by tools that print or merge one."""

  def __getitem__(self, name: str) -> Any:
    if name not in self.__struct_fields__:
      raise KeyError(name)
    return getattr(self, name)

  def keys(self) -> tuple[str, ...]:
    return self.__struct_fields__


class Done(Reply):
  """The reply of a request that only says it was applied."""


R = TypeVar("R", bound=Reply)


class Request(_schema.Message, Generic[R], frozen=True, kw_only=True, forbid_unknown_fields=True):
  """A request to an agent; a subclass names its ``op`` (its tag) and its ``Reply``
  (also its type parameter: what a client's ``call`` of it returns)."""

  Reply: ClassVar[type[Reply]] = Done


# -- what a trainer tells its agent at hello ----------------------------------------

class PersistOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
  """``host._persist.PersistConfig`` on the wire (its fields and defaults)."""
  directory: PathText
  interval_steps: Annotated[int, Meta(ge=1, le=INT64)]
  max_to_keep: Annotated[int, Meta(ge=1, le=INT64)] | None = None
  timeout_secs: Secs = 300.0
  hold_until_committed: bool = False


class ParityOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
  """``agent._parity_config.ParityConfig`` on the wire (its fields and defaults)."""
  group_size: Annotated[int, Meta(ge=2, le=255)]
  parity: Annotated[int, Meta(ge=1, le=254)]
  timeout_secs: Secs = 300.0
  poll_secs: Annotated[float, Meta(ge=1e-6, le=60.0)] = 0.005
  sub_block_bytes: Annotated[int, Meta(ge=1, le=1 << 40)] = 4 << 20

  def __post_init__(self) -> None:
    if not self.parity < self.group_size:
      raise errors.InvalidArgumentError(f"parity={self.parity} must be in [1, group_size - 1] "
                       f"(group_size={self.group_size})")


class AgentAddress(msgspec.Struct, frozen=True, kw_only=True):
  """An agent's address record (its address file, as the job published it)."""
  tcp: Annotated[str, Meta(pattern=r"\Atcp://", max_length=4096)]
  pid: Pid | None = None
  job: Annotated[str, Meta(max_length=4096)] | None = None
  host: Index | None = None
  ipc: Annotated[str, Meta(max_length=4096)] | None = None
  bulk: Annotated[str, Meta(max_length=4096)] | None = None


#: A job's process count.
Count = Annotated[int, Meta(ge=1, le=2**31)]


# -- a trainer and its agent ----------------------------------------------------

class HelloReply(Reply):
  pid: int
  steps: list[Step]
  slots: int
  generation: int


class Hello(Request[HelloReply], tag="hello"):
  """A trainer takes the lease and tells its options (persist, parity)."""
  Reply = HelloReply
  pid: Pid
  max_snapshots: Annotated[int, Meta(ge=1, le=MAX_SNAPSHOTS)] | None = None
  limit_bytes: Annotated[int, Meta(ge=1, le=INT64)] | None = None
  persist: PersistOptions | None = None
  parity: ParityOptions | None = None
  owner: Owner | None = None      # the manager asking (None: a bare store, known by its pid)
  # the run it saves (its directory; "": none; None: any)
  run: Annotated[str, Meta(max_length=4096)] | None = None


class ReserveReply(Reply):
  index: int | None
  path: str | None = None
  size: int | None = None
  fresh: bool = False
  note: str | None = None


class Reserve(Request[ReserveReply], tag="reserve"):
  """A free slot of ``nbytes`` for ``step`` (``index`` None in the reply: none free;
  ``fresh``: its file is new and sparse, the trainer allocates its memory; ``note``:
  why steps held for their persists may take the loop's slots, for the trainer's log)."""
  Reply = ReserveReply
  pid: Pid
  step: Step
  nbytes: Bytes


class PreallocateReply(Reply):
  slots: list[tuple[Index, str, Bytes, bool]]   # [index, path, size, fresh] of each free slot


class Preallocate(Request[PreallocateReply], tag="preallocate"):
  """Size every free slot for snapshots of ``nbytes`` now (``prepare()``)."""
  Reply = PreallocateReply
  nbytes: Bytes


class CommitReply(Reply):
  steps: list[Step]
  persist: PersistStatus | None         # None: the agent persists nothing
  persist_errors: list[PersistError]


class Commit(Request[CommitReply], tag="commit"):
  """Slot ``index`` holds ``step`` (``nbytes`` of it): make it visible. ``manifest``
  is its manifest's JSON (the agent parses it once, on first use); ``process``
  is [index, count] of the saving process."""
  Reply = CommitReply
  index: Index
  manifest: str
  step: Step
  nbytes: Bytes
  process: Annotated[list[Index], Meta(min_length=2, max_length=2)]
  persist_attempt: Attempt | None = None

  def __post_init__(self) -> None:
    if not self.process[0] < self.process[1]:
      raise errors.InvalidArgumentError(f"process={self.process!r} must be [index, count], index < count")


class Abort(Request[Done], tag="abort"):
  index: Index


class DiscardReply(Reply):
  discarded: bool
  persisting: bool
  deleted_by: int | None = None


class Discard(Request[DiscardReply], tag="discard"):
  """Forget ``step`` and fence its persists (``persisting`` in the reply while one runs),
  as the delete of host ``by`` (of the job's hosts, this one or another: ``deleted_by``
  in the reply names the host whose delete came first, if one did)."""
  Reply = DiscardReply
  step: Step
  by: Index | None = None


RollbackId = Annotated[str, Meta(pattern=r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")]


class RollbackRecord(msgspec.Struct, kw_only=True):
  """A rollback an agent recorded: its steps, the run it was of, the agents it was sent to."""
  steps: Annotated[list[Step], Meta(max_length=1 << 16)]
  run: Annotated[str, Meta(max_length=4096)] | None = None
  agents: Annotated[list[Annotated[str, Meta(max_length=4096)]], Meta(max_length=1 << 16)] = []


class RollbackReply(Reply):
  applied: bool                  # this request discarded them (False: applied before, or a query)
  persisting: Annotated[list[Step], Meta(max_length=1 << 16)]   # its steps still persisting (fenced)
  rollbacks: Annotated[dict[RollbackId, RollbackRecord], Meta(max_length=1 << 10)]  # every one recorded


class Rollback(Request[RollbackReply], tag="rollback"):
  """Rollback ``id`` of the job's run ``run`` (a new timeline): discard every step of
  ``steps`` at once and fence their persists, as the delete of host ``by``, and record
  it with the agents it was sent to (``agents``: their tcp addresses), so that a
  relaunch of the run finds it and completes it on those that missed it (never on an
  agent started since: it holds no step of the abandoned timeline). Applied once: the
  same ``id`` again only says which of its steps still persist (so a step of the new
  timeline with a number of the old one is never discarded by it). Without ``id``:
  only the records (``rollbacks``)."""
  Reply = RollbackReply
  id: RollbackId | None = None
  steps: Annotated[list[Step], Meta(max_length=1 << 16)] = []
  by: Index | None = None
  run: Annotated[str, Meta(max_length=4096)] | None = None
  agents: Annotated[list[Annotated[str, Meta(max_length=4096)]], Meta(max_length=1 << 16)] = []

  def __post_init__(self) -> None:
    if self.id is None and (self.steps or self.agents or self.run is not None):
      raise errors.InvalidArgumentError(
          f"a rollback of steps {self.steps[:8]} names no id: without one it is only a query "
          "of the records, and would discard nothing; give the rollback's id")


class PersistedReply(Reply):
  persist: PersistStatus | None         # None: the agent persists nothing
  persist_errors: list[PersistError]


class Persisted(Request[PersistedReply], tag="persisted"):
  """The persist status (and, with ``errors``, the persist errors since the last ask)."""
  Reply = PersistedReply
  errors: bool = True


class Bye(Request[Done], tag="bye"):
  """Trainer ``pid`` closed its manager (``owner``): it gives up the lease and its pins."""
  pid: Pid
  owner: Owner | None = None


# -- reading a step ----------------------------------------------------------------

class StepsReply(Reply):
  steps: list[Step]
  free_slots: int
  protected: int | None


class Steps(Request[StepsReply], tag="steps"):
  Reply = StepsReply


class HeldReply(Reply):
  held: list[tuple[Step, Index, Count]]   # [step, saving process index, process count] each


class Held(Request[HeldReply], tag="held"):
  Reply = HeldReply


class OpenReply(Reply):
  path: str
  manifest: str
  index: int
  size: int
  reader: int | None = None


class Open(Request[OpenReply], tag="open"):
  """Pin ``step`` for reader ``pid`` (its slot file and manifest in the reply). A
  reader on another machine (over tcp) holds its pin for ``lease_secs`` (the
  agent's default when not given), renewed by its reads of the step: its pid
  means nothing on the agent's machine, so the pin never depends on it; the
  reply's ``reader`` names the pin to ``close``."""
  Reply = OpenReply
  pid: Pid
  step: Step
  lease_secs: Annotated[float, Meta(ge=1e-3, le=3600.0)] | None = None


class Close(Request[Done], tag="close"):
  """Unpin what ``open`` pinned; ``lend``: the reader keeps views of the slot's
  memory (restored arrays), so it is never written again."""
  pid: Pid
  step: Step
  index: Index | None = None
  lend: bool = False
  reader: Reader | None = None       # a leased pin (``Open.Reply.reader``)


class ManifestReply(Reply):
  manifest: str


class Manifest(Request[ManifestReply], tag="manifest"):
  Reply = ManifestReply
  step: Step


# -- the job's agents, parity ------------------------------------------------------

class Peers(Request[Done], tag="peers"):
  """The job's current agents by process index (their address records); with ``merge``,
  only the processes named change (a process's agent was replaced)."""
  peers: dict[HostKey, AgentAddress]
  merge: bool = False

  def __post_init__(self) -> None:
    big = [h for h in self.peers if int(h) > 2**20]
    if big:
      raise errors.InvalidArgumentError(f"peers names process {big[0]}, not a process index in [0, {2**20}]")


class PeerManifestReply(Reply):
  manifest: str | None
  newest: int | None


class PeerManifest(Request[PeerManifestReply], tag="peer_manifest"):
  Reply = PeerManifestReply
  step: Step


class ParityDone(Request[Done], tag="parity_done"):
  """A group peer's parity thread says: my parity of ``step`` is done (host ``peer``,
  over its snapshot whose manifest has ``digest``)."""
  step: Step
  peer: Index
  digest: Annotated[str, Meta(max_length=64)]    # xxh3_64 hex (_parity_worker._digest)


class PeerHeldReply(Reply):
  """The job's whole step as the job's hub agent knows it (None: none known, or it is
  not the hub), and whether its trainers committed it since the map was published."""
  whole: Step | None = None
  fresh: bool = False


class PeerHeld(Request[PeerHeldReply], tag="peer_held"):
  """A peer agent of the job says which steps it holds now (it serves the job's process
  ``peer``), and which of them its current trainers committed (``fresh``: since the job's
  map of agents was last published, at the trainers' start), to the job's hub agent: a
  host drops a step only once a newer one is held by every host, of the same run
  (``agent._job_keep``); the reply says the job's whole step."""
  Reply = PeerHeldReply
  peer: Index
  steps: Annotated[list[Step], Meta(max_length=4 * MAX_SNAPSHOTS)]
  fresh: Annotated[list[Step], Meta(max_length=4 * MAX_SNAPSHOTS)] = []


class ParityStatusReply(Reply):
  # [step, state, secs, error, process count, the process that saved it here, group_size,
  # parity] each: a list, not a tuple type, since an older agent sends only the first five
  steps: list[list[Any]]
  bytes: int
  config: dict[str, Any] | None   # ParityConfig.to_obj(): read by _parity_config, which checks it


class ParityStatus(Request[ParityStatusReply], tag="parity_status"):
  Reply = ParityStatusReply


class ParityInfoReply(Reply):
  process_count: int
  config: dict[str, Any]    # ParityConfig.to_obj() of the parity held: _parity_config reads it
  manifests: dict[Any, str]   # group host -> its manifest (JSON); keys as the worker keeps them
  checksums: list[list[Any]]  # each stripe's piece checksums, as the parity worker records them
  stripes: list[int]
  index: int | None = None   # the process that saved the step here (None: an older agent)


class ParityInfo(Request[ParityInfoReply], tag="parity_info"):
  Reply = ParityInfoReply
  step: Step


# -- the agent itself --------------------------------------------------------------

class SlotStatus(Reply):
  """One slot as ``status`` shows it (read as attributes, or as a mapping)."""
  index: Index
  state: str
  step: Step | None
  bytes: Bytes
  readers: int


class LeaseStatus(Reply):
  """Who holds an agent's lease: the trainer's pid, its manager, the lease's generation."""
  pid: int
  owner: str | None
  generation: int


class StatusReply(Reply):
  pid: int
  job: str
  host: int
  steps: list[Step]
  slots: list[SlotStatus]
  bytes: int
  parity_bytes: int
  trainers: list[int]
  max_snapshots: int
  limit_bytes: int
  lease: LeaseStatus | None
  served_bytes: int = 0        # snapshot and parity bytes sent to other processes so far
  idle_secs: float | None = None           # since its last use (None: a trainer uses it)
  idle_timeout_secs: float | None = None   # it exits once idle that long


class Status(Request[StatusReply], tag="status"):
  Reply = StatusReply


class Stop(Request[Done], tag="stop"):
  pass


class JobViewReply(Reply):
  # process index (str) -> address record: kept as the dicts the job's map publishes
  # (AgentAddress checks one where it is taken in: op_peers)
  peers: dict[str, dict[str, Any]]
  # the PersistConfig a trainer gave (directory, interval_steps), as a mapping: PersistOptions
  # forbids fields it does not know, and a newer agent's may add one (only shown: jobs.py)
  persist: dict[str, Any] | None
  lag_secs: float | None       # since the oldest pending persist's step was committed
  directories: list[str] = msgspec.field(default_factory=list)   # every one it persists to


class JobView(Request[JobViewReply], tag="job_view"):
  """What ``jaxckpt status`` adds to ``status``: the job's agents as this one was told of
  them (by process index, as the job published them), where it persists, and how long the oldest
  step due for storage has waited (on the agent's clock: a caller's clock may differ)."""
  Reply = JobViewReply


# Every request, by op (the tagged union of requests): a new request is taken once
# it is listed here.
REQUESTS: dict[str, type[Request]] = _schema.table(
    Hello, Reserve, Preallocate, Commit, Abort, Discard, Rollback, Persisted, Bye, Steps, Held,
    Open, Close, Manifest, Peers, PeerManifest, PeerHeld, ParityDone, ParityStatus, ParityInfo, Status,
    Stop, JobView)
AnyRequest = Union[tuple(REQUESTS.values())]      # (for readers and type checkers)


def encode(req: Request) -> dict[str, Any]:
  """What a request's sealed header carries: its op and its fields."""
  return _schema.encode(req)


def decode(header: dict[str, Any]) -> Request:
  """The request a header carries, every field checked against its type and bounds;
  InvalidArgumentError naming what is wrong."""
  return _schema.decode(header, REQUESTS, "request")


def encode_reply(reply: Reply) -> dict[str, Any]:
  """What a reply's frame carries (beside ``ok``)."""
  return msgspec.to_builtins(reply)


def decode_reply(request: type[Request[R]], header: dict[str, Any], who: str, where: str) -> R:
  """``request``'s reply from the fields of an ``ok`` reply frame; one with a
  missing or mistyped field is an AgentUnavailableError naming the agent. A field
  this version does not know is left out (a newer agent may add one: a sidecar
  agent outlives its trainer's upgrade)."""
  try:
    return msgspec.convert(header, request.Reply)
  except msgspec.ValidationError as e:
    why = _schema.refused(e, header, f"the reply to {request.op!r}", tail="")
    raise errors.AgentUnavailableError(
        f"{who} at {where} answered {request.op!r} with a malformed reply ({why}); is it an "
        "agent of this jaxckpt version?") from None
