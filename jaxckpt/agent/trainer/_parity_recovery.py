"""The trainer's view of parity: which steps the job's live agents can rebuild
(:func:`survey`, :class:`StepParity`), the rebuilt, checksum-verified snapshots of lost
hosts (:func:`recover`), and the byte ranges of them that a restore onto another mesh
needs (:func:`rebuild_ranges`), from the parity the agents' parity threads hold
(:mod:`jaxckpt.agent.server._parity_worker`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from jaxckpt import errors
from jaxckpt.agent import _requests
from jaxckpt.agent._parity_config import ParityConfig, _lib
from jaxckpt.agent._protocol import Client, each
from jaxckpt.host.snapshot import SnapshotManifest

if TYPE_CHECKING:
  from jaxckpt.parity.placement import ParityOptions, Piece, StripeLayout

logger = logging.getLogger("jaxckpt.agent.parity")


@dataclasses.dataclass
class StepParity:
  """What the live agents of a job say about one step.

  Attributes:
    step: The step.
    process_count: Saving processes (hosts) of the step.
    options: The parity options it was protected with.
    held: Hosts whose agent holds the step's snapshot.
    done: Hosts whose agent holds all of its parity for the step.
  """

  step: int
  process_count: int
  options: ParityOptions
  held: set[int] = dataclasses.field(default_factory=set)
  done: set[int] = dataclasses.field(default_factory=set)
  errors: dict[int, str] = dataclasses.field(default_factory=dict)

  @property
  def lost(self) -> list[int]:
    return sorted(set(range(self.process_count)) - self.held)

  @property
  def protected(self) -> bool:
    return self.done == set(range(self.process_count))

  def check(self) -> None:
    """Raises unless the survivors can rebuild every lost host of this step.

    Raises:
      UnrecoverableLossError: a group lost more hosts than parity (naming the
        groups and hosts), or a survivor of a damaged group has no parity.
    """
    layout = _lib().StripeLayout.build([0] * self.process_count, self.options)
    try:
      _lib().check_recoverable(layout, self.lost)
    except errors.UnrecoverableLossError as e:
      raise errors.UnrecoverableLossError(f"step {self.step}: {e}") from None
    hit = [g for g in layout.groups if set(g) & set(self.lost)]
    missing = sorted(h for g in hit for h in g if h in self.held and h not in self.done)
    if missing:
      raise errors.UnrecoverableLossError(
          f"step {self.step}: hosts {self.lost} are lost and survivors {missing} of their "
          "parity groups hold no finished parity of it (it was never protected); restore "
          "an older protected step or from storage")


def survey(clients: dict[int, Client], *, skipped: list[str] | None = None) -> dict[int, StepParity]:
  """Steps that some live agent holds parity (or a parity record) for, by the step's
  process indices (an agent's record says which process saved the step there, and
  with which parity options). Where another run of the job saved the same step on
  another number of processes, the size whose snapshots more agents hold stands.
  ``skipped`` gets the agents that did not answer (:func:`each`)."""
  out: dict[tuple[int, int], StepParity] = {}
  held: dict[int, dict[int, set[int]]] = {}    # step -> count -> indices
  said = each(clients, lambda c: (c.call(_requests.ParityStatus())[0], c.call(_requests.Held())[0].held),
              skipped=skipped)
  for key, (status, here) in sorted(said.items()):
    c = clients[key]
    for step, index, count in here:
      held.setdefault(step, {}).setdefault(count, set()).add(index)
    if status.config is None:
      continue
    cfg = ParityConfig(**status.config)
    index_of = {step: index for step, index, _ in here}
    for entry in status.steps:
      step, state, _, error, count = entry[:5]
      if not count:
        continue
      index = entry[5] if len(entry) > 5 else index_of.get(step, c.host)   # (an older agent's)
      options = (cfg.options if len(entry) < 8 else
                 _lib().ParityOptions(group_size=entry[6], parity=entry[7]))
      sp = out.setdefault((step, count), StepParity(step, count, options))
      if state == "done":
        sp.done.add(index)
      elif error:
        sp.errors[index] = error
  for (step, count), sp in out.items():
    sp.held = held.get(step, {}).get(count, set())
  return {sp.step: sp for sp in sorted(out.values(), key=lambda sp: (sp.step, len(sp.held)))}


@dataclasses.dataclass
class Survivors:
  """What the live agents keep to rebuild a step's lost hosts: its stripe layout, every
  saving process's manifest, each piece's checksum, and the agent that was each
  process for the step (by the step's process index)."""

  step: int
  layout: StripeLayout
  manifests: dict[int, str]
  checksums: dict[Piece, str]
  holders: dict[int, Client]


def survivors(clients: dict[int, Client], step: int, lost: list[int],
              count: int | None = None) -> Survivors:
  """The survivors' parity records of ``step`` (saved by ``count`` processes: records
  of another run's step of that number are left out).

  Raises:
    UnrecoverableLossError: no live agent holds parity of the step, none the
      manifest of a lost host, or a group lost more hosts than its parity.
  """
  infos, holders = {}, {}     # by the process index each agent had for ``step``
  for c in clients.values():
    try:
      info = c.call(_requests.ParityInfo(step=step))[0]
    except (errors.StepNotFoundError, errors.AgentUnavailableError) as e:
      logger.info("step %d: %s has no parity to offer: %s", step, c.who, e)
      continue
    if count is not None and info.process_count != count:
      continue
    index = c.host if info.index is None else info.index      # (an older agent's reply)
    infos[index], holders[index] = info, c
  if not infos:
    raise errors.UnrecoverableLossError(
        f"step {step}: no live agent holds parity of it; cannot rebuild hosts {lost}")
  first = next(iter(infos.values()))
  cfg = ParityConfig(**first.config)
  manifests: dict[int, str] = {}
  checksums: dict[Piece, str] = {}
  for info in infos.values():
    manifests.update({int(h): js for h, js in info.manifests.items()})
    for stripe, slot, host, start, stop, value in info.checksums:
      checksums[_lib().Piece(host, stripe, slot, start, stop)] = value
  sizes = [0] * first.process_count
  for h, js in manifests.items():
    sizes[h] = SnapshotManifest.from_json(js).nbytes
  missing = [h for h in lost if h not in manifests]
  if missing:
    raise errors.UnrecoverableLossError(
        f"step {step}: no survivor holds the manifest of lost hosts {missing}")
  layout = _lib().StripeLayout.build(sizes, cfg.options)
  _lib().check_recoverable(layout, lost)
  return Survivors(step, layout, manifests, checksums, holders)


def recover(clients: dict[int, Client], step: int, lost: list[int],
            have: dict[int, Any] | None = None, *, count: int | None = None,
            known: Survivors | None = None, read: list[int] | None = None
            ) -> dict[int, tuple[SnapshotManifest, np.ndarray]]:
  """Rebuilds the whole snapshots of ``lost`` hosts of ``step`` from the survivors.

  ``have`` maps saving process indices to the pieces of ``step`` the caller
  already holds or is about to read (``BufferPiece``, ``RemotePiece``): data
  chunks are taken from them (``span``) instead of being read a second time.
  ``known``: the survivors' records, if the caller has them (:func:`survivors`);
  ``read[0]`` counts the bytes read from agents.

  Every fetched piece and every rebuilt piece is checked against the checksum
  saved when the parity was made (a corrupted survivor is left out while
  others can stand in); the caller checks each shard against its manifest
  checksum again before use.

  Raises:
    UnrecoverableLossError: too many hosts lost, or too few survivors answer.
    CorruptSnapshotError: too few survivors pass their checksums.
  """
  s = known or survivors(clients, step, lost, count)
  pieces = {h: (have or {}).get(h) for h in s.manifests}
  rebuilt = _lib().recover_hosts(s.layout, lost, _fetcher(s.holders, s.layout, step, pieces,
                                                          read), s.checksums)
  return {h: (SnapshotManifest.from_json(s.manifests[h]), buf) for h, buf in rebuilt.items()}


def rebuild_ranges(s: Survivors, lost: list[int], wanted: dict[int, list[tuple[int, int]]],
                   out: dict[int, np.ndarray], have: dict[int, Any]) -> int:
  """Rebuilds byte ranges ``wanted[h]`` of lost hosts' snapshots into ``out[h]``
  (``jaxckpt.parity.rebuild_ranges``: only the same ranges of their stripes are read,
  from the caller's pieces in ``have`` where they already hold them, else from the
  survivors' agents, each agent's ranges in one read). Unverified: the caller checks
  each rebuilt shard against its manifest. Returns the bytes read from agents."""
  read, lock = [0], threading.Lock()

  def fetch(host: int, items: Any) -> list[np.ndarray] | None:     # (hosts at once)
    got, snap, par = [None] * len(items), [], {}
    piece = have.get(host)
    for i, (p, lo, hi) in enumerate(items):
      if p.slot >= len(s.layout.stripes[p.stripe].data):
        par.setdefault(p.stripe, []).append((i, lo, hi - lo))
        continue
      a, b = p.start + lo, min(p.start + hi, p.stop)
      cached = None if piece is None or a >= b else piece.span(a, b - a, read=False)
      if a >= b:
        got[i] = np.empty(0, np.uint8)
      elif cached is not None:
        got[i] = cached
      else:
        snap.append((i, a, b - a))
    c = s.holders.get(host) or getattr(piece, "client", None)
    if c is None:
      return None if snap or par else got
    try:
      for (i, _, _), data in zip(snap, c.read("snapshot", s.step, [(a, n) for _, a, n in snap])
                                 if snap else []):
        got[i] = data
      for stripe, ranges in par.items():
        blocks = c.read("parity", s.step, [(lo, n) for _, lo, n in ranges], stripe=stripe)
        for (i, _, _), data in zip(ranges, blocks):
          got[i] = data
    except (errors.StepNotFoundError, errors.AgentUnavailableError,
            errors.CorruptSnapshotError) as e:   # (a parity file truncated there: damage)
      logger.warning("step %d: %s could not serve its pieces' ranges: %s", s.step, c.who, e)
      return None
    with lock:
      read[0] += sum(n for _, _, n in snap) + sum(n for r in par.values() for _, _, n in r)
    return got

  _lib().rebuild_ranges(s.layout, lost, wanted, fetch, out)
  return read[0]
def _fetcher(holders: dict[int, Client], layout: StripeLayout, step: int,
             pieces: dict[int, Any], read: list[int] | None = None) -> Callable[[Piece], Any]:
  """Fetches a survivor's piece: a data chunk of its snapshot (from the
  caller's ``pieces`` where they hold it, else from the agent that was its host
  for ``step``) or a parity block; ``read[0]`` counts what agents sent."""
  lock = threading.Lock()

  def fetch(piece: Piece) -> Any:
    data_piece = piece.slot < len(layout.stripes[piece.stripe].data)
    if data_piece and piece.nbytes == 0:
      return np.empty(0, np.uint8)
    if data_piece and pieces.get(piece.host) is not None:
      data = pieces[piece.host].span(piece.start, piece.nbytes)
      if data is not None:
        return data
    c = holders.get(piece.host)
    if c is None:
      return None
    try:
      if data_piece:
        data, = c.read("snapshot", step, [(piece.start, piece.nbytes)])
      else:
        data, = c.read("parity", step, [(0, piece.stop)], stripe=piece.stripe)
    except (errors.StepNotFoundError, errors.AgentUnavailableError,
            errors.CorruptSnapshotError) as e:   # (a parity file truncated there: damage)
      logger.warning("step %d: could not fetch %s: %s", step, piece, e)
      return None
    if read is not None:
      with lock:
        read[0] += data.size
    return data
  return fetch
