"""Persist and reshard-restore throughput of the universal format vs its peers.

Same run, same tree, same disk: jaxckpt persist (write_process_shards +
commit_step from a host snapshot) vs raw tensorstore zarr v3 writes of the
same bytes vs orbax async save; jaxckpt restore onto another mesh vs orbax
restore with the same target shardings; bytes read vs bytes needed.

  python benchmarks/universal_io.py [--quick] [--runs N] [--dir DIR]

Prints one JSON object (medians of the timed runs, after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # pylint: disable=wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=wrong-import-position
import tensorstore as ts  # pylint: disable=wrong-import-position
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

import jaxckpt.universal as u  # pylint: disable=wrong-import-position
from jaxckpt.universal import _fixtures  # pylint: disable=wrong-import-position
from jaxckpt.universal import _layout  # pylint: disable=wrong-import-position


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
    spec = {"driver": "zarr3", "kvstore": _layout.kvstore_url(d) + rec.path + "/",
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


def timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="64 MiB tree, 2 runs")
  parser.add_argument("--runs", type=int, default=None)
  parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  args = parser.parse_args()
  total = (64 << 20) if args.quick else (1 << 30)
  runs = args.runs or (2 if args.quick else 3)
  root = tempfile.mkdtemp(prefix="universal_io_", dir=args.dir)
  tree = make_tree(total)
  nbytes = sum(x.nbytes for x in tree.values())
  ((manifest, buf),) = _fixtures.host_snapshots(0, tree)
  target_mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(target_mesh, P("a", "b")))
            for k, x in tree.items()}
  aligned_mesh = Mesh(np.array(jax.devices()[:4]), ("c",))
  aligned = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(aligned_mesh, P("c")))
             for k, x in tree.items()}
  ckptr = ocp.StandardCheckpointer()
  res: dict[str, list[float]] = {k: [] for k in (
      "persist_s", "raw_tensorstore_write_s", "orbax_async_save_s", "orbax_save_blocking_s",
      "restore_reshard_s", "orbax_restore_reshard_s", "restore_aligned_s")}
  read_ratio = aligned_ratio = None
  for run in range(runs + 1):  # run 0 is the warm-up
    d = os.path.join(root, f"run{run}")
    os.makedirs(d)
    def persist():
      u.write_process_shards(d + "/j", manifest, buf, attempt="t")
      u.commit_step(d + "/j", 0, process_count=1, timeout_secs=60, attempt="t")

    def orbax_save():
      t0 = time.perf_counter()
      ckptr.save(os.path.join(d, "orbax"), tree)
      times["block"] = time.perf_counter() - t0
      ckptr.wait_until_finished()

    times: dict[str, float] = {}
    writers = [("persist", persist), ("raw", lambda: raw_tensorstore_write(d + "/raw", manifest, buf)),
               ("orbax", orbax_save)]
    for name, fn in writers[run % 3:] + writers[:run % 3]:  # rotate: no order advantage
      os.sync()  # each writer starts with no dirty pages of the previous one
      times[name] = timed(fn)
    t_p, t_raw, t_orbax, t_block = times["persist"], times["raw"], times["orbax"], times["block"]
    os.sync()
    reader = u.open_step(d + "/j", 0)
    t_r = timed(lambda: jax.block_until_ready(u.restore_arrays(reader, target)))
    ratio = reader.bytes_read / reader.bytes_needed
    t_o = timed(lambda: jax.block_until_ready(ckptr.restore(os.path.join(d, "orbax"), target)))
    reader2 = u.open_step(d + "/j", 0)
    t_a = timed(lambda: jax.block_until_ready(u.restore_arrays(reader2, aligned)))
    if run:
      for k, v in zip(res, (t_p, t_raw, t_orbax, t_block, t_r, t_o, t_a)):
        res[k].append(v)
      read_ratio, aligned_ratio = ratio, reader2.bytes_read / reader2.bytes_needed
    shutil.rmtree(d)
  shutil.rmtree(root, ignore_errors=True)
  med = {k: statistics.median(v) for k, v in res.items()}
  gbs = lambda s: round(nbytes / s / 1e9, 3)
  print(json.dumps({
      "bytes": nbytes, "leaves": len(tree), "runs": runs, "medians": True,
      "persist_GBps": gbs(med["persist_s"]),
      "raw_tensorstore_GBps": gbs(med["raw_tensorstore_write_s"]),
      "orbax_async_save_GBps": gbs(med["orbax_async_save_s"]),
      "persist_vs_raw": round(med["raw_tensorstore_write_s"] / med["persist_s"], 3),
      "persist_vs_orbax": round(med["orbax_async_save_s"] / med["persist_s"], 3),
      "restore_reshard_GBps": gbs(med["restore_reshard_s"]),
      "orbax_restore_reshard_GBps": gbs(med["orbax_restore_reshard_s"]),
      "restore_vs_orbax": round(med["orbax_restore_reshard_s"] / med["restore_reshard_s"], 3),
      "restore_aligned_GBps": gbs(med["restore_aligned_s"]),
      "reshard_bytes_read_over_needed": round(read_ratio, 4),
      "aligned_bytes_read_over_needed": round(aligned_ratio, 4),
      "seconds": {k: [round(x, 3) for x in v] for k, v in res.items()},
      "restore_target": "mesh (2,4) P('a','b') from saved (8,) P('x'); aligned: (4,) P('c')",
  }, indent=1))


if __name__ == "__main__":
  main()
