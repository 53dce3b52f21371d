"""Scale measurements used by ``benchmarks/scale.py`` and by the tests that keep costs
linear: a simulated job of many processes (what it leaves on storage, made in one
process), and the bytes and real-process curves (fresh processes of
:mod:`tests.support.scale_worker`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable

from jaxckpt import universal
from jaxckpt.testing.processes import free_port
from jaxckpt.universal import _layout as lay, _manifest as man


def simulated_commit_secs(processes: int, leaves: int = 100, rows_per_process: int = 4, *,
                          clock: Callable[[], float] = time.perf_counter) -> float:
  """Process 0's ``commit_step`` of a step whose ``processes`` part records are on
  storage (written here as each process would: one row block of every leaf), in
  seconds of ``clock`` (``time.process_time``: CPU seconds, which another
  process's load does not inflate)."""
  d = tempfile.mkdtemp(prefix="scale-commit-")
  try:
    attempt = write_simulated_parts(d, processes, leaves, rows_per_process)
    t = clock()
    universal.commit_step(d, 1, process_count=processes, timeout_secs=600, attempt=attempt)
    return clock() - t
  finally:
    shutil.rmtree(d, ignore_errors=True)


def write_simulated_parts(directory: str, processes: int, leaves: int = 100,
                          rows_per_process: int = 4) -> str:
  """Writes the part records of step 1 that ``processes`` processes would write (each one
  row block of every leaf) into ``directory``; returns their persist attempt."""
  attempt = f"rsim{uuid.uuid4().hex[:12]}-s1-0"
  kv = lay.open_kvstore(directory)
  rows = processes * rows_per_process
  for p in range(processes):
    recs = []
    for i in range(leaves):
      recs.append({
          "array": f"{attempt}/w{i:04d}", "path": f"['w{i:04d}']", "kind": "jax",
          "shape": [rows, 4], "dtype": "float32", "chunk_shape": [rows_per_process, 4],
          "inner_chunk_shape": [rows_per_process, 4], "key_impl": None, "value": None,
          "storage_dtype": None, "sharding": None,
          "chunks": {f"{p}.0": f"{(p * 7919 + i) & 0xffffffffffffffff:016x}"},
          "boxes": [[[p * rows_per_process, (p + 1) * rows_per_process], [0, 4]]]})
    doc = man.document(step=1, process_count=processes, process_index=p, metadata={},
                       leaves=recs)
    doc["attempt"] = attempt
    kv.write(lay.part_key(1, p, attempt), man.encode(doc, what="part")).result()
  return attempt


# -- bytes and real processes: fresh processes of tests.support.scale_worker --------

_TOOLS = ("jaxckpt", "orbax", "tensorstore")


def _worker(*args: str) -> list[str]:
  return [sys.executable, "-m", "tests.support.scale_worker", *args]


def _env() -> dict[str, str]:
  return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _last_json(text: str, what: str) -> dict[str, Any]:
  for line in reversed(text.strip().splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  raise RuntimeError(f"{what} printed no JSON; its output ends:\n{text[-3000:]}")


def _run_worker(args: list[str], what: str, timeout_secs: float) -> dict[str, Any]:
  p = subprocess.run(_worker(*args), capture_output=True, text=True, timeout=timeout_secs,
                     env=_env(), check=False)       # (run kills the child on a timeout)
  if p.returncode != 0:
    raise RuntimeError(f"{what} exited with {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
  return _last_json(p.stdout, what)


def _median(xs: list[float]) -> float:
  return round(statistics.median(xs), 4)


def bytes_point(mib: float, repeats: int, *, timeout_secs: float = 1800) -> dict[str, Any]:
  """The state of ``mib`` MiB (8 leaves on 8 CPU devices), ``repeats`` times: one
  process times jaxckpt's persist, orbax's save to finished and tensorstore's write
  (in an order that rotates between repeats), then a fresh process per restore
  measures jaxckpt's and orbax's restore time and peak resident-memory growth.

  Returns the medians: ``{"mib", "gib", "jaxckpt": {"persist_secs",
  "persist_cpu_secs", "restore_secs", "restore_rss_gb_per_gb"}, "orbax": {the same},
  "tensorstore": {"persist_secs", "persist_cpu_secs"}}`` (``persist_cpu_secs``: the
  saving process's CPU seconds, every thread's, over the same window).
  """
  runs: dict[str, list[dict[str, float]]] = {t: [] for t in _TOOLS}
  nbytes = 0
  for r in range(repeats):
    d = tempfile.mkdtemp(prefix=f"scale-bytes-{mib:g}-")
    try:
      order = _TOOLS[r % 3:] + _TOOLS[:r % 3]
      saved = _run_worker(["save", "--mib", str(mib), "--dir", d, "--order", ",".join(order)],
                          f"the save of {mib} MiB", timeout_secs)
      nbytes = saved["nbytes"]
      for tool in _TOOLS:
        runs[tool].append({"persist_secs": saved[f"{tool}_save_secs"][0],
                           "persist_cpu_secs": saved[f"{tool}_save_cpu_secs"][0]})
      for tool in _TOOLS[:2]:
        got = _run_worker(["restore", "--tool", tool, "--mib", str(mib), "--dir", d],
                          f"{tool}'s restore of {mib} MiB", timeout_secs)
        runs[tool][-1].update(restore_secs=got["restore_secs"],
                              restore_rss_gb_per_gb=got["restore_rss_gb_per_gb"])
    finally:
      shutil.rmtree(d, ignore_errors=True)
  out: dict[str, Any] = {"mib": mib, "gib": round(nbytes / 2**30, 4)}
  for tool, rs in runs.items():
    out[tool] = {k: _median([x[k] for x in rs]) for k in rs[0]}
  return out


def persist_secs(tool: str, mib: float, repeats: int, *, under: str | None = None,
                 timeout_secs: float = 600) -> list[float]:
  """``repeats`` timed saves of ``tool`` (``jaxckpt``, ``orbax`` or ``tensorstore``)
  of a ``mib`` MiB state to finished, in one fresh process after a warm-up save, to
  a fresh directory under ``under`` (None: the system's temporary directory)."""
  d = tempfile.mkdtemp(prefix=f"scale-persist-{mib:g}-", dir=under)
  try:
    return _run_worker(["save", "--mib", str(mib), "--dir", d, "--order", tool,
                        "--repeats", str(repeats)], f"{tool}'s saves of {mib} MiB",
                       timeout_secs)[f"{tool}_save_secs"]
  finally:
    shutil.rmtree(d, ignore_errors=True)


def real_processes_point(processes: int, mib: float, repeats: int, *,
                         timeout_secs: float = 600) -> dict[str, Any]:
  """A ``jax.distributed`` job of ``processes`` real processes on loopback (1 CPU
  device each) holding a ``mib`` MiB state, per tool (jaxckpt, orbax): the medians of
  ``repeats`` saves to finished on every process and restores, as seen by process 0
  between barriers. Every process started is killed by pid on the way out."""
  out: dict[str, Any] = {"processes": processes, "mib": mib}
  for tool in _TOOLS[:2]:
    got = _job(tool, processes, mib, repeats, timeout_secs)
    out["gib"] = round(got["nbytes"] / 2**30, 4)
    out[tool] = {"persist_secs": _median(got["save_secs"]),
                 "restore_secs": _median(got["restore_secs"])}
  return out


def _job(tool: str, processes: int, mib: float, repeats: int,
         timeout_secs: float) -> dict[str, Any]:
  d = tempfile.mkdtemp(prefix=f"scale-job-{tool}-{processes}-")
  port = free_port()
  procs: list[subprocess.Popen] = []
  logs = [os.path.join(d, f"p{i}.log") for i in range(processes)]
  try:
    for i in range(processes):
      with open(logs[i], "w", encoding="utf-8") as log:   # (files: a full pipe never blocks one)
        procs.append(subprocess.Popen(
            _worker("job", "--tool", tool, "--mib", str(mib), "--dir", d,
                    "--repeats", str(repeats), "--port", str(port),
                    "--num-processes", str(processes), "--process-id", str(i)),
            stdout=log, stderr=subprocess.STDOUT, env=_env()))
    deadline = time.monotonic() + timeout_secs
    for i, p in enumerate(procs):
      try:
        code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        code = None
      if code != 0:
        with open(logs[i], encoding="utf-8") as f:
          tail = f.read()[-3000:]
        state = "ran past" if code is None else f"exited with {code} within"
        raise RuntimeError(f"{tool} job of {processes} processes: process {i} (pid {p.pid}) "
                           f"{state} {timeout_secs} s; its output ends:\n{tail}")
    with open(logs[0], encoding="utf-8") as f:
      return _last_json(f.read(), f"process 0 of {tool}'s job")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
    shutil.rmtree(d, ignore_errors=True)
