"""A trainer that rolls back as the guide does, for a test that SIGKILLs it inside the
rollback (``JAXCKPT_CRASH_AT=rollback:K``, :mod:`jaxckpt.util._crash`).

  python -m tests.support.rollback_worker --run-root R --job J [--directory D]
      [--agent] [--persist-interval N]

Steps 21-30 saved and persisted as the options say, a loss spike, ``restore(25)``,
then 26-28 on the new timeline (``save(26)`` deletes the abandoned steps: there the
crash point kills it). It prints ``RESTORED 25`` after the restore and ``DONE`` at the
end (a K past the rollback's last crash point). The state of step ``s`` on timeline
``v`` is :func:`state` (``jaxckpt/rollback_test.py`` checks it bit for bit).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def state(step: int, version: int = 0) -> dict:
  return {"w": np.full((8, 4), step + 1000 * version, np.float32), "step": step}


def options(a: argparse.Namespace):
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  agent = jc.AgentOptions(job_name=a.job, run_root=a.run_root) if a.agent else None
  kw = {} if a.directory is None else {"persist_interval_steps": a.persist_interval}
  return jc.CheckpointOptions(max_snapshots=10, agent=agent, on_busy="wait",
                              handle_sigterm=False, **kw)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--run-root", required=True)
  p.add_argument("--job", required=True)
  p.add_argument("--directory", default=None)
  p.add_argument("--agent", action="store_true")
  p.add_argument("--persist-interval", type=int, default=10)
  a = p.parse_args(argv)
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  m = jc.CheckpointManager(a.directory, options(a))
  for s in range(21, 31):
    assert m.save(s, state(s))
  m.wait_until_finished()
  out = m.restore(25, state(0))
  assert out["step"] == 25, out["step"]
  print("RESTORED", 25, m.last_restore.tier, flush=True)
  for s in (26, 27, 28):
    assert m.save(s, state(s, version=1))
  m.wait_until_finished()
  m.close()
  print("DONE", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
