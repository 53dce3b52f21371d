"""One process of a jax.distributed job whose hosts share only a network (tests/support/netns.py).

  python -m tests.support.net_worker --coordinator ADDR --port P --num-processes N --process-id I \
      --run-root R --tcp-host ADDR --job J [--directory D] [--parity M] [--persist-interval K]

Each process is a host of its own: its own namespace, address (``--tcp-host``,
its agent's too) and run root; it finds the job's other agents only through
jax.distributed's key-value store, whose coordinator is process 0 at
``--coordinator``. It reads commands from stdin, one a line, runs each on its
``CheckpointManager`` in order, and answers each with one line ``R {json}``:
``{"cmd": ..., "ok": true, "value": ...}``, or ``"ok": false`` with the error's
``type`` and ``message`` (what a user's code would have caught). So a test can
start a wait, fault the network while it waits, heal, and read what the user was
told. Commands:

  save S [force]        mgr.save(S, state(S)); value: what it returned
  snapshotted SECS      mgr.wait_until_snapshotted(SECS)
  finished SECS         mgr.wait_until_finished(SECS)
  persisted S SECS      mgr.wait_until_persisted(S, SECS)
  protected S SECS      mgr.wait_until_protected(S, SECS)
  errors                mgr.check_for_errors()
  steps                 value: {"all": all_steps(), "protected": protected_steps()}
  restore [S]           value: {"step", "tier", "check"} ("ok": every shard bit-exact)
  barrier NAME          every process reaches NAME (jax.distributed)
  close                 mgr.close(); then the process says DONE and exits

The state is a ``(24, 6)`` float32 sharded over every device of the job and a
replicated leaf, a function of the step (:func:`expected`), plus a ``ballast`` of
``--ballast-mib`` per process (sharded) that makes a persist take a while.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

import numpy as np

from jaxckpt.testing import processes


def expected(step: int, ballast_rows: int = 0) -> dict[str, np.ndarray]:
  out = {"w": np.arange(24 * 6, dtype=np.float32).reshape(24, 6) + 1000 * step,
         "rep": np.full((5,), step, np.int32)}
  if ballast_rows:
    out["ballast"] = (np.arange(ballast_rows * 256, dtype=np.float32).reshape(ballast_rows, 256) + step)
  return out


class Worker:
  """This process's manager and state; :meth:`do` runs one command line."""

  def __init__(self, a: argparse.Namespace) -> None:
    import jax  # pylint: disable=import-outside-toplevel  (after join_job)
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
    import jaxckpt as jc  # pylint: disable=import-outside-toplevel
    self.a, self.jax, self.jc = a, jax, jc
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    self.shardings = {"w": NamedSharding(mesh, P("x")), "rep": NamedSharding(mesh, P()),
                      "ballast": NamedSharding(mesh, P("x"))}
    rows = a.ballast_mib * 2**20 // 4 // 256 * a.num_processes
    self.ballast_rows = rows - rows % len(devices)
    opts = jc.CheckpointOptions(
        handle_sigterm=False, timeout_secs=a.timeout_secs, persist_interval_steps=a.persist_interval,
        agent=jc.AgentOptions(job_name=a.job, run_root=a.run_root, tcp_host=a.tcp_host,
                              request_timeout_secs=a.timeout_secs),
        parity=jc.ParityOptions(group_size=a.num_processes, parity=a.parity) if a.parity else None)
    self.mgr = jc.CheckpointManager(a.directory or None, opts)

  def state(self, step: int) -> dict[str, Any]:
    vals = expected(step, self.ballast_rows)
    out = {k: self.jax.make_array_from_callback(v.shape, self.shardings[k], lambda i, v=v: v[i])
           for k, v in vals.items()}
    return {**out, "data": {"position": step}}

  def do(self, line: str) -> Any:
    words = line.split()
    cmd, args = words[0], words[1:]
    mgr = self.mgr
    if cmd == "save":
      return mgr.save(int(args[0]), self.state(int(args[0])), force="force" in args[1:])
    if cmd == "snapshotted":
      return mgr.wait_until_snapshotted(float(args[0]))
    if cmd == "finished":
      return mgr.wait_until_finished(float(args[0]))
    if cmd == "persisted":
      return mgr.wait_until_persisted(int(args[0]), float(args[1]))
    if cmd == "protected":
      return mgr.wait_until_protected(int(args[0]), float(args[1]))
    if cmd == "errors":
      return mgr.check_for_errors()
    if cmd == "steps":
      return {"all": mgr.all_steps(), "protected": mgr.protected_steps()}
    if cmd == "restore":
      out = mgr.restore(int(args[0]) if args else None, target=self.state(0))
      r = mgr.last_restore
      check = processes.differs(out, expected(r.step, self.ballast_rows), {"position": r.step})
      return {"step": r.step, "tier": r.tier, "check": check}
    if cmd == "barrier":
      return processes.barrier(args[0])
    if cmd == "close":
      return mgr.close()
    raise ValueError(f"net_worker: unknown command {cmd!r} (see the module docstring)")

  def serve(self) -> None:
    print("READY", flush=True)
    for line in sys.stdin:
      if not line.strip():
        continue
      try:
        answer = {"cmd": line.strip(), "ok": True, "value": self.do(line)}
      except Exception as e:  # pylint: disable=broad-except  (what the user would have caught)
        answer = {"cmd": line.strip(), "ok": False, "type": type(e).__name__, "message": str(e),
                  "mro": [c.__name__ for c in type(e).__mro__]}
        traceback.print_exc(file=sys.stderr)
      print("R " + json.dumps(answer, default=str), flush=True)
      if line.split()[0] == "close":
        return


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  processes.add_job_arguments(p)
  processes.add_machine_arguments(p)
  p.add_argument("--parity", type=int, default=0, help="ParityOptions.parity (0: off)")
  p.add_argument("--persist-interval", type=int, default=None)
  p.add_argument("--ballast-mib", type=int, default=0, help="per process")
  p.add_argument("--timeout-secs", type=float, default=60.0, help="CheckpointOptions.timeout_secs")
  a = p.parse_args(argv)
  processes.run_job(a, lambda: Worker(a).serve())
  return 0


if __name__ == "__main__":
  sys.exit(main())
