"""The chaos soak's fault kinds of issue 32 (:mod:`jaxckpt.testing.soak` runs them),
and the place where other checks join its run.

- ``second_manager``: at one step every trainer tries a second manager of its
  job and host beside the running one; each must be refused, naming the first,
  and the job goes on untouched.
- ``damage_newest``: the job stops cleanly, every machine loses its memory
  (agents killed, run roots removed) and one byte of the newest step on storage
  is flipped; the relaunch must skip that step (saying so) and restore the one
  before, bit for bit, and the job saves the damaged step's number again.

:data:`CHECKS` holds checks that run once per soak, after its schedule, each
returning counts for the soak's JSON (``checks``): ``skewed_clock``, a replacement
replica group on a clock 45 s behind (its quorums form, replays are refused).
"""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any, Callable

from jaxckpt.testing import processes

def _skewed_clock() -> dict[str, Any]:
  """A replacement replica group on a clock 45 s behind its dead predecessor's: each of
  its rounds forms a quorum, and every replayed message is refused (jaxckpt.ft)."""
  from jaxckpt.ft import replacement_check  # pylint: disable=import-outside-toplevel  (the replica groups: only this check)
  return replacement_check.replacement_on_skewed_clock(skew_secs=-45.0, groups=3, rounds=3)


#: name -> a check run once per soak after its schedule; it returns its counts (JSON).
CHECKS: dict[str, Callable[[], dict[str, Any]]] = {"skewed_clock": _skewed_clock}


def second_manager(soak: Any, info: dict[str, Any]) -> None:
  """Every trainer tries a second manager beside its own at the next step."""
  job = soak.job
  soak.second_tries += 1
  with job.cond:
    for t in job.trainers:
      t.second = None
  job.send(f"SECOND {soak.second_tries}")
  job.wait(lambda: all(t.second is not None for t in job.trainers), 300,
           "every trainer's second manager")
  said = [t.second for t in job.trainers]
  refused = sum(s[0] == "refused" for s in said)
  soak.second_managers["refused"] += refused
  soak.second_managers["refused_naming_the_first"] += sum(
      s == ("refused", "names_first") for s in said)
  soak.second_managers["accepted"] += len(said) - refused
  info["second_managers_refused"] = refused


def damage_newest(soak: Any, info: dict[str, Any]) -> None:
  """Stops the job, wipes every machine's memory, flips a byte of the newest stored
  step and relaunches: the restore must skip that step for the one before."""
  from jaxckpt import universal  # pylint: disable=import-outside-toplevel
  from jaxckpt.testing import damage  # pylint: disable=import-outside-toplevel
  job = soak.job
  progress = soak.stop_job("restart")
  for i in range(len(job.trainers)):
    for pid in processes.agent_pids(soak.machine(i)[0]):
      os.kill(pid, signal.SIGKILL)                 # our own agents, by pid
      processes.wait_gone(pid, 30, f"the agent of machine {i}")
    soak.keep_agent_logs(i, f"wiped{soak.incarnation:02d}")
    shutil.rmtree(soak.machine(i)[0], ignore_errors=True)
  stored = universal.all_steps(soak.directory)
  info["stored_steps"] = stored[-3:]
  if len(stored) < 2:           # nothing older to go back to: no damage, a plain relaunch
    soak.launch(fresh=False, cause="damage_newest", expect_min=None, progress=progress)
    return
  newest = stored[-1]
  damage.flip_stored_byte(soak.directory, newest, "['w']", (soak.rows // 2, 1))
  saved = [v for v in soak.versions if v[1] == newest]
  soak.damaged.update([max(saved)] if saved else [])   # the version on storage
  info["damaged_step"] = newest
  soak.launch(fresh=False, cause="damage_newest", expect_min=stored[-2], expect_not=newest,
              progress=progress)
  skipped = {tuple(t.damaged_skipped) for t in soak.job.trainers}
  if skipped == {(newest,)}:
    soak.damaged_skipped += 1
  else:
    soak.wrong.append(f"damage_newest: step {newest} was damaged; the trainers' restores "
                      f"skipped {sorted(skipped)}")


def run_checks() -> dict[str, Any]:
  """Every registered check's counts (an exception is its result, named)."""
  out = {}
  for name, check in sorted(CHECKS.items()):
    try:
      out[name] = check()
    except Exception as e:  # pylint: disable=broad-except  (said in the JSON, not hidden)
      out[name] = {"error": f"{type(e).__name__}: {e}"}
  return out
