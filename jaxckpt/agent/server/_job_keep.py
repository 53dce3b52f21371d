"""Which steps a host keeps in a job of several hosts: the job's decision, not its own.

A step the job holds is one every host holds: a relaunch restores the newest step
that every process's agent still holds, so a host must not drop a step on its own
timing (it is one step ahead of a slower host, its parity of a step was superseded,
a protected step took a place of the ``keep``) while no newer step is held by all.
The job's agents meet in a star, so a change costs O(1) messages per host, not one
to each of the others: the *hub* is the agent of the lowest process index in the
job's map (``Agent.peers``; every agent picks the same). Each other agent (``Agent.keep``)
tells the hub which steps it holds whenever that changes (``PeerHeld``, sent on its
own thread, never the request thread's); the newest step held by the hub and by every
other host, as last said, is the job's *whole* step (``SlotTable.agree``): the keep
rule drops only steps older than it. The hub applies it to itself and says it in each
reply, so another host learns it at its next word (a change, or a repeat); it applies
it only where it holds that step itself, of the run the hub said (a stale or forged
reply naming a step it lacks, or one of another run, drops nothing), and not from a
reply to a word said before its map changed or a step was committed again. A host that
learns of a newer whole step sooner than another drops nothing the other still needs:
the newest step any host knows whole was held by every host, and no host drops it
before it knows a newer one whole, so at every moment some step is held by every host.
A step counts as held by every host only where each host's is of the same run (its
current trainers committed it, or an earlier run's did): after a relaunch rolled back,
a step number saved again is not whole while another host still holds the abandoned
timeline's.

A word or a reply that is lost, or a hub that does not answer, only keeps steps longer:
a host says its word again while it holds a newer step than the whole one, soon after a
change (``FIRST_REPEAT_SECS``, doubling to ``REPEAT_SECS``), then every
``SLOW_REPEAT_SECS`` once ``REPEAT_FOR_SECS`` passed (a host far behind that catches
up is heard). A new map of the job's agents (a relaunch: ``Peers``) or a replaced
agent of a process forgets what was known of it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from jaxckpt import errors
from jaxckpt.agent import _requests
from jaxckpt.agent._protocol import Client

if TYPE_CHECKING:
  from jaxckpt.agent.server._server import Agent

logger = logging.getLogger("jaxckpt.agent")

# How often a host repeats what it holds while a newer step than the job's whole one
# waits for the others: soon after its last change, then each second, then seldom.
FIRST_REPEAT_SECS = 0.05
REPEAT_SECS = 1.0
REPEAT_FOR_SECS = 120.0
SLOW_REPEAT_SECS = 10.0
# The longest one peer's word may take (a peer that does not answer hears it later).
SAY_TIMEOUT_SECS = 2.0


class JobKeep:
  """``agent``'s view of what the job's other hosts hold (see the module docstring)."""

  def __init__(self, agent: Agent) -> None:
    self.agent = agent
    # process index -> the steps its agent holds: whether its current trainer committed each
    self.held: dict[int, dict[int, bool]] = {}
    # (step, fresh) -> how many of those hold it so: the hub's count per step, kept as
    # each word comes, so a word costs the hub its own steps, not the job's size
    self._holders: collections.Counter[tuple[int, bool]] = collections.Counter()
    self.fresh: set[int] = set()             # steps committed here since the last new map
    self.me: int | None = None               # the process this agent serves, in the map
    self.told: tuple[int, bool] | None = None   # the whole step the hub said, and its fresh
    self._gen = 0                            # counts new maps and steps committed again
    self._top: int | None = None             # the newest step committed here since
    self._pids: dict[int, Any] = {}          # process index -> its agent's identity, in the map
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
    mine = [p for p, info in peers.items() if _is_me(info, self.agent.tcp_address)]
    self.me = mine[0] if len(mine) == 1 else None
    pids = {p: _identity(info) for p, info in peers.items()}
    if not merge:                 # a relaunch: what the job's hosts hold is said anew, and
      self.held, self.fresh = {}, set()   # its steps of the run before count apart
      self.told, self._top = None, None
    self._gen += 1                # (a reply to a word said before it is not applied)
    for p in [p for p in self.held if pids.get(p) != self._pids.get(p)]:
      del self.held[p]
    self._holders = collections.Counter(kv for h in self.held.values() for kv in h.items())
    self._pids = pids
    self.agree()
    self.changed()

  def job_wide(self) -> bool:
    return self.me is not None and len(self.agent.peers) > 1

  def hub(self) -> int | None:
    """The process whose agent learns what every host holds (the lowest in the map)."""
    return min(self.agent.peers, default=None)

  def agree(self) -> None:
    """The job's whole step (the hub: from what every host said; another host: as the
    hub last said, where it holds that step of that run): the keep rule follows it."""
    table = self.agent.table
    if not self.job_wide():
      if table.job_wide:
        self.agent.dropped(table.agree(None, job_wide=False))
      return
    steps = table.steps()
    self.fresh &= set(steps)
    if self.me == self.hub():
      others = len(self.agent.peers) - 1      # (``held`` names only processes of the map)
      whole = max((s for s in steps if self._holders[(s, s in self.fresh)] == others),
                  default=None)
    else:
      whole = None if self.told is None else self.told[0]
      if whole is not None and (whole not in steps or (whole in self.fresh) is not self.told[1]):
        whole = None                 # not held here as the hub's: it drops nothing
    if (whole, True) != (table.whole, table.job_wide):
      self.agent.dropped(table.agree(whole))

  def committed(self, step: int) -> None:
    """This host's trainer committed ``step`` (a rolled back one again, too)."""
    if self._top is not None and step <= self._top:   # again: what the hub said before
      self.told = None                                 # it is not of this step
      self._gen += 1
    self._top = step
    self.fresh.add(step)
    self.agree()
    self.changed()

  def changed(self) -> None:
    """This host's steps changed: the hub hears it (on the keep thread)."""
    if not self.job_wide() or self.me == self.hub():
      return
    self._changed_at = time.monotonic()
    self._wake.set()
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="jaxckpt-keep", daemon=True)
      self._thread.start()

  def op_peer_held(self, peer: int, steps: list[int],
                   fresh: list[int] | None = None) -> _requests.PeerHeldReply:
    """Process ``peer``'s agent holds ``steps`` now (its current trainer committed
    ``fresh``); the reply: the job's whole step, where this agent is the hub."""
    peer, fresh = int(peer), {int(s) for s in fresh or ()}
    if peer != self.me and peer in self.agent.peers:
      new = {int(s): int(s) in fresh for s in steps}
      old = self.held.get(peer, {})
      if new != old:
        self._holders.subtract(old.items())
        self._holders.update(new.items())
        self._holders += collections.Counter()    # (drops the counts gone to 0)
        self.held[peer] = new
      self.agree()
    whole = self.agent.table.whole
    if not self.job_wide() or self.me != self.hub() or whole is None:
      return _requests.PeerHeldReply()
    return _requests.PeerHeldReply(whole=whole, fresh=whole in self.fresh)

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
    delay = FIRST_REPEAT_SECS
    while not self._stop.is_set():
      woken = self._wake.wait(delay)
      if self._stop.is_set():
        return
      self._wake.clear()
      with self.agent.lock:
        if not self.job_wide() or self.me == self.hub():
          delay = SLOW_REPEAT_SECS     # (a change of the map wakes it)
          continue
        steps = tuple(self.agent.table.steps())
        self.fresh &= set(steps)
        fresh = [s for s in steps if s in self.fresh]
        late = time.monotonic() - self._changed_at >= REPEAT_FOR_SECS
        delay = (FIRST_REPEAT_SECS if woken else
                 SLOW_REPEAT_SECS if late else min(2 * delay, REPEAT_SECS))
        if not woken and not (self._pending() or steps != self._said):
          delay = SLOW_REPEAT_SECS
          continue
        me, hub, gen = self.me, self.hub(), self._gen
        info = self.agent.peers[hub]
      try:
        reply, _ = self._client(hub, info).call(
            _requests.PeerHeld(peer=me, steps=list(steps), fresh=fresh),
            timeout_secs=SAY_TIMEOUT_SECS)
      except (errors.JaxckptError, OSError) as e:   # it hears at the next word
        logger.debug("telling process %d's agent (the job's hub) which steps host %d holds: %s",
                     hub, self.agent.host, e)
        self._drop_client(hub)
        continue
      self._said = steps
      with self.agent.lock:
        if gen == self._gen and self.hub() == hub:
          self.told = None if reply.whole is None else (reply.whole, reply.fresh)
          self.agree()

  def _client(self, p: int, info: dict[str, Any]) -> Client:
    cached = self._clients.get(p)
    if cached is not None and cached[0] == _identity(info):
      return cached[1]
    self._drop_client(p)
    c = Client.of(info, who=f"snapshot agent of process {p} (pid {info.get('pid')})",
                  timeout_secs=SAY_TIMEOUT_SECS, secret=self.agent.secret)
    self._clients[p] = (_identity(info), c)
    return c

  def _drop_client(self, p: int) -> None:
    cached = self._clients.pop(p, None)
    if cached is not None:
      cached[1].close()


def _identity(info: dict[str, Any]) -> tuple[Any, Any]:
  """An agent's identity in the job's map: its tcp address and pid. A pid alone is not one:
  agents on other machines (or in other pid namespaces: containers, pods) may share it,
  and an agent restarted may get its predecessor's number."""
  return (info.get("tcp"), info.get("pid"))


def _is_me(info: dict[str, Any], tcp_address: str | None) -> bool:
  """Whether ``info`` is this agent's own record: by its tcp address once it is bound (a
  pid may repeat on another host), by its pid before."""
  if tcp_address is not None:
    return info.get("tcp") == tcp_address and info.get("pid") in (None, os.getpid())
  return info.get("pid") == os.getpid()
