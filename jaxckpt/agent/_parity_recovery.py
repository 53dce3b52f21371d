"""The trainer's view of parity: which steps the job's live agents can rebuild
(:func:`survey`, :class:`StepParity`), and the rebuilt, checksum-verified snapshots
of lost hosts (:func:`recover`), from the parity the agents' parity threads hold
(:mod:`jaxckpt.agent._parity_worker`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from jaxckpt import errors
from jaxckpt.agent._parity_config import ParityConfig, _lib
from jaxckpt.agent._protocol import Client
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


def survey(clients: dict[int, Client]) -> dict[int, StepParity]:
  """Steps that some live agent holds parity (or a parity record) for."""
  out: dict[int, StepParity] = {}
  held: dict[int, set[int]] = {}
  for c in clients.values():
    host = c.host
    try:
      status = c.call("parity_status")[0]
      for step, index, _ in c.call("held")[0].held:
        held.setdefault(step, set()).add(index)
    except errors.AgentUnavailableError as e:
      logger.warning("skipping %s: %s", c.who, e)
      continue
    if status.config is None:
      continue
    cfg = ParityConfig(**status.config)
    for step, state, _, error, count in status.steps:
      if count:
        sp = out.setdefault(step, StepParity(step, count, cfg.options))
        if state == "done":
          sp.done.add(host)
        elif error:
          sp.errors[host] = error
  for step, sp in out.items():
    sp.held = held.get(step, set())
  return out


def recover(clients: dict[int, Client], step: int, lost: list[int],
            have: dict[int, Any] | None = None) -> dict[int, tuple[SnapshotManifest, np.ndarray]]:
  """Rebuilds the snapshots of ``lost`` hosts of ``step`` from the survivors.

  ``have`` maps saving process indices to the pieces of ``step`` the caller
  already holds or is about to read (``BufferPiece``, ``RemotePiece``): data
  chunks are taken from them (``span``) instead of being read a second time.

  Every fetched piece and every rebuilt piece is checked against the checksum
  saved when the parity was made (a corrupted survivor is left out while
  others can stand in); the caller checks each shard against its manifest
  checksum again before use.

  Raises:
    UnrecoverableLossError: too many hosts lost, or too few survivors answer.
    CorruptSnapshotError: too few survivors pass their checksums.
  """
  infos, holders = {}, {}     # holders: host id -> the agent that was that host for ``step``
  for c in clients.values():
    try:
      infos[c.host] = c.call("parity_info", step=step)[0]
      holders[c.host] = c
    except (errors.StepNotFoundError, errors.AgentUnavailableError) as e:
      logger.info("step %d: %s has no parity to offer: %s", step, c.who, e)
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
  sizes = [0] * first["process_count"]
  for h, js in manifests.items():
    sizes[h] = SnapshotManifest.from_json(js).nbytes
  missing = [h for h in lost if h not in manifests]
  if missing:
    raise errors.UnrecoverableLossError(
        f"step {step}: no survivor holds the manifest of lost hosts {missing}")
  layout = _lib().StripeLayout.build(sizes, cfg.options)
  pieces = {h: (have or {}).get(SnapshotManifest.from_json(js).process_index)
            for h, js in manifests.items()}
  rebuilt = _lib().recover_hosts(layout, lost, _fetcher(holders, layout, step, pieces), checksums)
  return {h: (SnapshotManifest.from_json(manifests[h]), buf) for h, buf in rebuilt.items()}


def _fetcher(holders: dict[int, Client], layout: StripeLayout, step: int,
             pieces: dict[int, Any]) -> Callable[[Piece], Any]:
  """Fetches a survivor's piece: a data chunk of its snapshot (from the
  caller's ``pieces`` where they hold it, else from the agent that was its host
  for ``step``) or a parity block."""
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
    except (errors.StepNotFoundError, errors.AgentUnavailableError) as e:
      logger.warning("step %d: could not fetch %s: %s", step, piece, e)
      return None
    return data
  return fetch
