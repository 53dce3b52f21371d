"""A trainer that a crash test kills: the default options with a snapshot agent and a
directory, a loop of a given step time, and a SIGKILL of itself in a step.

  python -m tests.support.crash_worker --run-root R --job J --directory D \
      --kill-after N [--step-ms MS] [--size-mib M] [--seed S] [--wait-go] [--snapshotted]

It first restores the newest step the agent (or storage) holds, if any, and checks
it bit-exact; then it trains from the step after it, one ``save`` per step, and
after the save of step ``resumed + N`` returns it sleeps a random part of the step
and SIGKILLs itself (a crash landing anywhere in that step, the snapshot's copy
included). It prints JSON lines: ``{"resumed": step or null, "tier", "exact",
"restore_secs"}``, ``{"ready": true}`` (with ``--wait-go`` it then waits for a line
on stdin: the caller pauses or slows storage first), and ``{"killing": step,
"stats": ...}`` just before the kill.

The state is a float32 vector of ``--size-mib`` MiB of random values (fixed by
``--seed``) plus the step, sharded over 8 CPU devices, and a scalar ``step`` leaf:
each step's values are those of no other step. ``--step-ms`` is the loop's step:
the time from one ``save`` call to the next, the state's update included.
``--snapshotted`` waits for each snapshot before the next step (a loop whose step
is never shorter than the snapshot's copy, whatever the machine's load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any


def say(**kw: object) -> None:
  print(json.dumps(kw), flush=True)


class Trainer:
  """A crash_worker process, driven by the caller: its JSON lines as they come, each
  wait bounded; a context manager that kills it (by pid) if it still runs."""

  def __init__(self, *, run_root: str, job: str, directory: str, kill_after: int,
               step_ms: float = 0.0, size_mib: float = 4.0, seed: int = 0,
               snapshotted: bool = False, env: dict[str, str] | None = None) -> None:
    args = [sys.executable, "-m", "tests.support.crash_worker", "--run-root", run_root,
            "--job", job, "--directory", directory, "--kill-after", str(kill_after),
            "--step-ms", str(step_ms), "--size-mib", str(size_mib), "--seed", str(seed),
            "--wait-go"] + (["--snapshotted"] if snapshotted else [])
    self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **(env or {})})
    self.lines: list[str] = []
    self._q: queue.Queue = queue.Queue()
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    with contextlib.suppress(OSError, ValueError):
      for line in self.p.stdout:
        self._q.put(line)
    self._q.put(None)

  def next(self, key: str, timeout_secs: float) -> dict[str, Any]:
    """The next JSON line that has ``key`` (other output is kept in ``lines``)."""
    deadline = time.monotonic() + timeout_secs
    while True:
      try:
        line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        line = ""
      if not line:
        raise TimeoutError(
            f"crash_worker pid {self.p.pid} did not say {key!r} within {timeout_secs} s "
            f"({'it ended, exit code ' + str(self.p.poll()) if line is None else 'still running'})"
            f"; its last output:\n{''.join(self.lines[-30:])}")
      self.lines.append(line)
      if line.startswith("{"):
        with contextlib.suppress(ValueError):
          msg = json.loads(line)
          if key in msg:
            return msg

  def go(self) -> None:
    """Lets it start its loop (it said ``ready``)."""
    self.p.stdin.write("go\n")
    self.p.stdin.flush()

  def wait_killed(self, timeout_secs: float) -> None:
    """Waits until it has killed itself (SIGKILL), or raises naming what it did."""
    try:
      code = self.p.wait(timeout=timeout_secs)
    except subprocess.TimeoutExpired:
      raise TimeoutError(f"crash_worker pid {self.p.pid} still runs {timeout_secs} s after "
                         f"its go; its last output:\n{''.join(self.lines[-30:])}") from None
    if code != -signal.SIGKILL:
      self._reader.join(10)
      raise RuntimeError(f"crash_worker pid {self.p.pid} exited with {code}, not by SIGKILL; "
                         f"its output:\n{''.join(self.lines[-30:])}")

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, *exc: object) -> None:
    if self.p.poll() is None:
      self.p.kill()
      self.p.wait(timeout=30)
    self._reader.join(10)                     # (it reads to the end of its output)
    for f in (self.p.stdin, self.p.stdout):
      with contextlib.suppress(OSError):
        f.close()


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--run-root", required=True)
  p.add_argument("--job", required=True)
  p.add_argument("--directory", required=True)
  p.add_argument("--kill-after", type=int, required=True)
  p.add_argument("--step-ms", type=float, default=0.0)
  p.add_argument("--size-mib", type=float, default=4.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--wait-go", action="store_true")
  p.add_argument("--snapshotted", action="store_true")
  a = p.parse_args(argv)

  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", 8)
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel

  n = max(8, int(a.size_mib * 2**20) // 4 // 8 * 8)
  sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  base = jax.device_put(np.random.default_rng(a.seed).standard_normal(n, dtype=np.float32),
                        sharding)
  at = jax.jit(lambda b, s: b + s.astype(np.float32), out_shardings=sharding)

  def state(step: int) -> dict:
    return {"w": at(base, np.int32(step)), "step": step}

  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=a.job, run_root=a.run_root))
  with jc.CheckpointManager(a.directory, opts) as m:
    step = 0
    if m.latest_step() is not None:
      target = {"w": jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding), "step": 0}
      out = m.restore(target=target)
      info = m.last_restore
      step = info.step
      exact = (out["step"] == step
               and np.array_equal(np.asarray(out["w"]), np.asarray(state(step)["w"])))
      say(resumed=step, tier=info.tier, exact=bool(exact), restore_secs=info.seconds)
    else:
      say(resumed=None)
    jax.block_until_ready(state(step + 1))          # compiled before the loop
    say(ready=True)
    if a.wait_go:
      sys.stdin.readline()
    kill_at = step + a.kill_after
    rng = random.Random(f"{a.seed}/{kill_at}")
    last = time.perf_counter()
    while True:
      step += 1
      s = state(step)
      jax.block_until_ready(s["w"])
      left = a.step_ms / 1e3 - (time.perf_counter() - last)
      if left > 0:
        time.sleep(left)
      last = time.perf_counter()
      m.save(step, s)
      if a.snapshotted:
        m.wait_until_snapshotted()
      if step == kill_at:
        st = m.stats
        say(killing=step, stats={"started": st.started, "skipped_busy": st.skipped_busy,
                                 "skip_reasons": st.skip_reasons,
                                 "last_snapshot_secs": st.last_snapshot_secs,
                                 "persists_pending": st.persists_pending,
                                 "persist_lag_steps": st.persist_lag_steps})
        time.sleep(rng.uniform(0, a.step_ms / 1e3))   # anywhere in the step
        os.kill(os.getpid(), signal.SIGKILL)
  return 0  # unreachable


if __name__ == "__main__":
  sys.exit(main())
