"""Replica groups against a synchronous restart, under one fault schedule (issues 33, 42).

Both jobs are real processes on this machine: the control plane (``--control-plane
etcd``, the default: a 3-member etcd cluster and three ``jaxckpt lighthouse --etcd``
replicas that elect a leader; ``lighthouse``: one ``jaxckpt lighthouse`` process)
and G replica groups (``--groups``, default 3), each a process with 2 CPU
devices training the toy MLP (:mod:`tests.support.ft_toy`, adam) with
``--step-secs`` of simulated compute per step, snapshotting every committed
step into its own snapshot agent (``CheckpointManager`` with
``AgentOptions``), which is also the snapshot source a recovering group reads.
Every ReplicaGroup and lighthouse option is its default unless given here
(``min_replicas`` is 1 for the replica groups, G for the synchronous job).
Each group warms its save path before it joins, as examples/train_flax.py does.

* ``ft``: the replica groups. A failed group is restarted at once and catches
  up from a healthy group's agent while the others train on.
* ``sync``: the same processes as one synchronous job: any failed step attempt
  ends its process, and on any failure every group is restarted from the
  newest snapshot all of them hold (the launcher notices a dead process at
  once; a stopped one by the others' failed attempt).

The fault schedule, one ``--window`` apart after a fault-free window: SIGKILL of
the last group (and its restart), SIGSTOP of the second group for
``--stop-secs``; with etcd, SIGKILL of an etcd member (restarted a window later),
of the leading lighthouse replica and of a following one (each restarted 2 s
later, as a follower); and a whole control-plane outage (SIGKILL of every
lighthouse process, new ones on the same ports ``--outage-secs`` later). Each
ft row's ``stall_over_median_step`` is the healthy groups' longest step in the
window less the median step, in median steps (the issue's bar for a control-plane
process: at most 1). ``replacement`` sets the killed and replaced group's cost
to the healthy groups against the synchronous job's loss for the same kill. Prints one JSON object: per job the
fraction of wall time spent making steps (steps advanced x the fault-free mean
step / wall time), steps lost per fault (window / mean step - steps advanced
in it), the outage as measured (from the kill until the new lighthouse
served: its process imports JAX) and what was lost beyond it, and for ``ft`` the
detection, quorum re-forming, catch-up and rejoin times that feed ``jaxckpt
simulate --from-benchmarks`` (``goodput_inputs``; write the output to
``jaxckpt/measured/h100_host/ft_goodput.json`` to ship it).

  python benchmarks/ft_goodput.py [--runs 3] [--quick] [--jobs ft,sync]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # Uninstalled repo.


# ---- one replica group (a process of its own: ``--worker``) -------------------------------------------

def worker(args: argparse.Namespace) -> int:
  """Trains one group until ``--stop-file`` exists; one JSON line per step attempt."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", 2)
  from datetime import timedelta  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  from jaxckpt import ft  # pylint: disable=import-outside-toplevel
  from tests.support import ft_toy as _toy  # pylint: disable=import-outside-toplevel
  started = time.time()
  mesh = _toy.make_mesh(jax.devices())
  state = _toy.init_state(mesh)
  jax.block_until_ready(_toy.apply_fn(state, _toy.grad_fn(state, *_toy.batch(0))))  # compile first
  job = f"{args.job}-{args.group}"
  mgr = jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=3, agent=jc.AgentOptions(
      job_name=job, run_root=args.run_root, idle_timeout_secs=120)))
  base = 0
  if args.resume_at_most is not None:       # sync: the newest step every group holds
    held = [s for s in mgr.all_steps() if s <= args.resume_at_most]
    if held:
      base = held[-1]
      state = mgr.restore(step=base, target=state)
  mgr.save(base, state)          # warms the snapshot path (as examples/train_flax.py does): a first
  mgr.wait_until_finished()      # save costs ~0.1 s, which the others would wait for at a rejoin
  source = ft.AgentSnapshotSource(run_root=args.run_root, job_name=job)
  kwargs = {} if args.timeout is None else {"timeout": timedelta(seconds=args.timeout)}
  with open(args.out, "a", encoding="utf-8") as out, mgr, ft.ReplicaGroup(
      lighthouse=args.lighthouse, group_id=args.group, snapshot_source=source, **kwargs) as group:
    out.write(json.dumps({"group": args.group, "pid": os.getpid(), "started": started,
                          "ready": time.time(), "base": base}) + "\n")
    out.flush()
    while not os.path.exists(args.stop_file):
      t0 = time.time()
      state = group.start_step(state, _toy.apply_fn, grads_like=state["params"])
      index = group.batch_index()
      time.sleep(args.step_secs)
      t_grad = time.time()
      grads = _toy.grad_fn(state, *_toy.batch(index))
      jax.block_until_ready(grads)
      t_grad = time.time() - t_grad
      grads = group.allreduce(grads)
      t_reduced = time.time()
      if group.should_commit():
        state = _toy.apply_fn(state, grads)
        mgr.save(base + group.step, state)
      m = group.metrics
      out.write(json.dumps({
          "group": args.group, "pid": os.getpid(), "step": base + group.step, "committed": m.committed,
          "contributors": list(m.contributors), "t0": t0, "t1": time.time(), "failure": m.failure,
          "caught_up_steps": m.caught_up_steps, "snapshot_step": m.snapshot_step,
          "catch_up_secs": m.catch_up_secs, "quorum_secs": m.quorum_secs,
          "allreduce_secs": m.allreduce_secs, "after_secs": time.time() - t_reduced,
          "grad_secs": t_grad}) + "\n")
      out.flush()
      if args.sync and not m.committed:
        return 3                              # a synchronous job: any failure ends the process
  return 0


# ---- the jobs --------------------------------------------------------------------------------------

class Job:
  """The control plane's processes and G group processes; every process it started is killed
  (by pid) in close. The control plane is one ``jaxckpt lighthouse`` process
  (``--control-plane lighthouse``) or a 3-member etcd cluster and 3 lighthouse replicas that
  elect a leader through it (``etcd``)."""

  def __init__(self, kind: str, args: argparse.Namespace, tmp: str, secret: str) -> None:
    self.kind, self.args, self.tmp = kind, args, tmp
    self.groups = [f"g{k}" for k in range(args.groups)]
    self.run_root = os.path.join(tmp, "agents")
    self.stop_file = os.path.join(tmp, f"{kind}.stop")
    self.env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAXCKPT_JOB_SECRET=secret)
    self.env.pop("XLA_FLAGS", None)
    self.etcd = None
    if args.control_plane == "etcd":
      from tests.support.etcd import EtcdCluster  # pylint: disable=import-outside-toplevel
      self.etcd = EtcdCluster(3).__enter__()
    self.ports = [_free_port() for _ in range(3 if self.etcd is not None else 1)]
    self.address = ",".join(f"127.0.0.1:{p}" for p in self.ports)
    self.lighthouses: list[subprocess.Popen | None] = [None] * len(self.ports)
    self.lighthouse_serving: list[float | None] = [None] * len(self.ports)
    self.procs: dict[str, subprocess.Popen] = {}
    self.faults: list[dict[str, Any]] = []
    self.restarts = 0

  def log(self, g: str) -> list[dict[str, Any]]:
    path = os.path.join(self.tmp, f"{self.kind}-{g}.jsonl")
    if not os.path.exists(path):
      return []
    with open(path, encoding="utf-8") as f:
      return [json.loads(x) for x in f if x.endswith("}\n")]

  def start_lighthouse(self, i: int = 0) -> None:
    min_replicas = len(self.groups) if self.kind == "sync" else 1
    cmd = [sys.executable, "-m", "jaxckpt", "lighthouse", "--bind", f"127.0.0.1:{self.ports[i]}",
           "--min-replicas", str(min_replicas)]
    if self.etcd is not None:
      cmd += ["--etcd", ",".join(self.etcd.endpoints), "--job", f"{self.kind}{os.getpid()}",
              "--leader-lease", "1"]
    err = open(os.path.join(self.tmp, f"{self.kind}-lighthouse{i}.err"), "ab")  # pylint: disable=consider-using-with
    self.lighthouses[i] = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=err)
    os.set_blocking(self.lighthouses[i].stdout.fileno(), False)
    self.lighthouse_serving[i] = None

  def lighthouse_up(self, i: int = 0) -> bool:
    """Whether lighthouse ``i`` said it serves (its start-up, jax's import included, takes a while)."""
    proc = self.lighthouses[i]
    if proc is not None and self.lighthouse_serving[i] is None and b"serving on" in (proc.stdout.read() or b""):
      self.lighthouse_serving[i] = time.time()
    return self.lighthouse_serving[i] is not None

  def leader(self) -> int | None:
    """The lighthouse replica that leads (with etcd), by its etcd key."""
    from jaxckpt.ft import _etcd  # pylint: disable=import-outside-toplevel
    client = _etcd.Etcd(self.etcd.endpoints)
    try:
      kv = client.get(f"/jaxckpt/{self.kind}{os.getpid()}/leader")
    finally:
      client.close()
    return None if kv is None else self.ports.index(int(kv.value.decode().rpartition(":")[2]))

  def spawn(self, g: str, resume_at_most: int | None = None) -> None:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--group", g,
           "--lighthouse", self.address, "--job", f"{self.kind}{os.getpid()}",
           "--run-root", self.run_root, "--out", os.path.join(self.tmp, f"{self.kind}-{g}.jsonl"),
           "--stop-file", self.stop_file, "--step-secs", str(self.args.step_secs)]
    if self.args.timeout is not None:
      cmd += ["--timeout", str(self.args.timeout)]
    if self.kind == "sync":
      cmd.append("--sync")
    if resume_at_most is not None:
      cmd += ["--resume-at-most", str(resume_at_most)]
    err = open(os.path.join(self.tmp, f"{self.kind}-{g}.err"), "ab")  # pylint: disable=consider-using-with
    self.procs[g] = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=err)

  def top(self, g: str) -> int:
    return max((r["step"] for r in self.log(g) if r.get("committed")), default=0)

  def job_step(self) -> int:
    return max(self.top(g) for g in self.groups)

  def wait(self, what: str, cond: Callable[[], bool], secs: float) -> None:
    deadline = time.monotonic() + secs
    while not cond():
      self.supervise()
      if time.monotonic() > deadline:
        raise TimeoutError(f"{self.kind}: waited {secs} s for {what} (logs in {self.tmp})")
      time.sleep(0.05)

  def sleep(self, secs: float) -> None:
    end = time.monotonic() + secs
    while time.monotonic() < end:
      self.supervise()
      time.sleep(0.02)

  def supervise(self) -> None:
    """The launcher: a sync job restarts every group from the newest common snapshot when any process ended."""
    for i in range(len(self.ports)):
      self.lighthouse_up(i)
    if self.kind != "sync" or all(p.poll() is None for p in self.procs.values()):
      return
    noticed = time.time()
    ended = {g: p.returncode for g, p in self.procs.items() if p.poll() is not None}
    for p in self.procs.values():
      _kill(p)
    why = {g: next((r.get("failure") for r in reversed(self.log(g)) if "step" in r), None) for g in ended}
    common = min(self.top(g) for g in self.groups)
    self.restarts += 1
    for g in self.groups:
      self.spawn(g, resume_at_most=common)
    self.faults.append({"kind": "sync restart", "at": noticed, "from_step": common, "ended": ended,
                        "why": {g: (w or "")[:200] for g, w in why.items()}})

  def close(self) -> None:
    with open(self.stop_file, "w", encoding="utf-8"):
      pass
    for p in list(self.procs.values()) + self.lighthouses:
      if p is not None:
        _kill(p)
    if self.etcd is not None:
      self.etcd.__exit__(None, None, None)


def run_job(kind: str, args: argparse.Namespace, tmp: str, secret: str) -> dict[str, Any]:
  """One job under the fault schedule; its measured figures."""
  job = Job(kind, args, tmp, secret)
  schedule: list[dict[str, Any]] = []

  def fault(what: str, victim: str | None = None) -> dict[str, Any]:
    schedule.append({"kind": what, "victim": victim, "at": time.time(), "step": job.job_step()})
    return schedule[-1]

  def rest_of_window() -> None:
    job.sleep(max(0.0, schedule[-1]["at"] + args.window - time.time()))

  try:
    for i in range(len(job.ports)):
      job.start_lighthouse(i)
    for g in job.groups:
      job.spawn(g)
    job.wait("every group to commit 10 steps", lambda: min(job.top(g) for g in job.groups) >= 10, 300)
    start, start_step = time.time(), job.job_step()
    job.sleep(args.window)                                   # fault-free: the pace
    last = job.groups[-1]
    fault(f"SIGKILL {last} and restart", last)
    _kill(job.procs[last])
    if kind == "ft":
      job.spawn(last)
    rest_of_window()
    stopped = job.groups[1]
    fault(f"SIGSTOP {stopped} {args.stop_secs:g} s", stopped)
    pid = job.procs[stopped].pid
    os.kill(pid, signal.SIGSTOP)
    job.sleep(args.stop_secs)
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGCONT)
    rest_of_window()
    if job.etcd is not None:
      fault("SIGKILL of an etcd member")
      job.etcd.kill(1)
      rest_of_window()
      job.etcd.restart(1)
      for what, pick in (("the leading lighthouse", job.leader),
                         ("a following lighthouse", lambda: next(i for i in range(3) if i != job.leader()))):
        i = pick()
        fault(f"SIGKILL of {what}")
        _kill(job.lighthouses[i])
        job.sleep(2.0)
        job.start_lighthouse(i)                            # (back as a follower)
        rest_of_window()
    row = fault(f"control-plane outage {args.outage_secs:g} s")
    for proc in job.lighthouses:
      _kill(proc)
    job.sleep(args.outage_secs)
    for i in range(len(job.ports)):
      job.start_lighthouse(i)
    job.wait("the new lighthouse to serve", lambda: any(job.lighthouse_up(i) for i in range(len(job.ports))), 60)
    row["serving"] = min(t for t in job.lighthouse_serving if t is not None)
    rest_of_window()
    end, end_step = time.time(), job.job_step()
  finally:
    job.close()
  return measure(job, schedule, start, start_step, end, end_step)


def measure(job: Job, schedule: list[dict[str, Any]], start: float, start_step: int, end: float,
            end_step: int) -> dict[str, Any]:
  logs = {g: job.log(g) for g in job.groups}
  commits = sorted((r["t1"], r["step"], g, r) for g, rs in logs.items() for r in rs if r.get("committed"))

  def step_at(t: float) -> int:          # the job's high-water mark (recomputed steps do not count)
    return max((s for t1, s, _, _ in commits if t1 <= t), default=0)

  first_fault = schedule[0]["at"]
  pace = _gaps([r for rs in logs.values() for r in rs if r.get("committed") and start <= r["t1"] < first_fault])
  mean, median = statistics.fmean(pace), statistics.median(pace)
  wall = end - start
  out: dict[str, Any] = {
      "wall_s": round(wall, 2), "steps": end_step - start_step,
      "fault_free_median_step_s": round(median, 4), "fault_free_mean_step_s": round(mean, 4),
      "step_fraction": round((end_step - start_step) * mean / wall, 3), "faults": []}
  bounds = [f["at"] for f in schedule] + [end]
  baseline = step_at(first_fault) - step_at(start)
  out["fault_free_window_lost_steps"] = round((first_fault - start) / mean - baseline, 2)
  for f, t_end in zip(schedule, bounds[1:]):
    advanced = step_at(t_end) - step_at(f["at"])
    lost_s = (t_end - f["at"]) - advanced * mean
    row = {"fault": f["kind"], "window_s": round(t_end - f["at"], 2), "steps": advanced,
           "lost_s": round(lost_s, 2), "lost_steps": round(lost_s / median, 1)}
    if job.kind == "ft":
      row.update(_ft_details(job, logs, f, t_end, median))
    if "serving" in f:          # the outage: from the kill until a new lighthouse served
      row["outage_s"] = round(f["serving"] - f["at"], 2)
      row["lost_beyond_outage_s"] = round(lost_s - row["outage_s"], 2)
    out["faults"].append(row)
  if job.kind == "sync":
    out["restarts"] = []
    for r in job.faults:
      before = [f for f in schedule if f["at"] <= r["at"]]
      out["restarts"].append({
          "after": before[-1]["kind"] if before else "no fault (unplanned)",
          "noticed_after_fault_s": round(r["at"] - before[-1]["at"], 2) if before else None,
          "from_step": r["from_step"], "ended": r["ended"], "why": r["why"]})
  return out


def _ft_details(job: Job, logs: dict[str, list[dict[str, Any]]], fault: dict[str, Any], t_end: float,
                median: float) -> dict[str, Any]:
  """Detection (fault to the survivors' failed attempt), re-forming (to their next commit, less a
  step), the longest step, and for a restarted or stopped group its catch-up and rejoin."""
  victim = fault.get("victim")
  healthy = [g for g in job.groups if g != victim]
  rows = sorted((r for g in healthy for r in logs[g] if "step" in r and fault["at"] <= r["t1"] < t_end),
                key=lambda r: r["t1"])
  out: dict[str, Any] = {}
  gaps = _gaps([r for r in rows if r["committed"]] + [
      max((r for g in healthy for r in logs[g] if r.get("committed") and r["t1"] < fault["at"]),
          key=lambda r: r["t1"])])
  out["longest_healthy_step_s"] = round(max(gaps), 3) if gaps else None
  if gaps:
    out["stall_over_median_step"] = round((max(gaps) - median) / median, 2)
  failed = [r for r in rows if not r["committed"]]
  if victim is not None:
    # Detection: until every survivor gave the attempt up (its failed attempt ended); none
    # failed (the victim came back in time): the stall itself. Re-forming: from then to the
    # next commit, less the step's own time.
    gave_up = [min((r["t1"] for r in failed if r["group"] == g), default=None) for g in healthy]
    if failed and None not in gave_up:
      out["detect_s"] = round(max(gave_up) - fault["at"], 3)
      after = [r for r in rows if r["committed"] and r["t1"] > max(gave_up)]
      if after:
        out["reform_s"] = round(max(0.0, after[0]["t1"] - max(gave_up) - median), 3)
    elif gaps:
      out["detect_s"] = round(max(gaps) - median, 3)
      out["reform_s"] = 0.0
    out["failed_attempt_reasons"] = sorted({(r["failure"] or "")[:200] for r in failed})
  if victim is not None:
    back = [r for r in logs[victim] if "step" in r and fault["at"] <= r["t0"] < t_end]
    mine = [r for r in back if r["committed"] and victim in r["contributors"]]
    starts = [r for r in logs[victim] if "ready" in r and fault["at"] <= r["ready"] < t_end]
    caught = [r for r in back if r["caught_up_steps"] or r["snapshot_step"] is not None]
    if starts:
      out["restart_s"] = round(starts[0]["ready"] - fault["at"], 2)
    if caught:
      out["catch_up_s"] = round(sum(r["catch_up_secs"] for r in caught), 3)
    if mine:
      out["rejoined_after_s"] = round(mine[0]["t1"] - fault["at"], 2)
      # The healthy groups' step that first included the victim again.
      step = mine[0]["step"]
      same = [r for r in rows if r["committed"] and r["step"] == step]
      prev = [r for g in healthy for r in logs[g] if r.get("committed") and r["step"] == step - 1]
      if same and prev:
        out["rejoin_step_s"] = round(max(r["t1"] for r in same) - max(r["t1"] for r in prev), 3)
        out["rejoin_step_over_median"] = round(out["rejoin_step_s"] / median, 2)
        out["rejoin_step_quorum_allreduce_s"] = {
            r["group"]: [round(r["quorum_secs"], 3), round(r.get("allreduce_secs", 0.0), 3)]
            for r in same + [mine[0]]}
  return out


def _gaps(records: list[dict[str, Any]]) -> list[float]:
  """Seconds between consecutive commits of the job (one per step: the last group's)."""
  by_step: dict[int, float] = {}
  for r in records:
    by_step[r["step"]] = max(by_step.get(r["step"], 0.0), r["t1"])
  steps = sorted(by_step)
  return [by_step[b] - by_step[a] for a, b in zip(steps, steps[1:]) if b == a + 1]


def _kill(p: subprocess.Popen) -> None:
  if p.poll() is None:
    with contextlib.suppress(ProcessLookupError):
      os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)


def _free_port() -> int:
  import socket  # pylint: disable=import-outside-toplevel
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """Medians over runs of every number (per fault row too)."""
  def med(values: list[Any]) -> Any:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return round(statistics.median(nums), 3) if len(nums) == len(values) and nums else values[0]
  out = {k: med([r[k] for r in runs]) for k in runs[0] if k not in ("faults", "restarts")}
  out["faults"] = [{k: med([r["faults"][i].get(k) for r in runs]) for k in runs[0]["faults"][i]}
                   for i in range(len(runs[0]["faults"]))]
  return out


def goodput_inputs(ft: dict[str, Any]) -> dict[str, float]:
  """The goodput model's replica-group inputs from the ``ft`` job's medians (seconds)."""
  group_faults = [f for f in ft["faults"] if f["fault"].startswith(("SIGKILL g", "SIGSTOP g"))]
  # (A fault whose stall outlasted its window has no detection of its own: the window's loss.)
  detect = statistics.median(f.get("detect_s", f["lost_s"]) for f in group_faults)
  reform = statistics.median(f.get("reform_s", 0.0) for f in group_faults)
  rejoin = [f["rejoin_step_s"] - ft["fault_free_median_step_s"] for f in group_faults if "rejoin_step_s" in f]
  catch = [f["catch_up_s"] for f in group_faults if "catch_up_s" in f]
  return {"failure_detection_secs": round(detect, 3), "quorum_reform_secs": round(reform, 3),
          "rejoin_stall_secs": round(max(0.0, statistics.median(rejoin)) if rejoin else 0.0, 3),
          "catch_up_secs": round(statistics.median(catch), 3) if catch else None}


def replacement(median: dict[str, Any]) -> dict[str, Any]:
  """A killed group replaced: what it cost the replica groups (the healthy groups' stall:
  detection, re-forming and the rejoin step) against the synchronous job's loss for the
  same fault (every process restarted from the newest snapshot all hold)."""
  ft = next(f for f in median["ft"]["faults"] if f["fault"].startswith("SIGKILL g"))
  sync = next(f for f in median["sync"]["faults"] if f["fault"].startswith("SIGKILL g"))
  step = median["ft"]["fault_free_median_step_s"]
  stall = ft.get("detect_s", 0.0) + ft.get("reform_s", 0.0) + max(0.0, ft.get("rejoin_step_s", step) - step)
  return {"ft_stall_s": round(stall, 3), "ft_lost_s": ft["lost_s"], "ft_lost_steps": ft["lost_steps"],
          "sync_lost_s": sync["lost_s"], "sync_lost_steps": sync["lost_steps"],
          "ft_over_sync": round(ft["lost_s"] / sync["lost_s"], 3) if sync["lost_s"] > 0 else None}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--group", help=argparse.SUPPRESS)
  p.add_argument("--lighthouse", help=argparse.SUPPRESS)
  p.add_argument("--job", help=argparse.SUPPRESS)
  p.add_argument("--run-root", help=argparse.SUPPRESS)
  p.add_argument("--out", help=argparse.SUPPRESS)
  p.add_argument("--stop-file", help=argparse.SUPPRESS)
  p.add_argument("--sync", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--resume-at-most", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--groups", type=int, default=3)
  p.add_argument("--step-secs", type=float, default=0.2, help="simulated compute per step")
  p.add_argument("--timeout", type=float, default=None,
                 help="ReplicaGroup timeout in seconds (default: ReplicaGroup's own)")
  p.add_argument("--window", type=float, default=40.0, help="seconds between faults")
  p.add_argument("--stop-secs", type=float, default=10.0)
  p.add_argument("--outage-secs", type=float, default=3.0)
  p.add_argument("--runs", type=int, default=1)
  p.add_argument("--jobs", default="ft,sync")
  p.add_argument("--control-plane", choices=("etcd", "lighthouse"), default="etcd",
                 help="a 3-member etcd cluster and 3 lighthouse replicas (each of whose processes is "
                      "killed once), or one lighthouse process")
  p.add_argument("--quick", action="store_true", help="25 s windows, one run")
  p.add_argument("--host", default=None, help="what to call this machine in the JSON")
  p.add_argument("--keep", action="store_true", help="keep each run's logs (printed to stderr)")
  args = p.parse_args()
  if args.worker:
    return worker(args)
  if args.quick:
    args.window, args.runs = 25.0, 1
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # (so every process it started is stopped)
  secret = uuid.uuid4().hex
  result: dict[str, Any] = {"groups": args.groups, "step_secs": args.step_secs, "timeout_s": args.timeout,
                            "control_plane": args.control_plane, "load_avg_1m": round(os.getloadavg()[0], 2),
                            "window_s": args.window, "host_cores": os.cpu_count(),
                            "host": args.host or f"{os.cpu_count()} cores, JAX on CPU", "runs": []}
  for _ in range(args.runs):
    tmp = tempfile.mkdtemp(prefix="jaxckpt-ftgp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
      run = {kind: run_job(kind, args, tmp, secret) for kind in args.jobs.split(",")}
    finally:
      _stop_agents(os.path.join(tmp, "agents"))
      if args.keep:
        print(f"logs kept in {tmp}", file=sys.stderr)
      else:
        shutil.rmtree(tmp, ignore_errors=True)
    result["runs"].append(run)
    print(json.dumps(run), file=sys.stderr, flush=True)
  kinds = args.jobs.split(",")
  result["median"] = {k: _median_of([r[k] for r in result["runs"]]) for k in kinds}
  if "ft" in kinds:
    result["goodput_inputs"] = goodput_inputs(result["median"]["ft"])
  if {"ft", "sync"} <= set(kinds):
    result["replacement"] = replacement(result["median"])
  print(json.dumps(result, indent=1))
  return 0


def _stop_agents(root: str) -> None:
  from jaxckpt.testing.processes import agent_pids  # pylint: disable=import-outside-toplevel
  for pid in agent_pids(root) if os.path.isdir(root) else []:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
  sys.exit(main())
