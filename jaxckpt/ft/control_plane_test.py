"""The control plane on etcd: lighthouse replicas that elect a leader, and groups that train
through the loss of any of its processes, and through a whole outage while their quorum holds."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest

from jaxckpt import errors
from jaxckpt.ft import Lighthouse, LighthouseOptions, ReplicaGroup, ReplicaGroupOptions, _etcd
from jaxckpt.ft.replica_group_process_test import Job, assert_consistent, commit_gaps
from jaxckpt.testing.processes import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECRET = "control-plane-test-secret"


def test_the_etcd_client_answers_through_the_loss_of_any_one_member(etcd_cluster):
  client = _etcd.Etcd(etcd_cluster.endpoints)
  for i in range(3):
    client.put("/t/k", f"v{i}")
    etcd_cluster.kill(i)
    try:
      client.put("/t/k", f"w{i}")                 # (within its timeout: another member answers)
      assert client.get("/t/k").value == f"w{i}".encode()
      won, _ = client.txn([_etcd.compare("/t/k", "VALUE", f"w{i}")], [_etcd.put_op("/t/k", "x")])
      assert won and client.get("/t/k").value == b"x"
    finally:
      etcd_cluster.restart(i)
      etcd_cluster.wait_healthy()
  lease = client.grant(1)
  client.put("/t/leased", "v", lease)
  client.revoke(lease)
  assert client.get("/t/leased") is None


@contextlib.contextmanager
def _joined(lh, gid, options, grads_like=None):
  """A group in the job (its first step's quorum taken), live until the block ends."""
  with ReplicaGroup(lighthouse=lh, group_id=gid, timeout=timedelta(seconds=2), options=options,
                    secret=SECRET) as ft:
    ft.start_step(grads_like=grads_like)
    yield ft


def _ask(lh, gid, options, out, grads_like=None):
  try:
    with ReplicaGroup(lighthouse=lh, group_id=gid, timeout=timedelta(seconds=2), options=options,
                      secret=SECRET) as ft:
      ft.start_step(grads_like=grads_like)
      out[gid] = ft.metrics if ft.metrics else "joined"
  except errors.TermsMismatchError as e:
    out[gid] = e


@pytest.mark.parametrize("field, theirs, want", [
    ("max_groups", 4, "group g1's max_groups is 4, the job's is 5"),
    ("data_order", "c4-seed18", "group g1's data_order is 'c4-seed18', the job's is 'c4-seed17'"),
    ("averaging", "sum", "group g1's averaging is 'sum', the job's is 'mean'"),
])
def test_a_group_whose_terms_differ_is_refused_at_join_with_the_field_and_both_values(field, theirs, want):
  # A group relaunched with max_groups=4 beside a peer with 5 trained batches 5 and 25 twice,
  # and nothing was refused.
  job = ReplicaGroupOptions(max_groups=5, data_order="c4-seed17", heartbeat_interval=timedelta(milliseconds=50))
  odd = ReplicaGroupOptions(**{**{k: getattr(job, k) for k in ("max_groups", "data_order", "heartbeat_interval")},
                               field: theirs})
  opts = LighthouseOptions(min_replicas=1, join_timeout=timedelta(seconds=0.1))
  with Lighthouse("127.0.0.1:0", opts, secret=SECRET) as lh, _joined(lh.address, "g0", job):
    out = {}
    t0 = time.monotonic()
    _ask(lh.address, "g1", odd, out)
    assert isinstance(out["g1"], errors.TermsMismatchError) and isinstance(out["g1"], ValueError)
    assert want in str(out["g1"]) and f"relaunch g1 with {field}=" in str(out["g1"]), out["g1"]
    assert time.monotonic() - t0 < 5                  # refused at once, not after a timeout
    assert lh.status()["terms"][:3] == [5, "c4-seed17", "mean"]


def test_a_lighthouse_that_outlives_a_run_gives_the_next_run_its_own_terms():
  opts = LighthouseOptions(join_timeout=timedelta(seconds=0.1), straggler_timeout=timedelta(seconds=0.3))
  group = lambda n: ReplicaGroupOptions(max_groups=n, heartbeat_interval=timedelta(milliseconds=50))
  with Lighthouse("127.0.0.1:0", opts, secret=SECRET) as lh:
    with _joined(lh.address, "g0", group(3)):
      first = lh.status()["run"]
    with _joined(lh.address, "g0", group(4)):              # (refused before: "the job's is 3")
      assert lh.status()["terms"][0] == 4 and lh.status()["run"] not in (None, first)
      out = {}
      _ask(lh.address, "g1", group(3), out)                 # the live run's terms hold
      assert "group g1's max_groups is 3, the job's is 4" in str(out["g1"]), out


def test_a_group_of_another_tree_layout_is_refused_at_join():
  opts = ReplicaGroupOptions(heartbeat_interval=timedelta(milliseconds=50))
  with (Lighthouse("127.0.0.1:0", LighthouseOptions(join_timeout=timedelta(seconds=0.1)), secret=SECRET) as lh,
        _joined(lh.address, "g0", opts, grads_like={"a": np.zeros(8, np.float32)})):
    out = {}
    _ask(lh.address, "g1", opts, out, grads_like={"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)})
  assert isinstance(out["g1"], errors.TermsMismatchError), out
  assert ("group g1's tree layout is {'a': float32[4], 'b': float32[4]}, the job's is {'a': float32[8]}"
          in str(out["g1"])), out["g1"]


def _wait(what, cond, timeout_secs):
  deadline = time.monotonic() + timeout_secs
  while not cond():
    assert time.monotonic() < deadline, f"{what} did not happen within {timeout_secs} s"
    time.sleep(0.02)


def test_the_next_run_of_a_job_on_etcd_starts_with_its_own_terms_and_a_live_runs_are_kept(etcd_cluster):
  # /jaxckpt/<job>/terms was created once and read by every later leader of every later run:
  # a run whose groups all use max_groups=4 (the ended run's was 3) was refused in every group.
  job = f"runs{os.getpid()}{int(time.time())}"
  opts = LighthouseOptions(etcd_endpoints=tuple(etcd_cluster.endpoints), job_name=job, leader_lease=timedelta(seconds=1),
                           join_timeout=timedelta(seconds=0.1), heartbeat_timeout=timedelta(seconds=2),
                           straggler_timeout=timedelta(seconds=0.3))
  etcd = _etcd.Etcd(etcd_cluster.endpoints)
  def record():                              # (a record of before runs was the terms alone)
    obj = json.loads(etcd.get(f"/jaxckpt/{job}/terms").value)
    return obj if isinstance(obj, dict) else {"terms": obj, "run": None}
  group = lambda max_groups: ReplicaGroupOptions(max_groups=max_groups, heartbeat_interval=timedelta(milliseconds=50))
  replicas = []

  def start(n):
    for _ in range(n):
      replicas.append(Lighthouse("127.0.0.1:0", opts, secret=SECRET).start())
    live = [r for r in replicas if r.options is opts and not getattr(r, "_stopped", False)]
    _wait("a replica to lead", lambda: any(r.leading for r in live), 30)
    return ",".join(r.address for r in live)

  def stop(lh):
    lh.stop()
    lh._stopped = True                       # (the test's own mark: not started again)

  try:
    # Run 1: max_groups=3, on two replicas; it ends (its group leaves).
    addresses = start(2)
    with _joined(addresses, "g0", group(3)):
      pass
    run1 = record()
    assert run1["terms"][0] == 3, run1
    # Run 2, on the same replicas: every group uses max_groups=4, and is not refused.
    out = {}
    with _joined(addresses, "g0", group(4)), _joined(addresses, "g1", group(4)):
      run2 = record()
      assert run2["terms"][0] == 4 and run1["run"] and run2["run"] != run1["run"], (run1, run2)
      leader = next(r for r in replicas if r.leading)
      assert leader.status()["run"] == run2["run"]
      # A group joining the live run is held to its terms, by the leader and by the next one.
      _ask(addresses, "g2", group(3), out)
      assert isinstance(out["g2"], errors.TermsMismatchError), out
      assert "group g2's max_groups is 3, the job's is 4" in str(out["g2"]), out["g2"]
      stop(leader)                            # (a clean exit: a follower leads at once)
      follower = next(r for r in replicas if r is not leader)
      _wait("the follower to lead", lambda: follower.leading, 30)
      del out["g2"]
      _ask(addresses, "g2", group(3), out)
      assert "group g2's max_groups is 3, the job's is 4" in str(out.get("g2")), out
      assert record()["run"] == run2["run"]
    # Run 3, on a control plane started again (every replica new): its own terms too.
    for r in replicas:
      if not getattr(r, "_stopped", False):
        stop(r)
    addresses = start(2)
    with _joined(addresses, "g0", group(5)):
      run3 = record()
    assert run3["terms"][0] == 5 and run3["run"] not in (run1["run"], run2["run"]), run3
  finally:
    for r in replicas:
      if not getattr(r, "_stopped", False):
        r.stop()
    etcd.close()


class Replicas:
  """``n`` lighthouse processes (``jaxckpt lighthouse --etcd``) of one job; each one started
  is killed by pid in ``close``."""

  def __init__(self, tmp: pathlib.Path, etcd: list[str], job: str, n: int = 3) -> None:
    self.tmp, self.etcd, self.job = tmp, etcd, job
    self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    self.procs: list[subprocess.Popen | None] = [None] * n
    self.client = _etcd.Etcd(etcd)

  def start(self, i: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAXCKPT_JOB_SECRET=SECRET)
    cmd = [sys.executable, "-m", "jaxckpt", "lighthouse", "--bind", self.addresses[i], "--etcd",
           ",".join(self.etcd), "--job", self.job, "--min-replicas", "2", "--heartbeat-timeout", "1",
           "--join-timeout", "0.5", "--straggler-timeout", "5", "--leader-lease", "1"]
    with open(self.tmp / f"lighthouse{i}.stderr", "ab") as err:
      self.procs[i] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)

  def leader(self) -> int | None:
    kv = self.client.get(f"/jaxckpt/{self.job}/leader")
    return None if kv is None else self.addresses.index(kv.value.decode())

  def kill(self, i: int) -> None:
    proc = self.procs[i]
    if proc is not None and proc.poll() is None:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(timeout=10)

  def stderr(self) -> str:
    return "".join(p.read_text() for p in self.tmp.glob("lighthouse*.stderr"))

  def close(self) -> None:
    for i in range(len(self.procs)):
      self.kill(i)
    self.client.close()


class _Server:
  secret = SECRET


def _max_gap(job: Job, group: str, start: float, end: float) -> float:
  times = [r["t1"] for r in job.records(group) if r["committed"]]
  inside = [t for t in times if start <= t <= end]
  before = [t for t in times if t < start]
  points = before[-1:] + inside
  return max(b - a for a, b in zip(points, points[1:]))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_groups_train_through_the_loss_of_any_control_plane_process_and_a_whole_outage(
    tmp_path, etcd_cluster):
  replicas = Replicas(tmp_path, etcd_cluster.endpoints, job=f"cp{os.getpid()}{int(time.time())}")
  job = Job(tmp_path, ",".join(replicas.addresses))
  job.lighthouse_server = _Server()
  groups = ("g0", "g1", "g2")
  try:
    for i in range(3):
      replicas.start(i)
    procs = {g: job.spawn(g, extra=("--max-groups", "3")) for g in groups}
    committed = lambda g: sum(r["committed"] for r in job.records(g))
    job.wait("every group to commit 15 steps", lambda: min(committed(g) for g in groups) >= 15, 120)
    median = statistics.median(d for g in groups for d, _ in commit_gaps(job.records(g)))
    marks = {}

    def after(what, steps=30):                           # (longer than a dead leader's lease)
      at = job.max_step("g0")
      job.wait(f"{steps} steps after {what}", lambda: min(job.max_step(g) for g in ("g0", "g1")) >= at + steps, 60)
      if what in marks:
        marks[what] = (marks[what], time.time())

    marks["etcd member"] = time.time()
    etcd_cluster.kill(1)
    after("etcd member")
    etcd_cluster.restart(1)
    leader = replicas.leader()
    assert leader is not None
    marks["leader"] = time.time()
    replicas.kill(leader)
    after("leader")
    deadline = time.monotonic() + 30
    while replicas.leader() in (None, leader):           # a follower takes over (its lease: 1 s)
      assert time.monotonic() < deadline, "no follower took the lead"
      time.sleep(0.05)
    marks["outage"] = time.time()
    for i in range(3):                                    # the whole control plane
      replicas.kill(i)
    after("outage")
    # A membership change during the outage waits for the control plane and says so.
    os.kill(procs["g2"].pid, signal.SIGKILL)
    procs["g2"].wait(timeout=10)
    stuck = job.max_step("g0")
    job.wait("g0 to say it waits for the control plane",
             lambda: "waits for the control plane" in (tmp_path / "g0.stderr").read_text(), 30)
    assert job.max_step("g0") <= stuck + 1
    for i in range(2):
      replicas.start(i)
    after("the control plane's return")
    restarted = job.spawn("g2", extra=("--max-groups", "3"))
    back = time.time()
    job.wait("g2 to contribute again", lambda: any(
        r["committed"] and "g2" in r["contributors"] and r["t0"] > back for r in job.records("g2")), 90)
    steps = job.finish_after(3)
    job.join([procs["g0"], procs["g1"], restarted], 60)
  finally:
    job.close()
    replicas.close()
  fps = assert_consistent(job, list(groups))
  assert sorted(fps) == list(range(1, steps + 1))
  # No batch trained twice (assert_consistent) or skipped: the committed steps' batches are 0 .. N-1.
  consumed = sorted({r["batch"] for g in groups for r in job.records(g) if r["committed"] and r["contributed"]})
  assert consumed == list(range(len(consumed))), [b for a, b in zip(consumed, consumed[1:]) if b != a + 1][:5]
  # Each kill cost the groups at most about one median step (slack for this shared 2-core machine).
  for what, (start, end) in marks.items():
    for g in ("g0", "g1"):
      gap = _max_gap(job, g, start, end)
      assert gap <= 2 * median + 0.7, (what, g, gap, median)
  # The failure found during the outage reached the control plane when it was back.
  assert "reports a failure of quorum" in replicas.stderr(), replicas.stderr()[-3000:]
  assert "waits for the control plane" in (tmp_path / "g1.stderr").read_text()
