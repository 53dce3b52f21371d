"""A job whose hosts share nothing but a network that fails (tests/support/netns.py).

Each host of the job (its trainer process and the agent it starts) lives in a
network namespace of its own, with its own address and run root; the job finds
its agents through jax.distributed (coordinator: process 0's host), never through
a shared directory. Storage (SeaweedFS) is a host of its own. The network between
them is cut, cut one way, or slowed at the cluster's router while the job saves,
protects and persists; each test asserts what the user is told (the error and the
host it names, no success for what did not happen) and what a restore returns
(the step, bit for bit, and its tier). :mod:`tests.support.net_worker` is each
process's side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Iterator

import pytest

from jaxckpt.testing import processes
from tests.support.netns import Cluster
from tests.support.s3 import SeaweedS3

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 7470                       # jax.distributed's coordinator, on process 0's host


@dataclasses.dataclass
class Job:
  """A running job: its network, storage, and one worker per trainer host."""
  net: Cluster
  s3: SeaweedS3
  directory: str
  hosts: list[str]
  root: str                      # the run roots' parent (each host's own: ROOT/HOST)
  name: str                      # the job's name
  worker_args: list[str]
  procs: list[processes.Proc] = dataclasses.field(default_factory=list)

  def launch(self) -> None:
    """Starts one worker per trainer host (process i on host ``h{i}``, coordinator on h0)
    and waits until each is ready."""
    n = len(self.hosts)
    for i, name in enumerate(self.hosts):
      host = self.net.host(name)
      self.procs.append(processes.Proc(
          ["-m", "tests.support.net_worker", "--coordinator", self.net.host("h0").address,
           "--port", str(PORT), "--num-processes", str(n), "--process-id", str(i),
           "--run-root", os.path.join(self.root, name), "--tcp-host", host.address, "--job", self.name,
           "--directory", self.directory, *self.worker_args], cwd=REPO, stdin=True, popen=host.popen))
    for i, p in enumerate(self.procs):
      try:
        p.wait_for("READY", 300)
      except TimeoutError as e:
        raise AssertionError(f"process {i} on {self.hosts[i]} did not start: {e}") from None

  def stop(self) -> None:
    """Kills every worker (by pid), as a lost trainer is; the agents live on."""
    for p in self.procs:
      p.__exit__(None, None, None)
    self.procs = []

  def ask(self, i: int, cmd: str, timeout_secs: float = 300.0) -> dict:
    """Sends ``cmd`` to process ``i`` and returns its answer."""
    self.send(i, cmd)
    return self.answer(i, cmd, timeout_secs)

  def send(self, i: int, cmd: str) -> None:
    self.procs[i].send(cmd)

  def answer(self, i: int, cmd: str, timeout_secs: float = 300.0) -> dict:
    try:
      line = self.procs[i].wait_for('R {"cmd": ' + json.dumps(cmd), timeout_secs)
    except TimeoutError as e:
      raise AssertionError(f"process {i} on {self.hosts[i]} did not answer {cmd!r} within "
                           f"{timeout_secs} s:\n{e}") from None
    return json.loads(line[2:])

  def all(self, cmd: str, timeout_secs: float = 300.0) -> list[dict]:
    """``cmd`` on every process at once (collective calls); their answers."""
    for i in range(len(self.procs)):
      self.send(i, cmd)
    return [self.answer(i, cmd, timeout_secs) for i in range(len(self.procs))]

  def ok(self, cmd: str, timeout_secs: float = 300.0) -> list:
    """``cmd`` on every process; their values, once each said it succeeded."""
    answers = self.all(cmd, timeout_secs)
    assert all(a["ok"] for a in answers), json.dumps(answers, indent=1)
    return [a["value"] for a in answers]

  def stored(self) -> list[int]:
    """The steps committed on storage, as a process on the storage host lists them."""
    done = self.net.host("storage").run(
        [sys.executable, "-c", "import json, sys, jaxckpt as jc; "
         "print(json.dumps(jc.universal.all_steps(sys.argv[1])))", self.directory], timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def network_job(n: int = 2, *, parity: int = 1, persist_interval: int | None = 1,
                ballast_mib: int = 0, timeout_secs: float = 60.0,
                heartbeat_timeout_secs: int = 100) -> Iterator[Job]:
  """``n`` trainer hosts (``h0``..) and a ``storage`` host, each in a namespace of its own;
  one process per trainer host, each ready for commands. Everything (namespaces,
  processes, agents, storage) is removed on exit, also when the test failed."""
  hosts = [f"h{i}" for i in range(n)]
  with contextlib.ExitStack() as stack:
    net = stack.enter_context(Cluster([*hosts, "storage"]))
    s3 = stack.enter_context(SeaweedS3(netns_host=net.host("storage")))
    root, name = stack.enter_context(processes.agent_sandbox("jn"))
    args = ["--parity", str(parity), "--ballast-mib", str(ballast_mib), "--timeout-secs", str(timeout_secs),
            "--heartbeat-timeout-secs", str(heartbeat_timeout_secs)]
    if persist_interval is not None:
      args += ["--persist-interval", str(persist_interval)]
    job = Job(net, s3, s3.url(uuid.uuid4().hex[:12]), hosts, root, name, args)
    stack.callback(job.stop)
    job.launch()
    yield job


def failed(answer: dict, kind: str) -> str:
  """The message of ``answer``, which must be an error that is (or subclasses) ``kind``."""
  assert not answer["ok"], f"{answer['cmd']!r} reported success: {answer}"
  assert kind in answer["mro"], answer
  return answer["message"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_storage_cut_off_during_a_persist_is_never_reported_persisted_and_the_job_goes_on_after_heal():
  # Storage (SeaweedFS on a host of its own) is cut off from the job while step 2 is
  # persisted: every process's wait_until_finished ends within its timeout, names the
  # store's endpoint, and never reports step 2 persisted; after the heal the persist goes
  # through, the job persists step 3 and restores it from host memory, bit for bit.
  with network_job() as job:
    assert job.ok("save 1") == [True, True]
    job.ok("finished 120")
    assert job.stored() == [1]
    job.net.cut("storage")
    assert job.ok("save 2") == [True, True]
    # the wait ends on time, says the step is not persisted, and names the store that is cut off
    for answer in job.all("finished 20"):
      message = failed(answer, "SnapshotTimeoutError")
      assert "steps [2] were not persisted" in message, message
      assert f"S3 endpoint {job.s3.endpoint}" in message, message
    job.net.heal()
    job.ok("finished 300")
    assert job.stored() == [1, 2]
    assert job.ok("save 3") == [True, True]
    job.ok("finished 300")
    assert job.stored() == [1, 2, 3]
    for value in job.ok("restore"):
      assert value == {"step": 3, "tier": "host", "check": "ok"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_host_cut_off_from_everyone_during_parity_is_named_on_time_and_protected_after_heal():
  # h1 (its trainer and agent) is cut off from the job while step 2's parity is exchanged:
  # h0's wait for the protection ends within its own timeout (not an agent request's 60 s),
  # names h1's agent and its address, and never reports step 2 protected; after the heal
  # both hosts protect step 2 and restore it bit for bit from host memory. (The cut is shorter
  # than jax.distributed's heartbeat timeout: a longer one ends the job, see the coordinator test.)
  with network_job(heartbeat_timeout_secs=300, persist_interval=10) as job:
    assert job.ok("save 10") == [True, True]          # on storage too
    job.ok("finished 120")
    job.ok("protected 10 120")
    job.net.cut("h1")
    job.send(0, "save 11")                           # host memory and parity only
    job.send(1, "save 11")
    assert job.answer(0, "save 11")["value"] is True
    started = time.monotonic()
    message = failed(job.ask(0, "protected 11 10"), "SnapshotTimeoutError")
    waited = time.monotonic() - started
    assert waited < 10 + 15, f"wait_until_protected(timeout_secs=10) returned after {waited:.0f} s"
    assert "step 11 was not protected within 10" in message, message
    assert "host 1 " in message and job.net.host("h1").address in message, message
    job.net.heal()
    assert job.answer(1, "save 11")["value"] is True
    job.ok("protected 11 200")
    job.ok("finished 200")
    for value in job.ok("steps"):
      assert value == {"all": [10, 11], "protected": [10, 11]}
    for value in job.ok("restore"):
      assert value == {"step": 11, "tier": "host", "check": "ok"}
    assert job.stored() == [10]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_slow_link_to_storage_delays_the_persist_and_nothing_reports_it_done_early():
  # Storage's link capped at 16 Mbit/s (tc tbf) while step 1 (2 x 4 MiB) is persisted: the
  # host snapshot is not held up, a wait shorter than the transfer says the step is not
  # persisted yet (it never reports success early), and the step commits once its bytes are
  # through, no sooner than the cap allows.
  rate_bits, ballast_mib = 16_000_000, 4
  with network_job(ballast_mib=ballast_mib) as job:
    job.net.limit("storage", rate="16mbit")
    started = time.monotonic()
    assert job.ok("save 1") == [True, True]
    job.ok("snapshotted 120")
    for answer in job.all("finished 1"):
      message = failed(answer, "SnapshotTimeoutError")
      assert "steps [1] were not persisted" in message, message
    job.ok("finished 600", timeout_secs=700)
    took = time.monotonic() - started
    floor = 2 * ballast_mib * 2**20 * 8 / rate_bits
    assert took > 0.8 * floor, f"2 x {ballast_mib} MiB through a 16 Mbit/s link in {took:.1f} s"
    assert job.stored() == [1]
    job.net.heal()
    assert job.ok("save 2") == [True, True]
    job.ok("finished 300")
    assert job.stored() == [1, 2]
    for value in job.ok("restore 1"):
      assert value == {"step": 1, "tier": "host", "check": "ok"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_coordinator_cut_off_ends_the_job_and_the_relaunch_restores_the_newest_protected_step():
  # h0 runs process 0, whose process hosts jax.distributed's coordinator. Cut off from the
  # job for longer than the heartbeat timeout (10 s here), the job ends: JAX terminates every
  # process. The agents are not jax processes: each keeps its host's snapshots and parity, and
  # the relaunched job (after the heal) restores step 2 from host memory, bit for bit.
  with network_job(persist_interval=10, heartbeat_timeout_secs=10) as job:
    for step in (1, 2):
      assert job.ok(f"save {step}") == [True, True]
      job.ok("snapshotted 120")
      job.ok(f"protected {step} 120")
    agents = processes.agent_pids(job.root)
    assert len(agents) == 2
    job.net.cut("h0")
    for i, p in enumerate(job.procs):
      try:
        code = p.p.wait(timeout=300)
      except subprocess.TimeoutExpired:
        raise AssertionError(f"process {i} on {job.hosts[i]} still runs 300 s after the coordinator "
                             "was cut off") from None
      assert code != 0, f"process {i} exited 0 with its coordinator cut off"
    assert sorted(processes.agent_pids(job.root)) == sorted(agents)     # they live on
    job.stop()
    job.net.heal()
    job.launch()
    for value in job.ok("restore"):
      assert value == {"step": 2, "tier": "host", "check": "ok"}
    assert job.stored() == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cut_between_two_parity_peers_only_is_named_by_each_and_healed():
  # Three hosts in one parity group; h1 and h2 lose each other (each still reaches h0, the
  # coordinator and storage). No host reports step 11 protected while they cannot exchange
  # its parity: h1's and h2's waits end on time naming the other's agent and address; after
  # the heal every host protects it and restores it from host memory, bit for bit.
  with network_job(3, persist_interval=10, heartbeat_timeout_secs=300) as job:
    assert job.ok("save 10") == [True, True, True]
    job.ok("finished 120")
    job.ok("protected 10 120")
    job.net.cut("h1", "h2")
    assert job.ok("save 11") == [True, True, True]
    job.ok("snapshotted 120")
    answers = job.all("protected 11 10", timeout_secs=120)
    messages = [failed(a, "SnapshotTimeoutError") for a in answers]
    for me, other in ((1, 2), (2, 1)):
      assert f"host {other} " in messages[me] and job.net.host(f"h{other}").address in messages[me], \
          messages[me]
    assert "step 11 was not protected within 10" in messages[0], messages[0]
    job.net.heal()
    job.ok("protected 11 200")
    for value in job.ok("restore"):
      assert value == {"step": 11, "tier": "host", "check": "ok"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_host_cut_off_through_a_persist_is_told_why_it_failed_and_the_job_goes_on():
  # h1 is cut off from everyone (storage included) for longer than the persist's timeout
  # while step 2 is persisted. Process 0's wait ends on time naming process 1's missing
  # part; after the heal each process is told why step 2 is not on storage (a cause that
  # names the store or the process that gave up, never an empty TimeoutError), step 2 is
  # not there, and step 3 is persisted and restored from host memory, bit for bit.
  with network_job(heartbeat_timeout_secs=600, timeout_secs=30) as job:
    assert job.ok("save 1") == [True, True]
    job.ok("finished 120")
    job.net.cut("h1")
    job.send(0, "save 2")
    job.send(1, "save 2")
    assert job.answer(0, "save 2")["value"] is True
    message = failed(job.ask(0, "finished 45"), "JaxckptError")
    assert "step 2" in message, message
    job.net.heal()
    assert job.answer(1, "save 2")["value"] is True
    message = failed(job.ask(1, "finished 300"), "JaxckptError")
    assert "step 2" in message and not message.rstrip().endswith(("TimeoutError:", "failed:")), message
    job.ok("finished 300")                   # (each failure is raised once)
    assert job.stored() == [1]
    assert job.ok("save 3") == [True, True]
    job.ok("finished 300")
    assert job.stored() == [1, 3]
    for value in job.ok("restore"):
      assert value == {"step": 3, "tier": "host", "check": "ok"}
