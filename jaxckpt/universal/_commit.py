"""Committing, listing and deleting steps.

A step is committed by process 0 of a persist *attempt* once every process of
that attempt wrote its part record: it merges those (and only those) into the
attempt's ``manifest.json`` and then writes ``commits/<step>.json`` naming the
attempt (one put; it records the manifest's checksum). The marker decides who
wrote the step: it is created exclusively where the store supports that, and
read back either way, so of two writers of one step exactly one commits and
the other gets :class:`~jaxckpt.errors.StepExistsError`; their data never
mixes because every attempt writes keys of its own. Readers list only markers,
so a crash at any point before the marker leaves nothing that
:func:`latest_step` or a restore would pick.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import random
import re
import shutil
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import tensorstore as ts

from jaxckpt import errors
from jaxckpt.util import _wait
from jaxckpt.host import snapshot as snap
from jaxckpt.universal import _arrays
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _merge
from jaxckpt.universal import _manifest as man

log = logging.getLogger(__name__)

def read_marker(kv: ts.KvStore, directory: str, step: int) -> dict[str, Any] | None:
  """The commit marker of ``step`` (None if the step is not committed)."""
  try:
    marker = lay.read_json(kv, lay.commit_key(step))
  except errors.ManifestError as e:           # not JSON: damaged (a flipped byte)
    marker = f"not JSON: {e}"
  if marker is not None and (not isinstance(marker, dict) or marker.get("step") != step):
    raise errors.CorruptSnapshotError(
        f"the commit marker of step {step} in {directory!r} is damaged ({marker!r}); "
        f"restore another step, or discard_step({directory!r}, {step})")
  return marker


def committed_by(directory: str, step: int) -> str | None:
  """The attempt whose data step ``step`` is (None: not committed, or format 1)."""
  marker = read_marker(lay.open_kvstore(directory), directory, step)
  return None if marker is None else marker.get("attempt")


def wait_committed(directory: str, step: int, attempt: str, process_index: int,
                   process_count: int, *, timeout_secs: float,
                   check: Callable[[], None] = lambda: None) -> None:
  """Waits until process 0 has committed ``step`` as ``attempt``: what a process
  other than 0 does once its part is written (with parity on), so that it keeps
  the step and its parity until storage holds it whole. ``check`` raises to stop
  waiting. It asks storage with backoff (20 ms up to 200 ms: the held slot
  blocks later saves until the commit is seen; its own part every 4th time), and
  a storage that does not answer for a while is asked again until the deadline.

  Raises:
    StepExistsError: another attempt committed ``step``; this one never will.
    StorageError (errno ECANCELED): process 0 gave up on the attempt: it removed
      the attempt's data, this process's part with it.
    SnapshotTimeoutError: no commit within ``timeout_secs``, naming the parts
      still missing (process 0 is late, failed or died, or a peer is late).
  """
  kv = lay.open_kvstore(directory)
  last: list[Exception | None] = [None]
  polls = [0]

  def committed() -> bool:
    check()
    polls[0] += 1
    try:
      marker = read_marker(kv, directory, step)
      if marker is not None and marker.get("attempt") != attempt:
        raise _exists(directory, step, marker, attempt)
      if (marker is None and polls[0] % 4 == 1      # (the first poll, then every 4th)
          and lay.read_json(kv, lay.part_key(step, process_index, attempt)) is None):
        raise errors.StorageError(
            errno.ECANCELED, f"step {step}: process 0 gave up on persist attempt {attempt!r} "
            f"(it removed the attempt's data from {directory!r}); the step is not on storage")
    except errors.JaxckptError:
      raise
    except (OSError, ValueError) as e:        # a storage that does not answer now: ask again
      last[0] = e
      return False
    return marker is not None

  def late() -> str:
    try:
      missing = missing_parts(directory, step, attempt, process_count)
      parts = f"; the parts of processes {missing} are missing" if missing else ""
    except (OSError, ValueError) as e:        # (a storage that does not answer now)
      parts = f"; which parts are missing is unknown ({type(e).__name__})"
    return (f"step {step} (attempt {attempt!r}): it was not committed in {directory!r} within "
            f"{timeout_secs} s of process {process_index}'s part{parts}; process 0 is late, "
            "failed or died, or a part is late (the step stays uncommitted)"
            + (f"; storage last failed with {type(last[0]).__name__}: {last[0]}" if last[0] else ""))

  _wait.until(committed, timeout_secs=timeout_secs, poll_secs=0.02, max_poll_secs=0.2,
              late=late)


def check_not_committed(kv: ts.KvStore, directory: str, step: int, attempt: str) -> None:
  """Raises StepExistsError if ``step`` is committed already (a committed step is
  never written again, by another attempt or by the one that committed it)."""
  marker = read_marker(kv, directory, step)
  if marker is not None:
    raise _exists(directory, step, marker, attempt)


def _exists(directory: str, step: int, marker: dict[str, Any], attempt: str) -> errors.StepExistsError:
  when = marker.get("committed_at")
  when = "" if when is None else time.strftime(" at %Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
  return errors.StepExistsError(
      f"step {step} is already committed in {directory!r} by persist attempt "
      f"{marker.get('attempt')!r}{when}; a committed step is never written again, so "
      f"this attempt ({attempt!r}) wrote nothing over it. Another job or an older timeline (before a rollback) owns "
      f"it: delete it first (jaxckpt.universal.discard_step({directory!r}, {step})) or "
      "persist into another directory")


def missing_parts(directory: str, step: int, attempt: str, process_count: int | None = None,
                  *, of: Iterable[int] = ()) -> list[int]:
  """The processes of ``attempt`` (``range(process_count)``, or those ``of``) whose
  part records of ``step`` are not on storage."""
  kv = lay.open_kvstore(directory)
  wanted = list(of) if process_count is None else range(process_count)
  reads = [(i, kv.read(lay.part_key(step, i, attempt))) for i in wanted]
  return [i for i, r in reads if r.result(timeout=lay.REQUEST_TIMEOUT_SECS).state != "value"]


def _wait_for_parts(kv: ts.KvStore, directory: str, step: int, attempt: str,
                    process_count: int, timeout_secs: float,
                    check: Callable[[], None]) -> list[_merge.Part]:
  parts: dict[int, _merge.Part] = {}

  def missing() -> list[int]:
    return [i for i in range(process_count) if i not in parts]

  def all_written() -> list[_merge.Part] | None:
    waiting = missing()
    reads = [kv.read(lay.part_key(step, i, attempt)) for i in waiting]   # all at once
    for i, read in zip(waiting, reads):
      res = read.result(timeout=lay.REQUEST_TIMEOUT_SECS)
      if res.state != "value":
        continue
      part = _merge.decode(res.value, f"part record of process {i} at step {step}")
      if part.step != step:
        raise errors.ManifestError(
            f"part record of process {i} at step {step} is of step {part.step}; it was written "
            "by another jaxckpt version or damaged")
      if part.attempt != attempt or part.process_index != i:
        raise errors.CorruptSnapshotError(
            f"commit of step {step}: the part record of process {i} under attempt "
            f"{attempt!r} says attempt {part.attempt!r}, process "
            f"{part.process_index!r}; it is damaged")
      parts[i] = part
    if not missing():
      return [parts[i] for i in range(process_count)]
    check()
    check_not_committed(kv, directory, step, attempt)
    return None

  return _wait.until(all_written, timeout_secs=timeout_secs, poll_secs=0.02, max_poll_secs=0.5,
                     late=lambda: (
      f"commit of step {step} (attempt {attempt!r}): processes {missing()} of "
      f"{process_count} did not write their part records within {timeout_secs} s; "
      "they are late or died while persisting (the step stays uncommitted)"))


def _finish_leaf(directory: str, step: int, merged: Any) -> dict[str, Any]:
  """The leaf's manifest entry: checks that the written boxes cover the leaf, and
  hashes the chunks no process hashed (chunks split between processes)."""
  leaf = _merge.outline(merged)
  leaf["chunks"] = merged.chunks(step)
  if leaf["kind"] == "scalar":
    return leaf
  boxes = merged.boxes
  have = _merge.covered(leaf["shape"], boxes)
  need = snap.box_size(snap.full_box(tuple(leaf["shape"])))
  if have is None:
    raise errors.ManifestError(
        f"commit of step {step}: a box written of leaf {leaf['path']!r} lies outside its "
        f"shape {leaf['shape']}; the part records are damaged")
  if have != need:
    raise errors.ManifestError(
        f"commit of step {step}: the processes wrote {have} of the {need} elements of "
        f"leaf {leaf['path']!r} (boxes {boxes[:8]}{' ...' if len(boxes) > 8 else ''}); "
        "some shards are missing")
  if leaf.get("chunk_shape") is None:  # empty leaf: nobody wrote, create it here
    info = man.LeafInfo.from_obj(dict(leaf, chunks={}))
    _, info = _arrays.open_for_write(directory, step, info)
    leaf["chunk_shape"] = list(info.chunk_shape)
    leaf["inner_chunk_shape"] = list(info.inner_chunk_shape)
  info = man.LeafInfo.from_obj(dict(leaf, chunks={}))
  grid = lay.chunk_grid(info.shape, info.chunk_shape)
  if _merge.complete(leaf["chunks"], grid):
    return leaf
  todo = [ix for ix in np.ndindex(*grid) if lay.chunk_key(ix) not in leaf["chunks"]]
  if todo:   # chunks split between processes: hash what they wrote, read back
    store = _arrays.open_for_read(directory, step, info)
    for ix in todo:
      region = lay.chunk_box(ix, info.shape, info.chunk_shape)
      arr = store[tuple(slice(a, b) for a, b in region)].read().result(
          timeout=lay.REQUEST_TIMEOUT_SECS)
      leaf["chunks"][lay.chunk_key(ix)] = snap.checksum(np.ascontiguousarray(arr))
  return leaf


def commit_step(directory: str, step: int, *, process_count: int, timeout_secs: float,
                attempt: str, check: Callable[[], None] = lambda: None) -> None:
  """Merges the part records of ``attempt`` into its manifest and commits the step.

  Run by process 0 of the attempt once all its processes called
  write_process_shards. Waits up to ``timeout_secs`` for the part records;
  the commit marker is written last, in one put, and read back. ``check()`` is
  called while waiting and just before the marker is written (under the commit
  claim): if it raises (the step was deleted meanwhile), nothing is committed. Committing a
  step this attempt committed already does nothing.

  Raises:
    StepExistsError: another attempt committed ``step`` (before or during this one).
    SnapshotTimeoutError: naming the processes whose part records are missing.
    ManifestError: the parts disagree or do not cover every leaf.
  """
  if process_count < 1:
    raise errors.InvalidArgumentError(
        f"commit_step: process_count must be >= 1, got {process_count=}")
  lay.check_attempt(attempt)
  kv = lay.open_kvstore(directory)
  marker = read_marker(kv, directory, step)
  if marker is not None:
    if marker.get("attempt") == attempt:
      log.info("step %d is already committed in %s by this attempt", step, directory)
      return
    raise _exists(directory, step, marker, attempt)
  with _no_gc():      # reading and merging build ~P x leaves dicts: collections scan them all
    # (In a call of its own: the parts are freed, by their count of references, before the
    # collector is back; held until then, its first collection scanned them all, 0.3 s at 4,096.)
    _commit_parts(kv, directory, step, attempt, process_count, timeout_secs, check,
                  _wait_for_parts(kv, directory, step, attempt, process_count, timeout_secs, check))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
  """The cyclic collector paused (what is built here holds no cycles): its full
  collections scan every live object, so they made the merge quadratic in processes."""
  was = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was:
      gc.enable()


def _commit_parts(kv: ts.KvStore, directory: str, step: int, attempt: str, process_count: int,
                  timeout_secs: float, check: Callable[[], None],
                  parts: list[_merge.Part]) -> None:
  metadata = parts[0].metadata
  try:
    merged = _merge.merge(step, parts, attempt)
    # The merged outline against the schema (the decoder checked every part's fields, chunk
    # tables included: validating the P x L merged chunk entries again was a third of the merge).
    man.validate(man.document(step=step, process_count=process_count, metadata=metadata,
                              leaves=[_merge.outline(m) for m in merged]),
                 what=f"the part records of step {step} ({process_count} processes)")
    leaves = [_finish_leaf(directory, step, m) for m in merged]
  except (TypeError, ValueError, KeyError, AttributeError) as e:
    if isinstance(e, errors.JaxckptError):
      raise
    raise errors.ManifestError(
        f"commit of step {step}: a part record is damaged: {type(e).__name__}: {e}") from None
  doc = man.document(step=step, process_count=process_count, metadata=metadata, leaves=leaves)
  body = _merge.encode(doc)
  kv.write(lay.manifest_key(step, attempt), body).result(timeout=lay.REQUEST_TIMEOUT_SECS)
  mine = {"step": step, "attempt": attempt, "manifest_xxh3": snap.checksum(body),
          "process_count": process_count, "committed_at": time.time()}
  with _claimed(kv, directory, step, attempt, timeout_secs):
    check()
    check_not_committed(kv, directory, step, attempt)
    _write_marker(kv, directory, step, mine)
  log.info("step %d committed in %s by attempt %s (%d leaves, %d processes)", step,
           directory, attempt, len(leaves), process_count)


@contextlib.contextmanager
def _claimed(kv: ts.KvStore, directory: str, step: int, attempt: str,
             timeout_secs: float) -> Iterator[None]:
  """Holds the right to write ``step``'s marker: mutual exclusion of the writers of
  one step on any store that reads its own writes and lists them (no compare-and-swap).

  Each writer puts ``claims/<attempt>`` and then lists the claims: it goes on only
  if it sees no other live claim, and keeps its claim until its marker is
  written. Of two writers that overlap, the later one's listing sees the
  earlier claim (or, once that claim is gone, its marker), so at most one
  writes a marker; two that see each other both step back, delete their claim
  and retry after a random pause. A claim older than ``timeout_secs`` is a
  crashed writer's and is ignored.
  """
  key = lay.claims_prefix(step) + attempt
  deadline = time.monotonic() + timeout_secs
  pause = 0.05
  while True:
    kv.write(key, json.dumps({"attempt": attempt, "at": time.time()}).encode()).result(
        timeout=lay.REQUEST_TIMEOUT_SECS)
    others = _live_claims(kv, step, key, timeout_secs)
    if not others:
      break
    _delete(kv, key)
    check_not_committed(kv, directory, step, attempt)
    if time.monotonic() > deadline:
      raise errors.SnapshotTimeoutError(
          f"commit of step {step} (attempt {attempt!r}) in {directory!r}: other writers "
          f"{others} kept claiming the step for {timeout_secs} s")
    time.sleep(random.uniform(pause, 2 * pause))
    pause = min(2 * pause, 1.0)
  try:
    yield
  finally:
    _delete(kv, key)


def _live_claims(kv: ts.KvStore, step: int, mine: str, max_age_secs: float) -> list[str]:
  keys = kv.list(lay.prefix_range(lay.claims_prefix(step))).result(
      timeout=lay.REQUEST_TIMEOUT_SECS)
  live = []
  for k in (k.decode() for k in keys):
    if k == mine:
      continue
    claim = lay.read_json(kv, k)
    if claim is not None and time.time() - float(claim.get("at", 0)) < max_age_secs:
      live.append(claim.get("attempt"))
  return live


def _delete(kv: ts.KvStore, key: str) -> None:
  kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result(timeout=lay.REQUEST_TIMEOUT_SECS)


def _write_marker(kv: ts.KvStore, directory: str, step: int, mine: dict[str, Any]) -> None:
  """Writes the marker if none exists, then reads it back: the attempt it names won.

  The write is conditional on the key's generation while it was absent (the store
  refuses it, answering an empty generation, once another attempt's marker is
  there; file and S3 honour it); the read back decides in any case.
  """
  key = lay.commit_key(step)
  try:
    absent = kv.read(key).result(timeout=lay.REQUEST_TIMEOUT_SECS)
    if absent.state != "value":
      kv.write(key, json.dumps(mine).encode(), if_equal=absent.stamp.generation).result(
          timeout=lay.REQUEST_TIMEOUT_SECS)
  except (ValueError, TimeoutError) as e:
    raise errors.StorageError(
        f"writing the commit marker of step {step} to {directory!r} failed: {e}") from None
  won = read_marker(kv, directory, step)
  if won is None or won.get("attempt") != mine["attempt"]:
    raise _exists(directory, step, won or {}, mine["attempt"])


def all_steps(directory: str) -> list[int]:
  """Committed steps in ``directory``, ascending."""
  kv = lay.open_kvstore(directory)
  keys = lay.storage_result(kv.list(lay.prefix_range(lay.COMMITS_PREFIX)), "listing the steps",
                            directory)
  steps = []
  for key in keys:
    name = key.decode()[len(lay.COMMITS_PREFIX):]
    if name.endswith(".json") and name[:-5].isdigit():
      steps.append(int(name[:-5]))
  return sorted(steps)


def latest_step(directory: str) -> int | None:
  """The newest committed step, or None if there is none."""
  steps = all_steps(directory)
  return steps[-1] if steps else None


def quarantine_step(directory: str, step: int, reason: str) -> None:
  """Sets committed ``step`` aside as damaged: its commit marker moves to
  ``quarantine/<step>.json`` with ``reason``, so no listing or restore picks it
  and the job may save the step again; its data stays for inspection (until
  :func:`discard_step`). A no-op if the step is not committed."""
  kv = lay.open_kvstore(directory)
  try:
    marker = read_marker(kv, directory, step)
  except errors.CorruptSnapshotError:
    marker = {"step": step, "marker": "damaged"}
  if marker is None:
    return
  record = dict(marker, reason=reason[:2000], quarantined_at=time.time())
  kv.write(lay.quarantine_key(step), json.dumps(record).encode()).result(
      timeout=lay.REQUEST_TIMEOUT_SECS)
  _delete(kv, lay.commit_key(step))
  log.warning("step %d in %s set aside as damaged (%s): %s", step, directory,
              lay.quarantine_key(step), reason)


def quarantined(directory: str, step: int) -> dict[str, Any] | None:
  """The record of ``step`` if :func:`quarantine_step` set it aside (and it was not
  committed again since), else None."""
  kv = lay.open_kvstore(directory)
  if lay.read_json(kv, lay.commit_key(step)) is not None:
    return None
  return lay.read_json(kv, lay.quarantine_key(step))


def discard_step(directory: str, step: int, *, todelete_subdir: str | None = None) -> None:
  """Deletes a step, every attempt at it included (marker first, so it is never
  listed half-deleted), and its quarantine record. With ``todelete_subdir``
  (orbax's option) a local directory's step is moved into
  ``directory/todelete_subdir/`` instead, for a reaper to remove later; on an
  object store it is deleted (as orbax does on GCS)."""
  kv = lay.open_kvstore(directory)
  kv.delete_range(ts.KvStore.KeyRange(lay.commit_key(step), lay.commit_key(step) + "\0")).result()
  _delete(kv, lay.quarantine_key(step))
  prefix = lay.step_dir(step)
  local = lay.local_path(directory)
  if todelete_subdir and local is not None and os.path.isdir(os.path.join(local, prefix)):
    into = os.path.join(local, todelete_subdir)
    os.makedirs(into, exist_ok=True)
    os.replace(os.path.join(local, prefix), os.path.join(into, prefix.rstrip("/")))
    return
  kv.delete_range(lay.prefix_range(prefix)).result(timeout=lay.REQUEST_TIMEOUT_SECS)
  if local is not None:  # the file kvstore leaves empty directories behind
    shutil.rmtree(os.path.join(local, prefix), ignore_errors=True)
    with contextlib.suppress(OSError):       # the last step gone: an empty directory again
      os.rmdir(os.path.join(local, lay.COMMITS_PREFIX))


def discard_attempt(directory: str, step: int, attempt: str) -> None:
  """Deletes what one persist attempt wrote of ``step`` (never the committed data:
  refuses if the marker names this attempt)."""
  kv = lay.open_kvstore(directory)
  marker = read_marker(kv, directory, step)
  if marker is not None and marker.get("attempt") == attempt:
    raise errors.StepExistsError(
        f"attempt {attempt!r} committed step {step} in {directory!r}; discard_step deletes it")
  for prefix in (lay.attempt_dir(step, attempt), f"{lay.step_dir(step)}arrays/{attempt}/"):
    kv.delete_range(lay.prefix_range(prefix)).result(timeout=lay.REQUEST_TIMEOUT_SECS)
    local = lay.local_path(directory)
    if local is not None:
      shutil.rmtree(os.path.join(local, prefix), ignore_errors=True)


def discard_uncommitted(directory: str, *, keep: Iterable[int] = ()) -> list[int]:
  """Deletes what unfinished saves left in a local ``directory``: the steps that have
  data but no commit marker (except those in ``keep``: a save may be writing them).
  On an object store it does nothing (an unfinished attempt's keys are its own and
  never read; listing every key to find them would cost more than they do).
  Returns the steps deleted."""
  local = lay.local_path(directory)
  if local is None or not os.path.isdir(local):
    return []
  committed, protected = set(all_steps(directory)), set(keep)
  doomed = sorted(int(n[len("step_"):]) for n in os.listdir(local)
                  if re.fullmatch(r"step_\d+", n) and int(n[len("step_"):]) not in committed)
  doomed = [s for s in doomed if s not in protected]
  for step in doomed:
    shutil.rmtree(os.path.join(local, lay.step_dir(step)), ignore_errors=True)
    log.info("removed the unfinished save of step %d from %s", step, directory)
  return doomed


def read_json(directory: str, name: str) -> Any:
  """The JSON object stored under ``name`` beside the steps (None if absent)."""
  return lay.read_json(lay.open_kvstore(directory), name)


def write_json(directory: str, name: str, obj: Any) -> None:
  """Stores ``obj`` as JSON under ``name`` beside the steps (one put)."""
  kv = lay.open_kvstore(directory)
  lay.storage_result(kv.write(name, json.dumps(obj).encode()), f"writing {name}", directory)


def gc_steps(directory: str, *, max_to_keep: int, keep: Iterable[int] = ()) -> list[int]:
  """Deletes committed steps older than the newest ``max_to_keep`` (except ``keep``).

  Never touches uncommitted steps (a save may be writing them) nor steps in
  ``keep``, so it can run in a background thread beside any save; it takes no
  lock. Returns the deleted steps.
  """
  if not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1:
    raise errors.InvalidArgumentError(f"gc_steps: max_to_keep must be an int >= 1, got {max_to_keep=}")
  protected = set(keep)
  steps = all_steps(directory)
  doomed = [s for s in steps[:-max_to_keep] if s not in protected]
  for s in doomed:
    discard_step(directory, s)
    log.info("gc: deleted step %d from %s", s, directory)
  return doomed
