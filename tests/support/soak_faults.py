"""The chaos soak's fault kinds of issues 32 and 40 (:mod:`tests.support.soak` runs
them), and the place where other checks join its run.

- ``second_manager``: at one step every trainer tries a second manager of its
  job and host beside the running one; each must be refused, naming the first,
  and the job goes on untouched.
- ``damage_newest``: the job stops cleanly, every machine loses its memory
  (agents killed, run roots removed) and one byte of the newest step on storage
  is flipped; the relaunch must skip that step (saying so) and restore the one
  before, bit for bit, and the job saves the damaged step's number again.
- ``impossible_newest`` (issue 40): as ``damage_newest``, but the newest step's
  manifest is resealed to claim a 2^40 x 2^40 leaf in one chunk (shape, layout
  and checksum table consistent): an impossible step is damage like any other.
- ``truncate_slots`` (issue 40): the job stops cleanly and a /dev/shm cleaner
  truncates every slot file of one machine's agent; the relaunch must restore
  (no trainer dies of SIGBUS: a damaged piece is read from the next tier, going
  back to a stored step if need be), bit for bit, and save into those slots again.
- ``dead_claim`` (issue 40): a writer killed while it committed the next step but
  one due for storage left its claim on it; the job goes on and that step is
  committed within seconds of its persist (the claim lapses), the claim removed.
- ``stray_tcp`` (issue 40): a process holding the job's secret sends every agent,
  over tcp, a trainer's requests naming pid 1 (reserve, hello, bye, preallocate,
  stop): each must be refused, and an open without a lease must come back leased;
  the job goes on untouched.

:data:`CHECKS` holds checks that run once per soak, after its schedule, each
returning counts for the soak's JSON (``checks``): ``skewed_clock``, a replacement
replica group on a clock 45 s behind (its quorums form, replays are refused).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import time
from typing import Any, Callable

from jaxckpt.testing import processes

def _skewed_clock() -> dict[str, Any]:
  """A replacement replica group on a clock 45 s behind its dead predecessor's: each of
  its rounds forms a quorum, and every replayed message is refused (jaxckpt.ft)."""
  from tests.support import replacement_check  # pylint: disable=import-outside-toplevel  (the replica groups: only this check)
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


def damage_newest(soak: Any, info: dict[str, Any], *, how: str = "flip") -> None:
  """Stops the job, wipes every machine's memory, damages the newest stored step
  (``how``: a byte flipped, or its manifest resealed to claim an impossible leaf) and
  relaunches: the restore must skip that step for the one before."""
  from jaxckpt import universal  # pylint: disable=import-outside-toplevel
  from jaxckpt.testing import damage  # pylint: disable=import-outside-toplevel
  from jaxckpt.util import _wait  # pylint: disable=import-outside-toplevel
  from tests.support.soak import PERSIST_INTERVAL  # pylint: disable=import-outside-toplevel
  job = soak.job
  # two stored steps first (a fault may have destroyed a due step): one to damage, one older
  # to go back to; the job goes on (at most two persist intervals more) until it stored them
  if len(universal.all_steps(soak.directory)) < 2:
    job.send(f"GO {max(job.furthest(), min(job.progress() + 2 * PERSIST_INTERVAL + 1, soak.steps - 3))}")
  _wait.until(lambda: len(universal.all_steps(soak.directory)) >= 2, timeout_secs=240,
              late=lambda: f"{info['kind']}: the job stored fewer than 2 steps in "
                           f"{soak.directory} within 240 s", max_poll_secs=0.5)
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
  if how == "flip":
    damage.flip_stored_byte(soak.directory, newest, "['w']", (soak.rows // 2, 1))
  else:
    damage.claim_impossible_leaf(soak.directory, newest, "['w']")
  info["damage"] = how
  soak.nemesis.record("damaged", step=newest, incarnation=soak.incarnation + 1)
  saved = [v for v in soak.versions if v[1] == newest]
  soak.damaged.update([max(saved)] if saved else [])   # the version on storage
  info["damaged_step"] = newest
  soak.launch(fresh=False, cause=info["kind"], expect_min=stored[-2], expect_not=newest,
              progress=progress)
  skipped = {tuple(t.damaged_skipped) for t in soak.job.trainers}
  if skipped == {(newest,)}:
    soak.damaged_skipped += 1
  else:
    soak.wrong.append(f"{info['kind']}: step {newest} was damaged; the trainers' restores "
                      f"skipped {sorted(skipped)}")


def impossible_newest(soak: Any, info: dict[str, Any]) -> None:
  """:func:`damage_newest` with the newest stored step claiming an impossible leaf."""
  damage_newest(soak, info, how="impossible")


def truncate_slots(soak: Any, info: dict[str, Any], host: int) -> None:
  """Stops the job, truncates every slot file of machine ``host``'s agent (as a /dev/shm
  cleaner would) and relaunches: every trainer must restore, bit for bit (a trainer
  that died of SIGBUS is an unplanned failure), and go on saving into those slots."""
  from jaxckpt import universal  # pylint: disable=import-outside-toplevel
  from jaxckpt.agent import _paths  # pylint: disable=import-outside-toplevel
  progress = soak.stop_job("restart")
  where = _paths.agent_dir(soak.machine(host)[0], soak.job_name, host)
  files = sorted(glob.glob(os.path.join(where, "slot*.bin")))
  for path in files:
    os.truncate(path, 0)
  info.update(host=host, truncated_files=len(files))
  stored = [s for s in universal.all_steps(soak.directory) if s <= progress]
  soak.truncations["truncations"] += 1
  soak.launch(fresh=False, cause="truncate_slots", expect_min=stored[-1] if stored else None,
              progress=progress)
  if all(t.restored is not None and t.restored[2] == "ok" for t in soak.job.trainers):
    soak.truncations["relaunches_restored"] += 1
  target = soak.job.progress() + 3          # and it saves into the truncated slots again
  soak.job.send(f"GO {target}")
  soak.job.wait(lambda: soak.job.progress() >= target, 300, f"the job to reach step {target}")


def dead_claim(soak: Any, info: dict[str, Any]) -> None:
  """Leaves a killed writer's commit claim on the next step but one due for storage; the
  job goes on, and that step must be committed (the claim lapsing, and removed)."""
  from jaxckpt import universal  # pylint: disable=import-outside-toplevel
  from jaxckpt.universal import _layout as lay  # pylint: disable=import-outside-toplevel
  job, interval = soak.job, soak.persist_interval
  due = (job.progress() // interval + 2) * interval       # no persist of it has begun
  kv = lay.open_kvstore(soak.directory)
  key = lay.claims_prefix(due) + "w-killed-mid-commit"
  kv.write(key, json.dumps({"attempt": "w-killed-mid-commit", "at": time.time(),
                            "renewal": 1}).encode()).result(timeout=60)
  soak.dead_claims["planted"] += 1
  job.send(f"GO {due + 2}")
  job.wait(lambda: job.progress() >= due, 300, f"the job to pass step {due}")
  t0, deadline = time.monotonic(), time.monotonic() + 180
  while due not in universal.all_steps(soak.directory) and time.monotonic() < deadline:
    time.sleep(0.5)
  committed = due in universal.all_steps(soak.directory)
  left = kv.list(lay.prefix_range(lay.claims_prefix(due))).result(timeout=60)
  info.update(claimed_step=due, committed=committed, claims_left=len(left),
              committed_secs_after_the_job_passed=round(time.monotonic() - t0, 1))
  if committed and not left:
    soak.dead_claims["committed"] += 1
  else:
    soak.wrong.append(f"dead_claim: step {due} (claimed by a killed writer) "
                      + ("is not on storage" if not committed else f"left claims {left}"))


def stray_tcp(soak: Any, info: dict[str, Any]) -> None:
  """Sends every agent, over tcp with the job's secret, a trainer's requests naming pid 1
  (each must be refused) and an open without a lease (it must come back leased)."""
  from jaxckpt import errors  # pylint: disable=import-outside-toplevel
  from jaxckpt.agent import _paths, _protocol  # pylint: disable=import-outside-toplevel
  from jaxckpt.agent import _requests as rq  # pylint: disable=import-outside-toplevel
  requests = [rq.Reserve(pid=1, step=10**6, nbytes=64), rq.Hello(pid=1), rq.Bye(pid=1),
              rq.Preallocate(nbytes=64), rq.Stop()]
  for i in range(len(soak.job.trainers)):
    root = soak.machine(i)[0]
    with open(_paths.address_file(_paths.agent_dir(root, soak.job_name, i))) as f:
      address = json.load(f)
    client = _protocol.Client.of(address, who=f"a stray client of machine {i}'s agent",
                                 timeout_secs=20, secret=_paths.job_secret(root, soak.job_name))
    try:
      for req in requests:
        try:
          client.call(req)
          soak.stray["accepted"] += 1
          soak.wrong.append(f"stray_tcp: machine {i}'s agent accepted {req.op!r} over tcp")
        except errors.PermissionDeniedError:
          soak.stray["refused"] += 1
      for _ in range(5):        # (the running job may drop the step it listed meanwhile)
        held = [s for s, _, _ in client.call(rq.Held())[0].held]
        if not held:
          break
        try:
          r = client.call(rq.Open(pid=1, step=held[-1]))[0]
        except errors.StepNotFoundError:
          continue
        soak.stray["leased_opens" if r.reader is not None else "unleased_opens"] += 1
        client.call(rq.Close(pid=1, step=held[-1], index=r.index, reader=r.reader))
        break
    finally:
      client.close()
  info.update(refused=soak.stray["refused"], accepted=soak.stray["accepted"])
  target = soak.job.progress() + 2           # the job goes on untouched
  soak.job.wait(lambda: soak.job.progress() >= target, 300, f"the job to reach step {target}")


def run_checks() -> dict[str, Any]:
  """Every registered check's counts (an exception is its result, named)."""
  out = {}
  for name, check in sorted(CHECKS.items()):
    try:
      out[name] = check()
    except Exception as e:  # pylint: disable=broad-except  (said in the JSON, not hidden)
      out[name] = {"error": f"{type(e).__name__}: {e}"}
  return out
