"""How jaxckpt's costs grow with leaves and with processes, side by side with orbax.

Curves (JSON on stdout; ``--plot DIR`` also draws one PNG per curve):

* ``leaves``: a state of N float32 (64, 64) leaves sharded over 8 CPU devices, random
  values (orbax's writer compresses constant fills). Each run is a fresh process, so a
  first save is a first save. jaxckpt: first ``save()`` blocking, warm ``save()``
  blocking, persist of a warm step (``save`` to ``wait_until_persisted``), objects on
  storage for one step, restore from storage. orbax (``CheckpointManager``, async):
  first ``save`` blocking, ``save`` to finished, restore.
* ``commit``: process 0's commit of a step whose part records P simulated processes
  wrote (100 leaves, each process one row block of every leaf), P = 64 .. 4096.
* ``bytes`` (``--bytes-mib``, off unless asked): a state of 8 float32 (rows, 1024)
  leaves of M MiB in all, rows sharded over 8 CPU devices, random values. jaxckpt's
  persist (``save`` of a step due for storage to ``wait_until_finished``), orbax's
  async save to finished and a raw tensorstore write of the same arrays (zarr3, one
  chunk per shard, all in flight at once: the machine's limit), each after a warm-up
  save, timed in one process; then jaxckpt's and orbax's restore, each in a fresh
  process, with the peak growth of its resident memory (GB held per GB restored).
  ``secs_per_gib`` is each figure over the state's size.
* ``real_processes`` (``--real-processes``, off unless asked): P real processes of a
  ``jax.distributed`` job on loopback (1 CPU device each) holding a random
  ``--real-mib`` MiB state sharded across them, the checkpoint directory shared:
  jaxckpt's persist on every process vs orbax's multi-process save to finished, and
  restore, as process 0 sees them between barriers (one job per tool; its figures are
  the medians of ``--repeats`` saves and restores after a warm-up save).
* ``lighthouse``: see ``benchmarks/lighthouse_scale.py`` (quorum time and reply bytes
  against the number of groups); ``--lighthouse`` runs it and includes its JSON.

Each figure is the median of ``--repeats`` runs; ``slopes`` gives the per-unit cost
between the two largest sizes (ms per leaf, ms per process, s per GiB); each row's
``ratio_jaxckpt_over_orbax`` (and ``_over_tensorstore``) divides figures of one run.

    python benchmarks/scale.py --leaves 10 100 1000 4000 --processes 64 256 1024 4096
    python benchmarks/scale.py --leaves --processes --bytes-mib 256 1024 4096 \
        --real-processes 2 4 8
    python benchmarks/scale.py --quick      # leaves 10 100, processes 64 256, bytes 64 128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import _repo  # noqa: F401  (the repository root on the path: tests.support)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# One run of the leaves curve, in a fresh interpreter (JSON on its last line).
_LEAVES_RUN = r"""
import json, os, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
n, tool, d = int(sys.argv[1]), sys.argv[2], sys.argv[3]
mesh = jax.make_mesh((8,), ("x",))
rng = np.random.default_rng(n)
def state(seed):
  r = np.random.default_rng(seed)
  return {f"w{i:05d}": jax.device_put(r.standard_normal((64, 64), dtype=np.float32),
                                      NamedSharding(mesh, P("x"))) for i in range(n)}
abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state(0).items()}
s1, s2, s3 = state(1), state(2), state(3)
out = {}
def count_files(path):
  return sum(len(f) for _, _, f in os.walk(path))
if tool == "jaxckpt":
  import jaxckpt as jc
  opts = jc.CheckpointOptions(persist_interval_steps=2, handle_sigterm=False)
  with jc.CheckpointManager(d, opts) as m:
    t = time.perf_counter(); m.save(1, s1); out["first_save_secs"] = time.perf_counter() - t
    m.wait_until_finished()
    m.prepare(s1)                                   # the compiled gather, for the warm figures
    warm = []
    for step in (3, 5, 7):
      t = time.perf_counter(); m.save(step, s2); warm.append(time.perf_counter() - t)
      m.wait_until_snapshotted()
    out["warm_save_secs"] = sorted(warm)[1]
    t = time.perf_counter(); m.save(8, s3); m.wait_until_persisted(8)
    out["persist_secs"] = time.perf_counter() - t
  step_dir = [p for p in os.listdir(d) if p.startswith("step_") and p.endswith("8")][0]
  out["objects_per_step"] = count_files(os.path.join(d, step_dir))
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False)) as m:
    t = time.perf_counter(); r = m.restore(8, abstract); jax.block_until_ready(r)
    out["restore_secs"] = time.perf_counter() - t
else:
  import orbax.checkpoint as ocp
  mgr = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
  t = time.perf_counter(); mgr.save(1, args=ocp.args.StandardSave(s1)); out["first_save_secs"] = time.perf_counter() - t
  mgr.wait_until_finished()
  t = time.perf_counter(); mgr.save(8, args=ocp.args.StandardSave(s3)); mgr.wait_until_finished()
  out["persist_secs"] = time.perf_counter() - t
  out["objects_per_step"] = count_files(os.path.join(d, "8"))
  mgr.close()
  mgr = ocp.CheckpointManager(d)
  t = time.perf_counter(); r = mgr.restore(8, args=ocp.args.StandardRestore(abstract)); jax.block_until_ready(r)
  out["restore_secs"] = time.perf_counter() - t
  mgr.close()
print(json.dumps(out), flush=True)
os._exit(0)    # (a daemon thread inside XLA must not take the interpreter's exit down)
"""


def _median_runs(runs: list[dict[str, float]]) -> dict[str, float]:
  keys = runs[0].keys()
  return {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}


def leaves_curve(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
  rows = []
  for n in sizes:
    row: dict[str, Any] = {"leaves": n}
    for tool in ("jaxckpt", "orbax"):
      runs = []
      for _ in range(repeats):
        d = tempfile.mkdtemp(prefix=f"scale-{tool}-")
        try:
          p = subprocess.run([sys.executable, "-c", _LEAVES_RUN, str(n), tool, d],
                             capture_output=True, text=True, timeout=3600, cwd=ROOT,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
          if p.returncode != 0:
            raise RuntimeError(f"{tool} at {n} leaves failed:\n{p.stderr[-3000:]}")
          runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        finally:
          shutil.rmtree(d, ignore_errors=True)
      row[tool] = _median_runs(runs)
    j, o = row["jaxckpt"], row["orbax"]
    row["ratio_jaxckpt_over_orbax"] = {
        "first_save": round(j["first_save_secs"] / o["first_save_secs"], 3),
        "persist": round(j["persist_secs"] / o["persist_secs"], 3),
        "restore": round(j["restore_secs"] / o["restore_secs"], 3)}
    print(json.dumps(row), file=sys.stderr, flush=True)
    rows.append(row)
  return rows


def commit_curve(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
  from tests.support.scale import simulated_commit_secs  # pylint: disable=import-outside-toplevel
  rows = []
  for p in sizes:
    secs = [simulated_commit_secs(p) for _ in range(repeats)]
    rows.append({"processes": p, "commit_secs": round(statistics.median(secs), 4),
                 "per_process_ms": round(1e3 * statistics.median(secs) / p, 4)})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  return rows


def _ratio(a: float, b: float) -> float:
  return round(a / b, 3)


def bytes_curve(sizes_mib: list[float], repeats: int) -> list[dict[str, Any]]:
  from tests.support.scale import bytes_point  # pylint: disable=import-outside-toplevel
  rows = []
  for mib in sizes_mib:
    row = bytes_point(mib, repeats)
    j, o, t = row["jaxckpt"], row["orbax"], row["tensorstore"]
    for tool in (j, o, t):
      tool["secs_per_gib"] = {k: round(v / row["gib"], 4) for k, v in tool.items()
                              if k.endswith("_secs")}
    row["ratio_jaxckpt_over_orbax"] = {
        "persist": _ratio(j["persist_secs"], o["persist_secs"]),
        "restore": _ratio(j["restore_secs"], o["restore_secs"]),
        "restore_rss": _ratio(j["restore_rss_gb_per_gb"], o["restore_rss_gb_per_gb"])}
    row["ratio_jaxckpt_over_tensorstore"] = {
        "persist": _ratio(j["persist_secs"], t["persist_secs"])}
    print(json.dumps(row), file=sys.stderr, flush=True)
    rows.append(row)
  return rows


def real_processes_curve(sizes: list[int], mib: float, repeats: int) -> list[dict[str, Any]]:
  from tests.support.scale import real_processes_point  # pylint: disable=import-outside-toplevel
  rows = []
  for p in sizes:
    row = real_processes_point(p, mib, repeats)
    j, o = row["jaxckpt"], row["orbax"]
    row["ratio_jaxckpt_over_orbax"] = {
        "persist": _ratio(j["persist_secs"], o["persist_secs"]),
        "restore": _ratio(j["restore_secs"], o["restore_secs"])}
    print(json.dumps(row), file=sys.stderr, flush=True)
    rows.append(row)
  return rows


def _slope(rows: list[dict[str, Any]], x: str, y, scale: float = 1e3) -> float | None:
  """``y``'s growth per unit of ``x`` between the two largest sizes (ms per unit by default)."""
  if len(rows) < 2:
    return None
  a, b = rows[-2], rows[-1]
  return round(scale * (y(b) - y(a)) / (b[x] - a[x]), 4)


def _plot(out: dict[str, Any], where: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  os.makedirs(where, exist_ok=True)
  if out.get("leaves"):
    rows = out["leaves"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, title in zip(axes, ("first_save_secs", "persist_secs", "restore_secs"),
                              ("first save() blocks", "save to on storage", "restore from storage")):
      for tool in ("jaxckpt", "orbax"):
        ax.plot([r["leaves"] for r in rows], [r[tool][key] for r in rows], "o-", label=tool)
      ax.set_xscale("log"), ax.set_yscale("log"), ax.set_title(title), ax.set_xlabel("leaves")
    axes[0].set_ylabel("seconds"), axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(where, "scale_leaves.png"), dpi=80)
  if out.get("commit"):
    rows = out["commit"]
    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    ax.plot([r["processes"] for r in rows], [r["commit_secs"] for r in rows], "o-")
    ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlabel("processes (simulated)")
    ax.set_ylabel("commit seconds"), ax.set_title("commit of one step, 100 leaves")
    fig.tight_layout()
    fig.savefig(os.path.join(where, "scale_commit.png"), dpi=80)
  if out.get("bytes"):
    rows = out["bytes"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    x = [r["gib"] for r in rows]
    for tool in ("jaxckpt", "orbax", "tensorstore"):
      axes[0].plot(x, [r[tool]["persist_secs"] for r in rows], "o-", label=tool)
    for tool in ("jaxckpt", "orbax"):
      axes[1].plot(x, [r[tool]["restore_secs"] for r in rows], "o-", label=tool)
      axes[2].plot(x, [r[tool]["restore_rss_gb_per_gb"] for r in rows], "o-", label=tool)
    for ax, title in zip(axes, ("save to on storage", "restore from storage",
                                "restore: GB held per GB restored")):
      ax.set_xscale("log"), ax.set_title(title), ax.set_xlabel("state GiB")
      ax.set_xticks(x, [f"{g:g}" for g in x])
      ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    for ax in axes[:2]:
      ax.set_yscale("log")
      ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
      ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
      ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    axes[0].set_ylabel("seconds"), axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(where, "scale_bytes.png"), dpi=80)
  if out.get("real_processes"):
    rows = out["real_processes"]
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.4))
    for ax, key, title in zip(axes, ("persist_secs", "restore_secs"),
                              ("save to on storage", "restore from storage")):
      for tool in ("jaxckpt", "orbax"):
        ax.plot([r["processes"] for r in rows], [r[tool][key] for r in rows], "o-", label=tool)
      ax.set_xscale("log", base=2), ax.set_title(f"{title}, {rows[0]['mib']:g} MiB")
      ax.set_xticks([r["processes"] for r in rows], [str(r["processes"]) for r in rows])
      ax.set_ylim(bottom=0)
      ax.set_xlabel("jax.distributed processes")
    axes[0].set_ylabel("seconds"), axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(where, "scale_real_processes.png"), dpi=80)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--leaves", type=int, nargs="*", help="default 10 100 1000 4000")
  ap.add_argument("--processes", type=int, nargs="*", help="simulated, for the commit curve; "
                  "default 64 256 1024 4096")
  ap.add_argument("--bytes-mib", type=float, nargs="*", help="state sizes of the bytes curve "
                  "(off unless given; e.g. 256 1024 4096)")
  ap.add_argument("--real-processes", type=int, nargs="*", help="jax.distributed job sizes "
                  "(off unless given; e.g. 2 4 8)")
  ap.add_argument("--real-mib", type=float, help="the real-process state's total size "
                  "(default 256)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help="small sizes where none are given: "
                  "leaves 10 100, processes 64 256, bytes 64 128, real processes 2 4 of 64 MiB")
  ap.add_argument("--lighthouse", action="store_true", help="run lighthouse_scale.py too")
  ap.add_argument("--plot", help="write one PNG per curve into this directory")
  args = ap.parse_args()
  for name, full, quick in (("leaves", [10, 100, 1000, 4000], [10, 100]),
                            ("processes", [64, 256, 1024, 4096], [64, 256]),
                            ("bytes_mib", [], [64, 128]), ("real_processes", [], [2, 4]),
                            ("real_mib", 256.0, 64.0)):
    if getattr(args, name) is None:
      setattr(args, name, quick if args.quick else full)
  out: dict[str, Any] = {"repeats": args.repeats, "cores": os.cpu_count()}
  out["leaves"] = leaves_curve(args.leaves, args.repeats) if args.leaves else []
  out["commit"] = commit_curve(args.processes, args.repeats) if args.processes else []
  out["bytes"] = bytes_curve(args.bytes_mib, args.repeats) if args.bytes_mib else []
  out["real_processes"] = (real_processes_curve(args.real_processes, args.real_mib, args.repeats)
                           if args.real_processes else [])
  if args.lighthouse:
    p = subprocess.run([sys.executable, os.path.join(HERE, "lighthouse_scale.py")],
                       capture_output=True, text=True, check=True, cwd=ROOT)
    out["lighthouse"] = json.loads(p.stdout)
  out["slopes"] = {
      "first_save_ms_per_leaf": _slope(out["leaves"], "leaves",
                                       lambda r: r["jaxckpt"]["first_save_secs"]),
      "persist_ms_per_leaf": _slope(out["leaves"], "leaves", lambda r: r["jaxckpt"]["persist_secs"]),
      "orbax_save_ms_per_leaf": _slope(out["leaves"], "leaves",
                                       lambda r: r["orbax"]["persist_secs"]),
      "commit_ms_per_process": _slope(out["commit"], "processes", lambda r: r["commit_secs"]),
  }
  for tool in ("jaxckpt", "orbax", "tensorstore"):
    out["slopes"][f"{tool}_persist_secs_per_gib"] = _slope(
        out["bytes"], "gib", lambda r, t=tool: r[t]["persist_secs"], scale=1)
  for tool in ("jaxckpt", "orbax"):
    out["slopes"][f"{tool}_restore_secs_per_gib"] = _slope(
        out["bytes"], "gib", lambda r, t=tool: r[t]["restore_secs"], scale=1)
    out["slopes"][f"{tool}_real_persist_ms_per_process"] = _slope(
        out["real_processes"], "processes", lambda r, t=tool: r[t]["persist_secs"])
  if args.plot:
    _plot(out, args.plot)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
