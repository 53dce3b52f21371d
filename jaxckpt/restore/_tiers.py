"""Which step to restore and where its pieces are, across the hosts of a job.

With the in-process store, this process's snapshot is the whole story. With
agents, every saving process's snapshot of a step lives in its host's agent;
a step is restorable when the agents of all its saving processes hold it,
and a restoring process reads the pieces it needs from whichever agents hold
them (its own through shared memory, others' over the network). With parity
on, a step that lost some hosts is still restorable when the survivors' parity
rebuilds them (tier "parity", ``jaxckpt.agent.trainer._parity_recovery``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jaxckpt import errors, universal
from jaxckpt.util import _progress, _wait
from jaxckpt.host.snapshot import Box, LeafRecord
from jaxckpt.tree import scalar_from_json
from jaxckpt.host.store import HostStore, ParityReport, Piece
from jaxckpt.net import _kv
from jaxckpt.restore import _read

logger = logging.getLogger(__name__)


def complete_steps(store: HostStore) -> list[int]:
  """Steps whose every saving process's snapshot is held in the job."""
  return store.complete_steps()


def storage_steps(directory: str | None, *, timeout_secs: float | None = None) -> list[int]:
  """The steps stored in ``directory``: jaxckpt's committed ones and those an orbax
  CheckpointManager wrote there (``universal.stored_steps``: read where they lie);
  ``timeout_secs`` bounds the listing (default: one storage request's)."""
  if directory is None:
    return []
  if timeout_secs is None:
    return universal.stored_steps(directory)
  return universal.stored_steps(directory, timeout_secs=max(timeout_secs, 0.1))


# How long a timeout's message may ask the agents who holds the step (one that is cut off
# from this host never answers: the wait must still end on time).
_LATE_PROBE_SECS = 2.0


def parity_steps(store: HostStore, *, timeout_secs: float | None = None) -> dict[int, ParityReport]:
  """What the job's agents say about the parity of each step they protect (asked for
  ``timeout_secs`` at most; None: one request's timeout)."""
  return store.parity_steps(timeout_secs=timeout_secs)


def protected_steps(store: HostStore) -> list[int]:
  """Steps whose parity every saving host's agent holds, all of it."""
  return sorted(s for s, sp in parity_steps(store).items() if sp.protected)


def wait_protected(store: HostStore, step: int, *, timeout_secs: float) -> None:
  """Polls the agents until ``step`` is protected; the timeout names the late hosts and
  the agents that did not answer. No question to an agent outlives the wait: each is
  asked for the time left at most (an agent cut off from this host never answers)."""
  last: list[ParityReport | None] = [None]
  deadline = time.monotonic() + timeout_secs

  def protected() -> bool:
    sp = last[0] = parity_steps(store, timeout_secs=deadline - time.monotonic()).get(step)
    if sp is not None and sp.errors:      # a failed parity is never retried: say so now
      raise errors.ParityError(
          f"step {step} will not be protected: " + "; ".join(
              f"host {h}: {e}" for h, e in sorted(sp.errors.items())))
    return sp is not None and sp.protected

  def late() -> str:
    sp = last[0]
    silent = store.unanswered()            # (the last survey's, before holders asks again)
    held, count = store.holders(step, timeout_secs=_LATE_PROBE_SECS)
    silent += [s for s in store.unanswered() if s not in silent]
    count = count or (sp.process_count if sp is not None else None)
    done = set() if sp is None else sp.done
    why = []
    if count is not None and set(range(count)) - held:
      why.append(f"hosts {sorted(set(range(count)) - held)} do not hold step {step} (they "
                 "skipped it, or lost it)")
    waiting = sorted(held - done)
    if waiting or not why:
      who = f"hosts {waiting}" if waiting else "all hosts"
      why.append(f"{who} hold no finished parity of it")
    if silent:
      why.append("no answer from " + "; ".join(silent))
    return f"step {step} was not protected within {timeout_secs} s: " + "; ".join(why)
  _wait.until(protected, timeout_secs=timeout_secs, late=late, poll_secs=0.005)


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


# What makes a step unrestorable: its bytes or its manifest are damaged on every tier
# that holds it, or parity could not rebuild it after all.
DAMAGE = (errors.CorruptSnapshotError, errors.ManifestError, errors.UnrecoverableLossError)
# What makes a step unreadable now, not damaged: storage refused or did not answer a read
# (access, throttling, a timeout, the connection: ``universal._failures``).
UNREADABLE = (errors.StorageError,)


def restore(store: HostStore, directory: str | None, step: int | None, target: Any, *,
            partial: bool, timeout_secs: float, writes: bool = True,
            onto: Callable[[int, Callable[[Any, bool], Any]], Any] | None = None
            ) -> tuple[Any, _read.RestoreInfo]:
  """Chooses the step and its fastest tier, reads it onto ``target``, and says
  what it did: the one place a restore's tiers are chosen and read, top to
  bottom. A host or parity read that finds a damaged or lost snapshot falls
  back to storage when storage holds the step.

  With ``step=None`` the newest step that can be restored is taken: a newer one
  that is damaged on every tier holding it (on any process: they agree) is
  skipped with a WARNING naming it and the damage, recorded in the returned
  ``RestoreInfo.skipped``, and, if it is on storage, set aside there by process 0
  (``universal.quarantine_step``) so the job can save that step again; an
  explicit ``restore(step=...)`` of it still raises CorruptSnapshotError. Only proven
  damage is set aside, and only when the manager may write (``writes``: not orbax's
  ``read_only``): a manifest this version cannot read (ManifestError: another jaxckpt
  version wrote it, its checksum intact) is skipped, never set aside. A step that
  storage could not read now (StorageError: access refused, throttling, a timeout, the
  connection) is skipped for this restore only, with a WARNING saying so, and stays
  listed: the next restore tries it again; asked for by name, or with nothing older,
  the StorageError is raised (naming the step and the cause).

  ``onto(step, read)``, if given, makes what the restore returns from the chosen step,
  through ``read(target, partial)`` (orbax's forms build their target from the step's
  metadata first); else the step is read onto ``target``."""
  t0 = time.perf_counter()
  source: _read.Source
  if step is not None and onto is None and jax.process_count() == 1:   # held here whole:
    local = _read_local(store, step, target, partial)    # nothing else to ask
    if local is not None:
      out, source = local
      info = _read.RestoreInfo(step, _read.Tier.HOST, time.perf_counter() - t0,
                               source.bytes_read)
      _said(info)
      return out, info
  skipped: list[tuple[int, str]] = []
  unread: set[int] = set()
  while True:
    chosen, tier = choose_step(store, directory, step, timeout_secs=timeout_secs,
                               skip={s for s, _ in skipped}, unreadable=unread)
    try:
      if onto is None:
        out, tier, source = _read_step(store, directory, chosen, tier, target, partial)
      else:
        got: list[tuple[Any, _read.Tier, _read.Source]] = []

        def read(t: Any, p: bool, s: int = chosen, tr: _read.Tier = tier) -> Any:
          got.append(_read_step(store, directory, s, tr, t, p))
          return got[-1][0]
        out = onto(chosen, read)
        _, tier, source = got[-1]
      failure = None
    except (*DAMAGE, *UNREADABLE) as e:
      if step is not None or (jax.process_count() == 1 and not _older(store, directory, chosen)):
        raise                           # asked for, or nothing older to go back to
      out, failure = None, e
    if step is None:
      said = (_verdicts(failure, timeout_secs) if jax.process_count() > 1
              else {} if failure is None else {0: _verdict(failure)})
      if said:
        why = (f"{type(failure).__name__}: {failure}" if failure is not None
               else "; ".join(f"processes {ps} found it {v}" for v, ps in _by_verdict(said)))
        skipped.append((chosen, why))
        if DAMAGED in said.values():
          logger.warning("restore(): step %d cannot be restored (%s); skipping it for the "
                         "newest older step", chosen, why)
          if writes and not isinstance(failure, errors.ManifestError):
            _set_aside(directory, chosen, why)
        else:
          unread.add(chosen)
          logger.warning("restore(): step %d could not be read now (%s); restoring the newest "
                         "older step for this restore only: step %d stays listed and the next "
                         "restore tries it again", chosen, why, chosen)
        continue
    break
  info = _read.RestoreInfo(chosen, tier, time.perf_counter() - t0, source.bytes_read,
                           tuple(skipped))
  _said(info)
  return out, info


DAMAGED, UNREAD = "damaged", "unreadable"


def _verdict(failure: Exception) -> str:
  """What a process's failed read of the agreed step says of it."""
  return UNREAD if isinstance(failure, UNREADABLE) else DAMAGED


def _by_verdict(said: dict[int, str]) -> list[tuple[str, list[int]]]:
  return [(v, sorted(p for p, w in said.items() if w == v)) for v in sorted(set(said.values()))]


def _said(info: _read.RestoreInfo) -> None:
  logger.info("restored step %d from %s: %s in %.3f s (%s)", info.step, info.tier.value,
              _progress.human_bytes(info.nbytes), info.seconds,
              _progress.rate(info.nbytes, info.seconds))


def _read_local(store: HostStore, step: int, target: Any, partial: bool
                ) -> tuple[Any, _read.HostSource] | None:
  """``step`` read from this store alone when it holds the whole step (one saving
  process): (the tree, the source); None otherwise, or when its read fails (the
  full path then says why, and falls back to storage)."""
  with contextlib.ExitStack() as stack:
    try:
      manifest, buffer = stack.enter_context(store.read(step))
    except (errors.StepNotFoundError, *DAMAGE):
      return None
    if manifest.process_count != 1:
      return None
    source = _read.HostSource([_read.BufferPiece(
        manifest, buffer, lend=functools.partial(store.lend, step, buffer))])
    try:
      return jax.block_until_ready(_read.restore_tree(source, target, partial=partial)), source
    except DAMAGE:
      return None


def _read_step(store: HostStore, directory: str | None, step: int, tier: _read.Tier,
               target: Any, partial: bool) -> tuple[Any, _read.Tier, _read.Source]:
  """``step`` read onto ``target`` from ``tier``, or from storage if that tier
  fails and storage holds it: (the tree, the tier used, the source read)."""
  if tier is not _read.Tier.STORAGE:
    try:
      with host_pieces(store, step, rebuild=tier is _read.Tier.PARITY) as pieces:
        source: _read.Source = _read.HostSource(pieces)
        out = jax.block_until_ready(_read.restore_tree(source, target, partial=partial))
      return out, tier, source
    except (errors.CorruptSnapshotError, errors.UnrecoverableLossError) as e:
      if step not in storage_steps(directory):
        raise
      logger.warning("step %d: %s tier failed (%s); reading storage instead", step, tier.value, e)
  source = StorageSource(directory, step)
  out = jax.block_until_ready(_read.restore_tree(source, target, partial=partial))
  return out, _read.Tier.STORAGE, source


def _older(store: HostStore, directory: str | None, step: int) -> bool:
  """Whether any tier holds a step older than ``step`` (somewhere to go back to)."""
  held = complete_steps(store)
  return any(s < step for s in [*held, *rebuildable_steps(held, store),
                                *storage_steps(directory)])


def _verdicts(failure: Exception | None, timeout_secs: float) -> dict[int, str]:
  """The processes whose read of the agreed step failed, and whether they found it
  damaged or could not read it now (every process says, so that all of them skip
  it or none does, and set it aside only when one proved it damaged)."""
  said = _kv.allgather("restore_ok", "" if failure is None else _verdict(failure),
                       timeout_secs=timeout_secs, what="whether they could read the step")
  return {p: v for p, v in enumerate(said) if v}


def _set_aside(directory: str | None, step: int, why: str) -> None:
  """Process 0 quarantines a skipped step that storage holds (see :func:`restore`)."""
  if directory is None or jax.process_index() != 0 or step not in storage_steps(directory):
    return
  try:
    universal.quarantine_step(directory, step, why)
  except (OSError, ValueError, errors.JaxckptError) as e:
    logger.warning("step %d could not be set aside on %s (%s); a save of it will find it "
                   "committed", step, directory, e)


def choose_step(store: HostStore, directory: str | None, step: int | None, *,
                timeout_secs: float, skip: set[int] | frozenset = frozenset(),
                unreadable: set[int] | frozenset = frozenset()) -> tuple[int, _read.Tier]:
  """The step to restore and the fastest tier that holds it: "host" (every
  saving process's snapshot is held), "parity" (some are lost but the
  survivors' parity rebuilds them) or "storage".

  Raises:
    UnrecoverableLossError: the step (or, for ``step=None``, the newest step
      anywhere) lost more hosts than parity can rebuild and storage has no step.
    CorruptSnapshotError: ``step`` was set aside on storage as damaged, or (for
      ``step=None``) every step left is in ``skip`` (found damaged).
    StorageError: (``step=None``) every step left is in ``skip``, and those in
      ``unreadable`` (of ``skip``) could not be read now.
    StepNotFoundError: no tier holds the step.
  """
  held = complete_steps(store)
  rebuilt, why = _rebuildable(held, store)
  stored = storage_steps(directory)
  every = (set(held) | set(rebuilt) | set(stored)) - set(skip)
  if step is None:
    if not every:
      if unreadable:
        damaged = sorted(set(skip) - set(unreadable))
        raise errors.StorageError(
            f"restore(): no step can be restored now: steps {sorted(unreadable)} could not be "
            "read (see the warnings: access refused, throttling, a timeout or the connection, "
            "not damage; they stay listed)"
            + (f" and steps {damaged} are damaged on every tier that holds them" if damaged
               else "") + "; no tier holds an older one. Try again once storage answers")
      if skip:
        raise errors.CorruptSnapshotError(
            f"restore(): no step can be restored: steps {sorted(skip)} are damaged on every "
            "tier that holds them (see the warnings), and no tier holds an older one")
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
    aside = universal.quarantined(directory, step) if directory else None
    if aside is not None:
      raise errors.CorruptSnapshotError(
          f"restore(step={step}): step {step} in {directory!r} was found damaged by an "
          f"earlier restore and set aside ({aside.get('reason')}); restore another step")
    raise errors.StepNotFoundError(
        f"restore(step={step}): step {step} is not held (held steps: {held})"
        + (f"; rebuildable from parity: {rebuilt}" if rebuilt else "")
        + (f"; on storage: {stored}" if directory else ""))
  if jax.process_count() > 1:
    step = agree(step, timeout_secs=timeout_secs)
  tier = (_read.Tier.HOST if step in held else _read.Tier.PARITY if step in rebuilt
          else _read.Tier.STORAGE)
  return step, tier


def describe(store: HostStore, directory: str | None, step: int
             ) -> tuple[str, list[LeafRecord | universal.LeafInfo], dict[str, Any]]:
  """What ``metadata(step)`` reads, from the first tier that has it: (the tier, the
  leaf records, the user metadata). A manifest of any saving process serves
  (each records every leaf): this host's, another host's agent's, or the copy
  the survivors keep with their parity; else the stored manifest.

  Raises:
    StepNotFoundError: no tier of the job holds ``step`` (naming what they hold).
  """
  if step in store.steps():
    try:
      with store.read(step) as (manifest, _):
        return "host", list(manifest.leaves), manifest.metadata
    except DAMAGE as e:               # (a truncated slot file): the next tier says it
      logger.warning("step %d: this host's snapshot cannot be read (%s); its metadata comes "
                     "from the next tier", step, e)
  held = complete_steps(store)
  rebuilt = [] if step in held else rebuildable_steps(held, store)
  if step in held or step in rebuilt:
    manifest = store.step_manifest(step)
    if manifest is not None:
      return "host" if step in held else "parity", list(manifest.leaves), manifest.metadata
  stored = storage_steps(directory)
  if step in stored:
    reader = universal.open_stored(directory, step)        # jaxckpt's step, or orbax's
    return "storage", list(reader.leaves.values()), reader.metadata
  raise errors.StepNotFoundError(
      f"metadata(): step {step} is held neither by the job's agents (held: {held}"
      + (f"; rebuildable from parity: {rebuilt}" if rebuilt else "") + ")"
      + (f" nor in storage ({stored})" if directory else ""))


def step_metadata(store: HostStore, directory: str | None, step: int
                  ) -> tuple[str, dict[str, _read.LeafMetadata], dict[str, Any]]:
  """:func:`describe`'s answer as ``metadata(step)`` gives it: the tier, the leaves by
  path (their kind, shape, dtype, saving sharding, scalar value) and the
  metadata saved with the step. Reads no array bytes.

  Raises:
    StepNotFoundError: no tier of the job holds ``step``.
  """
  tier, leaves, meta = describe(store, directory, step)
  return tier, {r.path: leaf_metadata(r) for r in leaves}, dict(meta)


def leaf_metadata(rec: LeafRecord | universal.LeafInfo) -> _read.LeafMetadata:
  """What ``metadata()`` says of a saved leaf (a host LeafRecord or a stored LeafInfo)."""
  return _read.LeafMetadata(rec.kind, tuple(rec.shape), rec.dtype, rec.sharding,
                            scalar_from_json(rec.value), rec.key_impl)


class StorageSource:
  """A step read from storage: the universal format (each region read on demand,
  verified), or a step an orbax CheckpointManager wrote there (read where it lies)."""

  def __init__(self, directory: str, step: int) -> None:
    self.reader_ = universal.open_stored(directory, step)
    self.step = step
    self.leaves = tuple(LeafRecord(path=i.path, kind=i.kind, shape=tuple(i.shape),
                                   dtype=i.dtype, value=i.value, key_impl=i.key_impl)
                        for i in self.reader_.leaves.values())

  @property
  def bytes_read(self) -> int:
    return self.reader_.bytes_read

  def prefetch(self, needed: dict[int, set[Box]]) -> None:
    """Nothing: each reader fetches its boxes at once."""
    del needed

  def reader(self, i: int, *, private: bool = True,
             boxes: set[Box] | None = None) -> Callable[[Box], np.ndarray]:
    """``read_region(box)`` for leaf ``i``: every stored chunk read once, verified
    (reads are fresh arrays: always private); ``boxes`` are fetched at once."""
    del private
    return self.reader_.region_reader(self.leaves[i].path, boxes=boxes)


def agree(step: int, *, timeout_secs: float) -> int:
  """The smallest of every process's choice, agreed through jax.distributed's key-value store.

  Raises SnapshotTimeoutError naming the processes that did not answer.
  """
  return min(int(v) for v in _kv.allgather("restore", str(step), timeout_secs=timeout_secs,
                                       what="the step they hold"))


@contextlib.contextmanager
def host_pieces(store: HostStore, step: int, *, rebuild: bool = False) -> Iterator[list[Piece]]:
  """This host's piece first (if it holds one), then the pieces the job holds
  elsewhere for the other saving processes of ``step``; with ``rebuild``, the
  pieces of lost hosts rebuilt from parity (checksum-verified) as local buffers."""
  with contextlib.ExitStack() as stack:
    pieces: list[Piece] = []
    local_index = None
    try:
      manifest, buffer = stack.enter_context(store.read(step))
    except errors.StepNotFoundError:       # this host holds none: the job's other hosts do
      manifest = None
    if manifest is not None:
      pieces.append(_read.BufferPiece(manifest, buffer,
                                         lend=functools.partial(store.lend, step, buffer)))
      local_index = manifest.process_index
      if manifest.process_count == 1:
        yield pieces
        return
    pieces += store.other_pieces(step, local_index, rebuild=rebuild, have=pieces, stack=stack)
    yield pieces
