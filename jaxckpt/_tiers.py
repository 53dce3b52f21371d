"""Which step to restore and where its pieces are, across the hosts of a job.

With the in-process store, this process's snapshot is the whole story. With
agents, every saving process's snapshot of a step lives in its host's agent;
a step is restorable when the agents of all its saving processes hold it,
and a restoring process reads the pieces it needs from whichever agents hold
them (its own through shared memory, others' over the network). With parity
on, a step that lost some hosts is still restorable when the survivors' parity
rebuilds them (tier "parity", ``jaxckpt.agent._parity``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Iterator

import jax

from jaxckpt import _restore, errors
from jaxckpt.store import HostStore

logger = logging.getLogger(__name__)
_agreements = [0]


def is_agent_store(store: HostStore) -> bool:
  return hasattr(store, "run_root")


@contextlib.contextmanager
def agent_clients(store: HostStore) -> Iterator[dict[int, Any]]:
  """Clients of every live agent of the store's job, by host id (none for other stores)."""
  if not is_agent_store(store):
    yield {}
    return
  from jaxckpt.agent import client as agent_client  # pylint: disable=import-outside-toplevel
  with agent_client.clients_of(store.agents(), store.opts.job_name, local_pid=store.pid,
                               secret=store.secret,
                               timeout_secs=store.opts.request_timeout_secs) as clients:
    yield clients


def complete_steps(store: HostStore) -> list[int]:
  """Steps whose every saving process's snapshot is held by some live agent."""
  if not is_agent_store(store):
    return store.steps()
  from jaxckpt.agent.client import complete_steps_of  # pylint: disable=import-outside-toplevel
  with agent_clients(store) as clients:
    return complete_steps_of(clients)


def storage_steps(directory: str | None) -> list[int]:
  if directory is None:
    return []
  from jaxckpt import universal  # pylint: disable=import-outside-toplevel
  return universal.all_steps(directory)


def parity_steps(store: HostStore) -> dict[int, Any]:
  """What the live agents say about the parity of each step they protect
  ({step: ``_parity.StepParity``}); empty without agents or parity."""
  if not is_agent_store(store):
    return {}
  from jaxckpt.agent import _parity  # pylint: disable=import-outside-toplevel
  with agent_clients(store) as clients:
    return _parity.survey(clients)


def protected_steps(store: HostStore) -> list[int]:
  """Steps whose parity every saving host's agent holds, all of it."""
  return sorted(s for s, sp in parity_steps(store).items() if sp.protected)


def wait_protected(store: HostStore, step: int, *, timeout_secs: float) -> None:
  """Polls the agents until ``step`` is protected; the timeout names the late hosts."""
  deadline = time.monotonic() + timeout_secs
  while True:
    sp = parity_steps(store).get(step)
    if sp is not None and sp.protected:
      return
    if sp is not None and sp.errors:      # a failed parity is never retried: say so now
      raise errors.ParityError(
          f"step {step} will not be protected: " + "; ".join(
              f"host {h}: {e}" for h, e in sorted(sp.errors.items())))
    if time.monotonic() > deadline:
      late = "all hosts" if sp is None else f"hosts {sorted(set(range(sp.process_count)) - sp.done)}"
      why = "" if sp is None else "; ".join(f"host {h}: {e}" for h, e in sp.errors.items())
      raise errors.SnapshotTimeoutError(
          f"step {step} was not protected within {timeout_secs} s: {late} hold no finished "
          f"parity of it" + (f" ({why})" if why else ""))
    time.sleep(0.005)


def rebuildable_steps(held: list[int], store: HostStore) -> list[int]:
  """Steps not held complete that the survivors' parity can rebuild."""
  return _rebuildable(held, store)[0]


def _rebuildable(held: list[int], store: HostStore) -> tuple[list[int], dict[int, Exception]]:
  """Steps not held complete that parity can rebuild, and why the others cannot."""
  ok, why = [], {}
  for step, sp in parity_steps(store).items():
    if step in held or not sp.held:
      continue
    try:
      sp.check()
      ok.append(step)
    except errors.UnrecoverableLossError as e:
      why[step] = e
  return sorted(ok), why


def choose_step(store: HostStore, directory: str | None, step: int | None, *,
                timeout_secs: float) -> tuple[int, str]:
  """The step to restore and the fastest tier that holds it: "host" (every
  saving process's snapshot is held), "parity" (some are lost but the
  survivors' parity rebuilds them) or "storage".

  Raises:
    UnrecoverableLossError: the step (or, for ``step=None``, the newest step
      anywhere) lost more hosts than parity can rebuild and storage has no step.
    StepNotFoundError: no tier holds the step.
  """
  held = complete_steps(store)
  rebuilt, why = _rebuildable(held, store)
  stored = storage_steps(directory)
  every = set(held) | set(rebuilt) | set(stored)
  if step is None:
    if not every:
      if why:
        raise why[max(why)]
      raise errors.StepNotFoundError(
          "restore(): no snapshot is held and nothing is on storage"
          + (f" at {directory!r}" if directory else "") + "; save first")
    step = max(every)
    for lost_step in sorted(s for s in why if s > step):
      logger.warning("%s; restoring step %d instead", why[lost_step], step)
  elif step not in every:
    if step in why:
      raise why[step]
    raise errors.StepNotFoundError(
        f"restore(step={step}): step {step} is not held (held steps: {held})"
        + (f"; rebuildable from parity: {rebuilt}" if rebuilt else "")
        + (f"; on storage: {stored}" if directory else ""))
  if jax.process_count() > 1:
    step = agree(step, timeout_secs=timeout_secs)
  tier = "host" if step in held else "parity" if step in rebuilt else "storage"
  return step, tier


class StorageSource:
  """A step read from the universal format: each region read on demand, verified."""

  def __init__(self, directory: str, step: int) -> None:
    from jaxckpt import universal  # pylint: disable=import-outside-toplevel
    from jaxckpt.snapshot import LeafRecord  # pylint: disable=import-outside-toplevel
    self.reader_ = universal.open_step(directory, step)
    self.step = step
    self.leaves = tuple(LeafRecord(path=i.path, kind=i.kind, shape=tuple(i.shape),
                                   dtype=i.dtype, value=i.value, key_impl=i.key_impl)
                        for i in self.reader_.leaves.values())

  @property
  def bytes_read(self) -> int:
    return self.reader_.bytes_read

  def reader(self, i: int, *, private: bool = True, boxes: Any = None):
    """``read_region(box)`` for leaf ``i``: every stored chunk read once, verified
    (reads are fresh arrays: always private); ``boxes`` are fetched at once."""
    del private
    return self.reader_.region_reader(self.leaves[i].path, boxes=boxes)


def broadcast_from_0(name: str, make: Any, *, timeout_secs: float) -> str:
  """``make()`` on process 0, handed to every process through jax.distributed's
  key-value store; a process that does not hear in time names process 0."""
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  client = distributed.global_state.client
  _agreements[0] += 1
  key = f"jaxckpt/{name}/{_agreements[0]}"
  if jax.process_index() == 0:
    value = make()
    client.key_value_set(key, value)
    return value
  try:
    return client.blocking_key_value_get(key, int(timeout_secs * 1000))
  except Exception:  # pylint: disable=broad-except  (the client raises XlaRuntimeError)
    raise errors.SnapshotTimeoutError(
        f"process {jax.process_index()}: process 0 did not publish the job's {name} within "
        f"{timeout_secs} s (is it running, with the same jaxckpt version?)") from None


def allgather(name: str, value: str, *, timeout_secs: float, what: str) -> list[str]:
  """Every process's ``value``, in process order, through jax.distributed's key-value
  store; SnapshotTimeoutError naming the processes that did not publish ``what`` in time."""
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  client = distributed.global_state.client
  n, me = jax.process_count(), jax.process_index()
  _agreements[0] += 1
  key = f"jaxckpt/{name}/{_agreements[0]}"
  client.key_value_set(f"{key}/{me}", value)
  got, late = {}, []
  for p in range(n):
    try:
      got[p] = client.blocking_key_value_get(f"{key}/{p}", int(timeout_secs * 1000))
    except Exception:  # pylint: disable=broad-except  (the client raises XlaRuntimeError)
      late.append(p)
  if late:
    raise errors.SnapshotTimeoutError(
        f"processes {late} did not publish {what} within {timeout_secs} s (process {me} "
        f"heard from {sorted(got)})")
  return [got[p] for p in range(n)]


def agree(step: int, *, timeout_secs: float) -> int:
  """The smallest of every process's choice, agreed through jax.distributed's key-value store.

  Raises SnapshotTimeoutError naming the processes that did not answer.
  """
  return min(int(v) for v in allgather("restore", str(step), timeout_secs=timeout_secs,
                                       what="the step they hold"))


def discover_agents(store: HostStore, *, timeout_secs: float) -> None:
  """Tells every process of a multi-process job where the job's agents are.

  Each process publishes the agents of the job on its own machine (its run root
  is private) through jax.distributed's key-value store; every process keeps
  the whole list (restores read other hosts' pieces from it) and hands its
  agent the job's current agents by host id (for parity exchange). No
  directory is shared between hosts.
  """
  import json  # pylint: disable=import-outside-toplevel
  mine = {"own": store.info, "local": store.local_agents()}
  everyone = [json.loads(v) for v in allgather(
      f"agents/{store.opts.job_name}", json.dumps(mine), timeout_secs=timeout_secs,
      what="their snapshot agents' addresses")]
  store.directory = [a for e in everyone for a in e["local"]]
  store.call("peers", peers={str(e["own"]["host"]): e["own"] for e in everyone})


@contextlib.contextmanager
def host_pieces(store: HostStore, step: int, *, rebuild: bool = False) -> Iterator[list[Any]]:
  """This host's piece first (if it holds one), then remote pieces for the other
  saving processes of ``step``; with ``rebuild``, the pieces of lost hosts
  rebuilt from parity (checksum-verified) as local buffers."""
  with contextlib.ExitStack() as stack:
    pieces = []
    local_index = None
    if step in store.steps():
      manifest, buffer = stack.enter_context(store.read(step))
      pieces.append(_restore.BufferPiece(manifest, buffer,
                                         lend=functools.partial(store.lend, step, buffer)))
      local_index = manifest.process_index
      if manifest.process_count == 1:
        yield pieces
        return
    if not is_agent_store(store):
      raise errors.StepNotFoundError(f"step {step} is not held in this process")
    clients = stack.enter_context(agent_clients(store))
    pieces += _remote_pieces(store, clients, step, local_index, stack)
    if rebuild:
      pieces += _rebuilt_pieces(clients, step, pieces)
    yield pieces


def _remote_pieces(store: HostStore, clients: dict[int, Any], step: int,
                   local_index: int | None, stack: contextlib.ExitStack) -> list[Any]:
  """Other agents' pieces of ``step``, each saving process once, pinned while restoring."""
  from jaxckpt.agent.client import open_remote_piece  # pylint: disable=import-outside-toplevel
  out, found = [], set() if local_index is None else {local_index}
  for c in clients.values():
    if c.pid == store.pid and local_index is not None:
      continue
    piece = open_remote_piece(c, step, stack)
    if piece is not None and piece.manifest.process_index not in found:
      out.append(piece)
      found.add(piece.manifest.process_index)
  return out


def _rebuilt_pieces(clients: dict[int, Any], step: int, pieces: list[Any]) -> list[Any]:
  """The snapshots of the saving processes that no live agent holds, from parity."""
  from jaxckpt.agent import _parity  # pylint: disable=import-outside-toplevel
  if not pieces:
    raise errors.UnrecoverableLossError(f"step {step}: no host holds any piece of it")
  count = pieces[0].manifest.process_count
  lost = sorted(set(range(count)) - {p.manifest.process_index for p in pieces})
  if not lost:
    return []
  have = {p.manifest.process_index: p for p in pieces}   # their bytes are not read twice
  rebuilt = _parity.recover(clients, step, lost, have=have)
  logger.info("step %d: rebuilt the snapshots of lost hosts %s from parity", step, lost)
  return [_restore.BufferPiece(manifest, buf, private=True) for manifest, buf in rebuilt.values()]
