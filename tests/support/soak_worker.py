"""One trainer of the chaos soak (:mod:`tests.support.soak`): a process of a
``jax.distributed`` job on loopback with its own run root, address and agent.

  python -m tests.support.soak_worker --port P --num-processes 4 --process-id I \
      --run-root R --tcp-host 127.0.1.M --job J --directory s3://bucket/run \
      --seed S --steps N [--fresh]

The training state is a deterministic function of the seed and the step
(:func:`reference`): integer arithmetic whose result is the same bits in numpy
and in XLA, with a sum over the whole job each step (a cross-process
collective, as a real step's gradient reduction is). Without ``--fresh`` the
trainer restores the newest step, compares every addressable shard with the
reference bit for bit and goes on from there; it saves every step (parity m=1,
every 5th step persisted) until step N.

It talks to the soak on stdout, one line per event:

  TIMING ...                             (seconds to import, join the job, open the manager)
  RESTORED step tier ok|BAD:<why> secs   FRESH    (tier "none": nothing was left, step 0)
  DAMAGED_SKIPPED s1,s2,...              (before RESTORED: newer steps the restore skipped)
  AVAILABLE s1,s2,...                    (after a restore, or asked: mgr.all_steps())
  STEP step saved restarts skipped       (after save() and wait_until_snapshotted())
  SAVE_ERROR step type: message          (an earlier step's persist failed or the agent
                                          died: said, and the loop goes on)
  DELETED step s1,s2,...                 (after delete(step): what it can still restore)
  SECOND refused|accepted names_first|-  (a second manager of the job, tried beside this one)
  STOPPED step   DONE step   ERROR type: message (then it exits 3)

and reads commands on stdin: ``GO k`` (run up to step k, then hold: the soak
places its faults this way, a few steps after their seeded step at most),
``AVAIL`` (say AVAILABLE after the next step, or at once while held), ``STOP restart`` (every trainer stops after the same step, agreed through the
step's collective, closes its manager and exits), ``STOP delete d0,d1,...`` (the
same, at the next step due for storage, which every trainer deletes after its
snapshot, trainer i ``di`` seconds later, while persists run: the deletes of one
step come at different times, in a seeded order) and ``SECOND k`` (at the step
agreed, every trainer tries a second manager of the job beside its own, and
says whether it was refused; ``k`` numbers the tries).
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
import traceback

import numpy as np

from jaxckpt.testing import history, processes

# The state: w (uint32, rows sharded over every device of the job), f (float32,
# derived from w, columns sharded), rep (uint32, replicated), a typed PRNG key
# (replicated) and a non-array position.
_MUL, _ADD = np.uint32(1664525), 1013904223
CODES = {"restart": 1, "delete": 2}
SECOND = 16                 # the flags carry code + SECOND x the newest SECOND try


def initial(seed: int, rows: int, cols: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  w = rng.integers(0, 2**32, (rows, cols), dtype=np.uint32)
  return {"w": w, "f": _derived(w), "rep": rng.integers(0, 2**32, (16,), dtype=np.uint32)}


def _derived(w: np.ndarray) -> np.ndarray:
  return (w >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)   # exact: < 2**24


def advance(vals: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
  """The numpy reference of one training step (the same bits as :func:`_jax_step`)."""
  w, rep = vals["w"], vals["rep"]
  total = np.sum(w, dtype=np.uint32)                  # wraps mod 2**32, as XLA's does
  w2 = w * _MUL + np.uint32((_ADD + step + int(total)) % 2**32)
  w2 ^= w2 >> np.uint32(13)
  rep2 = rep * np.uint32(3) + np.uint32((int(total) + step) % 2**32)
  return {"w": w2, "f": _derived(w2), "rep": rep2}


class Reference:
  """The expected state at any step, by replaying the numpy reference (cached)."""

  def __init__(self, seed: int, rows: int, cols: int) -> None:
    self.seed = seed
    self._vals = {0: initial(seed, rows, cols)}
    self._keys: dict[int, np.ndarray] = {}

  def arrays(self, step: int) -> dict[str, np.ndarray]:
    have = max(s for s in self._vals if s <= step)
    vals = self._vals[have]
    for s in range(have + 1, step + 1):
      vals = advance(vals, s)
      if s % 16 == 0 or s == step:
        self._vals[s] = vals
    return vals

  def key_data(self, step: int) -> np.ndarray:
    """The PRNG key's data at ``step`` (fold_in of the step each step)."""
    import jax  # pylint: disable=import-outside-toplevel
    if step not in self._keys:
      have = max([s for s in self._keys if s <= step], default=None)
      key = (jax.random.key(self.seed) if have is None
             else jax.random.wrap_key_data(self._keys[have]))
      for s in range((0 if have is None else have) + 1, step + 1):
        key = jax.random.fold_in(key, s)
      self._keys[step] = np.asarray(jax.random.key_data(key))
    return self._keys[step]


def _commands() -> "queue.Queue[str]":
  q: queue.Queue[str] = queue.Queue()

  def read() -> None:
    for line in sys.stdin:
      q.put(line.strip())
  threading.Thread(target=read, daemon=True, name="soak-stdin").start()
  return q


def say(*words: object) -> None:
  """One line to the soak, in one write (no other thread's output inside it)."""
  sys.stdout.write(" ".join(map(str, words)) + "\n")
  sys.stdout.flush()


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  processes.add_job_arguments(p)
  p.add_argument("--run-root", required=True)
  p.add_argument("--tcp-host", required=True)
  p.add_argument("--job", required=True)
  p.add_argument("--directory", required=True)
  p.add_argument("--seed", type=int, required=True)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--rows", type=int, default=256)
  p.add_argument("--cols", type=int, default=512)
  p.add_argument("--persist-interval", type=int, default=5)
  p.add_argument("--timeout-secs", type=float, default=90.0)
  p.add_argument("--fresh", action="store_true")
  p.add_argument("--history", default=None,
                 help="append this trainer's history here (jaxckpt.testing.history)")
  p.add_argument("--incarnation", type=int, default=0)
  p.add_argument("--run-ahead", type=int, default=None,
                 help="hold before step START + this + 1 until the soak says GO (default: run on)")
  a = p.parse_args(argv)
  try:
    return _run(a)
  except BaseException as e:  # pylint: disable=broad-except  (reported, then a hard exit)
    say(f"ERROR {type(e).__name__}: {str(e)[:2000]}".replace("\n", " | "))
    traceback.print_exc(file=sys.stdout)
    sys.stdout.flush()
    os._exit(3)               # no jax.distributed shutdown barrier with dead peers


def _run(a: argparse.Namespace) -> int:
  import logging  # pylint: disable=import-outside-toplevel
  logging.basicConfig(level=logging.WARNING, stream=sys.stdout,
                      format=f"[p{a.process_id} %(asctime)s %(name)s %(levelname)s] %(message)s")
  t_start = time.perf_counter()
  import jax  # pylint: disable=import-outside-toplevel
  t_import = time.perf_counter()
  processes.join_job(a, timeout_secs=180)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  from jaxckpt import errors  # pylint: disable=import-outside-toplevel

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  n_dev = len(devices)
  shard = {"w": NamedSharding(mesh, P("x")), "f": NamedSharding(mesh, P(None, "x")),
           "rep": NamedSharding(mesh, P()), "key": NamedSharding(mesh, P()),
           "flags": NamedSharding(mesh, P("x"))}
  ref = Reference(a.seed, a.rows, a.cols)

  def put(vals: dict[str, np.ndarray], key_data: np.ndarray, step: int) -> dict:
    out = {k: jax.make_array_from_callback(v.shape, shard[k], lambda i, v=v: v[i])
           for k, v in vals.items()}
    key = jax.make_array_from_callback(key_data.shape, shard["key"], lambda i: key_data[i])
    return {**out, "key": jax.random.wrap_key_data(key), "data": {"position": step}}

  def _jax_step(w, rep, key, flags, step):
    total = jnp.sum(w, dtype=jnp.uint32)
    w2 = w * jnp.uint32(_MUL) + (jnp.uint32(_ADD) + step + total)
    w2 = w2 ^ (w2 >> jnp.uint32(13))
    f = (w2 >> jnp.uint32(8)).astype(jnp.float32) * jnp.float32(2.0**-24)
    rep2 = rep * jnp.uint32(3) + (total + step)
    return w2, f, rep2, jax.random.fold_in(key, step), jnp.max(flags)

  step_fn = jax.jit(_jax_step, out_shardings=(shard["w"], shard["f"], shard["rep"], shard["key"],
                                               shard["rep"]))

  opts = jc.CheckpointOptions(
      max_snapshots=2, save_interval_steps=1, on_busy="skip",
      persist_interval_steps=a.persist_interval, timeout_secs=a.timeout_secs,
      handle_sigterm=False,
      # Agents on loopback answer in milliseconds. After an agent is replaced, every
      # question to all of the job's agents (all_steps(), restore) still waits this long
      # for the dead one's address, once per kind of question.
      agent=jc.AgentOptions(job_name=a.job, run_root=a.run_root, tcp_host=a.tcp_host,
                            idle_timeout_secs=900, request_timeout_secs=10),
      parity=jc.ParityOptions(group_size=a.num_processes, parity=1))
  commands = _commands()
  t_init = time.perf_counter()
  mgr = jc.CheckpointManager(a.directory, opts)
  t_mgr = time.perf_counter()
  hist = _Recorder(a, opts, mgr)
  say(f"TIMING import={t_import - t_start:.2f} distributed={t_init - t_import:.2f} "
      f"manager={t_mgr - t_init:.2f}")
  if a.fresh:
    start = 0
    state = put(ref.arrays(0), ref.key_data(0), 0)
    hist.record("start", fresh=True, digest=history.digest(state))
    say("FRESH")
  elif not _anything_restorable(mgr):
    # A fault destroyed every copy of every step (a host lost before any step was
    # protected or persisted): the job starts again from step 0, as a real one would.
    start = 0
    state = put(ref.arrays(0), ref.key_data(0), 0)
    hist.record("start", fresh=False)
    hist.record("restore", step=0, tier="none", digest=history.digest(state), skipped=[],
                secs=0.0)
    hist.record("available", steps=[])
    say("RESTORED 0 none ok 0")
    say("AVAILABLE -")
  else:
    t0 = time.perf_counter()
    target = put(ref.arrays(0), ref.key_data(0), 0)
    hist.record("start", fresh=False)
    state = mgr.restore(target=target)
    start = mgr.last_restore.step
    hist.record("restore", step=start, tier=str(mgr.last_restore.tier),
                digest=history.digest(state), secs=round(time.perf_counter() - t0, 3),
                skipped=[s for s, _ in mgr.last_restore.skipped])
    if mgr.last_restore.skipped:
      say("DAMAGED_SKIPPED", ",".join(str(s) for s, _ in mgr.last_restore.skipped))
    why = _compare(state, ref, start, shard)
    say("RESTORED", start, mgr.last_restore.tier, "ok" if why is None else f"BAD:{why}",
        f"{time.perf_counter() - t0:.3f}")
    if why is not None:                  # go on from the reference: later checks stay sharp
      state = put(ref.arrays(start), ref.key_data(start), start)
    # what any tier could restore now (held, rebuildable from parity, stored)
    hist.available()
  ctl = _Control(ceiling=a.steps if a.run_ahead is None else start + a.run_ahead)
  stopping = 0
  for step in range(start + 1, a.steps + 1):
    while True:
      while not commands.empty():
        ctl.handle(commands.get())
      if ctl.avail and step > ctl.ceiling:         # held: answer at once
        hist.available()
        ctl.avail = False
      if step <= ctl.ceiling:
        break
      ctl.handle(commands.get())                   # held until the soak says GO
    code = ctl.code + SECOND * ctl.second
    flags = jax.make_array_from_callback(
        (n_dev,), shard["flags"], lambda i, c=code: np.full((n_dev,), c, np.int32)[i])
    w, f, rep, key, agreed = step_fn(state["w"], state["rep"], state["key"], flags,
                                     jnp.uint32(step))
    agreed = int(np.asarray(agreed.addressable_data(0)))    # the loop's "loss fetch"
    state = {"w": w, "f": f, "rep": rep, "key": key, "data": {"position": step}}
    stopping = max(stopping, agreed % SECOND)
    saved = _save(mgr, step, state, errors, hist)
    if step % a.persist_interval == 0:
      hist.listing(step)
    if agreed // SECOND > ctl.second_done:      # every trainer at this same step
      ctl.second_done = ctl.second = agreed // SECOND
      _second_manager(jc, a.directory, opts, errors)
    say("STEP", step, int(saved), mgr.stats.agent_restarts, mgr.stats.skipped_busy)
    if ctl.avail:
      hist.available()
      ctl.avail = False
    if stopping == CODES["restart"] or (stopping == CODES["delete"]
                                        and step % a.persist_interval == 0):
      if stopping == CODES["delete"]:
        time.sleep(ctl.delays[a.process_id % len(ctl.delays)] if ctl.delays else 0.0)
        with hist.lock:               # no storage listing across the delete
          mgr.delete(step)
          after = mgr.all_steps()
          hist.record("delete", step=step, after=after)
        say("DELETED", step, ",".join(map(str, after)) or "-")
      _close(mgr, errors, hist)
      hist.record("stopped", step=step)
      say("STOPPED", step)
      _leave(jax)
  _close(mgr, errors, hist)
  hist.record("done", step=a.steps)
  say("DONE", a.steps)
  _leave(jax)


def _leave(jax) -> None:
  """Exits once every process of the job is leaving: the coordinator (process 0)
  going first aborts the others (MEASURED.md), so they meet in jax.distributed's
  shutdown barrier first."""
  jax.distributed.shutdown()
  sys.stdout.flush()
  os._exit(0)


class _Control:
  """What the soak said on stdin: stop (and how), say what is restorable, how far to run."""

  def __init__(self, ceiling: int) -> None:
    self.code, self.avail, self.ceiling = 0, False, ceiling
    self.delays: list[float] = []
    self.second = self.second_done = 0

  def handle(self, line: str) -> None:
    words = line.split()
    if words[:1] == ["STOP"]:
      self.code = max(self.code, CODES[words[1]])
      if len(words) > 2:
        self.delays = [float(x) for x in words[2].split(",")]
    elif words[:1] == ["SECOND"]:
      self.second = max(self.second, int(words[1]))
    elif words == ["AVAIL"]:
      self.avail = True
    elif words[:1] == ["GO"]:
      self.ceiling = int(words[1])


class _Recorder:
  """This trainer's history (:mod:`jaxckpt.testing.history`; nothing without
  ``--history``). Process 0 lists the committed steps on storage every second in a
  thread and records each change (what the job is told is persisted); every
  process records at each due step what is protected by parity."""

  LIST_EVERY_SECS = 1.0

  def __init__(self, a: argparse.Namespace, opts, mgr) -> None:
    self.mgr, self.directory, self.process = mgr, a.directory, a.process_id
    self.timeout_secs = opts.timeout_secs
    self.lock = threading.Lock()
    self._h = None if a.history is None else history.History(
        a.history, f"inc{a.incarnation:02d}-p{a.process_id}", role="trainer",
        incarnation=a.incarnation, process=a.process_id, max_snapshots=opts.max_snapshots)
    self._stored: list[int] | None = None
    self._stop = threading.Event()
    if self._h is not None and a.process_id == 0:
      threading.Thread(target=self._list_storage, daemon=True, name="soak-history").start()

  def record(self, event: str, **fields) -> None:
    if self._h is not None:
      self._h.record(event, **fields)

  def available(self) -> list[int]:
    steps = self.mgr.all_steps()
    self.record("available", steps=steps)
    say("AVAILABLE", ",".join(map(str, steps)) or "-")
    return steps

  def listing(self, step: int) -> None:
    if self._h is None:
      return
    try:
      protected = self.mgr.protected_steps()
    except Exception as e:  # pylint: disable=broad-except  (an agent away: nothing claimed)
      self.error(step, e)
      protected = []
    self.record("listing", step=step, protected=protected, stored=None)

  def _list_storage(self) -> None:
    from jaxckpt import universal  # pylint: disable=import-outside-toplevel
    while not self._stop.wait(self.LIST_EVERY_SECS):
      with self.lock:
        try:
          stored = universal.all_steps(self.directory, timeout_secs=5)
        except Exception:  # pylint: disable=broad-except  (storage away: nothing told)
          continue
        if stored != self._stored:
          self._stored = stored
          self.record("listing", step=None, protected=None, stored=stored)

  def wait(self, what: str, secs: float, e: BaseException | None) -> None:
    if e is not None or secs > 1.0:
      self.record("wait", what=what, timeout_secs=self.timeout_secs, secs=round(secs, 3),
                  ok=e is None, message=None if e is None else f"{type(e).__name__}: {e}")

  def error(self, step: int | None, e: BaseException) -> None:
    self.record("error", step=step, type=type(e).__name__, message=str(e)[:2000])

  def stop(self) -> None:
    self._stop.set()
    with self.lock:
      pass


def _second_manager(jc, directory: str, opts, errors) -> None:
  """A second manager of this job and host beside the running one (every trainer at
  the same step, so their agreements stay in step): it must be refused, naming
  the first."""
  try:
    second = jc.CheckpointManager(directory, opts)
  except errors.PermissionDeniedError as e:
    say("SECOND refused", "names_first" if "held by another live manager" in str(e) else "-")
    return
  say("SECOND accepted -")
  second.close()


def _anything_restorable(mgr) -> bool:
  """Whether any process of the job sees a restorable step on any tier (agreed:
  every process gets the same answer)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  mine = np.int32(bool(mgr.all_steps()))
  return bool(np.max(multihost_utils.process_allgather(mine)))


def _reported(e: BaseException, errors) -> bool:
  """Whether ``e`` is a failure the loop goes on after: an earlier step's persist
  that failed (raised from a later call), or an agent that died (the next save
  starts a new one)."""
  return isinstance(e, errors.JaxckptError) and (
      isinstance(e, errors.AgentUnavailableError) or _persist_failure(e))


def _persist_failure(e: BaseException) -> bool:
  """Whether ``e`` is a persist's failure (its message, without an OSError's errno)."""
  text = e.strerror if isinstance(e, OSError) and e.errno and e.strerror else str(e)
  return text.startswith("persisting step ")


def _save(mgr, step: int, state: dict, errors, hist: "_Recorder") -> bool:
  """:func:`_save_once`, recorded: the step, whether save() took it and its snapshot
  committed on this host (or why not), and the digest of this process's bytes."""
  skipped = dict(mgr.stats.skip_reasons)
  accepted: list[bool] = []
  snapshotted = _save_once(mgr, step, state, errors, hist, accepted)
  reason = None
  if not snapshotted:
    reason = next((k for k, n in mgr.stats.skip_reasons.items() if n > skipped.get(k, 0)),
                  "not snapshotted")
  hist.record("save", step=step, accepted=bool(accepted and accepted[0]), snapshotted=snapshotted,
              reason=reason, digest=history.digest(state))
  return snapshotted


def _save_once(mgr, step: int, state: dict, errors, hist: "_Recorder",
               accepted: list[bool]) -> bool:
  """save() then wait_until_snapshotted(); True if the snapshot committed on this host.

  A failure the loop goes on after is said (SAVE_ERROR). save() raising it has
  not started the save (it raises before anything), so it is tried again; once
  save() returned, never (a second save of a due step would be a second persist
  attempt on this process alone, which the other processes' parts never match).
  """
  for tries_left in (2, 1, 0):
    try:
      saved = mgr.save(step, state)
      accepted.append(saved)
      break
    except Exception as e:  # pylint: disable=broad-except
      if not _reported(e, errors):
        raise
      hist.error(step, e)
      say(f"SAVE_ERROR {step} {type(e).__name__}: {e}".replace("\n", " | "))
      if not tries_left:
        return False
  t0 = time.monotonic()
  try:
    mgr.wait_until_snapshotted()
  except Exception as e:  # pylint: disable=broad-except
    hist.wait(f"wait_until_snapshotted() after save({step})", time.monotonic() - t0, e)
    if not _reported(e, errors):
      raise
    hist.error(step, e)
    say(f"SAVE_ERROR {step} {type(e).__name__}: {e}".replace("\n", " | "))
    # an earlier step's persist (raised after this snapshot committed), or this snapshot's own
    return saved and _persist_failure(e)
  hist.wait(f"wait_until_snapshotted() after save({step})", time.monotonic() - t0, None)
  return saved


def _close(mgr, errors, hist: "_Recorder") -> None:
  """close(), which waits for this run's persists; their failures (and a persist
  that did not end in time: the agent goes on with it) are said."""
  t0 = time.monotonic()
  try:
    mgr.close()
  except Exception as e:  # pylint: disable=broad-except  (closed all the same)
    hist.wait("close()", time.monotonic() - t0, e)
    if not (_reported(e, errors) or isinstance(e, errors.SnapshotTimeoutError)):
      raise
    hist.error(None, e)
    say(f"SAVE_ERROR close {type(e).__name__}: {e}".replace("\n", " | "))
  else:
    hist.wait("close()", time.monotonic() - t0, None)
  hist.stop()


def _compare(state: dict, ref: Reference, step: int, shard: dict) -> str | None:
  """Why the restored ``state`` differs from the reference at ``step`` (None: bit-exact)."""
  import jax  # pylint: disable=import-outside-toplevel
  want = ref.arrays(step)
  for k, v in want.items():
    got = state[k]
    if got.sharding != shard[k]:
      return f"{k}:sharding:{got.sharding}"
    for s in got.addressable_shards:
      a, b = np.asarray(s.data), v[s.index]
      if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
        return f"{k}{s.index}:differs"
  if np.asarray(jax.random.key_data(state["key"]).addressable_data(0)).tobytes() != \
      ref.key_data(step).tobytes():
    return "key:differs"
  if state["data"] != {"position": step}:
    return f"data:{state['data']}"
  return None


if __name__ == "__main__":
  sys.exit(main())
