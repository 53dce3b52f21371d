"""The trainer's side of the snapshot agent: find or start it, and a HostStore on it.

The trainer writes shard bytes straight into the agent's shared-memory slot
files (memory-mapped here), then sends only the manifest; no tensor bytes go
through a socket on the local path.

If the agent dies while the trainer runs, the next ``save()`` notices (its pid
is gone), logs a warning, starts a new agent and goes on: the snapshots the
dead agent held are lost, and ``stats.agent_restarts`` counts it. A request
that is not answered within ``request_timeout_secs`` raises
AgentUnavailableError naming the agent; nothing waits forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import subprocess
import sys
import threading
from typing import Any, Iterator, TypeVar

import msgspec

from jaxckpt import errors
from jaxckpt.util import _crash, _wait
from jaxckpt.agent import _paths, _requests
from jaxckpt.agent.trainer._job_agents import JobAgents
from jaxckpt.agent._paths import pid_alive, read_address
from jaxckpt.agent._protocol import Client
from jaxckpt.agent.trainer._repersist import Repersister
from jaxckpt.agent.trainer._slot_maps import SlotMaps, _populate
from jaxckpt.host.snapshot import SnapshotManifest
from jaxckpt.host.store import HostStore, PersistError, PersistStatus, Slot
from jaxckpt.options import AgentOptions

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=_requests.Reply)


def wait_exited(pid: int, timeout_secs: float) -> bool:
  """Waits up to ``timeout_secs`` for ``pid`` to exit; True if it did."""
  try:
    return _wait.until(lambda: not pid_alive(pid), timeout_secs=timeout_secs,
                       late=lambda: f"pid {pid} still runs")
  except errors.SnapshotTimeoutError:
    return False


def start_agent(*, job: str, host: int, run_root: str, max_snapshots: int,
                limit_bytes: int, idle_timeout_secs: float, tcp_host: str = "127.0.0.1",
                start_timeout_secs: float, secret: bytes | None = None) -> dict[str, Any]:
  """Finds the running agent of (job, host) or spawns a detached one.

  Spawned with a fresh interpreter (fork+exec, new session), never a fork of
  a process that runs JAX. Serialized by a lock file so that two trainers of
  one host never start two agents. A trainer gives the job's ``secret`` it holds:
  the agent it starts serves with that one (the file ``RUN_ROOT/JOB/secret`` is
  written again where it is gone, and one that holds another secret is refused),
  so the agent that replaces a stopped or dead one is never locked out of its trainer.
  """
  d = _paths.agent_dir(run_root, job, host)
  os.makedirs(os.path.dirname(d), exist_ok=True)
  with open(d + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    info = read_address(d)
    if info is not None:
      return info
    if os.path.isdir(d):
      logger.warning("removing the files of a dead agent of job %s host %d", job, host)
      shutil.rmtree(d, ignore_errors=True)
    env = None
    if secret is not None:
      _paths.job_secret(run_root, job, secret)     # (PermissionDeniedError: another one there)
      env = dict(os.environ, **{_paths.SECRET_ENV: secret.decode()})
    os.makedirs(d)
    log = _paths.log_file(d)     # in the job's private directory, removed with the agent
    cmd = [sys.executable, "-m", "jaxckpt.agent", "serve", "--job-name", job,
           "--host-id", str(host), "--run-root", run_root,
           "--max-snapshots", str(max_snapshots), "--limit-bytes", str(limit_bytes),
           "--idle-timeout-secs", str(idle_timeout_secs), "--tcp-host", tcp_host]
    with open(log, "ab") as out:
      proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                              start_new_session=True, close_fds=True, env=env)
    # Reap it whenever it exits, so a dead agent never lingers as our zombie.
    threading.Thread(target=proc.wait, daemon=True, name="jaxckpt-agent-reaper").start()

    def up() -> dict[str, Any] | None:
      info = read_address(d)
      if info is None and proc.poll() is not None:
        raise errors.AgentUnavailableError(
            f"the snapshot agent of job {job!r} host {host} exited with code "
            f"{proc.returncode} at start; see {log}")
      return info

    try:
      return _wait.until(up, timeout_secs=start_timeout_secs, late=lambda: (
          f"the snapshot agent of job {job!r} host {host} (pid {proc.pid}) did not come "
          f"up within {start_timeout_secs} s; see {log}"))
    except errors.SnapshotTimeoutError as e:
      proc.kill()
      raise errors.AgentUnavailableError(str(e)) from None


class AgentStore(HostStore):
  """A HostStore whose slots are the shared memory of this host's agent.

  ``persist`` and ``parity`` (a ``_parity_config.ParityConfig.to_obj()``) are handed
  to the agent at hello: it then persists and exchanges parity on its own.
  ``host`` names the agent (its directory under the run root); ``process`` is this
  trainer's index in its job (default ``host``): a relaunched job whose machines run
  other indices than before keeps each machine's agent (``_factory.agent_hosts``).

  Its collaborators: ``job`` (:class:`~jaxckpt.agent.trainer._job_agents.JobAgents`, the
  job's other agents), ``repersist`` (:class:`~jaxckpt.agent.trainer._repersist.Repersister`,
  the persists rebuilt from parity after a lost agent) and ``maps``
  (:class:`~jaxckpt.agent.trainer._slot_maps.SlotMaps`, this trainer's maps of the slot files).
  """

  def __init__(self, opts: AgentOptions, *, host: int, max_snapshots: int,
               limit_bytes: int, persist: dict[str, Any] | None = None,
               parity: dict[str, Any] | None = None, secret: str | None = None,
               owner: str | None = None, process: int | None = None,
               run: str | None = None) -> None:
    self.opts = opts
    self.owner = owner          # the manager this store serves: the agent's lease names it
    self.run = run              # the run it saves (its directory): another run's snapshots go
    self.host = host
    self.process = host if process is None else process
    self.run_root = opts.run_root or _paths.default_run_root()
    self.secret = _paths.job_secret(self.run_root, opts.job_name, secret or opts.secret)
    self._max = max_snapshots
    self._limit = limit_bytes
    self.persist_options = persist
    self.parity_options = parity
    self.maps = SlotMaps(self, keep=max_snapshots)
    self._failed: list[PersistError] = []
    self._errors_lock = threading.Lock()
    self._status = PersistStatus()          # as the agent's last reply said
    self._attempts: dict[int, str] = {}     # due steps sent to this agent -> their attempts
    self._note: str | None = None           # the agent's room note, as its last reserve said
    self._crowded = 0                       # how often it said one
    self.restarts = 0
    self.job = JobAgents(self)
    self.repersist = Repersister(self)
    self._connect()

  @property
  def who(self) -> str:
    return f"snapshot agent of job {self.opts.job_name!r} host {self.host} (pid {self.pid})"

  def _connect(self) -> None:
    if not self.opts.spawn:
      info = read_address(_paths.agent_dir(self.run_root, self.opts.job_name, self.host))
      if info is None:
        raise errors.AgentUnavailableError(
            f"no snapshot agent of job {self.opts.job_name!r} host {self.host} is running "
            f"under {self.run_root}; start it with `jaxckpt agent start --job-name "
            f"{self.opts.job_name} --host-id {self.host}` or set AgentOptions(spawn=True)")
    else:
      info = start_agent(job=self.opts.job_name, host=self.host, run_root=self.run_root,
                         max_snapshots=self._max, limit_bytes=self._limit,
                         idle_timeout_secs=self.opts.idle_timeout_secs,
                         tcp_host=self.opts.tcp_host,
                         start_timeout_secs=self.opts.start_timeout_secs, secret=self.secret)
    self.pid = info["pid"]
    self.info = info
    self.client = Client(info["ipc"], who=f"snapshot agent pid {self.pid} of job "
                         f"{self.opts.job_name!r} host {self.host}",
                         timeout_secs=self.opts.request_timeout_secs, secret=self.secret,
                         host=self.host, pid=self.pid)
    try:
      self.client.call(self._hello())
    except BaseException:
      self.client.close()             # refused (another manager holds the lease): nothing kept
      raise
    self.maps.forget()

  def ensure_alive(self) -> None:
    """Starts a new agent if ours died (its snapshots are lost with it)."""
    if pid_alive(self.pid):
      return
    logger.warning("%s died; starting a new agent (the snapshots it held are lost)", self.who)
    self.client.close()
    self.restarts += 1
    lost = [(s, self._attempts[s]) for s in self._status.pending if s in self._attempts]
    self._status = PersistStatus(persisted=self._status.persisted)
    dead = self.info
    self._connect()
    if lost:
      # The steps the dead agent held for storage: this host's piece of each is rebuilt
      # from the other hosts' parity (when parity is on) and written as the same attempt,
      # on a thread of its own (process 0's commit waits for it); else it is reported.
      self.repersist.start(lost)
    self.job.announce(dead)

  def recover_persists(self, process_index: int, *, run_id: str | None = None) -> None:
    """Finishes the persists of the job's steps that this host's new agent does not
    hold, rebuilt from parity (see :meth:`Repersister.recover`)."""
    self.repersist.recover(process_index, run_id=run_id)

  def failed(self, error: PersistError) -> None:
    """A persist failed here (a rebuilt one): the next ``persist_errors`` says so."""
    with self._errors_lock:
      self._failed.append(error)

  # Requests that mean the same to a new agent: one the dead agent never
  # answered is sent again to its replacement.
  _RESENDABLE = (_requests.Reserve, _requests.Steps, _requests.Persisted, _requests.Discard)

  def call(self, req: _requests.Request[R]) -> R:
    """``req``'s reply from this host's agent (one of ``_RESENDABLE`` goes again to the
    new agent if this one died before it answered)."""
    try:
      return self.client.call(req)[0]
    except errors.AgentUnavailableError:
      if not isinstance(req, self._RESENDABLE) or not wait_exited(self.pid, 1.0):
        raise                             # alive but silent (hung): the caller hears it
    self.ensure_alive()                   # it died: a new agent takes the request
    return self.client.call(req)[0]

  def _hello(self) -> _requests.Hello:
    """This trainer's hello: it takes the lease and tells its options."""
    return _requests.Hello(
        pid=os.getpid(), max_snapshots=self._max, limit_bytes=self._limit,
        persist=None if self.persist_options is None else msgspec.convert(
            self.persist_options, _requests.PersistOptions),
        parity=None if self.parity_options is None else msgspec.convert(
            self.parity_options, _requests.ParityOptions),
        owner=self.owner, run=self.run)

  # -- the job's other agents (HostStore's job methods): ``JobAgents`` ----------

  def local_agents(self) -> list[dict[str, Any]]:
    """The live agents of this job on this machine (under this run root)."""
    return self.job.local()

  def agents(self) -> list[dict[str, Any]]:
    """Every agent of the job this store knows of (``JobAgents.all``)."""
    return self.job.all()

  def job_clients(self) -> contextlib.AbstractContextManager[dict[int, Client]]:
    """Clients of every agent of the job this store knows of."""
    return self.job.clients()

  def complete_steps(self) -> list[int]:
    return self.job.complete_steps()

  def holders(self, step: int, *, timeout_secs: float | None = None) -> tuple[set[int], int | None]:
    return self.job.holders(step, timeout_secs=timeout_secs)

  def parity_steps(self, *, timeout_secs: float | None = None) -> dict[int, Any]:
    return self.job.parity_steps(timeout_secs=timeout_secs)

  def unanswered(self) -> list[str]:
    return list(self.job.unanswered)

  def step_manifest(self, step: int) -> SnapshotManifest | None:
    return self.job.step_manifest(step)

  def other_pieces(self, step: int, local_index: int | None, *, rebuild: bool,
                   have: list[Any], stack: contextlib.ExitStack) -> list[Any]:
    return self.job.other_pieces(step, local_index, rebuild=rebuild, have=have, stack=stack)

  def discover(self, *, timeout_secs: float) -> None:
    """Publishes this machine's agents and learns the job's (``JobAgents.discover``)."""
    self.job.discover(timeout_secs=timeout_secs)

  # -- this host's slots -------------------------------------------------------

  def reserve(self, step: int, nbytes: int, *, timeout_secs: float | None) -> Slot | None:
    self.ensure_alive()
    self.maps.drop_lent()

    notes: list[str] = []

    def reserved() -> dict[str, Any] | None:
      r = self.call(_requests.Reserve(pid=os.getpid(), step=step, nbytes=nbytes))
      notes.append(r.note)
      return r if r.index is not None else None

    try:
      r = _wait.until(reserved, timeout_secs=timeout_secs or 0.0, poll_secs=0.005,
                      late=lambda: f"no slot of {self.who} freed up for step {step}")
    except errors.SnapshotTimeoutError:
      return None                           # HostStore.reserve's contract: None, not an error
    finally:
      self._said(next((n for n in notes if n), None))
    fresh = r.fresh and self.maps.allocated.get(r.index) != r.path    # not allocated by us
    # A slot not mapped yet (or a new file) is allocated and mapped, and a kept map
    # checked against its file, when the background copy first reads ``slot.buffer``:
    # never on the save path.
    return Slot(r.index, step, None, nbytes,
                opener=functools.partial(self.maps.map, r.index, r.path, r.size,
                                         allocate=fresh, write=True))

  def preallocate(self, nbytes: int) -> None:
    """Sizes the agent's free slots for ``nbytes`` and allocates, maps and touches
    their memory here, so that no save pays for it."""
    self.ensure_alive()
    self.maps.drop_lent()
    for index, path, size, fresh in self.call(_requests.Preallocate(nbytes=nbytes)).slots:
      _populate(self.maps.map(index, path, size, allocate=fresh, write=True))

  def commit(self, slot: Slot, manifest: SnapshotManifest, *,
             persist_attempt: str | None = None) -> None:
    self.job.elsewhere = []       # this run's agents hold what it may restore from now on
    if persist_attempt is not None:
      self._attempts[manifest.step] = persist_attempt
    # a new timeline from this step on (a rollback, or the step saved again): a rebuilt
    # persist of the old one must not commit
    self.repersist.fence(lambda s: s >= manifest.step)
    text = manifest.to_json()
    self._take_persist(self.call(_requests.Commit(
        index=slot.index, manifest=text, step=manifest.step, nbytes=manifest.nbytes,
        process=[manifest.process_index, manifest.process_count],
        persist_attempt=persist_attempt)))
    self.maps.remember(manifest.step, text, manifest)

  def persist_to(self, config: Any) -> None:
    obj = config.to_obj()
    if obj != self.persist_options:
      self.persist_options = obj
      self.client.call(self._hello())

  def _take_persist(self, reply: _requests.Persisted.Reply | _requests.Commit.Reply) -> None:
    """Keeps the persist status and errors an agent's reply brings."""
    with self._errors_lock:
      self._failed += reply.persist_errors
      if reply.persist is not None:
        self._status = reply.persist

  def persist_status(self, *, ask: bool = True) -> PersistStatus:
    if ask:
      self.ensure_alive()
      self._take_persist(self.call(_requests.Persisted(errors=False)))
    return self._status

  def persist_errors(self, *, ask: bool = True) -> list[PersistError]:
    if ask:
      self.ensure_alive()
      self._take_persist(self.call(_requests.Persisted()))
    with self._errors_lock:
      known, self._failed = self._failed, []
    return known

  def has_free_slot(self) -> bool:
    self.ensure_alive()
    return bool(self.call(_requests.Steps()).free_slots)

  def room_note(self) -> str | None:
    return self._note

  def _said(self, note: str | None) -> None:
    """The agent's room note of a reserve, in this trainer's log too (a WARNING at the
    1st, 2nd, 4th... reserve that had one)."""
    self._note = note
    if note:
      self._crowded += 1
      logger.log(logging.WARNING if self._crowded & (self._crowded - 1) == 0 else logging.DEBUG,
                 "%s", note)

  def abort(self, slot: Slot) -> None:
    with contextlib.suppress(errors.AgentUnavailableError):
      self.call(_requests.Abort(index=slot.index))

  def steps(self) -> list[int]:
    return list(self.call(_requests.Steps()).steps)

  # Its discard fences every agent of the job: a step it deleted is on no host's agent,
  # and no persist of it runs anywhere (so any process may clear storage next).
  fences_job = True

  def discard(self, step: int, *, timeout_secs: float = 60.0) -> bool:
    """Discards ``step`` on this host's agent and then on every other agent of the
    job (a delete is final on every host, whichever process calls it first: a
    peer's snapshot, parity and persist of it go too), each fenced until its
    persist has ended. True if this agent held it, or another host's delete
    discarded it here first."""
    discarded, first = [], []
    self.repersist.fence(lambda s: s == step)   # a persist of it rebuilt here, too

    def fenced() -> bool:       # fenced at once; asked again until its persist has ended
      r = self.call(_requests.Discard(step=step, by=self.process))
      discarded.append(r.discarded)
      first.append(r.deleted_by)
      return not r.persisting and not self.repersist.rebuilding(step)
    _wait.until(fenced, timeout_secs=timeout_secs, poll_secs=0.01, late=lambda: (
        f"discard of step {step}: the persist that {self.who} runs of it (or this trainer's "
        f"rebuild of it after a lost agent) did not stop within {timeout_secs} s (it will not "
        "commit)"))
    self._attempts.pop(step, None)
    self.job.discard_elsewhere(step, timeout_secs)
    return any(discarded) or first[0] not in (None, self.process)

  def rollback(self, rid: str, steps: list[int], *, timeout_secs: float = 60.0) -> None:
    """Rollback ``rid``: ``steps`` discarded on this host's agent in one request (a
    trainer killed meanwhile leaves it whole, and recorded there, with the job's agents
    it goes to), then on every other agent of the job; each fenced until its persists
    have ended. Applied once per agent: asked again (a relaunch completing it), it
    discards nothing more."""
    doomed = frozenset(steps)
    self.repersist.fence(doomed.__contains__)
    req = _requests.Rollback(id=rid, steps=sorted(doomed), by=self.process, run=self.run,
                             agents=self.job.agent_addresses())

    def fenced() -> bool:
      r = self.call(req)
      return not r.persisting and not any(self.repersist.rebuilding(s) for s in doomed)
    _wait.until(fenced, timeout_secs=timeout_secs, poll_secs=0.01, late=lambda: (
        f"rollback {rid}: the persists that {self.who} runs of steps {sorted(doomed)} did not "
        f"stop within {timeout_secs} s (they will not commit)"))
    for s in doomed:
      self._attempts.pop(s, None)
    _crash.point("rollback")
    self.job.rollback_elsewhere(req, timeout_secs)

  def complete_rollbacks(self, *, timeout_secs: float = 60.0) -> None:
    self.job.complete_rollbacks(timeout_secs)

  @contextlib.contextmanager
  def read(self, step: int) -> Iterator[tuple[SnapshotManifest, Any]]:
    r = self.call(_requests.Open(pid=os.getpid(), step=step))
    lent: list[bool] = []
    self.maps.lending[step] = (r.index, lent)
    try:
      manifest = self.maps.manifest(step, r.manifest)
      yield manifest, self.maps.read_map(r, manifest)
    finally:
      self.maps.lending.pop(step, None)
      self.maps.unlend(r, bool(lent))
      with contextlib.suppress(errors.AgentUnavailableError):   # (its reply is taken by the
        self.client.post(_requests.Close(                       # next request: a restore
            pid=os.getpid(), step=step, index=r.index, lend=bool(lent)))   # does not wait)

  def lend(self, step: int, buffer: Any) -> bool:
    """Restored arrays keep views of ``buffer`` (``step``'s slot, pinned by
    ``read``): the agent never writes that slot's file again, as the unpin at
    the end of ``read`` tells it (until then the pin keeps every writer out)."""
    return self.maps.lend(step, buffer)

  def close(self, timeout_secs: float = 300.0) -> None:
    """Gives up this trainer's lease (the agent goes on persisting what is queued)."""
    del timeout_secs            # the manager waited for its persists already
    try:
      if pid_alive(self.pid):
        self.call(_requests.Bye(pid=os.getpid(), owner=self.owner))
    except errors.JaxckptError as e:
      logger.warning("%s: could not give up the lease at close: %s", self.who, e)
    finally:
      self.maps.forget()
      self.client.close()
      if not pid_alive(self.pid):   # its agent went before it (the secret was kept for it)
        _paths.release_job_dir(self.run_root, self.opts.job_name)
