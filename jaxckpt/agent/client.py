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

import concurrent.futures
import contextlib
import fcntl
import functools
import json
import logging
import mmap
import os
import shutil
import socket
import subprocess
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

import msgspec
import numpy as np

from jaxckpt import errors
from jaxckpt.util import _wait
from jaxckpt.agent import _parity_recovery, _paths, _requests
from jaxckpt.agent._paths import pid_alive, read_address
from jaxckpt.agent._protocol import Client, each
from jaxckpt.agent.jobs import same_directory
from jaxckpt.host import _persist
from jaxckpt.host.snapshot import SnapshotManifest
from jaxckpt.net import _schema
from jaxckpt.host.store import HostStore, PersistError, PersistStatus, Slot
from jaxckpt.options import AgentOptions
from jaxckpt.agent._remote import (clients_of, complete_steps_of, job_agents,
                                   open_remote_piece, _rebuilt_pieces)

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=_requests.Reply)

# How long discover waits for an agent of the job's earlier run to answer (a lost
# machine's never does).
_PROBE_SECS = 5.0


def wait_exited(pid: int, timeout_secs: float) -> bool:
  """Waits up to ``timeout_secs`` for ``pid`` to exit; True if it did."""
  try:
    return _wait.until(lambda: not pid_alive(pid), timeout_secs=timeout_secs,
                       late=lambda: f"pid {pid} still runs")
  except errors.SnapshotTimeoutError:
    return False


def start_agent(*, job: str, host: int, run_root: str, max_snapshots: int,
                limit_bytes: int, idle_timeout_secs: float, tcp_host: str = "127.0.0.1",
                start_timeout_secs: float) -> dict[str, Any]:
  """Finds the running agent of (job, host) or spawns a detached one.

  Spawned with a fresh interpreter (fork+exec, new session), never a fork of
  a process that runs JAX. Serialized by a lock file so that two trainers of
  one host never start two agents.
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
    os.makedirs(d)
    log = _paths.log_file(d)     # in the job's private directory, removed with the agent
    cmd = [sys.executable, "-m", "jaxckpt.agent", "serve", "--job-name", job,
           "--host-id", str(host), "--run-root", run_root,
           "--max-snapshots", str(max_snapshots), "--limit-bytes", str(limit_bytes),
           "--idle-timeout-secs", str(idle_timeout_secs), "--tcp-host", tcp_host]
    with open(log, "ab") as out:
      proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                              start_new_session=True, close_fds=True)
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


class _Fenced(Exception):
  """A rebuilt persist of a step deleted meanwhile: it must not commit."""


class AgentStore(HostStore):
  """A HostStore whose slots are the shared memory of this host's agent.

  ``persist`` and ``parity`` (a ``_parity_config.ParityConfig.to_obj()``) are handed
  to the agent at hello: it then persists and exchanges parity on its own.
  ``host`` names the agent (its directory under the run root); ``process`` is this
  trainer's index in its job (default ``host``): a relaunched job whose machines run
  other indices than before keeps each machine's agent (``_factory.agent_hosts``).
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
    self._persist = persist
    self._parity = parity
    # slot -> (path, size, map, the mapped file's (device, inode)): checked against the
    # file before every use (_intact), as a save writes it and as a restore reads it
    self._maps: dict[int, tuple[str, int, np.ndarray, tuple[int, int]]] = {}
    self._maps_lock = threading.Lock()
    # Maps of slot files lent to restores (never written again): a later restore of the
    # same step reads them without a page fault a page; dropped at this trainer's next
    # reservation, so their memory goes with the restored arrays.
    self._lent: dict[int, tuple[str, int, np.ndarray, tuple[int, int]]] = {}   # (as _maps)
    self._lending: dict[int, tuple[int, list[bool]]] = {}   # step read -> (slot, lent?)
    self._allocated: dict[int, str] = {}    # slot -> the file this trainer allocated
    self._committed: dict[int, tuple[str, SnapshotManifest]] = {}   # step -> what it sent
    self._failed: list[PersistError] = []
    self._errors_lock = threading.Lock()
    self._status = PersistStatus()          # as the agent's last reply said
    self._attempts: dict[int, str] = {}     # due steps sent to this agent -> their attempts
    self._note: str | None = None           # the agent's room note, as its last reserve said
    self._crowded = 0                       # how often it said one
    self.restarts = 0
    self.directory: list[dict[str, Any]] = []     # the job's agents on other machines
    # agents of the job's earlier run on machines outside this run (discover): they serve
    # its first restore, until this trainer's first commit
    self.elsewhere: list[dict[str, Any]] = []
    self.job_size: int | None = None              # processes of the job (discover)
    self._peers: dict[str, dict[str, Any]] = {}   # process index -> its agent (discover)
    self._fence_lock = threading.Lock()
    # (step, attempt) of the persists rebuilt here that run, and of those fenced (deleted
    # or rolled back: they must not commit)
    self._repersisting: set[tuple[int, str]] = set()
    self._fenced: set[tuple[int, str]] = set()
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
                         start_timeout_secs=self.opts.start_timeout_secs)
    self.pid = info["pid"]
    self.info = info
    self._client = Client(info["ipc"], who=f"snapshot agent pid {self.pid} of job "
                          f"{self.opts.job_name!r} host {self.host}",
                          timeout_secs=self.opts.request_timeout_secs, secret=self.secret,
                          host=self.host, pid=self.pid)
    try:
      self._client.call(self._hello())
    except BaseException:
      self._client.close()            # refused (another manager holds the lease): nothing kept
      raise
    self._maps.clear()
    self._lent.clear()
    self._allocated.clear()

  def ensure_alive(self) -> None:
    """Starts a new agent if ours died (its snapshots are lost with it)."""
    if pid_alive(self.pid):
      return
    logger.warning("%s died; starting a new agent (the snapshots it held are lost)", self.who)
    self._client.close()
    self.restarts += 1
    lost = [(s, self._attempts[s]) for s in self._status.pending if s in self._attempts]
    self._status = PersistStatus(persisted=self._status.persisted)
    dead = self.info
    self._connect()
    if lost:
      # The steps the dead agent held for storage: this host's piece of each is rebuilt
      # from the other hosts' parity (when parity is on) and written as the same attempt,
      # on a thread of its own (process 0's commit waits for it); else it is reported.
      self._repersist(lost)
    self._announce(dead)

  def recover_persists(self, process_index: int, *, run_id: str | None = None) -> None:
    """Finishes the persists the job started that this host's agent can no longer
    take part in: it is a new agent holding nothing (the machine was lost, or the
    agent died while no trainer ran). For each step due for storage whose persist
    the job's other agents still run (one attempt: theirs, which a rollback or a
    delete would have fenced), saved by a job of this one's size (``discover``), and
    that is not committed, this process's piece is
    rebuilt from parity and written as the same attempt, and process 0 commits
    it: on a thread of its own, fenced by a delete or a rollback of this run. An
    agent that holds steps outlived the last run: a step it lacks it dropped on
    purpose, and nothing is recovered. Runs once the job's agents are known
    (``discover``); a no-op without parity or a persist directory.

    Each peer's persist runs until process 0 has committed the step
    (``_persist.persist_part``), so a lost process 0 is found too. Not
    recovered: a step whose peers' persists all ended without a commit (they
    waited ``PersistConfig.timeout_secs``), since only storage then knows the
    attempt, and an attempt found there cannot be told from an abandoned one;
    nor an attempt of this run (``run_id``): a peer that ran ahead of this
    process is persisting its own new save, which this process saves too; nor
    an attempt to another directory than this trainer's (of an earlier run's
    persist options: this trainer knows neither its timeout nor its hold)."""
    if not (self._parity and self._persist) or self.steps():
      return
    from jaxckpt import universal  # pylint: disable=import-outside-toplevel  (JAX: the trainer's side)
    directory = self._persist["directory"]
    pending: dict[int, set[str]] = {}
    with self.job_clients() as clients:
      for c in clients.values():
        if c.pid == self.pid:
          continue
        try:
          status = PersistStatus.from_obj(c.call(_requests.Persisted(errors=False))[0].persist)
          counts = {s: n for s, _, n in c.call(_requests.Held())[0].held}
        except errors.AgentUnavailableError as e:
          logger.warning("recovering persists: %s", e)
          continue
        for s, a, where in status.attempts:
          if self.job_size is not None and counts.get(s, self.job_size) != self.job_size:
            logger.warning("step %d: not recovering its persist (attempt %s): a job of %d "
                           "processes saved it, this one has %d", s, a, counts[s],
                           self.job_size)
          elif where and not same_directory(where, directory):
            logger.warning("step %d: not recovering its persist to %s (attempt %s, an earlier "
                           "run's options): this trainer persists to %s", s, where, a, directory)
          elif not _persist.of_run(a, run_id):
            pending.setdefault(s, set()).add(a)
    lost = []
    for step, attempts in sorted(pending.items()):
      if universal.committed_by(directory, step) is not None:
        continue
      if len(attempts) != 1:
        logger.warning("step %d: not recovering its persist: attempts %s disagree", step,
                       sorted(attempts))
        continue
      attempt, = attempts
      if process_index == 0 or universal.missing_parts(directory, step, attempt,
                                                       of=[process_index]):
        lost.append((step, attempt))
    if lost:
      logger.warning("steps %s: the job persists them and this host's new agent does not "
                     "hold them; rebuilding this host's piece from parity",
                     [s for s, _ in lost])
      self._repersist(lost)

  def _repersist(self, lost: list[tuple[int, str]]) -> None:
    with self._fence_lock:
      self._repersisting.update(lost)
    threading.Thread(target=self._persist_lost, args=(lost,), daemon=True,
                     name="jaxckpt-repersist").start()

  def _check_fence(self, step: int, attempt: str) -> None:
    with self._fence_lock:
      if (step, attempt) in self._fenced:
        raise _Fenced(step)

  def _fence_rebuilds(self, fenced: Callable[[int], bool]) -> None:
    """Fences the rebuilt persists of the steps ``fenced`` says (a delete, a rollback)."""
    if not self._repersisting:          # (every commit asks: almost always nothing runs)
      return
    with self._fence_lock:
      self._fenced.update(j for j in self._repersisting if fenced(j[0]))

  def _announce(self, dead: dict[str, Any]) -> None:
    """Tells the job's agents (this host's new one too) where this host's agent is
    now, so parity reaches it, and forgets the ``dead`` one's address; an agent
    that does not answer hears it at the next ``discover``. Only in a job that
    was discovered (several hosts)."""
    if not self._peers:
      return
    old_pid = dead["pid"]
    self.directory = [a for a in self.directory if a["tcp"] != dead["tcp"]] + [self.info]
    self._peers[str(self.process)] = self.info
    mine = {str(self.process): self.info}
    with self.job_clients() as clients:
      for c in clients.values():
        try:
          if c.pid == self.pid:
            c.call(_peers(self._peers))
          else:
            c.call(_peers(mine, merge=True))
        except errors.JaxckptError as e:    # it hears at the next discover; parity to
          # this host fails until then, which wait_until_protected reports
          logger.warning("telling %s of host %d's new agent (the old was pid %s): %s",
                         c.who, self.host, old_pid, e)

  def _persist_lost(self, lost: list[tuple[int, str]]) -> None:
    for step, attempt in lost:
      try:
        self._persist_rebuilt(step, attempt)
        logger.warning("step %d: rebuilt from parity and persisted after %s died", step, self.who)
      except _Fenced:
        logger.info("step %d: its rebuilt persist was fenced (deleted)", step)
      except Exception as e:  # pylint: disable=broad-except  (handed to the trainer, typed)
        with self._errors_lock:
          self._failed.append(PersistError(
              step, attempt, "AgentUnavailableError",
              f"{self.who} died before step {step} was on storage, and its piece could not be "
              f"rebuilt from parity ({type(e).__name__}: {e}); restore an earlier step, or "
              "save it again"))
      finally:
        with self._fence_lock:
          self._repersisting.discard((step, attempt))
          self._fenced.discard((step, attempt))

  def _persist_rebuilt(self, step: int, attempt: str) -> None:
    if not (self._parity and self._persist):
      raise errors.UnrecoverableLossError("parity is off: nothing else holds the piece")
    config = _persist.PersistConfig(**self._persist)
    from jaxckpt import universal  # pylint: disable=import-outside-toplevel  (JAX: the trainer's side)
    if universal.committed_by(config.directory, step) is not None:
      return        # it ended on storage before its agent died (the status was stale)
    if self.process != 0 and not universal.missing_parts(config.directory, step, attempt,
                                                         of=[self.process]):
      return        # the dead agent wrote this process's part; process 0 commits it
    check = functools.partial(self._check_fence, step, attempt)
    with contextlib.ExitStack() as stack:
      pieces = self.other_pieces(step, None, rebuild=True, have=[], stack=stack)
      # this process's piece, rebuilt here (another lost one's is its own process's to write)
      piece = next((p for p in pieces if p.rebuilt
                    and p.manifest.process_index == self.process), None)
      if piece is None:
        raise errors.UnrecoverableLossError(f"process {self.process}'s piece of step {step} "
                                            "was not rebuilt")
      buffer = piece.whole()
      check()
      _persist.persist_part(config, piece.manifest, buffer, attempt, check,
                            storage=universal)

  # Requests that mean the same to a new agent: one the dead agent never
  # answered is sent again to its replacement.
  _RESENDABLE = (_requests.Reserve, _requests.Steps, _requests.Persisted, _requests.Discard)

  def call(self, req: _requests.Request[R]) -> R:
    """``req``'s reply from this host's agent (one of ``_RESENDABLE`` goes again to the
    new agent if this one died before it answered)."""
    try:
      return self._client.call(req)[0]
    except errors.AgentUnavailableError:
      if not isinstance(req, self._RESENDABLE) or not wait_exited(self.pid, 1.0):
        raise                             # alive but silent (hung): the caller hears it
    self.ensure_alive()                   # it died: a new agent takes the request
    return self._client.call(req)[0]

  def _hello(self) -> _requests.Hello:
    """This trainer's hello: it takes the lease and tells its options."""
    return _requests.Hello(
        pid=os.getpid(), max_snapshots=self._max, limit_bytes=self._limit,
        persist=None if self._persist is None else msgspec.convert(
            self._persist, _requests.PersistOptions),
        parity=None if self._parity is None else msgspec.convert(
            self._parity, _requests.ParityOptions),
        owner=self.owner, run=self.run)

  def local_agents(self) -> list[dict[str, Any]]:
    """The live agents of this job on this machine (under this run root)."""
    return list(job_agents(self.run_root, self.opts.job_name).values())

  def agents(self) -> list[dict[str, Any]]:
    """Every agent of the job this store knows of: this machine's, those the
    other processes published (``discover``) or announced since as the new agent of
    their process, and until this trainer's first commit the earlier run's agents on
    machines outside this run, each once."""
    self._follow_replaced()
    out = {a["tcp"]: a for a in [*self.directory, *self.elsewhere]}
    out.update((a["tcp"], a) for a in self.local_agents())
    return list(out.values())

  def _follow_replaced(self) -> None:
    """Takes the new agents that other processes started in place of dead ones
    since ``discover`` (they announce them to this host's agent: ``_announce``) in
    place of the dead ones: else every request of the job's (what it holds, a
    restore, a delete) waited out its timeout on a dead agent and never reached
    the new one. One request to this host's agent; nothing in a job that was not
    discovered (one host)."""
    if not self._peers:
      return
    try:
      peers = self._client.call(_requests.JobView())[0].peers
    except errors.JaxckptError as e:    # this host's agent died (the next request starts a
      logger.debug("%s: no view of the job's agents: %s", self.who, e)   # new one), or is old
      return
    for p, info in peers.items():
      old = self._peers.get(p)
      if (p == str(self.process) or old is None or not isinstance(info, dict)
          or info.get("tcp") == old.get("tcp") or not isinstance(info.get("host"), int)
          or not isinstance(info.get("pid"), int) or not isinstance(info.get("tcp"), str)):
        continue
      logger.info("process %s of job %r has a new snapshot agent: host %d (pid %d) at %s, "
                  "in place of pid %s at %s", p, self.opts.job_name, info["host"], info["pid"],
                  info["tcp"], old.get("pid"), old.get("tcp"))
      self.directory = [a for a in self.directory if a["tcp"] != old["tcp"]] + [dict(info)]
      self._peers[p] = dict(info)

  # -- the job's other agents (HostStore's job methods) -------------------------

  @contextlib.contextmanager
  def job_clients(self) -> Iterator[dict[int, Client]]:
    """Clients of every agent of the job this store knows of (see :func:`clients_of`)."""
    with clients_of(self.agents(), self.opts.job_name, local_pid=self.pid, secret=self.secret,
                    timeout_secs=self.opts.request_timeout_secs) as clients:
      yield clients

  def complete_steps(self) -> list[int]:
    with self.job_clients() as clients:
      return complete_steps_of(clients)

  def holders(self, step: int) -> tuple[set[int], int | None]:
    held, count = set(), None
    with self.job_clients() as clients:
      for c in clients.values():
        try:
          for s, index, n in c.call(_requests.Held())[0].held:
            if s == step:
              held.add(index)
              count = n
        except errors.AgentUnavailableError as e:
          logger.warning("skipping %s: %s", c.who, e)
    return held, count

  def parity_steps(self) -> dict[int, Any]:
    if not self._parity:                  # this trainer's job keeps no parity
      return {}
    with self.job_clients() as clients:
      return _parity_recovery.survey(clients)

  def step_manifest(self, step: int) -> SnapshotManifest | None:
    """Any agent's manifest of ``step`` (each records every leaf), else one of the
    group's manifests that a parity holder keeps for its rebuild."""
    with self.job_clients() as clients:
      for ask in (_requests.Manifest, _requests.ParityInfo):
        for c in clients.values():
          try:
            r = c.call(ask(step=step))[0]
          except (errors.StepNotFoundError, errors.AgentUnavailableError):
            continue
          text = (r.manifest if isinstance(r, _requests.Manifest.Reply)
                  else next(iter(r.manifests.values()), None))
          if text:
            return SnapshotManifest.from_json(text)
    return None

  def other_pieces(self, step: int, local_index: int | None, *, rebuild: bool,
                   have: list[Any], stack: contextlib.ExitStack) -> list[Any]:
    clients = stack.enter_context(self.job_clients())
    others = {k: c for k, c in clients.items()   # (this host's own piece is read from its memory)
              if not (c.pid == self.pid and local_index is not None)}
    pins = contextlib.ExitStack()
    stack.push(pins)          # (unpinned with the rest: pins taken on the asking threads)
    opened = [p for _, p in sorted(each(others, lambda c: open_remote_piece(c, step, pins)).items())
              if p is not None]
    # The pieces of one run of the job: this host's piece's, else the size most pieces
    # have (an agent of a run on another number of processes may hold the same step).
    counts = [p.manifest.process_count for p in [*have, *opened]]
    count = counts[0] if have else max(set(counts), key=counts.count, default=None)
    out, found = [], set() if local_index is None else {local_index}
    for piece in opened:
      if piece.manifest.process_count == count and piece.manifest.process_index not in found:
        out.append(piece)
        found.add(piece.manifest.process_index)
    if rebuild:
      out += _rebuilt_pieces(clients, step, [*have, *out])
    return out

  def discover(self, *, timeout_secs: float) -> None:
    """Publishes the agents of the job on this machine (its run root is private)
    through jax.distributed's key-value store and learns everyone's: restores
    read other hosts' pieces from that list, and this host's agent gets the
    job's current agents by process index (for parity exchange). No directory is
    shared between hosts.

    Each process also says which agents its own agent was told of by the job's
    earlier run (its map of that run's processes): those on machines outside this
    run (a relaunch on fewer processes, a machine left out) that still answer join
    the list until this trainer's first commit, so the relaunch restores from
    them; each process asks a share of them, and the job agrees on the answers."""
    from jaxckpt.net import _kv  # pylint: disable=import-outside-toplevel  (JAX: trainer side only)
    mine = {"own": self.info, "local": self.local_agents(), "earlier": self._earlier()}
    everyone = [json.loads(v) for v in _kv.allgather(
        f"agents/{self.opts.job_name}", json.dumps(mine), timeout_secs=timeout_secs,
        what="their snapshot agents' addresses")]
    self.directory = [a for e in everyone for a in e["local"]]
    self.job_size = len(everyone)
    self._peers = {str(p): e["own"] for p, e in enumerate(everyone)}
    here = {a["tcp"] for a in self.directory}
    earlier = sorted({a["tcp"]: a for e in everyone for a in e.get("earlier", [])
                      if a["tcp"] not in here}.items())
    if earlier:                            # (every process decides alike: same data)
      me = next(p for p, e in enumerate(everyone) if e["own"]["tcp"] == self.info["tcp"])
      mine_to_ask = [a for i, (_, a) in enumerate(earlier) if i % len(everyone) == me]
      answered = [json.loads(v) for v in _kv.allgather(
          f"agents_earlier/{self.opts.job_name}", json.dumps(self._answering(mine_to_ask)),
          timeout_secs=timeout_secs, what="which agents of the job's earlier run answer")]
      alive = {tcp for tcps in answered for tcp in tcps}
      self.elsewhere = [a for tcp, a in earlier if tcp in alive]
      if self.elsewhere:
        logger.info("agents of the job's earlier run outside this one serve its restore: %s",
                    ", ".join(f"host {a['host']} at {a['tcp']}" for a in self.elsewhere))
    self.call(_peers(self._peers))

  def _earlier(self) -> list[dict[str, Any]]:
    """The agents this host's agent was told of by the job's earlier run (none: a new
    agent, or one that never had peers)."""
    try:
      peers = self.call(_requests.JobView()).peers
    except errors.JaxckptError as e:      # an agent of an older jaxckpt: nothing to add
      logger.info("%s: no earlier peers (%s)", self.who, e)
      return []
    return [dict(a) for a in peers.values()
            if isinstance(a, dict) and isinstance(a.get("tcp"), str)]

  def _answering(self, records: list[dict[str, Any]]) -> list[str]:
    """The tcp addresses of ``records`` whose agent answers with this job's secret
    within a few seconds (a lost machine's never does), asked at once."""
    if not records:
      return []
    secs = min(_PROBE_SECS, self.opts.request_timeout_secs)

    def answers(info: dict[str, Any]) -> bool:
      if not _listening(info["tcp"], secs):    # (a refused port says so at once; ZeroMQ
        return False                            # would wait out the timeout)
      c = Client.of(info, who=f"snapshot agent of job {self.opts.job_name!r} host "
                    f"{info.get('host')} at {info['tcp']}", timeout_secs=secs, secret=self.secret)
      try:
        c.call(_requests.Steps())
        return True
      except errors.JaxckptError as e:
        logger.info("an agent of the job's earlier run does not answer: %s", e)
        return False
      finally:
        c.close()
    with concurrent.futures.ThreadPoolExecutor(min(16, len(records)),
                                               thread_name_prefix="jaxckpt-probe") as pool:
      return [a["tcp"] for a, ok in zip(records, pool.map(answers, records)) if ok]

  def _drop_lent(self) -> None:
    """Forgets the maps of lent slot files before a reservation (one of them may be
    renewed: its old file's memory must go back once no restored array views it)."""
    with self._maps_lock:
      self._lent.clear()

  def _map(self, index: int, path: str, size: int, *, allocate: bool = False,
           write: bool = False) -> np.ndarray:
    """Slot ``index``'s file, mapped once and kept across saves and restores (a
    fresh map of tmpfs pays a page fault per page; a kept one none); ``allocate``
    gives a new, sparse file its memory first. A kept map is used only while its
    file is intact (:func:`_intact`: the same file, at least ``size`` long): a file
    truncated or replaced under it (a /dev/shm cleaner, a full tmpfs) would kill
    this process with SIGBUS at its first touch. ``write`` (a save's slot) then
    allocates the file again and maps it afresh; a read raises CorruptSnapshotError."""
    if size == 0:                      # a state with no array bytes (only scalars)
      return np.empty(0, np.uint8)
    with self._maps_lock:
      cached = self._maps.get(index)
      if cached is not None and cached[:2] != (path, size):
        # The slot has another file now: forget the old one's map first, so that its
        # memory goes back (once no restored array views it) before the new one takes any.
        del self._maps[index]
        cached = None
    if cached is not None and not allocate:
      why = _intact(cached[2], path, cached[3], size)
      if why is None:
        return cached[2]
      with self._maps_lock:
        if self._maps.get(index) is cached:
          del self._maps[index]
      if not write:
        raise errors.CorruptSnapshotError(f"the snapshot file {path} {why}")
      logger.warning("%s: snapshot slot file %s %s; allocating it again for this save",
                     self.who, path, why)
      allocate = True
    del cached
    if write and not allocate and _paths.file_size(path) < size:
      logger.warning("%s: snapshot slot file %s is shorter than its %d bytes (truncated); "
                     "allocating it again for this save", self.who, path, size)
      allocate = True
    if allocate:      # memory that exists now: a full /dev/shm must not SIGBUS our copy
      _paths.allocate(path, size, host=self.host)
    buf, ident = _map_file(path, size)
    with self._maps_lock:
      self._maps[index] = (path, size, buf, ident)
      if allocate:
        self._allocated[index] = path
    return buf

  def reserve(self, step: int, nbytes: int, *, timeout_secs: float | None) -> Slot | None:
    self.ensure_alive()
    self._drop_lent()

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
    fresh = r.fresh and self._allocated.get(r.index) != r.path    # not allocated by us
    # A slot not mapped yet (or a new file) is allocated and mapped, and a kept map
    # checked against its file, when the background copy first reads ``slot.buffer``:
    # never on the save path.
    return Slot(r.index, step, None, nbytes,
                opener=functools.partial(self._map, r.index, r.path, r.size, allocate=fresh,
                                         write=True))

  def preallocate(self, nbytes: int) -> None:
    """Sizes the agent's free slots for ``nbytes`` and allocates, maps and touches
    their memory here, so that no save pays for it."""
    self.ensure_alive()
    self._drop_lent()
    for index, path, size, fresh in self.call(_requests.Preallocate(nbytes=nbytes)).slots:
      _populate(self._map(index, path, size, allocate=fresh, write=True))

  def commit(self, slot: Slot, manifest: SnapshotManifest, *,
             persist_attempt: str | None = None) -> None:
    self.elsewhere = []           # this run's agents hold what it may restore from now on
    if persist_attempt is not None:
      self._attempts[manifest.step] = persist_attempt
    # a new timeline from this step on (a rollback, or the step saved again): a rebuilt
    # persist of the old one must not commit
    self._fence_rebuilds(lambda s: s >= manifest.step)
    text = manifest.to_json()
    self._take_persist(self.call(_requests.Commit(
        index=slot.index, manifest=text, step=manifest.step, nbytes=manifest.nbytes,
        process=[manifest.process_index, manifest.process_count],
        persist_attempt=persist_attempt)))
    with self._maps_lock:         # a restore of it need not parse its manifest again
      self._committed[manifest.step] = (text, manifest)
      while len(self._committed) > self._max + 2:
        self._committed.pop(next(iter(self._committed)))

  def persist_to(self, config: Any) -> None:
    obj = config.to_obj()
    if obj != self._persist:
      self._persist = obj
      self._client.call(self._hello())

  def _take_persist(self, reply: _requests.Persisted.Reply | _requests.Commit.Reply) -> None:
    """Keeps the persist status and errors an agent's reply brings."""
    with self._errors_lock:
      self._failed += [PersistError(**e) for e in reply.persist_errors]
      if reply.persist:
        self._status = PersistStatus.from_obj(reply.persist)

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
    self._fence_rebuilds(lambda s: s == step)   # a persist of it rebuilt here, too

    def fenced() -> bool:       # fenced at once; asked again until its persist has ended
      r = self.call(_requests.Discard(step=step, by=self.process))
      discarded.append(r.discarded)
      first.append(r.deleted_by)
      with self._fence_lock:
        rebuilding = any(s == step for s, _ in self._repersisting)
      return not r.persisting and not rebuilding
    _wait.until(fenced, timeout_secs=timeout_secs, poll_secs=0.01, late=lambda: (
        f"discard of step {step}: the persist that {self.who} runs of it (or this trainer's "
        f"rebuild of it after a lost agent) did not stop within {timeout_secs} s (it will not "
        "commit)"))
    self._attempts.pop(step, None)
    self._discard_elsewhere(step, timeout_secs)
    return any(discarded) or first[0] not in (None, self.process)

  def _discard_elsewhere(self, step: int, timeout_secs: float) -> None:
    """The job's other agents discard ``step`` as this host's delete (each fenced
    until its persist of it has ended); one that does not answer is skipped with
    a warning (its snapshots count as lost)."""
    with self.job_clients() as clients:
      for c in clients.values():
        if c.pid == self.pid:
          continue
        try:
          _wait.until(lambda c=c: not c.call(_requests.Discard(step=step, by=self.process))[0].persisting,
                      timeout_secs=timeout_secs, poll_secs=0.01, late=lambda c=c: (
                          f"discard of step {step}: the persist that {c.who} runs of it did "
                          f"not stop within {timeout_secs} s (it will not commit)"))
        except errors.AgentUnavailableError as e:
          logger.warning("delete of step %d: skipping %s: %s", step, c.who, e)

  @contextlib.contextmanager
  def read(self, step: int) -> Iterator[tuple[SnapshotManifest, Any]]:
    r = self.call(_requests.Open(pid=os.getpid(), step=step))
    lent: list[bool] = []
    self._lending[step] = (r.index, lent)
    try:
      with self._maps_lock:
        known = self._committed.get(step)
      manifest = (known[1] if known is not None and known[0] == r.manifest
                  else SnapshotManifest.from_json(r.manifest))
      yield manifest, self._read_map(r, manifest)
    finally:
      self._lending.pop(step, None)
      if lent:      # the map is the restored arrays' now: its memory goes with the last of
        with self._maps_lock:             # them (and the next reservation), not with this
          if self._maps.get(r.index, ("",))[0] == r.path:       # slot's next file
            self._lent[r.index] = self._maps.pop(r.index)
      with contextlib.suppress(errors.AgentUnavailableError):   # (its reply is taken by the
        self._client.post(_requests.Close(                      # next request: a restore
            pid=os.getpid(), step=step, index=r.index, lend=bool(lent)))   # does not wait)

  def _read_map(self, r: _requests.Open.Reply, manifest: SnapshotManifest) -> np.ndarray:
    """The pinned slot's memory, through the map kept for it; a missing, short or
    replaced file is corrupt (CorruptSnapshotError: the restore reads the next tier),
    never a SIGBUS."""
    if not manifest.nbytes:
      return np.empty(0, np.uint8)
    where = f"step {manifest.step}: the snapshot file {r.path}"
    if r.size < manifest.nbytes:
      raise errors.CorruptSnapshotError(
          f"{where} has {r.size} bytes, its manifest needs {manifest.nbytes}; it was "
          "truncated (restore another tier)")
    with self._maps_lock:
      lent = self._lent.get(r.index)
    if lent is not None and lent[:2] == (r.path, r.size):
      why = _intact(lent[2], r.path, lent[3], manifest.nbytes)
      if why is None:                  # (the agent never writes a lent file again)
        return lent[2]
      with self._maps_lock:            # (a new agent's file of that name, or a truncated one)
        if self._lent.get(r.index) is lent:
          del self._lent[r.index]
    try:
      buf = self._map(r.index, r.path, r.size)
    except (OSError, ValueError) as e:
      if isinstance(e, errors.JaxckptError):
        raise errors.CorruptSnapshotError(f"step {manifest.step}: {e} (restore another "
                                          "tier)") from None
      raise errors.CorruptSnapshotError(f"{where} cannot be mapped ({e})") from None
    if (why := _intact(buf, r.path, None, manifest.nbytes)) is not None:
      raise errors.CorruptSnapshotError(f"{where} {why} (restore another tier)")
    return buf

  def lend(self, step: int, buffer: Any) -> bool:
    """Restored arrays keep views of ``buffer`` (``step``'s slot, pinned by
    ``read``): the agent never writes that slot's file again, as the unpin at
    the end of ``read`` tells it (until then the pin keeps every writer out)."""
    with self._maps_lock:
      mapped = self._lending.get(step)
      if mapped is None or all(m.get(mapped[0], (None, None, None))[2] is not buffer
                               for m in (self._maps, self._lent)):
        return False                   # the caller copies instead
    mapped[1].append(True)
    return True

  def close(self, timeout_secs: float = 300.0) -> None:
    """Gives up this trainer's lease (the agent goes on persisting what is queued)."""
    del timeout_secs            # the manager waited for its persists already
    try:
      if pid_alive(self.pid):
        self.call(_requests.Bye(pid=os.getpid(), owner=self.owner))
    except errors.JaxckptError as e:
      logger.warning("%s: could not give up the lease at close: %s", self.who, e)
    finally:
      self._maps.clear()
      self._lent.clear()
      self._client.close()


def _listening(endpoint: str, timeout_secs: float) -> bool:
  """Whether something accepts TCP connections at ``tcp://HOST:PORT``."""
  host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_secs):
      return True
  except (OSError, ValueError):
    return False


def _intact(buf: np.ndarray, path: str, ident: tuple[int, int] | None, need: int) -> str | None:
  """Why the map ``buf`` of ``path`` must not be touched, or None: its file (the one
  mapped, by the map's own descriptor: fstat) is shorter than ``need`` bytes (a page
  past its end is SIGBUS), or ``path`` now names another file than ``ident``."""
  try:
    size = buf.base.obj.size()          # fstat of the mapped file (frombuffer's base: a view)
  except (AttributeError, OSError, ValueError):
    size = None
  if size is not None and size < need:
    return f"is {size} bytes, shorter than the {need} mapped: it was truncated"
  if ident is not None:
    try:
      st = os.stat(path)
    except OSError as e:
      return f"is gone ({e.strerror})"
    if (st.st_dev, st.st_ino) != ident:
      return "was replaced by another file"
  return None


_MADV_POPULATE_WRITE = 23       # Linux 5.14+ (Python's mmap module names it from 3.13)


def _map_file(path: str, size: int) -> tuple[np.ndarray, tuple[int, int]]:
  """A shared, writable map of ``size`` bytes of ``path`` (huge pages where the run
  root's tmpfs allows them), and the mapped file's (device, inode)."""
  with open(path, "r+b") as f:
    st = os.fstat(f.fileno())
    if st.st_size < size:              # (mmap would map past the end: SIGBUS at first touch)
      raise errors.CorruptSnapshotError(
          f"the snapshot file {path} is {st.st_size} bytes, shorter than its slot's {size}: "
          "it was truncated")
    mm = mmap.mmap(f.fileno(), size)
  with contextlib.suppress(OSError, AttributeError, ValueError):
    mm.madvise(mmap.MADV_HUGEPAGE)
  return np.frombuffer(mm, np.uint8), (st.st_dev, st.st_ino)


def _populate(buf: np.ndarray) -> None:
  """Maps every page of a slot map for writing, now (``prepare()``): the first save
  into the slot then pays no page fault a page (~4 us each: 0.25 s for 256 MiB)."""
  if not buf.size:
    return
  try:
    buf.base.obj.madvise(_MADV_POPULATE_WRITE)    # (frombuffer's base: a view of the mmap)
  except (OSError, AttributeError, ValueError):   # an older kernel: write each page
    view = buf[::mmap.PAGESIZE]
    np.bitwise_or(view, 0, out=view)


def _peers(records: dict[str, dict[str, Any]], *, merge: bool = False) -> _requests.Peers:
  """The request that tells an agent the job's agents (``records``: address records by
  process index)."""
  try:
    return _requests.Peers(peers=msgspec.convert(records, dict[str, _requests.AgentAddress]),
                           merge=merge)
  except msgspec.ValidationError as e:
    raise _schema.refused(e, records, "request 'peers'", tail="") from None
