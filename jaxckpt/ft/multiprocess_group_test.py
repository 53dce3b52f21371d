"""A replica group made of two processes (one jax.distributed job) trains beside a one-process group.

g0 is one process with 2 CPU devices; g1 is a ``jax.distributed`` job of two
processes with 2 CPU devices each, its mesh (FSDP) over all 4. Only g1's
process 0 talks to the lighthouse and to g0; it gathers g1's gradients and
broadcasts every decision and the averaged gradients to g1's process 1.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from jaxckpt.ft import Lighthouse, LighthouseOptions
from jaxckpt.testing.processes import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 15
JOIN_SECS = 150.0
LIGHTHOUSE = LighthouseOptions(min_replicas=2, heartbeat_timeout=timedelta(seconds=3),
                               join_timeout=timedelta(seconds=0.5),
                               straggler_timeout=timedelta(seconds=10))
# name -> extra worker arguments; the g1 entries form one group of two processes.
WORKERS = {"g0": ["--group", "g0"],
           "g1p0": ["--group", "g1", "--num-processes", "2", "--process-id", "0"],
           "g1p1": ["--group", "g1", "--num-processes", "2", "--process-id", "1"]}


def _spawn(tmp: pathlib.Path, lighthouse: Lighthouse, coordinator: str, name: str) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAXCKPT_JOB_SECRET=lighthouse.secret)
  env.pop("XLA_FLAGS", None)
  extra = WORKERS[name] + (["--coordinator", coordinator] if name.startswith("g1") else [])
  cmd = [sys.executable, "-m", "tests.support.ft_worker", "--lighthouse", lighthouse.address, "--steps", str(STEPS),
         "--timeout", "10", "--out", str(tmp / f"{name}.jsonl"), "--dump", str(tmp / f"{name}.npz"),
         *extra]
  with open(tmp / f"{name}.stderr", "wb") as err:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)


def _tails(tmp: pathlib.Path) -> str:
  return "\n".join(f"--- {p.name}:\n{p.read_text()[-1500:]}" for p in sorted(tmp.glob("*.stderr")))


def _join(procs: dict[str, subprocess.Popen], tmp: pathlib.Path) -> None:
  """Waits for every worker to exit 0 within JOIN_SECS in all; names the one that did not."""
  deadline = time.monotonic() + JOIN_SECS
  for name, proc in procs.items():
    try:
      proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      raise TimeoutError(f"worker {name} (pid {proc.pid}) still running after {JOIN_SECS}s:\n"
                         f"{_tails(tmp)}") from None
    assert proc.returncode == 0, f"worker {name} exited {proc.returncode}:\n{_tails(tmp)}"


def _records(tmp: pathlib.Path, name: str) -> list[dict[str, Any]]:
  return [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_process_group_trains_bit_identically_with_one_process_group(tmp_path: pathlib.Path):
  lighthouse = Lighthouse("127.0.0.1:0", LIGHTHOUSE).start()
  procs: dict[str, subprocess.Popen] = {}
  try:
    coordinator = f"127.0.0.1:{free_port()}"
    for name in WORKERS:
      procs[name] = _spawn(tmp_path, lighthouse, coordinator, name)
    _join(procs, tmp_path)
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    lighthouse.stop()

  records = {name: _records(tmp_path, name) for name in WORKERS}
  assert {(r["processes"], r["mesh_devices"]) for r in records["g0"]} == {(1, 2)}
  for i in (0, 1):
    assert {(r["process"], r["processes"], r["mesh_devices"]) for r in records[f"g1p{i}"]} == {(i, 2, 4)}
  # g1's processes took every decision together: the same attempts, outcomes and states.
  strip = lambda rs: [{k: r[k] for k in ("step", "attempt", "committed", "batch", "contributors", "fp")}
                      for r in rs]
  assert strip(records["g1p0"]) == strip(records["g1p1"])
  committed = {name: {r["step"]: r["fp"] for r in rs if r["committed"]} for name, rs in records.items()}
  assert sorted(committed["g0"]) == list(range(1, STEPS + 1))
  assert committed["g1p0"] == committed["g0"], "g0 and g1 hold different states at some step"
  assert len(set(committed["g0"].values())) == STEPS, "the state did not change at every step"
  both = [r for r in records["g0"] if r["committed"] and r["contributors"] == ["g0", "g1"]]
  assert len(both) >= STEPS - 3, [r["contributors"] for r in records["g0"]]
  # The final params, gathered whole by each process, are bit-identical.
  final = {name: np.load(tmp_path / f"{name}.npz") for name in WORKERS}
  assert sorted(final["g0"].files) == sorted(final["g1p0"].files) == sorted(final["g1p1"].files)
  for name in ("g1p0", "g1p1"):
    for key in final["g0"].files:
      a, b = final["g0"][key], final[name][key]
      assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (name, key)
