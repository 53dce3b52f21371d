"""Conversion and orbax import: lazy jaxckpt vs the eager way, same run, same disk.

Tree: a scanned transformer (stacked ``w`` and fused ``qkv`` per layer) and a
padded embedding. Measured side by side:

* ``convert``: Unstack + Split(qkv) + Unpad(embed) written as a new step by
  :func:`jaxckpt.universal.convert.convert` (lazy views, chunk by chunk) vs the
  eager peer: read each leaf whole, numpy ops, ``write_leaves`` from numpy.
  Wall time and peak RSS growth of this process (sampled every 5 ms).
* ``restore``: every layer's ``q`` of the converted *view* restored onto 8
  devices (no converted copy on disk) vs restoring the same bytes from the
  converted copy.
* ``import``: ``import_orbax`` of an orbax checkpoint vs orbax's own restore
  to numpy followed by ``write_leaves``.

  python benchmarks/convert.py [--quick] [--runs N] [--dir DIR]

Prints one JSON object: medians of the timed runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # pylint: disable=wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=wrong-import-position
import psutil  # pylint: disable=wrong-import-position
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

import jaxckpt.universal as u  # pylint: disable=wrong-import-position
import _repo  # noqa: F401  (the repository root on the path: tests.support)
from tests.support import fixtures as _fixtures  # pylint: disable=wrong-import-position
from jaxckpt.universal import convert as cv  # pylint: disable=wrong-import-position
from jaxckpt.orbax import interop as ox  # pylint: disable=wrong-import-position

SPEC = cv.ConversionSpec(rules=(
    cv.Unstack(src="['layers']['{p}']", dst="['layer_{i}']['{p}']"),
    cv.Split(src="['layer_{i}']['qkv']", axis=1,
             dsts=("['layer_{i}']['q']", "['layer_{i}']['k']", "['layer_{i}']['v']")),
    cv.Unpad(src="['embed']", axis=0, size=1000),
))


def make_tree(total_bytes: int, layers: int = 8) -> dict[str, np.ndarray]:
  d = int((total_bytes / 4 / layers / 4) ** 0.5) // 64 * 64  # w: d*d, qkv: d*3d per layer
  rng = np.random.default_rng(0)
  return {"['layers']['w']": rng.standard_normal((layers, d, d), np.float32),
          "['layers']['qkv']": rng.standard_normal((layers, d, 3 * d), np.float32),
          "['embed']": rng.standard_normal((1024, d), np.float32)}


class PeakRss:
  """Peak resident-set growth of this process while the block runs."""

  def __init__(self):
    self._proc, self._stop = psutil.Process(), threading.Event()
    self.peak = 0

  def __enter__(self) -> "PeakRss":
    self._base = self._proc.memory_info().rss
    self._t = threading.Thread(target=self._sample, daemon=True)
    self._t.start()
    return self

  def _sample(self) -> None:
    while not self._stop.wait(0.005):
      self.peak = max(self.peak, self._proc.memory_info().rss - self._base)

  def __exit__(self, *exc: Any) -> None:
    self._stop.set()
    self._t.join(timeout=5)


def eager_convert(src: str, dst: str) -> None:
  reader = u.open_step(src)
  out, infos = {}, {}
  for path in reader.leaves:
    full = reader.read(path)
    if path == "['embed']":
      out[path] = full[:1000]
      continue
    name = path.split("'")[-2]
    for i, layer in enumerate(full):
      parts = np.split(layer, 3, axis=1) if name == "qkv" else [layer]
      for sub, arr in zip("qkv" if name == "qkv" else [name], parts):
        out[f"['layer_{i}']['{sub}']"] = arr
  for p, a in out.items():
    infos[p] = u.LeafInfo(path=p, kind="numpy", shape=a.shape, dtype=a.dtype.name)
  u.write_leaves(dst, reader.step, infos, out, metadata={})


def timed_runs(runs: int, fn: Callable[[int], Any]) -> tuple[float, float]:
  """Median seconds and median peak RSS growth (MiB) of ``runs`` calls after a warm-up."""
  fn(-1)
  secs, peaks = [], []
  for r in range(runs):
    with PeakRss() as rss:
      t = time.perf_counter()
      fn(r)
      secs.append(time.perf_counter() - t)
    peaks.append(rss.peak / 2**20)
  return statistics.median(secs), statistics.median(peaks)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="32 MiB tree, 2 runs")
  parser.add_argument("--runs", type=int, default=None)
  parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
  args = parser.parse_args()
  total = (32 << 20) if args.quick else (512 << 20)
  runs = args.runs or (2 if args.quick else 3)
  root = tempfile.mkdtemp(dir=args.dir, prefix="jaxckpt-convert-bench-")
  try:
    print(json.dumps(run(root, total, runs), indent=1))
  finally:
    shutil.rmtree(root, ignore_errors=True)


def run(root: str, total: int, runs: int) -> dict[str, Any]:
  tree = make_tree(total)
  nbytes = sum(a.nbytes for a in tree.values())
  src = os.path.join(root, "src")
  for manifest, buf in _fixtures.host_snapshots(1, tree):
    u.write_process_shards(src, manifest, buf, attempt="t")
  u.commit_step(src, 1, process_count=1, timeout_secs=60, attempt="t")
  out = lambda name, r: os.path.join(root, f"{name}{r}")
  lazy_s, lazy_mib = timed_runs(runs, lambda r: cv.convert(src, out("lazy", r), SPEC))
  eager_s, eager_mib = timed_runs(runs, lambda r: eager_convert(src, out("eager", r)))

  mesh = Mesh(np.array(jax.devices()), ("x",))
  view = cv.apply(SPEC, u.open_step(src, 1))
  qs = [p for p in view.leaves if p.endswith("['q']")]
  targets = {p: jax.ShapeDtypeStruct(view.leaves[p].shape, np.float32,
                                     sharding=NamedSharding(mesh, P("x"))) for p in qs}
  view_s, _ = timed_runs(runs, lambda r: u.restore_arrays(cv.apply(SPEC, u.open_step(src, 1)),
                                                          targets))
  copy_s, _ = timed_runs(runs, lambda r: u.restore_arrays(u.open_step(out("lazy", 0), 1), targets))

  orbax_dir = os.path.join(root, "orbax")
  with ocp.StandardCheckpointer() as ck:
    ck.save(orbax_dir, {"layers": {"w": tree["['layers']['w']"], "qkv": tree["['layers']['qkv']"]},
                        "embed": tree["['embed']"]})
    ck.wait_until_finished()

  def orbax_then_write(r: int) -> None:
    with ocp.StandardCheckpointer() as ck:
      restored = ck.restore(orbax_dir)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
    infos = {p: u.LeafInfo(path=p, kind="numpy", shape=a.shape, dtype=a.dtype.name)
             for p, a in flat.items()}
    u.write_leaves(out("ow", r), 0, infos, flat, metadata={})

  imp_s, imp_mib = timed_runs(runs, lambda r: ox.import_orbax(orbax_dir, out("imp", r)))
  ow_s, ow_mib = timed_runs(runs, orbax_then_write)
  mib = nbytes / 2**20
  return {
      "tree_mib": round(mib, 1), "runs": runs,
      "convert": {"jaxckpt_lazy_s": round(lazy_s, 3), "eager_numpy_s": round(eager_s, 3),
                  "jaxckpt_lazy_peak_rss_mib": round(lazy_mib, 1),
                  "eager_numpy_peak_rss_mib": round(eager_mib, 1),
                  "jaxckpt_lazy_mib_per_s": round(mib / lazy_s, 1)},
      "restore_q_onto_8_devices": {"from_converted_view_s": round(view_s, 3),
                                   "from_converted_copy_s": round(copy_s, 3),
                                   "mib": round(sum(view.leaves[p].nbytes for p in qs) / 2**20, 1)},
      "import_orbax": {"jaxckpt_import_s": round(imp_s, 3),
                       "orbax_restore_then_write_s": round(ow_s, 3),
                       "jaxckpt_import_peak_rss_mib": round(imp_mib, 1),
                       "orbax_restore_then_write_peak_rss_mib": round(ow_mib, 1)},
  }


if __name__ == "__main__":
  main()
