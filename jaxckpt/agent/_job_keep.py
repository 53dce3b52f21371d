"""Which steps a host keeps in a job of several hosts: the job's decision, not its own.

A step the job holds is one every host holds: a relaunch restores the newest step
that every process's agent still holds, so a host must not drop a step on its own
timing (it is one step ahead of a slower host, its parity of a step was superseded,
a protected step took a place of the ``keep``) while no newer step is held by all.
Each agent of a job (``Agent.keep``) tells its peers which steps it holds whenever
that changes (``PeerHeld``, sent on its own thread, never the request thread's) and
learns theirs; the newest step held here and by every peer, as last said, is the
job's *whole* step (``SlotTable.agree``): the keep rule drops only steps older than
it. A host that learns of a newer whole step sooner than another drops nothing the
other still needs: the newest step any host knows whole was held by every host, and
no host drops it before it knows a newer one whole, so at every moment some step is
held by every host. A step counts as held by every host only where each host's is of
the same run (its current trainers committed it, or an earlier run's did): after a
relaunch rolled back, a step number saved again is not whole while another host still
holds the abandoned timeline's.

A peer's word that is lost only keeps steps longer (the word is said again, every
``REPEAT_SECS`` while a newer step than the whole one is held, for a while after the
last change). A new map of the job's agents (a relaunch: ``Peers``) or a replaced
agent of a process forgets what was known of it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from jaxckpt import errors
from jaxckpt.agent import _requests
from jaxckpt.agent._protocol import Client

if TYPE_CHECKING:
  from jaxckpt.agent._server import Agent

logger = logging.getLogger("jaxckpt.agent")

# How often a host repeats what it holds while a newer step than the job's whole one
# waits for the others, and for how long after its last change.
REPEAT_SECS = 1.0
REPEAT_FOR_SECS = 120.0
# The longest one peer's word may take (a peer that does not answer hears it later).
SAY_TIMEOUT_SECS = 2.0


class JobKeep:
  """``agent``'s view of what the job's other hosts hold (see the module docstring)."""

  def __init__(self, agent: Agent) -> None:
    self.agent = agent
    # process index -> the steps its agent holds: whether its current trainer committed each
    self.held: dict[int, dict[int, bool]] = {}
    self.fresh: set[int] = set()             # steps committed here since the last new map
    self.me: int | None = None               # the process this agent serves, in the map
    self._pids: dict[int, Any] = {}          # process index -> its agent's pid, in the map
    self._clients: dict[int, tuple[Any, Client]] = {}
    self._said: tuple[int, ...] | None = None
    self._changed_at = time.monotonic()
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # -- under the agent's lock -------------------------------------------------

  def peers_changed(self, merge: bool) -> None:
    """The job's map of agents changed (``Agent.peers``): a new map (a relaunch) forgets
    what was known; a process whose agent was replaced holds nothing of what its old
    agent held."""
    peers = self.agent.peers
    mine = [p for p, info in peers.items() if info.get("pid") == os.getpid()]
    self.me = mine[0] if len(mine) == 1 else None
    pids = {p: info.get("pid") for p, info in peers.items()}
    if not merge:                 # a relaunch: what the job's hosts hold is said anew, and
      self.held, self.fresh = {}, set()   # its steps of the run before count apart
    for p in [p for p in self.held if pids.get(p) != self._pids.get(p)]:
      del self.held[p]
    self._pids = pids
    self.agree()
    self.changed()

  def job_wide(self) -> bool:
    return self.me is not None and len(self.agent.peers) > 1

  def agree(self) -> None:
    """The job's whole step from what every host said: the keep rule follows it."""
    table = self.agent.table
    if not self.job_wide():
      if table.job_wide:
        self.agent.dropped(table.agree(None, job_wide=False))
      return
    others = [p for p in self.agent.peers if p != self.me]
    whole = max((s for s in table.steps()
                 if all(self.held.get(p, {}).get(s) is (s in self.fresh) for p in others)),
                default=None)
    if (whole, True) != (table.whole, table.job_wide):
      self.agent.dropped(table.agree(whole))

  def committed(self, step: int) -> None:
    """This host's trainer committed ``step`` (a rolled back one again, too)."""
    self.fresh.add(step)
    self.agree()
    self.changed()

  def changed(self) -> None:
    """This host's steps changed: its peers hear it (on the keep thread)."""
    if not self.job_wide():
      return
    self._changed_at = time.monotonic()
    self._wake.set()
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="jaxckpt-keep", daemon=True)
      self._thread.start()

  def op_peer_held(self, peer: int, steps: list[int],
                   fresh: list[int] | None = None) -> _requests.Done:
    """Process ``peer``'s agent holds ``steps`` now (its current trainer committed
    ``fresh``)."""
    peer, fresh = int(peer), {int(s) for s in fresh or ()}
    if peer != self.me and peer in self.agent.peers:
      self.held[peer] = {int(s): int(s) in fresh for s in steps}
      self.agree()
    return _requests.Done()

  # -- the keep thread --------------------------------------------------------

  def close(self) -> None:
    self._stop.set()
    self._wake.set()
    if self._thread is not None:
      self._thread.join(5)
    for _, c in self._clients.values():
      c.close()
    self._clients.clear()

  def _pending(self) -> bool:
    """Whether a step newer than the whole one is held here (the others may not know)."""
    t = self.agent.table
    steps = t.steps()
    return bool(steps) and (t.whole is None or steps[-1] > t.whole)

  def _run(self) -> None:
    while not self._stop.is_set():
      self._wake.wait(REPEAT_SECS)
      if self._stop.is_set():
        return
      woken = self._wake.is_set()
      self._wake.clear()
      with self.agent.lock:
        if not self.job_wide():
          continue
        steps = tuple(self.agent.table.steps())
        self.fresh &= set(steps)
        fresh = [s for s in steps if s in self.fresh]
        repeat = (self._pending() and time.monotonic() - self._changed_at < REPEAT_FOR_SECS)
        if not woken and not (repeat or steps != self._said):
          continue
        me, peers = self.me, dict(self.agent.peers)
      failed = False
      for p, info in peers.items():
        if p == me:
          continue
        try:
          self._client(p, info).call(_requests.PeerHeld(peer=me, steps=list(steps), fresh=fresh),
                                     timeout_secs=SAY_TIMEOUT_SECS)
        except (errors.JaxckptError, OSError) as e:   # it hears at the next word
          failed = True
          logger.debug("telling process %d's agent which steps host %d holds: %s", p,
                       self.agent.host, e)
          self._drop_client(p)
      if not failed:
        self._said = steps

  def _client(self, p: int, info: dict[str, Any]) -> Client:
    cached = self._clients.get(p)
    if cached is not None and cached[0] == info.get("pid"):
      return cached[1]
    self._drop_client(p)
    c = Client.of(info, who=f"snapshot agent of process {p} (pid {info.get('pid')})",
                  timeout_secs=SAY_TIMEOUT_SECS, secret=self.agent.secret)
    self._clients[p] = (info.get("pid"), c)
    return c

  def _drop_client(self, p: int) -> None:
    cached = self._clients.pop(p, None)
    if cached is not None:
      cached[1].close()
