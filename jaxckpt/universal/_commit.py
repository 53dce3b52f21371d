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
import shlex
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import tensorstore as ts

from jaxckpt import errors
from jaxckpt.util import _wait
from jaxckpt.util._text import counted
from jaxckpt.host import snapshot as snap
from jaxckpt.universal import _arrays
from jaxckpt.universal import _failures
from jaxckpt.universal import _orbax_steps
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _local
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
        f"restore another step, or delete it: {delete_command(directory, step)}")
  return marker


def delete_command(directory: str, step: int) -> str:
  """The command that deletes ``step`` for good (fencing the job's agents too): what an
  error about a damaged or clashing step tells its user to run."""
  return shlex.join(["jaxckpt", "delete", directory, "--step", str(step)])


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
      missing = missing_parts(directory, step, attempt, process_count,
                              timeout_secs=lay.LATE_PROBE_SECS)
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
  never written again, by another attempt or by the one that committed it), and
  PermissionDeniedError if a local step's directory is a link (nothing is written
  through it)."""
  local = lay.local_root(kv)
  if local is not None:
    for prefix in (lay.attempt_dir(step, attempt), f"{lay.step_dir(step)}arrays/{attempt}/"):
      _local.check_dirs(local, prefix, writing=True,
                        where=f"writing step {step} (attempt {attempt!r}) to {directory!r}")
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
      f"it: delete it first ({delete_command(directory, step)}) or "
      "persist into another directory")


def missing_parts(directory: str, step: int, attempt: str, process_count: int | None = None,
                  *, of: Iterable[int] = (),
                  timeout_secs: float = lay.REQUEST_TIMEOUT_SECS) -> list[int]:
  """The processes of ``attempt`` (``range(process_count)``, or those ``of``) whose
  part records of ``step`` are not on storage.

  Raises:
    TimeoutError: storage did not answer within ``timeout_secs`` (all reads together).
  """
  deadline = time.monotonic() + timeout_secs
  kv = lay.open_kvstore(directory, timeout_secs=timeout_secs)
  wanted = list(of) if process_count is None else range(process_count)
  reads = [(i, lay.read(kv, lay.part_key(step, i, attempt))) for i in wanted]
  missing = []
  for i, r in reads:
    try:
      state = r.result(timeout=max(0.0, deadline - time.monotonic())).state
    except TimeoutError:
      raise TimeoutError(f"storage ({lay.server_of(directory)}) did not answer within "
                         f"{timeout_secs} s") from None
    if state != "value":
      missing.append(i)
  return missing


def who_is_late(directory: str, step: int, attempt: str, process_count: int) -> str:
  """Why persist ``attempt`` of ``step`` is not on storage yet: the processes whose
  part is missing there, or process 0's commit (what a timeout names). Storage is
  asked for ``LATE_PROBE_SECS`` at most: a wait that ran out raises on time even when
  storage does not answer."""
  try:
    missing = missing_parts(directory, step, attempt, process_count,
                            timeout_secs=lay.LATE_PROBE_SECS)
  except (OSError, ValueError) as e:       # (a storage that does not answer now)
    return f"step {step}: which parts are missing is unknown ({type(e).__name__}: {e})"
  if missing:
    return (f"step {step}: processes {missing} of {process_count} (their agents or "
            "trainers) did not write their part")
  return f"step {step}: every process wrote its part but process 0 did not commit it"


def _wait_for_parts(kv: ts.KvStore, directory: str, step: int, attempt: str,
                    process_count: int, timeout_secs: float,
                    check: Callable[[], None]) -> list[_merge.Part]:
  parts: dict[int, _merge.Part] = {}

  def missing() -> list[int]:
    return [i for i in range(process_count) if i not in parts]

  def all_written() -> list[_merge.Part] | None:
    waiting = missing()
    reads = [lay.read(kv, lay.part_key(step, i, attempt)) for i in waiting]   # all at once
    for i, read in zip(waiting, reads):
      res = lay.storage_result(read, f"reading the part record of process {i} at step {step}", directory)
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
    StepExistsError: another attempt committed ``step`` (before or during this one);
      StepAlreadyExistsError: orbax wrote ``step`` in ``directory``.
    SnapshotTimeoutError: naming the processes whose part records are missing.
    ManifestError: the parts disagree or do not cover every leaf.
  """
  if process_count < 1:
    raise errors.InvalidArgumentError(
        f"commit_step: process_count must be >= 1, got {process_count=}")
  lay.check_attempt(attempt)
  kv = lay.open_kvstore(directory)
  marker = read_marker(kv, directory, step)
  if marker is None:
    _orbax_steps.check_not_orbax(directory, step)        # a step is saved once, by either
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
                 what=f"the part records of step {step} "
                 f"({counted(process_count, 'process', 'processes')})")
    leaves = [_finish_leaf(directory, step, m) for m in merged]
  except (TypeError, ValueError, KeyError, AttributeError) as e:
    if isinstance(e, errors.JaxckptError):
      raise
    raise errors.ManifestError(
        f"commit of step {step}: a part record is damaged: {type(e).__name__}: {e}") from None
  doc = man.document(step=step, process_count=process_count, metadata=metadata, leaves=leaves)
  body = _merge.encode(doc)
  kv.write(lay.manifest_key(step, attempt), body).result(timeout=lay.REQUEST_TIMEOUT_SECS)
  local = lay.local_root(kv)
  if local is not None:       # the step's new directories, then commits/, survive a power loss
    _local.sync_tree(local, lay.step_dir(step))
    _local.ensure_dir(local, lay.COMMITS_PREFIX)
  mine = {"step": step, "attempt": attempt, "manifest_xxh3": snap.checksum(body),
          "process_count": process_count, "committed_at": time.time()}
  with _claimed(kv, directory, step, attempt, timeout_secs) as claim:
    check()
    check_not_committed(kv, directory, step, attempt)
    claim.check_held()
    _write_marker(kv, directory, step, mine)
  log.info("step %d committed in %s by attempt %s (%s, %s)", step, directory, attempt,
           counted(len(leaves), "leaf", "leaves"), counted(process_count, "process", "processes"))


#: A writer renews its claim on a step this often while it holds it ...
CLAIM_RENEW_SECS = 1.0
#: ... and another writer takes a claim it has watched stay unchanged this long for the
#: claim of a writer that died (a SIGKILL mid-commit leaves it on storage).
CLAIM_LAPSE_SECS = 6.0
#: A look at the claims counts at most this much of the waiter's clock towards a claim's
#: lapse (it looks every 2 x CLAIM_RENEW_SECS at most): a clock that jumps forward between
#: two looks takes no live writer's claim, one that jumps back keeps no dead one's.
CLAIM_LOOK_CAP_SECS = 3.0
#: A wait for other writers' claims that lasts longer than this is logged (whom, why).
CLAIM_WAIT_LOGGED_SECS = 2.0


class _Claim:
  """This writer's claim on a step (``claims/<attempt>``), renewed on a thread of its
  own while it is held: each renewal changes it, so the other writers of the step
  tell a live claim from a dead writer's by watching it (their own clocks, never
  this host's), and a dead writer's claim lapses within ``CLAIM_LAPSE_SECS``."""

  def __init__(self, kv: ts.KvStore, key: str, attempt: str, step: int) -> None:
    self.kv, self.key, self.attempt, self.step = kv, key, attempt, step
    self.renewals = 0
    self.renewed = 0.0                 # monotonic time of the last renewal on storage
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def put(self) -> None:
    self.renewals += 1
    body = {"attempt": self.attempt, "at": time.time(), "renewal": self.renewals,
            "renew_secs": CLAIM_RENEW_SECS, "lapse_secs": CLAIM_LAPSE_SECS}
    self.kv.write(self.key, json.dumps(body).encode()).result(timeout=lay.REQUEST_TIMEOUT_SECS)
    self.renewed = time.monotonic()

  def hold(self) -> None:
    """Renews the claim every ``CLAIM_RENEW_SECS`` until :meth:`release`."""
    def renew() -> None:
      while not self._stop.wait(CLAIM_RENEW_SECS):
        try:
          self.put()
        except (OSError, ValueError, TimeoutError) as e:   # check_held says it, if it matters
          log.warning("step %d: renewing the commit claim of attempt %s failed: %s", self.step,
                      self.attempt, e)
    self._thread = threading.Thread(target=renew, daemon=True,
                                    name=f"jaxckpt-claim-{self.step}")
    self._thread.start()

  def check_held(self) -> None:
    """Raises StorageError unless the claim was renewed well within its lapse (a writer
    stalled past it may have been taken for dead: it must not write a marker)."""
    age = time.monotonic() - self.renewed
    if age > CLAIM_LAPSE_SECS / 2:
      raise errors.StorageError(
          f"commit of step {self.step} (attempt {self.attempt!r}): its claim was last renewed "
          f"{age:.1f} s ago, past half its {CLAIM_LAPSE_SECS} s lapse (storage too slow to "
          "answer, or this process stalled): another writer may take it for a dead one's, so "
          "this attempt commits nothing; it may be tried again")

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()


@contextlib.contextmanager
def _claimed(kv: ts.KvStore, directory: str, step: int, attempt: str,
             timeout_secs: float) -> Iterator[_Claim]:
  """Holds the right to write ``step``'s marker: mutual exclusion of the writers of
  one step on any store that reads its own writes and lists them (no compare-and-swap).

  Each writer puts ``claims/<attempt>`` and then lists the claims: it goes on only
  if it sees no other live claim, and keeps its claim, renewed every
  ``CLAIM_RENEW_SECS``, until its marker is written. Of two writers that overlap, the
  later one's listing sees the earlier claim (or, once that claim is gone, its
  marker), so at most one writes a marker; two that see each other both step back,
  delete their claim and retry after a random pause. A claim this writer has seen
  unchanged for ``CLAIM_LAPSE_SECS`` is a dead writer's (killed mid-commit): it is
  removed, so a relaunched writer of the step goes on within seconds. A wait of more
  than ``CLAIM_WAIT_LOGGED_SECS`` is logged, naming whom it waits for.
  """
  key = lay.claims_prefix(step) + attempt
  claim = _Claim(kv, key, attempt, step)
  # another claim -> (its body, how long this writer has seen it unchanged, its last look)
  seen: dict[str, tuple[bytes, float, float]] = {}
  start = time.monotonic()
  deadline, logged = start + timeout_secs, False
  pause = 0.05
  while True:
    claim.put()
    others = _live_claims(kv, directory, step, key, seen)
    if not others:
      break
    _delete_key(kv, key, f"withdrawing the commit claim of step {step}")
    check_not_committed(kv, directory, step, attempt)
    waited = time.monotonic() - start
    if time.monotonic() > deadline:
      raise errors.SnapshotTimeoutError(
          f"commit of step {step} (attempt {attempt!r}) in {directory!r}: other writers "
          f"{others} kept claiming the step for {timeout_secs} s (their claims were renewed: "
          "they live; a dead writer's claim lapses within "
          f"{CLAIM_LAPSE_SECS} s)")
    if not logged and waited > CLAIM_WAIT_LOGGED_SECS:
      logged = True
      log.warning(
          "commit of step %d (attempt %s) in %s: waiting %.0f s so far for the claims of "
          "attempts %s on the step (another writer commits it now; a claim that stays unchanged "
          "for %.0f s is a dead writer's and is removed)", step, attempt, directory, waited,
          others, CLAIM_LAPSE_SECS)
    time.sleep(random.uniform(pause, 2 * pause))
    pause = min(2 * pause, CLAIM_RENEW_SECS)
  claim.hold()
  try:
    yield claim
  finally:
    claim.release()
    _delete_key(kv, key, f"withdrawing the commit claim of step {step}")


def _live_claims(kv: ts.KvStore, directory: str, step: int, mine: str,
                 seen: dict[str, tuple[bytes, float, float]]) -> list[str]:
  """The attempts of the other claims on ``step`` that live: new to this writer, changed
  (renewed) since it last looked, or unchanged for less than ``CLAIM_LAPSE_SECS`` of
  its own clock, each look counting at most ``CLAIM_LOOK_CAP_SECS`` (and never less than
  nothing: a clock stepped back). A lapsed one (its writer died) is removed."""
  keys = kv.list(lay.prefix_range(lay.claims_prefix(step))).result(
      timeout=lay.REQUEST_TIMEOUT_SECS)
  live = []
  now = time.monotonic()
  for k in (k.decode(errors="replace") for k in keys):
    if k == mine:
      continue
    got = lay.read(kv, k).result(timeout=lay.REQUEST_TIMEOUT_SECS)
    if got.state != "value":
      continue                       # (gone since the listing: its writer finished)
    body = bytes(got.value)
    try:
      who = json.loads(body).get("attempt")
    except (ValueError, AttributeError):
      who = None
    who = who if isinstance(who, str) else k.rsplit("/", 1)[-1]
    before = seen.get(k)
    if before is None or before[0] != body:
      seen[k] = (body, 0.0, now)       # new, or renewed since: its writer lives
      live.append(who)
      continue
    unchanged = before[1] + min(max(0.0, now - before[2]), CLAIM_LOOK_CAP_SECS)
    seen[k] = (body, unchanged, now)
    if unchanged < CLAIM_LAPSE_SECS:
      live.append(who)
    else:
      log.warning("commit of step %d in %s: the claim of attempt %r was not renewed for %.0f s: "
                  "its writer died mid-commit; removing it", step, directory, who, unchanged)
      _delete_key(kv, k, f"removing a dead writer's commit claim on step {step}")
      seen.pop(k, None)
  return live


def _delete(kv: ts.KvStore, key: str) -> None:
  kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result(timeout=lay.REQUEST_TIMEOUT_SECS)


def _delete_key(kv: ts.KvStore, key: str, what: str) -> None:
  """Deletes one key; in a local directory its name only, never through a link."""
  local = lay.local_root(kv)
  if local is None:
    _delete(kv, key)
  else:
    _local.remove(local, key, what=what)


def _write_marker(kv: ts.KvStore, directory: str, step: int, mine: dict[str, Any]) -> None:
  """Writes the marker if none exists, then reads it back: the attempt it names won.

  The write is conditional on the key's generation while it was absent (the store
  refuses it, answering an empty generation, once another attempt's marker is
  there; file and S3 honour it); the read back decides in any case.
  """
  key = lay.commit_key(step)
  try:
    absent = lay.read(kv, key).result(timeout=lay.REQUEST_TIMEOUT_SECS)
    if absent.state != "value":
      kv.write(key, json.dumps(mine).encode(), if_equal=absent.stamp.generation).result(
          timeout=lay.REQUEST_TIMEOUT_SECS)
  except (ValueError, TimeoutError) as e:
    raise errors.StorageError(
        f"writing the commit marker of step {step} to {directory!r} failed: "
        f"{lay.ts_error(e)}") from None
  won = read_marker(kv, directory, step)
  if won is None or won.get("attempt") != mine["attempt"]:
    raise _exists(directory, step, won or {}, mine["attempt"])


def all_steps(directory: str, *, timeout_secs: float = lay.REQUEST_TIMEOUT_SECS) -> list[int]:
  """Committed steps in ``directory``, ascending (a marker's name is the step, in
  ASCII digits as :func:`~jaxckpt.universal._layout.commit_key` writes it; any
  other name there is not a step). ``timeout_secs`` bounds the listing (a wait
  asks with the time it has left).

  Raises:
    CorruptSnapshotError: ``commits/`` of a local directory is a link (never listed
      through).
    StorageError: storage did not answer within ``timeout_secs``, or refused.
  """
  kv = lay.open_kvstore(directory, timeout_secs=timeout_secs)
  local = lay.local_root(kv)
  if local is not None:
    _local.check_dirs(local, lay.COMMITS_PREFIX, where=f"listing the steps of {directory!r}")
  keys = lay.storage_result(kv.list(lay.prefix_range(lay.COMMITS_PREFIX)), "listing the steps",
                            directory, timeout_secs)
  steps = []
  for key in keys:
    name = key.decode(errors="replace")
    if _MARKER.fullmatch(name) and name == lay.commit_key(int(name[len(lay.COMMITS_PREFIX):-5])):
      steps.append(int(name[len(lay.COMMITS_PREFIX):-5]))
  return sorted(steps)


def stored_steps(directory: str, *, timeout_secs: float = lay.REQUEST_TIMEOUT_SECS) -> list[int]:
  """Every step stored in ``directory``, ascending: those jaxckpt committed and those an
  orbax CheckpointManager finalized there (``_orbax_steps``). A step both hold is
  jaxckpt's (a warning names orbax's directory, left as it is)."""
  own = all_steps(directory, timeout_secs=timeout_secs)
  orbax = _orbax_steps.orbax_steps(directory)
  for step in set(own) & set(orbax):
    _orbax_steps.warn_once(directory, step, "step %d is both a jaxckpt step and orbax's %s in "
                           "%s: jaxckpt's is read, orbax's is left as it is", step, orbax[step],
                           directory)
  return sorted(set(own) | set(orbax))


_MARKER = re.compile(re.escape(lay.COMMITS_PREFIX) + r"[0-9]{10,20}\.json", re.ASCII)
_STEP_NAME = re.compile(r"step_([0-9]{10,20})", re.ASCII)


def latest_step(directory: str) -> int | None:
  """The newest committed step, or None if there is none."""
  steps = all_steps(directory)
  return steps[-1] if steps else None


def quarantine_step(directory: str, step: int, reason: str) -> None:
  """Sets committed ``step`` aside as damaged: its commit marker moves to
  ``quarantine/<step>.json`` with ``reason``, so no listing or restore picks it
  and the job may save the step again; its data stays for inspection (until
  :func:`discard_step`). A no-op if the step is not committed. In a local
  directory nothing is written or removed through a link (PermissionDeniedError)."""
  kv = lay.open_kvstore(directory)
  try:
    marker = read_marker(kv, directory, step)
  except errors.CorruptSnapshotError:
    marker = {"step": step, "marker": "damaged"}
  if marker is None:
    return
  record = dict(marker, reason=reason[:2000], quarantined_at=time.time())
  local = lay.local_root(kv)
  what = f"setting step {step} of {directory!r} aside"
  if local is not None:        # (the record's directory is written through: no link there)
    _local.check_dirs(local, lay.quarantine_key(step), where=what, writing=True)
  kv.write(lay.quarantine_key(step), json.dumps(record).encode()).result(
      timeout=lay.REQUEST_TIMEOUT_SECS)
  _delete_key(kv, lay.commit_key(step), what)
  log.warning("step %d in %s set aside as damaged (%s): %s", step, directory,
              lay.quarantine_key(step), reason)


def quarantined(directory: str, step: int) -> dict[str, Any] | None:
  """The record of ``step`` if :func:`quarantine_step` set it aside (and it was not
  committed again since), else None."""
  kv = lay.open_kvstore(directory)
  with _failures.reading(f"step {step}: its commit and quarantine records in {directory!r}"):
    if lay.read_json(kv, lay.commit_key(step)) is not None:
      return None
    return lay.read_json(kv, lay.quarantine_key(step))


def discard_step(directory: str, step: int, *, todelete_subdir: str | None = None) -> None:
  """Deletes a step, every attempt at it included (marker first, so it is never
  listed half-deleted), and its quarantine record; a step orbax wrote there, its
  step directory (exactly that: ``_orbax_steps.discard_orbax_step``). With
  ``todelete_subdir`` (orbax's option) a local directory's step is moved into
  ``directory/todelete_subdir/`` instead, for a reaper to remove later; on an
  object store it is deleted (as orbax does on GCS).

  In a local directory a delete never follows a link: a step directory (or a
  marker, or anything in the step) that is a link, a FIFO or a hard link loses
  its name only, and what it points to stays (see :mod:`jaxckpt.universal._local`).

  Raises:
    PermissionDeniedError: a directory the delete passes through (``commits/``,
      ``quarantine/``, ``todelete_subdir``) is a link: nothing is deleted through it.
  """
  _orbax_steps.discard_orbax_step(directory, step, todelete_subdir=todelete_subdir)
  local = lay.local_path(directory)
  if local is not None:
    _discard_local(directory, local, step, todelete_subdir)
    return
  kv = lay.open_kvstore(directory)
  _delete(kv, lay.commit_key(step))
  _delete(kv, lay.quarantine_key(step))
  kv.delete_range(lay.prefix_range(lay.step_dir(step))).result(timeout=lay.REQUEST_TIMEOUT_SECS)


def _discard_local(directory: str, local: str, step: int, todelete_subdir: str | None) -> None:
  """:func:`discard_step` of a local directory: names removed, never through a link."""
  if not os.path.isdir(local):
    return
  what = f"deleting step {step} of {directory!r}"
  _local.remove(local, lay.commit_key(step), what=what)
  try:
    _local.remove(local, lay.quarantine_key(step), what=what)
  except errors.PermissionDeniedError as e:   # (a planted quarantine/ link: never followed)
    log.warning("%s", e)
  prefix = lay.step_dir(step).rstrip("/")
  if todelete_subdir:
    _local.rename(local, prefix, todelete_subdir, what=what)
  else:
    _local.remove(local, prefix, what=what)
  _local.rmdir_if_empty(local, lay.COMMITS_PREFIX)   # the last step gone: an empty directory again


def unlist_steps(directory: str, steps: Iterable[int]) -> None:
  """Removes the commit markers of ``steps`` (newest first): from here on none of them
  exists (:func:`all_steps`); :func:`discard_step` then deletes their data. A
  rollback unlists every step of the abandoned timeline first, so that a crash
  while their data goes never leaves one of them listed."""
  local = lay.local_path(directory)
  kv = None if local is not None else lay.open_kvstore(directory)
  for step in sorted(steps, reverse=True):
    if local is not None:        # a name removed, never through a link
      _local.remove(local, lay.commit_key(step), what=f"unlisting step {step} of {directory!r}")
    else:
      _delete(kv, lay.commit_key(step))


def discard_attempt(directory: str, step: int, attempt: str) -> None:
  """Deletes what one persist attempt wrote of ``step`` (never the committed data:
  refuses if the marker names this attempt); in a local directory never through a link."""
  kv = lay.open_kvstore(directory)
  marker = read_marker(kv, directory, step)
  if marker is not None and marker.get("attempt") == attempt:
    raise errors.StepExistsError(
        f"attempt {attempt!r} committed step {step} in {directory!r}; discard_step deletes it")
  local = lay.local_root(kv)
  for prefix in (lay.attempt_dir(step, attempt), f"{lay.step_dir(step)}arrays/{attempt}/"):
    if local is None:
      kv.delete_range(lay.prefix_range(prefix)).result(timeout=lay.REQUEST_TIMEOUT_SECS)
    else:
      _local.remove(local, prefix, what=f"removing attempt {attempt!r} of step {step} from "
                    f"{directory!r}")


def discard_uncommitted(directory: str, *, keep: Iterable[int] = ()) -> list[int]:
  """Deletes what unfinished saves left in a local ``directory``: the steps that have
  data but no commit marker (except those in ``keep``: a save may be writing them).
  A step directory that is a link, a file or a FIFO loses its name only.
  On an object store it does nothing (an unfinished attempt's keys are its own and
  never read; listing every key to find them would cost more than they do).
  Returns the steps deleted."""
  local = lay.local_path(directory)
  if local is None or not os.path.isdir(local):
    return []
  committed, protected = set(all_steps(directory)), set(keep)
  orbax = {os.path.basename(p) for p in _orbax_steps.orbax_steps(directory).values()}
  doomed = sorted(int(m.group(1)) for n in os.listdir(local)
                  if (m := _STEP_NAME.fullmatch(n)) and n == lay.step_dir(int(m.group(1)))[:-1]
                  and int(m.group(1)) not in committed
                  and n not in orbax)             # (orbax's step_prefix="step" names its so)
  doomed = [s for s in doomed if s not in protected]
  for step in doomed:
    what = f"removing the unfinished save of step {step} from {directory!r}"
    _local.remove(local, lay.step_dir(step), what=what)
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
  """Deletes stored steps older than the newest ``max_to_keep`` (except ``keep``):
  jaxckpt's committed steps and orbax's finalized ones count alike (:func:`stored_steps`).

  Never touches uncommitted steps (a save may be writing them) nor steps in
  ``keep``, so it can run in a background thread beside any save; it takes no
  lock. Returns the deleted steps.
  """
  if not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1:
    raise errors.InvalidArgumentError(f"gc_steps: max_to_keep must be an int >= 1, got {max_to_keep=}")
  protected = set(keep)
  steps = stored_steps(directory)
  doomed = [s for s in steps[:-max_to_keep] if s not in protected]
  for s in doomed:
    discard_step(directory, s)
    log.info("gc: deleted step %d from %s", s, directory)
  return doomed
