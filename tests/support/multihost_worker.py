"""One "host" of a multi-process jax.distributed job on loopback (used by tests).

  python -m tests.support.multihost_worker --port P --num-processes N --process-id I \
      --run-root R --tcp-host 127.0.1.M --job J --mode save|restore [--permute] [--steps S]

Each "host" is a machine of its own: its own run root (nothing shared with the
others) and its own loopback address for its agent; the job finds its agents
through jax.distributed's key-value store.

``save`` snapshots steps 1..S of a state sharded over every device of the job
(sharded, replicated and partially replicated leaves, a PRNG key, non-array
state), prints SAVED and sleeps until killed. ``loop`` is a training loop with
the default options: it calls ``save()`` every step without waiting (with a
``--ballast-mib`` leaf that makes copies slower than the loop's steps), prints
``STEPS [...]`` (the steps its save() took), waits until the newest is
protected (parity on), prints PROTECTED and sleeps until killed. ``restore`` restores the newest
step onto a mesh whose device order is reversed when ``--permute`` is given,
checks every addressable shard against the expected values, prints OK.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxckpt.testing import processes


def expected(step: int):
  """The same global values whatever the number of processes (so restarts may differ)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  w = np.arange(32 * 6, dtype=np.float32).reshape(32, 6) * step
  return {"w": w, "rep": np.full((5,), step, np.int32), "part": w[:, :4] + 1}


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  processes.add_job_arguments(p)
  p.add_argument("--run-root", required=True, help="this machine's own run root")
  p.add_argument("--tcp-host", default="127.0.0.1", help="this machine's address (127.0.1.M)")
  p.add_argument("--job", required=True)
  p.add_argument("--mode", choices=["save", "restore", "loop"], required=True)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--permute", action="store_true")
  p.add_argument("--parity", type=int, default=0, help="ParityOptions.parity (0: off)")
  p.add_argument("--directory", default=None, help="the job's storage (loop mode)")
  p.add_argument("--persist-interval", type=int, default=None)
  p.add_argument("--ballast-mib", type=int, default=0, help="per process (loop mode)")
  a = p.parse_args(argv)
  processes.join_job(a)
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if a.permute:
    devices = devices[::-1]
  mesh1 = jax.sharding.Mesh(np.array(devices), ("x",))
  mesh2 = jax.sharding.Mesh(np.array(devices).reshape(a.num_processes, 2), ("a", "b"))
  shardings = {"w": NamedSharding(mesh1, P("x")), "rep": NamedSharding(mesh1, P()),
               "part": NamedSharding(mesh2, P("a", None))}

  ballast_rows = a.ballast_mib * 2**20 // 4 // 256 * a.num_processes

  def make(step):
    vals = expected(step)
    out = {k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i])
           for k, v in vals.items()}
    out = {**out, "key": jax.random.key(step), "data": {"position": step * 10}}
    if ballast_rows:
      out["ballast"] = jax.make_array_from_callback(
          (ballast_rows, 256), shardings["w"],
          lambda i: np.full((ballast_rows, 256), step, np.float32)[i])
    return out

  parity = (jc.ParityOptions(group_size=a.num_processes, parity=a.parity) if a.parity
            else None)
  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=a.job, run_root=a.run_root,
                                                    tcp_host=a.tcp_host), parity=parity,
                              persist_interval_steps=a.persist_interval)
  with jc.CheckpointManager(a.directory, options=opts) as mgr:
    if a.mode == "loop":
      fast = jax.jit(lambda s, st: jax.tree.map(lambda x: x * s, st),
                     out_shardings={k: v.sharding for k, v in make(1).items()
                                    if hasattr(v, "sharding") and k != "key"})
      ones = {k: v for k, v in make(1).items() if hasattr(v, "sharding") and k != "key"}
      ones["rep"] = ones["rep"] * 0 + 1
      ones["part"] = ones["part"] - 1                      # w[:, :4] * step, + 1 below

      def make_fast(step):      # the values make(step) gives, from one jitted call
        out = fast(np.float32(step), ones)
        out["rep"] = out["rep"].astype(np.int32)
        out["part"] = out["part"] + 1
        return {**out, "key": jax.random.key(step), "data": {"position": step * 10}}
      taken = [step for step in range(1, a.steps + 1) if mgr.save(step, make_fast(step))]
      mgr.wait_until_finished()
      print("STEPS", taken, flush=True)
      print("HELD", mgr.all_steps(), flush=True)
      if parity is not None:
        mgr.wait_until_protected(taken[-1], timeout_secs=120)
        print("PROTECTED", taken[-1], flush=True)
      time.sleep(3600)
      return 0
    if a.mode == "save":
      for step in range(1, a.steps + 1):
        mgr.save(step, make(step))
        mgr.wait_until_finished()
      deadline = time.monotonic() + 120      # every host's agent has committed the last step
      while a.steps not in mgr.all_steps():
        if time.monotonic() > deadline:
          raise TimeoutError(f"step {a.steps} not complete on every host: {mgr.all_steps()}")
        time.sleep(0.05)
      print("SAVED", mgr.all_steps(), flush=True)
      if parity is not None:
        mgr.wait_until_protected(a.steps, timeout_secs=120)
        print("PROTECTED", a.steps, flush=True)
      time.sleep(3600)
      return 0
    target = make(0)
    target.pop("ballast", None)
    out = mgr.restore(target=target, partial=True)
    step = mgr.last_restore.step
    vals = expected(step)
    for k in vals:
      assert out[k].sharding == shardings[k], (k, out[k].sharding)
      for s in out[k].addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), vals[k][s.index])
    assert out["data"] == {"position": step * 10}
    np.testing.assert_array_equal(jax.random.key_data(out["key"]),
                                  jax.random.key_data(jax.random.key(step)))
    print("OK", step, mgr.last_restore.tier, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
