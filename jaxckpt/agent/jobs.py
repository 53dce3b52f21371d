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

import concurrent.futures
import dataclasses
import os
import time
from typing import Any

from jaxckpt import errors
from jaxckpt.util import _wait
from jaxckpt.agent import _paths
from jaxckpt.agent._protocol import Client
from jaxckpt.agent._remote import job_agents


@dataclasses.dataclass
class AgentView:
  """One agent of the job as it answered (``alive`` False and ``error`` set if it did not).

  Attributes:
    host: the host id (process index) it serves. pid: its process id.
    address: its TCP address. local: under this machine's run root.
    held: the steps it holds in host memory. protected: the newest step whose parity its
      group holds (None without parity). persisted: the steps it wrote to storage.
    pending: the steps due for storage not yet written, oldest first.
    lag_steps: its newest held step minus the oldest pending one (0: none pending).
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
    st = c.call("status")[0]
    view.held, view.bytes, view.limit_bytes = list(st.steps), st.bytes, st.limit_bytes
    view.trainers, view.served_bytes = list(st.trainers), st.served_bytes
    view.protected = c.call("steps")[0].protected
    persist = c.call("persisted", errors=False)[0].persist     # the trainer's errors stay queued
    view.persisted = list(persist.get("persisted", []))
    view.pending = list(persist.get("pending", []))
    view.alive = True
    if view.pending and view.held:
      view.lag_steps = max(view.held) - view.pending[0]
    try:
      jv = c.call("job_view")[0]
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
  first = c.call("discard", step=step)[0]
  if first.discarded:
    fenced.dropped.append(a.host)
  if first.persisting:
    fenced.persisting.append(a.host)
  start = time.monotonic()
  _wait.until(lambda: not c.call("discard", step=step)[0].persisting,
              timeout_secs=timeout_secs, poll_secs=0.01, max_poll_secs=0.2, late=lambda: (
                  f"the persist of step {step} that {c.who} runs did not stop within "
                  f"{time.monotonic() - start:.0f} s (it will not commit)"))
