"""A job's snapshot agents, found from this machine: what ``jaxckpt status``,
``jaxckpt delete`` and ``jaxckpt agent status|stop`` use, with no host id to guess.

A job's agents on this machine live under its run root (``RUN_ROOT/JOB/hostH``).
Each was told by its trainer where the job's other agents are: the addresses the
job's processes published through jax.distributed's key-value store when the
manager started (``AgentStore.discover``). So asking the local agents
(``job_view``) finds every agent of the job, on every machine. Local agents are
reached through their ipc sockets, the others over TCP, all with the job's
secret (``RUN_ROOT/JOB/secret``, the same on every machine of the job). No JAX.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import time
from typing import Any

import psutil

from jaxckpt import errors
from jaxckpt.util import _wait
from jaxckpt.agent import _paths, _requests
from jaxckpt.agent._protocol import Client
from jaxckpt.agent.trainer._remote import job_agents

# The flags of ``jaxckpt agent serve`` (what start_agent spawns) that say where an agent is.
_SERVE = argparse.ArgumentParser(add_help=False)
_SERVE.add_argument("--job-name")
_SERVE.add_argument("--host-id", type=int, default=0)
_SERVE.add_argument("--run-root", default=None)


@dataclasses.dataclass
class AgentView:
  """One agent of the job as it answered (``alive`` False and ``error`` set if it did not).

  Attributes:
    host: the host id (process index) it serves. pid: its process id.
    address: its TCP address. local: under this machine's run root.
    held: the steps it holds in host memory. protected: the newest step whose parity its
      group holds (None without parity). persisted: the steps it wrote to storage.
    pending: the steps due for storage not yet written, oldest first.
    lag_steps: its newest step (held or pending) minus the oldest pending one (0: none
      pending; never negative).
    lag_secs: how long the oldest pending step has waited.
    bytes, limit_bytes: host memory its slots and parity take, against its budget.
    directory: where it persists (None: no trainer asked it to).
    directories: that and where the persists still running under a trainer's earlier
      options write (a delete in any of them must reach this agent).
    trainers: pids of the trainers using it.
    served_bytes: snapshot and parity bytes it has sent other processes (their restores,
      their parity) since it started.
  """
  host: int
  pid: int
  address: str
  local: bool
  alive: bool = False
  error: str | None = None
  held: list[int] = dataclasses.field(default_factory=list)
  protected: int | None = None
  persisted: list[int] = dataclasses.field(default_factory=list)
  pending: list[int] = dataclasses.field(default_factory=list)
  lag_steps: int = 0
  lag_secs: float | None = None
  bytes: int = 0
  limit_bytes: int = 0
  directory: str | None = None
  directories: list[str] = dataclasses.field(default_factory=list)
  trainers: list[int] = dataclasses.field(default_factory=list)
  served_bytes: int = 0
  peers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict, repr=False)
  record: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)  # its address


@dataclasses.dataclass
class JobStatus:
  """Every agent of ``job`` found from ``run_root``, by host id then address."""
  job: str
  run_root: str
  agents: list[AgentView]

  def to_obj(self) -> dict[str, Any]:
    return {"job": self.job, "run_root": self.run_root,
            "agents": [{k: v for k, v in dataclasses.asdict(a).items()
                        if k not in ("peers", "record")} for a in self.agents]}


def local_jobs(run_root: str) -> dict[str, dict[int, dict[str, Any]]]:
  """The jobs with a live agent under ``run_root``: job -> host id -> address record."""
  out = {}
  if os.path.isdir(run_root):
    for name in sorted(os.listdir(run_root)):
      try:
        agents = job_agents(run_root, name)
      except errors.InvalidArgumentError:     # not a job's directory
        continue
      if agents:
        out[name] = agents
  return out


def jobs_here(run_root: str, job: str | None) -> dict[str, dict[int, dict[str, Any]]]:
  """``job`` (or every job) with a live agent under ``run_root``; AgentUnavailableError
  naming the run root and the jobs it has when there is none."""
  every = local_jobs(run_root)
  jobs = every if job is None else {job: every[job]} if job in every else {}
  if not jobs:
    what = f"of job {job!r} " if job is not None else ""
    others = f" (it has agents of {sorted(every)})" if every else ""
    raise errors.AgentUnavailableError(
        f"no snapshot agent {what}runs on this machine under {run_root}{others}; a job's agents "
        "are found from the run root of a machine that runs one of them: run this there, or "
        "pass --run-root (AgentOptions.run_root)")
  return jobs


def _client(info: dict[str, Any], job: str, local: bool, secret: bytes,
            timeout_secs: float) -> Client:
  return Client.of(info, who=f"snapshot agent of job {job!r} host {info['host']} (pid "
                   f"{info['pid']}, {info['tcp']})", timeout_secs=timeout_secs, secret=secret,
                   endpoint=info["ipc"] if local else None)


def _ask(info: dict[str, Any], job: str, local: bool, secret: bytes,
         timeout_secs: float) -> AgentView:
  """One agent's view; an agent that does not answer is shown with the error."""
  view = AgentView(host=int(info["host"]), pid=int(info["pid"]), address=info["tcp"], local=local,
                   record=dict(info))
  c = _client(info, job, local, secret, timeout_secs)
  try:
    st = c.call(_requests.Status())[0]
    view.held, view.bytes, view.limit_bytes = list(st.steps), st.bytes, st.limit_bytes
    view.trainers, view.served_bytes = list(st.trainers), st.served_bytes
    view.protected = c.call(_requests.Steps())[0].protected
    persist = c.call(_requests.Persisted(errors=False))[0].persist     # the trainer's errors stay queued
    view.persisted = [] if persist is None else list(persist.persisted)
    view.pending = [] if persist is None else list(persist.pending)
    view.alive = True
    view.lag_steps = lag_steps(view.held, view.pending)
    try:
      jv = c.call(_requests.JobView())[0]
      view.peers, view.lag_secs = jv.peers, jv.lag_secs
      view.directory = (jv.persist or {}).get("directory")
      view.directories = list(jv.directories) or ([view.directory] if view.directory else [])
    except errors.JaxckptError as e:          # an agent of an older jaxckpt
      view.error = f"no job view ({e})"
  except errors.JaxckptError as e:
    view.error = str(e)
  finally:
    c.close()
  return view


def lag_steps(held: list[int], pending: list[int]) -> int:
  """How many steps the oldest pending persist is behind the newest step the agent
  knows (held, or pending itself: the two lists come from two requests, and a step
  committed between them is pending but not yet in ``held``); 0 with none pending.

  >>> lag_steps([9, 10], [11]), lag_steps([9, 10, 11], [5, 11]), lag_steps([4], [])
  (0, 6, 0)
  """
  if not pending:
    return 0
  return max([*held, *pending]) - min(pending)


def job_status(run_root: str, job: str, *, timeout_secs: float = 5.0) -> JobStatus:
  """Every agent of ``job``: those under ``run_root`` and every one they were told of.

  Agents are asked at once (one that does not answer costs ``timeout_secs``, once).
  """
  local = job_agents(run_root, job)
  secret = _paths.job_secret(run_root, job)
  with concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="jaxckpt-status") as pool:
    views = list(pool.map(lambda i: _ask(i, job, True, secret, timeout_secs), local.values()))
    known = {v.address for v in views}
    peers = {info["tcp"]: info for v in views for info in v.peers.values()
             if info.get("tcp") not in known}
    views += list(pool.map(lambda i: _ask(i, job, False, secret, timeout_secs), peers.values()))
  return JobStatus(job, run_root, sorted(views, key=lambda v: (v.host, v.address)))


def same_directory(a: str, b: str) -> bool:
  """Whether two checkpoint directories (paths or URLs) name the same place."""
  def norm(d: str) -> str:
    d = d.removeprefix("file://") if d.startswith("file:///") else d
    return os.path.realpath(d) if "://" not in d else d.rstrip("/")
  return norm(a) == norm(b)


@dataclasses.dataclass
class Fenced:
  """What fencing a step did: the agents told, and those of them that held it."""
  job: str
  agents: list[AgentView]
  dropped: list[int]            # host ids whose agent held the step (now forgotten)
  persisting: list[int]         # host ids whose agent was persisting it (stopped, not committed)


def fence_step(run_root: str, directory: str, step: int, *, job: str | None = None,
               timeout_secs: float = 60.0, ignore_unreachable: bool = False) -> list[Fenced]:
  """Makes sure no persist of ``step`` to ``directory`` commits from now on: every agent of
  each job (under ``run_root``, and their peers) that persists to ``directory`` is told to
  ``discard`` the step, as ``CheckpointManager.delete()`` tells its own, and asked again until
  none of them persists it. The agents forget the step too (every tier, as delete() does).

  Raises:
    AgentUnavailableError: an agent of such a job did not answer (its persist could still
      commit), unless ``ignore_unreachable``.
    SnapshotTimeoutError: a persist of the step did not stop within ``timeout_secs``.
  """
  out = []
  for name in (local_jobs(run_root) if job is None else [job]):
    st = job_status(run_root, name, timeout_secs=min(timeout_secs, 10.0))
    if not any(same_directory(d, directory) for a in st.agents for d in a.directories):
      continue
    silent = [a for a in st.agents if not a.alive]
    if silent and not ignore_unreachable:
      raise errors.AgentUnavailableError(
          f"agents of job {name!r} persist to {directory!r}, and these did not answer: "
          + "; ".join(f"host {a.host} pid {a.pid} at {a.address}: {a.error}" for a in silent)
          + f". A persist of step {step} they run could still commit; pass "
          "--ignore-unreachable if they are gone for good")
    secret = _paths.job_secret(run_root, name)
    fenced = Fenced(name, [a for a in st.agents if a.alive], [], [])
    for a in fenced.agents:
      c = _client(a.record, name, a.local, secret, timeout_secs)
      try:
        _discard(c, a, step, fenced, timeout_secs)
      finally:
        c.close()
    out.append(fenced)
  return out


def _discard(c: Client, a: AgentView, step: int, fenced: Fenced, timeout_secs: float) -> None:
  """``discard`` until the agent persists the step no more (the same request and wait as
  ``AgentStore.discard``)."""
  first = c.call(_requests.Discard(step=step))[0]
  if first.discarded:
    fenced.dropped.append(a.host)
  if first.persisting:
    fenced.persisting.append(a.host)
  start = time.monotonic()
  _wait.until(lambda: not c.call(_requests.Discard(step=step))[0].persisting,
              timeout_secs=timeout_secs, poll_secs=0.01, max_poll_secs=0.2, late=lambda: (
                  f"the persist of step {step} that {c.who} runs did not stop within "
                  f"{time.monotonic() - start:.0f} s (it will not commit)"))


@dataclasses.dataclass
class LocalAgent:
  """A snapshot agent process of this user on this machine, whatever its run root.

  Attributes:
    pid: its process. job, host, run_root: what it serves, and where its files are.
    rss_bytes: its resident memory (its shared-memory slots are in ``bytes``).
    answered: it answered ``status`` (else ``error`` says why).
    bytes, limit_bytes: host memory its slots and parity take, against its budget.
    steps: the steps it holds. trainers: pids of the trainers using it.
    idle_secs: how long it has been idle (None: a trainer uses it);
      idle_timeout_secs: it exits once idle that long.
  """
  pid: int
  job: str
  host: int
  run_root: str
  rss_bytes: int = 0
  answered: bool = False
  error: str | None = None
  bytes: int = 0
  limit_bytes: int = 0
  steps: list[int] = dataclasses.field(default_factory=list)
  trainers: list[int] = dataclasses.field(default_factory=list)
  idle_secs: float | None = None
  idle_timeout_secs: float | None = None

  @property
  def directory(self) -> str:
    return _paths.agent_dir(self.run_root, self.job, self.host)


def parse_agent_command(cmd: list[str]) -> tuple[str, int, str | None] | None:
  """(job, host id, run root or None) of a ``jaxckpt agent serve`` command line (as
  spawned, ``python -m jaxckpt.agent serve``, or ``(python -m) jaxckpt agent serve``);
  None for any other command."""
  for i in range(len(cmd) - 1):
    if cmd[i + 1] == "serve" and (cmd[i] == "jaxckpt.agent" or (
        cmd[i] == "agent" and i > 0 and os.path.basename(cmd[i - 1]) == "jaxckpt")):
      break
  else:
    return None
  args, _ = _SERVE.parse_known_args(cmd[i + 2:])
  if not args.job_name:
    return None
  try:
    _paths.check_job_name(args.job_name)
  except errors.InvalidArgumentError:
    return None
  return args.job_name, args.host_id, args.run_root


def agent_of(proc: psutil.Process) -> LocalAgent | None:
  """The agent ``proc`` runs (:func:`parse_agent_command` of its command line), or None."""
  try:
    found = parse_agent_command(proc.cmdline())
    rss = proc.memory_info().rss
  except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
    return None
  if found is None:
    return None
  job, host, run_root = found
  return LocalAgent(pid=proc.pid, job=job, host=host,
                    run_root=run_root or _paths.default_run_root(), rss_bytes=rss)


def local_agents(*, ask: bool = True, timeout_secs: float = 5.0) -> list[LocalAgent]:
  """Every snapshot agent process of this user on this machine (by its command line:
  any run root), asked what it holds (``ask``), by job, host and pid."""
  uid = os.getuid()
  found = []
  for proc in psutil.process_iter(["uids"]):
    try:
      if proc.info["uids"] is None or proc.info["uids"].real != uid or proc.pid == os.getpid():
        continue
    except (psutil.NoSuchProcess, psutil.AccessDenied):
      continue
    a = agent_of(proc)
    if a is not None:
      found.append(a)
  if ask:
    with concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="jaxckpt-list") as pool:
      list(pool.map(lambda a: _ask_local(a, timeout_secs), found))
  return sorted(found, key=lambda a: (a.job, a.host, a.pid))


def _ask_local(a: LocalAgent, timeout_secs: float) -> None:
  info = _paths.read_address(a.directory)
  if info is None or int(info.get("pid", -1)) != a.pid:
    a.error = f"no address file of pid {a.pid} in {a.directory} (starting, or stopping)"
    return
  try:
    c = _client(info, a.job, True, _paths.job_secret(a.run_root, a.job), timeout_secs)
  except errors.JaxckptError as e:
    a.error = str(e)
    return
  try:
    st = c.call(_requests.Status())[0]
    a.answered = True
    a.bytes, a.limit_bytes = st.bytes, st.limit_bytes
    a.steps, a.trainers = list(st.steps), list(st.trainers)
    a.idle_secs, a.idle_timeout_secs = st.idle_secs, st.idle_timeout_secs
  except errors.JaxckptError as e:
    a.error = str(e)
  finally:
    c.close()
