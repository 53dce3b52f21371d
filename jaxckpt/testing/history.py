"""A run's history: every process appends what it was told, one JSON object a line.

A soak or nemesis run gives each process (a trainer of one incarnation of the job,
a replica group, the nemesis itself) a :class:`History` of its own, one file in the
run's history directory. Each :meth:`History.record` is one line, written with a
single ``write`` to a file opened ``O_APPEND`` and fsynced before it returns, so a
line that was recorded survives the process being killed right after (a process
killed mid-write leaves at most its last line torn, which :func:`read_run` drops and
counts). ``tests/support/checker.py`` reads every file of a run back and checks it
against the model of docs/reliability.md.

Each line holds ``event`` (what happened), ``seq`` (its place in this file), ``t``
(``time.time()`` of the recording process) and the identity the history was opened
with (``role``, ``incarnation``, ``process``, ``group``), then the event's fields.
The events a trainer records (``tests/support/soak_worker.py``):

- ``start`` ``{fresh, digest}``: the incarnation began (``fresh``: at step 0, whose
  bytes' digest it gives);
- ``restore`` ``{step, tier, digest, skipped, secs}``: a restore returned ``step``
  from ``tier`` (``"none"``: nothing was left, step 0), ``digest`` of the bytes it
  returned (this process's shards), the newer steps it skipped;
- ``save`` ``{step, accepted, snapshotted, reason, digest}``: ``save(step)``
  returned ``accepted`` and the snapshot committed on this host (``snapshotted``)
  or not, and why (``reason``: the skip's reason or the error);
- ``listing`` ``{step, protected, stored}``: at ``step``, what this process was told
  is protected by parity (``mgr.protected_steps()``) and on storage (``stored``,
  process 0 only: the committed steps listed there);
- ``available`` ``{steps}``: ``mgr.all_steps()``;
- ``delete`` ``{step, after}``: ``delete(step)`` returned; ``after``: all_steps() then;
- ``wait`` ``{what, timeout_secs, secs, ok, message}``: a wait ended (``ok``) or
  raised ``message``;
- ``error`` ``{step, type, message}``: a failure reported to the loop;
- ``stopped`` / ``done`` ``{step}``.

A replica group records ``quorum`` ``{step, quorum_id, members}`` and ``commit``
``{step, should_commit, digest, batch}``. The nemesis records ``fault`` ``{id,
kind, host, at_step, incarnation}``, ``fault_end`` ``{id}``, ``recovered`` ``{id,
incarnation, restored_step}``, ``damaged`` ``{step, incarnation}`` (it changed a
stored step's bytes on purpose), ``cut`` / ``heal`` ``{process, incarnation}`` and
``end`` ``{stored}`` (the steps on storage when the run ended).

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...   with History(d, "inc01-p0", role="trainer", incarnation=1, process=0) as h:
...     h.record("save", step=5, accepted=True, snapshotted=True, digest="ab")
...   events, torn = read_run(d)
>>> events[0]["event"], events[0]["step"], events[0]["process"], torn
('save', 5, 0, 0)
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import threading
import time
from typing import Any

SUFFIX = ".jsonl"


class History:
  """One process's history file ``directory/name.jsonl`` (appended to, fsynced per line)."""

  def __init__(self, directory: str, name: str, **identity: Any) -> None:
    os.makedirs(directory, exist_ok=True)
    self.path = os.path.join(directory, name + SUFFIX)
    self._identity = identity
    self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    self._seq = 0
    self._lock = threading.Lock()

  def record(self, event: str, **fields: Any) -> None:
    """Appends one event and fsyncs it (it is on disk when this returns)."""
    with self._lock:
      self._seq += 1
      line = json.dumps({"event": event, "seq": self._seq, "t": time.time(), **self._identity,
                         **fields}, sort_keys=True, default=str) + "\n"
      os.write(self._fd, line.encode())
      os.fsync(self._fd)

  def close(self) -> None:
    with self._lock:
      if self._fd >= 0:
        os.close(self._fd)
        self._fd = -1

  def __enter__(self) -> "History":
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def read_run(directory: str) -> tuple[list[dict[str, Any]], int]:
  """Every event of every history file in ``directory`` (each file's events in the
  order recorded, the files by name), and how many torn lines were dropped (a
  process killed in the middle of a write leaves its last line incomplete)."""
  events, torn = [], 0
  for path in sorted(glob.glob(os.path.join(directory, "*" + SUFFIX))):
    with open(path, "rb") as f:
      for raw in f:
        try:
          e = json.loads(raw)
        except ValueError:
          torn += 1
          continue
        e["file"] = os.path.basename(path)
        events.append(e)
  return events, torn


def digest(tree: Any) -> str:
  """The sha256 of a pytree's bytes as this process holds them: every leaf in path
  order, a ``jax.Array`` by each addressable shard (its index, dtype, shape, bytes),
  a typed PRNG key by its key data, anything else by its ``repr``. Two restores
  (or a save and a restore) of the same bytes on the same process give the same
  digest; one flipped bit gives another."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  for path, leaf in leaves:
    h.update(jax.tree_util.keystr(path).encode())
    if isinstance(leaf, jax.Array):
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
      for s in sorted(leaf.addressable_shards, key=lambda s: repr(s.index)):
        a = np.ascontiguousarray(np.asarray(s.data))
        h.update(f"{s.index}{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(leaf, np.ndarray):
      a = np.ascontiguousarray(leaf)
      h.update(f"{a.dtype.str}{a.shape}".encode())
      h.update(a.tobytes())
    else:
      h.update(repr(leaf).encode())
  return h.hexdigest()[:32]
