"""The job's other agents, as a trainer's store sees them (``AgentStore.job``): who
they are (``discover``, a replaced agent announced and followed), and what the
store asks of them all at once (what they hold, a restore's pieces, a delete)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import socket
from typing import TYPE_CHECKING, Any, Iterator

import msgspec

from jaxckpt import errors
from jaxckpt.util import _crash, _wait
from jaxckpt.agent.trainer import _parity_recovery
from jaxckpt.agent import _requests
from jaxckpt.agent._protocol import Client, each
from jaxckpt.agent.trainer._remote import (clients_of, complete_steps_of, job_agents,
                                   open_remote_piece, _rebuilt_pieces)
from jaxckpt.host.snapshot import SnapshotManifest
from jaxckpt.net import _schema

if TYPE_CHECKING:
  from jaxckpt.agent.trainer.client import AgentStore

logger = logging.getLogger("jaxckpt.agent.trainer.client")

# How long discover waits for an agent of the job's earlier run to answer (a lost
# machine's never does).
_PROBE_SECS = 5.0


class JobAgents:
  """The agents of ``store``'s job: this machine's, those the other processes
  published (``discover``), and the earlier run's that serve its first restore."""

  def __init__(self, store: AgentStore) -> None:
    self.store = store
    self.directory: list[dict[str, Any]] = []     # the job's agents on other machines
    # agents of the job's earlier run on machines outside this run (discover): they serve
    # its first restore, until this trainer's first commit
    self.elsewhere: list[dict[str, Any]] = []
    self.size: int | None = None                  # processes of the job (discover)
    self.peers: dict[str, dict[str, Any]] = {}    # process index -> its agent (discover)
    # the agents that did not answer the last survey of them all (holders, parity_steps)
    self.unanswered: list[str] = []

  def announce(self, dead: dict[str, Any]) -> None:
    """Tells the job's agents (this host's new one too) where this host's agent is
    now, so parity reaches it, and forgets the ``dead`` one's address; an agent
    that does not answer hears it at the next ``discover``. Only in a job that
    was discovered (several hosts)."""
    if not self.peers:
      return
    old_pid = dead["pid"]
    self.directory = [a for a in self.directory if a["tcp"] != dead["tcp"]] + [self.store.info]
    self.peers[str(self.store.process)] = self.store.info
    mine = {str(self.store.process): self.store.info}
    with self.clients() as clients:
      for c in clients.values():
        try:
          if c.pid == self.store.pid:
            c.call(_peers(self.peers))
          else:
            c.call(_peers(mine, merge=True))
        except errors.JaxckptError as e:    # it hears at the next discover; parity to
          # this host fails until then, which wait_until_protected reports
          logger.warning("telling %s of host %d's new agent (the old was pid %s): %s",
                         c.who, self.store.host, old_pid, e)

  def local(self) -> list[dict[str, Any]]:
    """The live agents of this job on this machine (under this run root)."""
    return list(job_agents(self.store.run_root, self.store.opts.job_name).values())

  def all(self) -> list[dict[str, Any]]:
    """Every agent of the job this store knows of: this machine's, those the
    other processes published (``discover``) or announced since as the new agent of
    their process, and until this trainer's first commit the earlier run's agents on
    machines outside this run, each once."""
    self.follow_replaced()
    out = {a["tcp"]: a for a in [*self.directory, *self.elsewhere]}
    out.update((a["tcp"], a) for a in self.local())
    return list(out.values())

  def follow_replaced(self) -> None:
    """Takes the new agents that other processes started in place of dead ones
    since ``discover`` (they announce them to this host's agent: ``announce``) in
    place of the dead ones: else every request of the job's (what it holds, a
    restore, a delete) waited out its timeout on a dead agent and never reached
    the new one. One request to this host's agent; nothing in a job that was not
    discovered (one host)."""
    if not self.peers:
      return
    try:
      peers = self.store.client.call(_requests.JobView())[0].peers
    except errors.JaxckptError as e:    # this host's agent died (the next request starts a
      logger.debug("%s: no view of the job's agents: %s", self.store.who, e)   # new one), or is old
      return
    for p, info in peers.items():
      old = self.peers.get(p)
      if (p == str(self.store.process) or old is None or not isinstance(info, dict)
          or info.get("tcp") == old.get("tcp") or not isinstance(info.get("host"), int)
          or not isinstance(info.get("pid"), int) or not isinstance(info.get("tcp"), str)):
        continue
      logger.info("process %s of job %r has a new snapshot agent: host %d (pid %d) at %s, "
                  "in place of pid %s at %s", p, self.store.opts.job_name, info["host"],
                  info["pid"], info["tcp"], old.get("pid"), old.get("tcp"))
      self.directory = [a for a in self.directory if a["tcp"] != old["tcp"]] + [dict(info)]
      self.peers[p] = dict(info)

  # -- the job's other agents (HostStore's job methods) -------------------------

  @contextlib.contextmanager
  def clients(self, timeout_secs: float | None = None,
              agents: list[dict[str, Any]] | None = None) -> Iterator[dict[int, Client]]:
    """Clients of every agent of the job this store knows of (or of ``agents``; see
    :func:`clients_of`), each request bounded by ``timeout_secs`` (a wait's time left)
    when shorter than ``AgentOptions.request_timeout_secs``."""
    store = self.store
    timeout = store.opts.request_timeout_secs
    if timeout_secs is not None:
      timeout = max(0.05, min(timeout, timeout_secs))
    with clients_of(self.all() if agents is None else agents, store.opts.job_name,
                    local_pid=store.pid, secret=store.secret, timeout_secs=timeout) as clients:
      yield clients

  def complete_steps(self) -> list[int]:
    with self.clients() as clients:
      return complete_steps_of(clients)

  def holders(self, step: int, *, timeout_secs: float | None = None) -> tuple[set[int], int | None]:
    held, count, skipped = set(), None, []
    with self.clients(timeout_secs) as clients:
      for here in each(clients, lambda c: c.call(_requests.Held())[0].held, skipped=skipped).values():
        for s, index, n in here:
          if s == step:
            held.add(index)
            count = n
    self.unanswered = skipped
    return held, count

  def parity_steps(self, *, timeout_secs: float | None = None) -> dict[int, Any]:
    if not self.store.parity_options:                  # this trainer's job keeps no parity
      return {}
    skipped: list[str] = []
    with self.clients(timeout_secs) as clients:
      out = _parity_recovery.survey(clients, skipped=skipped)
    self.unanswered = skipped
    return out

  def step_manifest(self, step: int) -> SnapshotManifest | None:
    """Any agent's manifest of ``step`` (each records every leaf), else one of the
    group's manifests that a parity holder keeps for its rebuild."""
    with self.clients() as clients:
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
    clients = stack.enter_context(self.clients())
    others = {k: c for k, c in clients.items()   # (this host's own piece is read from its memory)
              if not (c.pid == self.store.pid and local_index is not None)}
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
    mine = {"own": self.store.info, "local": self.local(), "earlier": self.earlier()}
    everyone = [json.loads(v) for v in _kv.allgather(
        f"agents/{self.store.opts.job_name}", json.dumps(mine), timeout_secs=timeout_secs,
        what="their snapshot agents' addresses")]
    self.directory = [a for e in everyone for a in e["local"]]
    self.size = len(everyone)
    self.peers = {str(p): e["own"] for p, e in enumerate(everyone)}
    here = {a["tcp"] for a in self.directory}
    earlier = sorted({a["tcp"]: a for e in everyone for a in e.get("earlier", [])
                      if a["tcp"] not in here}.items())
    if earlier:                            # (every process decides alike: same data)
      me = next(p for p, e in enumerate(everyone) if e["own"]["tcp"] == self.store.info["tcp"])
      mine_to_ask = [a for i, (_, a) in enumerate(earlier) if i % len(everyone) == me]
      answered = [json.loads(v) for v in _kv.allgather(
          f"agents_earlier/{self.store.opts.job_name}", json.dumps(self.answering(mine_to_ask)),
          timeout_secs=timeout_secs, what="which agents of the job's earlier run answer")]
      alive = {tcp for tcps in answered for tcp in tcps}
      self.elsewhere = [a for tcp, a in earlier if tcp in alive]
      if self.elsewhere:
        logger.info("agents of the job's earlier run outside this one serve its restore: %s",
                    ", ".join(f"host {a['host']} at {a['tcp']}" for a in self.elsewhere))
    self.store.call(_peers(self.peers))

  def earlier(self) -> list[dict[str, Any]]:
    """The agents this host's agent was told of by the job's earlier run (none: a new
    agent, or one that never had peers)."""
    try:
      peers = self.store.call(_requests.JobView()).peers
    except errors.JaxckptError as e:      # an agent of an older jaxckpt: nothing to add
      logger.info("%s: no earlier peers (%s)", self.store.who, e)
      return []
    return [dict(a) for a in peers.values()
            if isinstance(a, dict) and isinstance(a.get("tcp"), str)]

  def answering(self, records: list[dict[str, Any]]) -> list[str]:
    """The tcp addresses of ``records`` whose agent answers with this job's secret
    within a few seconds (a lost machine's never does), asked at once."""
    if not records:
      return []
    secs = min(_PROBE_SECS, self.store.opts.request_timeout_secs)

    def answers(info: dict[str, Any]) -> bool:
      if not _listening(info["tcp"], secs):    # (a refused port says so at once; ZeroMQ
        return False                            # would wait out the timeout)
      c = Client.of(info, who=f"snapshot agent of job {self.store.opts.job_name!r} host "
                    f"{info.get('host')} at {info['tcp']}", timeout_secs=secs,
                    secret=self.store.secret)
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

  def discard_elsewhere(self, step: int, timeout_secs: float) -> None:
    """The job's other agents discard ``step`` as this host's delete (each fenced
    until its persist of it has ended); one that does not answer is skipped with
    a warning (its snapshots count as lost)."""
    with self.clients() as clients:
      for c in clients.values():
        if c.pid == self.store.pid:
          continue
        def ended(c: Client = c) -> bool:
          return not c.call(_requests.Discard(step=step, by=self.store.process))[0].persisting
        try:
          _wait.until(ended, timeout_secs=timeout_secs, poll_secs=0.01, late=lambda c=c: (
              f"discard of step {step}: the persist that {c.who} runs of it did "
              f"not stop within {timeout_secs} s (it will not commit)"))
        except errors.AgentUnavailableError as e:
          logger.warning("delete of step %d: skipping %s: %s", step, c.who, e)


  def rollback_elsewhere(self, req: _requests.Rollback, timeout_secs: float) -> None:
    """The job's other agents apply rollback ``req`` (its steps discarded at once, each
    fenced until its persist has ended; once per agent, whoever asks again); one that
    does not answer is skipped with a warning (its snapshots count as lost)."""
    with self.clients() as clients:
      for c in clients.values():
        if c.pid == self.store.pid:
          continue
        try:
          self._rolled_back(c, req, timeout_secs)
        except errors.AgentUnavailableError as e:
          logger.warning("rollback %s: skipping %s: %s", req.id, c.who, e)
        _crash.point("rollback")

  def agent_addresses(self) -> list[str]:
    """The tcp addresses of every agent of the job this store knows of (a rollback's)."""
    return sorted(a["tcp"] for a in self.all())

  def complete_rollbacks(self, timeout_secs: float) -> None:
    """The rollbacks of this run that some agent of the job recorded, applied on every
    agent they were sent to that missed them (its trainer was killed between the
    agents; an agent started since holds none of their steps and is left alone); an
    agent that does not answer is skipped with a warning."""
    agents = sorted(self.all(), key=lambda a: (a["host"], a["tcp"]))   # (clients_of's order)
    with self.clients(agents=agents) as clients:
      held: dict[int, dict[str, _requests.RollbackRecord]] = {}
      for h, c in clients.items():
        try:
          held[h] = dict(c.call(_requests.Rollback())[0].rollbacks)
        except errors.JaxckptError as e:    # (gone, or an answer that is not one: skipped)
          logger.warning("skipping %s: %s", c.who, e)
      every = {rid: r for mine in held.values() for rid, r in mine.items()
               if r.run == self.store.run}
      for h, mine in held.items():
        c = clients[h]
        for rid in sorted(set(every) - set(mine)):
          r = every[rid]
          if agents[h]["tcp"] not in r.agents:
            continue
          logger.warning("completing rollback %s (steps %s) on %s: its trainer was killed "
                         "before it reached it", rid, r.steps, c.who)
          self._rolled_back(c, _requests.Rollback(
              id=rid, steps=r.steps, by=self.store.process, run=r.run,
              agents=r.agents), timeout_secs)

  @staticmethod
  def _rolled_back(c: Client, req: _requests.Rollback, timeout_secs: float) -> None:
    """``req`` applied by agent ``c``, once none of its steps' persists runs there."""
    _wait.until(lambda: not c.call(req)[0].persisting, timeout_secs=timeout_secs,
                poll_secs=0.01, late=lambda: (
                    f"rollback {req.id}: the persists that {c.who} runs of steps {req.steps} "
                    f"did not stop within {timeout_secs} s (they will not commit)"))


def _listening(endpoint: str, timeout_secs: float) -> bool:
  """Whether something accepts TCP connections at ``tcp://HOST:PORT``."""
  host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_secs):
      return True
  except (OSError, ValueError):
    return False


def _peers(records: dict[str, dict[str, Any]], *, merge: bool = False) -> _requests.Peers:
  """The request that tells an agent the job's agents (``records``: address records by
  process index)."""
  try:
    return _requests.Peers(peers=msgspec.convert(records, dict[str, _requests.AgentAddress]),
                           merge=merge)
  except msgspec.ValidationError as e:
    raise _schema.refused(e, records, "request 'peers'", tail="") from None
