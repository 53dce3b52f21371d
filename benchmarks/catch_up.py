"""Catch-up from a healthy group's snapshot agent against a restart from storage (issue 6).

A healthy replica group snapshots its state into its agent every step and persists
every ``--persist-interval`` steps to the universal format. A failed group comes
back either (a) by FT-HSDP catch-up: fetch the newest host snapshot from the
healthy group's agent (``AgentSnapshotSource``) and replay the averaged
gradients of the steps since (``--behind`` steps, from the gradient ring), or
(b) by a synchronous restart from storage: restore the newest persisted step
and recompute the steps since it (on average half a persist interval, timed
with the same update). Prints JSON with medians.

``--stall`` (issue 14) measures what a catch-up costs the healthy groups:
three replica groups as processes (``tests.support.ft_worker``) train with a
lighthouse; g2 is killed, the others train on, g2 restarts from scratch and
catches up from a peer (snapshot and ring replay) while g0 and g1 keep
committing. It prints the healthy groups' median step, their worst step while
g2 catches up (from its restart until its first committed step), and the ratio.

  python benchmarks/catch_up.py [--quick] [--size-mib 256] [--repeats 5]
  python benchmarks/catch_up.py --stall [--quick]
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
import time
import uuid

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxckpt as jc  # noqa: E402
from jaxckpt.ft.agent_source import AgentSnapshotSource  # noqa: E402
from jaxckpt.ft.catch_up import replay  # noqa: E402
import _repo  # noqa: E402,F401  (the repository root on the path: tests.support's worker)


def make_state(size_mib: int, sharding):
  leaves = 12
  rows = max(8, (size_mib << 20) // (4 * 1024 * leaves) // 8 * 8)
  return {"params": {f"w{i}": jax.device_put(
      np.random.default_rng(i).standard_normal((rows, 1024), np.float32), sharding)
      for i in range(leaves)}}


def stall(quick: bool) -> dict:
  """Healthy groups' steps while a restarted peer catches up (processes, loopback)."""
  from datetime import timedelta  # pylint: disable=import-outside-toplevel
  from jaxckpt.ft import Lighthouse, LighthouseOptions  # pylint: disable=import-outside-toplevel
  tmp = tempfile.mkdtemp(prefix="jaxckpt-stall-")
  steps_file = os.path.join(tmp, "steps")
  with open(steps_file, "w") as f:
    f.write("100000")
  lh = Lighthouse("127.0.0.1:0", LighthouseOptions(min_replicas=2)).start()
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAXCKPT_JOB_SECRET=lh.secret)
  env.pop("XLA_FLAGS", None)

  def spawn(g: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.ft_worker", "--lighthouse", lh.address, "--group", g,
         "--steps", "100000", "--steps-file", steps_file, "--out", os.path.join(tmp, g + ".jsonl"),
         "--timeout", "5", "--step-secs", "0.1", "--ring-size", "8", "--snapshot-every", "5"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, g + ".err"), "a"))

  def lines(g: str) -> list[dict]:
    path = os.path.join(tmp, g + ".jsonl")
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return [json.loads(x) for x in f if x.strip()]

  def wait(what: str, cond, secs: float) -> None:
    deadline = time.monotonic() + secs
    while not cond():
      if time.monotonic() > deadline:
        raise TimeoutError(f"{what} within {secs} s (logs in {tmp})")
      time.sleep(0.1)

  procs = {g: spawn(g) for g in ("g0", "g1", "g2")}
  try:
    top = lambda g: max([r["step"] for r in lines(g) if r["committed"]] or [0])
    wait("g2 to commit 20 steps", lambda: top("g2") >= 20, 240)
    killed_at = time.time()
    procs["g2"].kill()
    procs["g2"].wait()
    killed = top("g0")
    wait("the healthy groups to train on", lambda: top("g0") >= killed + (12 if quick else 25), 120)
    restart = time.time()
    procs["g2"] = spawn("g2")
    seen = len(lines("g2"))
    wait("g2 to commit again", lambda: any(r["committed"] for r in lines("g2")[seen:]), 240)
    rejoined = min(r["t1"] for r in lines("g2")[seen:] if r["committed"])
    asked = min(r["t0"] for r in lines("g2")[seen:])   # its first quorum request (after start-up)
    after = top("g0")
    wait("ten more steps of everyone", lambda: min(top(g) for g in ("g0", "g1", "g2")) >= after + 10,
         60)
  finally:
    with open(steps_file, "w") as f:
      f.write("0")
    for p in procs.values():
      p.kill()
      p.wait()
    lh.stop()
  healthy = [r for g in ("g0", "g1") for r in lines(g)]
  # The median step: before g2 was killed (after warm-up), and after it rejoined.
  durations = [r["t1"] - r["t0"] for r in healthy if r["committed"] and r["step"] > 5
               and (r["t1"] < killed_at or r["t0"] > rejoined)]
  during = [r["t1"] - r["t0"] for r in healthy if r["t1"] >= asked and r["t0"] <= rejoined]
  startup = [r["t1"] - r["t0"] for r in healthy if restart <= r["t1"] and r["t0"] < asked]
  catch = [r for r in lines("g2") if r["t0"] >= restart and r["caught_up_steps"]]
  median = statistics.median(durations)
  out = {"healthy_median_step_s": round(median, 4),
         "healthy_worst_step_while_catching_up_s": round(max(during), 4),
         "worst_over_median": round(max(during) / median, 3), "target_worst_over_median": 1.5,
         "healthy_steps_during_catch_up": len(during),
         "g2_start_up_secs": round(asked - restart, 3),
         "healthy_worst_step_while_g2_starts_s": round(max(startup, default=0.0), 4),
         "catch_up_attempts": len(catch),
         "replayed_steps": sum(r["caught_up_steps"] for r in catch),
         "snapshot_step": next((r["snapshot_step"] for r in catch if r["snapshot_step"]), None),
         "catch_up_secs": round(sum(r["catch_up_secs"] for r in catch), 3)}
  shutil.rmtree(tmp, ignore_errors=True)
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--stall", action="store_true",
                 help="the healthy groups' worst step while a restarted peer catches up")
  p.add_argument("--size-mib", type=int, default=256)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--behind", type=int, default=3, help="steps the recovering group missed")
  p.add_argument("--persist-interval", type=int, default=100)
  a = p.parse_args()
  if a.stall:
    print(json.dumps(stall(a.quick), indent=1))
    return 0
  if a.quick:
    a.size_mib, a.repeats = 32, 3
  sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  state = make_state(a.size_mib, sharding)
  update = jax.jit(lambda s, g: jax.tree.map(lambda x, y: x - 1e-3 * y, s, g))
  grads = jax.tree.map(jnp.ones_like, state)
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  root = os.path.join(base, f"jaxckpt-catchup-{uuid.uuid4().hex[:6]}")
  job = "healthy-g0"
  ckpt = tempfile.mkdtemp(prefix="jaxckpt-catchup-")
  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                              persist_interval_steps=1)
  out = {"size_mib": a.size_mib, "behind_steps": a.behind,
         "persist_interval_steps": a.persist_interval, "repeats": a.repeats}
  try:
    with jc.CheckpointManager(ckpt, options=opts) as mgr:
      mgr.save(1, state)
      mgr.wait_until_persisted(1)
    step_secs = []
    for _ in range(a.repeats + 1):
      t0 = time.perf_counter()
      jax.block_until_ready(update(state, grads))
      step_secs.append(time.perf_counter() - t0)
    step = statistics.median(step_secs[1:])
    catch_up, storage = [], []
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
    for _ in range(a.repeats + 1):          # the first round warms up
      t0 = time.perf_counter()
      src = AgentSnapshotSource(run_root=root, job_name=job)
      host = src.fetch(src.latest_step())
      s = {"params": {k.split("'")[-2]: jax.device_put(v, sharding)
                      for k, v in host.items()}}
      jax.block_until_ready(replay(s, [grads] * a.behind, update))
      catch_up.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      with jc.CheckpointManager(ckpt) as fresh:       # no host tier: storage only
        s = fresh.restore(target=target)
        assert fresh.last_restore.tier == "storage"
      jax.block_until_ready(s)
      storage.append(time.perf_counter() - t0)
    med = lambda xs: round(statistics.median(xs[1:]), 4)   # noqa: E731
    recompute = step * a.persist_interval / 2
    out.update({"step_secs": round(step, 4), "catch_up_secs": med(catch_up),
                "storage_read_secs": med(storage),
                "storage_recompute_secs_expected": round(recompute, 4),
                "restart_from_storage_secs": round(med(storage) + recompute, 4)})
    out["catch_up_speedup_over_storage_restart"] = round(
        out["restart_from_storage_secs"] / out["catch_up_secs"], 2)
    out["catch_up_speedup_over_storage_read_alone"] = round(
        out["storage_read_secs"] / out["catch_up_secs"], 2)
  finally:
    subprocess.run([sys.executable, "-m", "jaxckpt.agent", "stop", "--job-name", job,
                    "--run-root", root], capture_output=True, timeout=60)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(ckpt, ignore_errors=True)
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
