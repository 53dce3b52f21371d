"""One measurement of ``benchmarks/scale.py``'s bytes and real-process curves, in a
fresh process (:mod:`tests.support.scale` starts these).

  python -m tests.support.scale_worker save --mib M --dir D [--order a,b,c]
  python -m tests.support.scale_worker restore --tool jaxckpt|orbax --mib M --dir D
  python -m tests.support.scale_worker job --tool jaxckpt|orbax --mib M --dir D \
      --repeats R --port P --num-processes N --process-id I

The state is 8 float32 leaves of ``(rows, 1024)`` totalling M MiB, random values
(orbax's writer compresses constant fills), rows sharded over every device of the
job. Each region's values depend only on the seed, the leaf and the first row, so
any process can make its own shards and a restore can check them.

``save`` (8 CPU devices) times ``--repeats`` times, in ``--order``, jaxckpt's persist (``save`` of a
step due for storage to ``wait_until_finished``), orbax's async save to finished
and a raw tensorstore write of the same arrays (zarr3, one array per leaf, one
chunk per shard, every open and write in flight at once), each after one warm-up
save of another state, and leaves step 2 of each under ``--dir``. ``restore``
restores jaxckpt's or orbax's step 2 and reports its time and the peak growth of
this process's resident memory (sampled every 2 ms, and ``ru_maxrss``) over the
restore. ``job`` is one process of a ``jax.distributed`` job (1 CPU device each)
on loopback: a warm-up save, then ``--repeats`` timed saves (barrier, save,
``wait_until_finished``, barrier: the slowest process's time) and restores.

Each prints one JSON object on its last line (``job``: process 0 only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

LEAVES = 8
COLS = 1024
TOOLS = ("jaxckpt", "orbax", "tensorstore")


def rows_for(mib: float, devices: int) -> int:
  """Rows of each leaf: ``LEAVES`` leaves total ``mib`` MiB, a multiple of ``devices``."""
  rows = int(mib * 2**20 / 4 / COLS / LEAVES)
  return max(devices, rows // devices * devices)


def region(seed: int, leaf: int, index: tuple[slice, ...], rows: int) -> np.ndarray:
  """The values of ``index`` (a row block, all columns) of leaf ``leaf``."""
  start, stop, _ = index[0].indices(rows)
  rng = np.random.default_rng((seed, leaf, start))
  return rng.random((stop - start, COLS), dtype=np.float32)


def make_state(seed: int, rows: int, sharding: Any) -> dict[str, Any]:
  return {f"w{i}": jax.make_array_from_callback(
      (rows, COLS), sharding, lambda idx, i=i: region(seed, i, idx, rows))
          for i in range(LEAVES)}


def abstract(rows: int, sharding: Any) -> dict[str, Any]:
  return {f"w{i}": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sharding)
          for i in range(LEAVES)}


def check(out: dict[str, Any], seed: int, rows: int) -> None:
  """Every addressable shard of ``out`` holds ``seed``'s values."""
  for i in range(LEAVES):
    for s in out[f"w{i}"].addressable_shards:
      if not np.array_equal(np.asarray(s.data), region(seed, i, s.index, rows)):
        raise AssertionError(f"restored leaf w{i} at {s.index} differs from seed {seed}'s")


CPU_SECS: list[float] = []      # this process's CPU seconds over each ``_timed`` call


def _timed(fn: Callable[[], Any]) -> float:
  """Wall seconds of ``fn()``; its CPU seconds (every thread's) go to ``CPU_SECS``."""
  c, t = time.process_time(), time.perf_counter()
  fn()
  secs = time.perf_counter() - t
  CPU_SECS.append(time.process_time() - c)
  return secs


# -- the tools --------------------------------------------------------------


def jaxckpt_manager(d: str, **kw: Any):
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  return jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False, **kw))


def orbax_manager(d: str):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  return ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=True))


@contextlib.contextmanager
def saver(tool: str, d: str) -> Iterator[Callable[[int, Any], None]]:
  """A call that saves a state as a step under ``d`` and returns once it is on storage."""
  if tool == "tensorstore":
    yield lambda step, state: ts_write(os.path.join(d, str(step)), state)
    return
  if tool == "jaxckpt":
    mgr = jaxckpt_manager(d, persist_interval_steps=1)
    def save(step: int, state: Any) -> None:
      if not mgr.save(step, state):
        raise AssertionError(f"jaxckpt skipped step {step}: {mgr.stats.skip_reasons}")
      mgr.wait_until_finished()
  else:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    mgr = orbax_manager(d)
    def save(step: int, state: Any) -> None:
      mgr.save(step, args=ocp.args.StandardSave(state))
      mgr.wait_until_finished()
  try:
    yield save
  finally:
    mgr.close()


def save_with(tool: str, d: str, warm: Any, timed: Any, barrier: Callable[[str], None],
              repeats: int = 1) -> list[float]:
  """Step 1 of ``warm``, then ``repeats`` timed steps 2, 3, ... (each from the call
  to ``save`` until it is on storage; step 2 is ``timed``, later steps alternate
  with ``warm``); ``barrier`` around each."""
  secs = []
  with saver(tool, d) as save:
    save(1, warm)
    for r in range(repeats):
      barrier(f"{tool}{r}a")
      secs.append(_timed(lambda r=r: save(2 + r, timed if r % 2 == 0 else warm)))
      barrier(f"{tool}{r}b")
  return secs


@contextlib.contextmanager
def restorer(tool: str, d: str, step: int, target: Any) -> Iterator[Callable[[], Any]]:
  """An open manager of ``tool`` on ``d``, as a call that restores ``step`` onto
  ``target`` (so a timing covers the restore alone, as the leaves curve's does)."""
  if tool == "jaxckpt":
    def restore() -> Any:
      out = jax.block_until_ready(mgr.restore(step, target))
      if mgr.last_restore.tier != "storage":
        raise AssertionError(f"restored from {mgr.last_restore.tier!r}, not from storage")
      return out
    with jaxckpt_manager(d) as mgr:
      yield restore
    return
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mgr = ocp.CheckpointManager(d)
  try:
    yield lambda: jax.block_until_ready(mgr.restore(step,
                                                    args=ocp.args.StandardRestore(target)))
  finally:
    mgr.close()


def ts_write(path: str, state: dict[str, Any]) -> None:
  """Every leaf as a zarr3 array under ``path`` (one chunk per shard), all in flight at once."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  opens = {}
  for k, v in state.items():
    chunk = list(v.sharding.shard_shape(v.shape))
    opens[k] = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                       "path": os.path.join(path, k)}},
                       create=True, dtype=ts.float32, shape=list(v.shape),
                       chunk_layout=ts.ChunkLayout(write_chunk_shape=chunk))
  writes = []
  for k, v in state.items():
    arr = opens[k].result()
    writes += [arr[s.index].write(np.asarray(s.data)) for s in v.addressable_shards
               if s.replica_id == 0]
  for w in writes:
    w.result()


# -- the modes --------------------------------------------------------------


def run_save(a: argparse.Namespace) -> dict[str, Any]:
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  rows = rows_for(a.mib, len(jax.devices()))
  warm, timed = make_state(1, rows, sharding), make_state(2, rows, sharding)
  out: dict[str, Any] = {"nbytes": LEAVES * rows * COLS * 4, "devices": len(jax.devices())}
  for tool in a.order.split(","):
    CPU_SECS.clear()
    out[f"{tool}_save_secs"] = save_with(tool, os.path.join(a.dir, tool), warm, timed,
                                         lambda _: None, a.repeats)
    out[f"{tool}_save_cpu_secs"] = list(CPU_SECS)
  return out


class PeakRss:
  """The peak resident memory of this process while inside, sampled every 2 ms and
  read from ``ru_maxrss`` (which catches a peak between samples)."""

  def __init__(self) -> None:
    import psutil  # pylint: disable=import-outside-toplevel
    self._proc = psutil.Process()
    self._stop = threading.Event()
    self.before = self.peak = 0

  def _sample(self) -> None:
    while not self._stop.wait(0.002):
      self.peak = max(self.peak, self._proc.memory_info().rss)

  def __enter__(self) -> "PeakRss":
    self._max_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    self.before = self.peak = self._proc.memory_info().rss
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc: Any) -> None:
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, self._proc.memory_info().rss)
    max_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if max_after > self._max_before:            # a new lifetime peak: it was during the restore
      self.peak = max(self.peak, max_after)


def run_restore(a: argparse.Namespace) -> dict[str, Any]:
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  rows = rows_for(a.mib, len(jax.devices()))
  with restorer(a.tool, os.path.join(a.dir, a.tool), 2, abstract(rows, sharding)) as restore:
    with PeakRss() as rss:
      t = time.perf_counter()
      out = restore()
      secs = time.perf_counter() - t
  check(out, 2, rows)
  nbytes = LEAVES * rows * COLS * 4
  return {"restore_secs": secs, "restore_rss_growth_bytes": rss.peak - rss.before,
          "restore_rss_gb_per_gb": (rss.peak - rss.before) / nbytes}


def run_job(a: argparse.Namespace) -> dict[str, Any] | None:
  jax.config.update("jax_num_cpu_devices", 1)
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}",
                             num_processes=a.num_processes, process_id=a.process_id,
                             initialization_timeout=120)
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  client = distributed.global_state.client

  def barrier(name: str) -> None:
    client.wait_at_barrier(f"scale-{name}", 600_000)

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  sharding = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P("x"))
  rows = rows_for(a.mib, len(devices))
  warm, timed = make_state(1, rows, sharding), make_state(2, rows, sharding)
  d = os.path.join(a.dir, a.tool)
  save_secs = save_with(a.tool, d, warm, timed, barrier, a.repeats)
  restore_secs = []
  with restorer(a.tool, d, 2, abstract(rows, sharding)) as restore:
    for r in range(a.repeats):
      barrier(f"restore{r}a")
      t = time.perf_counter()
      out = restore()
      barrier(f"restore{r}b")
      restore_secs.append(time.perf_counter() - t)
      check(out, 2, rows)
      del out
  barrier("done")
  if jax.process_index() != 0:
    return None
  return {"nbytes": LEAVES * rows * COLS * 4, "save_secs": save_secs,
          "restore_secs": restore_secs}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("mode", choices=["save", "restore", "job"])
  p.add_argument("--mib", type=float, required=True, help="the state's total size")
  p.add_argument("--dir", required=True, help="one directory per tool is made under it")
  p.add_argument("--tool", choices=TOOLS[:2], help="restore and job: whose checkpoint")
  p.add_argument("--order", default=",".join(TOOLS), help="save: the tools, in this order")
  p.add_argument("--repeats", type=int, default=1, help="save, job: timed saves (and restores)")
  p.add_argument("--port", type=int, help="job: the coordinator's port on 127.0.0.1")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  a = p.parse_args(argv)
  if a.mode != "job":
      jax.config.update("jax_num_cpu_devices", 8)
  out = {"save": run_save, "restore": run_restore, "job": run_job}[a.mode](a)
  if out is not None:
    print(json.dumps(out), flush=True)
  if a.mode == "job":
      jax.distributed.shutdown()     # (its barrier: no process outlives the coordinator's)
  os._exit(0)    # (a daemon thread inside XLA must not take the interpreter's exit down)


if __name__ == "__main__":
  sys.exit(main())
