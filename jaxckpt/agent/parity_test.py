"""Parity across snapshot agents: four "hosts" (agents 0..3 of one job) lose some,
a restarted job rebuilds them from the survivors' data and parity.

One test process drives four AgentStores, each writing its own per-process
manifest (process_index i of 4) holding different shards of the same global
arrays, as four trainers would. Losing a host = SIGKILL its agent by pid and
delete its directory (its shared memory); its replacement is a fresh agent.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.util import _wait
from jaxckpt.agent import _parity_config, _paths, _requests
from jaxckpt.agent.trainer.client import AgentStore
from jaxckpt.host._persist import PendingAttempt
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, align, checksum
from jaxckpt.parity.placement import StripeLayout
from jaxckpt.testing import processes

HOSTS = 4
# Global arrays; host i holds rows ROWS[i] of "w", and CUTS[i] of "u" (uneven sizes).
ROWS = [(16 * i, 16 * i + 16) for i in range(HOSTS)]
CUTS = [(0, 100), (100, 350), (350, 700), (700, 1000)]


def state(step: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(step)
  return {"u": rng.standard_normal(1000).astype(np.float32),
          "w": rng.standard_normal((64, 24)).astype(np.float32)}


def host_shards(h: int, values: dict[str, np.ndarray], empty: tuple[int, ...] = ()
                ) -> list[tuple[str, tuple, np.ndarray]]:
  """Host ``h``'s shards. Hosts in ``empty`` hold none: the next lower host holds their
  rows too (as when every replica a host has is stored by another)."""
  if h in empty:
    return []
  (r0, r1), (c0, c1) = ROWS[h], CUTS[h]
  last = h
  while last + 1 < HOSTS and last + 1 in empty:
    last += 1
  r1, c1 = ROWS[last][1], CUTS[last][1]
  return [("['u']", ((c0, c1),), values["u"][c0:c1]),
          ("['w']", ((r0, r1), (0, 24)), values["w"][r0:r1])]


class Cluster:
  """Four hosts' stores (one agent each) saving hand-made per-process snapshots."""

  def __init__(self, root: str, job: str, parity: int, *, timeout_secs: float = 60.0,
               empty: tuple[int, ...] = (), persist: dict | None = None,
               sub_block_bytes: int = 320):
    self.root, self.job, self.empty, self.persist = root, job, empty, persist
    self.options = jc.ParityOptions(group_size=4, parity=parity)
    # Small sub-blocks: each stripe is pulled and encoded in several ranges, the last padded.
    self.config = _parity_config.ParityConfig(4, parity, timeout_secs,
                                              sub_block_bytes=sub_block_bytes).to_obj()
    self.stores = [self._store(h) for h in range(HOSTS)]

  def _store(self, h: int) -> AgentStore:
    return AgentStore(jc.AgentOptions(job_name=self.job, run_root=self.root), host=h,
                      max_snapshots=2, limit_bytes=1 << 30, parity=self.config,
                      persist=self.persist)

  def save(self, step: int, hosts=range(HOSTS), attempt: str | None = None) -> None:
    values = state(step)
    for h in hosts:
      leaves, offset, records = [], 0, {}
      for path, box, arr in host_shards(h, values, self.empty):
        records[path] = (box, offset, arr)
        offset = align(offset + arr.nbytes)
      slot = self.stores[h].reserve(step, offset, timeout_secs=10)
      store_buf = slot.buffer
      for path, (box, off, arr) in records.items():
        store_buf[off:off + arr.nbytes] = arr.view(np.uint8).reshape(-1)
      for path in ("['u']", "['w']"):
        shards = ()
        if path in records:
          box, off, arr = records[path]
          shards = (ShardRecord(box, off, arr.nbytes, checksum(arr)),)
        leaves.append(LeafRecord(path=path, kind="jax", shape=values[path[2]].shape,
                                 dtype="float32", shards=shards))
      self.stores[h].commit(slot, SnapshotManifest(step=step, leaves=tuple(leaves),
                                                   nbytes=offset, process_index=h,
                                                   process_count=HOSTS),
                            persist_attempt=attempt)

  def lose(self, hosts) -> None:
    """SIGKILLs the hosts' agents, wipes their shared memory, starts empty replacements."""
    for h in hosts:
      pid = self.stores[h].pid
      self.stores[h].close()
      os.kill(pid, signal.SIGKILL)
      processes.wait_gone(pid, 10, f"killed agent of host {h}")
      shutil.rmtree(_paths.agent_dir(self.root, self.job, h))
    for h in hosts:
      self.stores[h] = self._store(h)

  def manager(self, directory=None) -> jc.CheckpointManager:
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=self.job, run_root=self.root,
                                                      host_id=0),
                                parity=self.options, timeout_secs=60.0, handle_sigterm=False)
    return jc.CheckpointManager(directory, opts, store=self._store(0))

  def parity_status(self, h: int) -> dict:
    return self.stores[h].call(_requests.ParityStatus())

  def protect(self, step: int) -> None:
    """Saves ``step`` on every host and waits until its parity is complete."""
    self.save(step)
    with self.manager() as mgr:
      mgr.wait_until_protected(step, timeout_secs=60)

  def close(self) -> None:
    for s in self.stores:
      s.close()

  def __enter__(self) -> "Cluster":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@pytest.fixture
def sandbox():
  with processes.agent_sandbox("jp") as (root, job):
    yield root, job


def target():
  s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  return {"u": jax.ShapeDtypeStruct((1000,), np.float32, sharding=s),
          "w": jax.ShapeDtypeStruct((64, 24), np.float32, sharding=s)}


def assert_restores(mgr: jc.CheckpointManager, step: int, tier: str) -> None:
  out = mgr.restore(target=target())
  assert (mgr.last_restore.step, mgr.last_restore.tier) == (step, tier)
  want = state(step)
  for k in want:
    np.testing.assert_array_equal(np.asarray(out[k]), want[k], err_msg=f"{k} of step {step}")


@pytest.mark.parametrize("m", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_every_single_lost_host_is_rebuilt_and_the_next_step_protected(sandbox, m):
  with Cluster(*sandbox, m) as c:
    step = 1
    c.save(step)
    with c.manager() as mgr:
      mgr.wait_until_protected(step, timeout_secs=60)
      assert mgr.protected_steps() == [step]
    for lost in itertools.combinations(range(HOSTS), 1):
      step = _lose_restore_and_protect(c, lost, step)


@pytest.mark.slow
def test_every_pair_of_lost_hosts_is_rebuilt_with_parity_2(sandbox):
  with Cluster(*sandbox, 2) as c:
    step = 1
    c.protect(step)
    for lost in itertools.combinations(range(HOSTS), 2):
      step = _lose_restore_and_protect(c, lost, step)


def _lose_restore_and_protect(c: Cluster, lost: tuple[int, ...], step: int) -> int:
  c.lose(lost)
  with c.manager() as mgr:                        # the restarted job
    assert not mgr.is_protected(step)             # lost hosts took their parity along
    assert step in mgr.all_steps() and mgr.latest_step() == step   # counted: parity rebuilds it
    assert_restores(mgr, step, "parity")
    c.save(step + 1)                              # replacements are empty agents
    mgr.wait_until_protected(step + 1, timeout_secs=60)
    assert mgr.is_protected(step + 1)
  return step + 1


def test_the_newest_protected_step_is_kept_while_newer_ones_wait_for_their_parity(sandbox):
  # Host 3 falls behind: steps 2-4 commit on hosts 0-2 only, so their parity never
  # completes. The keep rule (2 snapshots) must not drop step 1, the newest step whose
  # parity every host holds: when host 3 is then lost, step 1 is rebuilt from parity.
  with Cluster(*sandbox, 1) as c:
    c.protect(1)
    for step in (2, 3, 4):
      c.save(step, hosts=[0, 1, 2])
    for h in (0, 1, 2):
      assert c.stores[h].steps() == [1, 4], f"host {h} holds {c.stores[h].steps()}"
    c.lose([3])
    with c.manager() as mgr:
      assert mgr.latest_step() == 1
      assert_restores(mgr, 1, "parity")
      c.save(5)                                   # host 3's replacement takes part again
      mgr.wait_until_protected(5, timeout_secs=60)
    for h in range(HOSTS):                        # each agent hears its group is done
      _wait.until(lambda h=h: c.stores[h].call(_requests.Steps())["protected"] == 5, timeout_secs=30,
                  late=lambda h=h: f"host {h} did not learn that step 5 is protected")
    c.save(6, hosts=[0, 1, 2])                    # 5 is now the step kept: 1 is let go
    for h in (0, 1, 2):
      assert c.stores[h].steps() == [5, 6], f"host {h} holds {c.stores[h].steps()}"


def test_a_rolled_back_step_does_not_hold_up_the_parity_of_the_new_timeline(sandbox):
  # Step 3 commits on hosts 0-2 only (host 3's trainer died before its commit); the
  # relaunched job restores step 1 and saves step 2 on every host, which drops step 3.
  # The parity thread, waiting for host 3's step 3, must move on to step 2 at once,
  # not after its 120 s timeout.
  with Cluster(*sandbox, 1, timeout_secs=120.0) as c:
    c.protect(1)
    c.save(3, hosts=[0, 1, 2])
    c.save(2)
    with c.manager() as mgr:
      mgr.wait_until_protected(2, timeout_secs=20)
      assert 3 not in mgr.all_steps()


def _no_repersist_thread() -> None:
  _wait.until(lambda: not any(t.name == "jaxckpt-repersist" for t in threading.enumerate()),
              timeout_secs=60, late=lambda: "the repersist thread did not end")


def test_a_host_lost_while_a_due_step_is_persisted_is_rebuilt_and_its_part_written(
    sandbox, s3_server):
  # Step 5 is due for storage: every host's agent holds it for its persist, and its
  # parity is done. S3 stops answering, host 3 is lost before its part is written, and
  # S3 comes back: hosts 0-2 write theirs and process 0's commit waits for host 3's.
  # Host 3's relaunched trainer (a new, empty agent) finds that the job waits on its
  # part, rebuilds its piece from parity and writes it: the step commits, bit-exact.
  # Hosts 1 and 2 are done by then (parity off their persists end with their part):
  # only host 0's commit, queued before the manager asked for other persist options,
  # says that the job waits (CI run of stop 36: it was hidden, nothing was rebuilt).
  d = s3_server.url()
  persist = {"directory": d, "interval_steps": 5, "max_to_keep": None, "timeout_secs": 120.0}
  with Cluster(*sandbox, 1, persist=persist) as c:
    with s3_server.paused():
      c.save(5, attempt="run1-s5-0")
      with c.manager() as mgr:
        mgr.wait_until_protected(5, timeout_secs=60)
      c.lose([3])
    _wait.until(lambda: all(5 in s.persist_status().persisted for s in c.stores[1:3]),
                timeout_secs=60, late=lambda: "hosts 1 and 2 did not write their parts")
    assert 5 not in u.all_steps(d)
    c.stores[3].recover_persists(3)               # what a relaunched manager does
    _wait.until(lambda: 5 in u.all_steps(d), timeout_secs=120,
                late=lambda: f"step 5 was not committed: parts missing "
                f"{u.missing_parts(d, 5, 'run1-s5-0', HOSTS)}; host 3's persist errors "
                f"{c.stores[3].persist_errors()}, host 0's persists "
                f"{c.stores[0].persist_status()}")
    want = state(5)
    reader = u.open_step(d, 5)
    for k in want:
      np.testing.assert_array_equal(reader.read(f"['{k}']"), want[k], err_msg=k)
    _no_repersist_thread()          # it unpins its peers' pieces: before they stop
    assert [e for s in c.stores for e in s.persist_errors()] == []


def test_a_lost_process_0_is_rebuilt_and_commits_while_its_peers_hold_the_step(
    sandbox, s3_server):
  # Step 5 is due and protected; host 0 (the committer) is lost before anything is on
  # storage. S3 comes back and hosts 1-3 write their parts: each keeps holding step 5
  # (its persist runs until process 0 commits), so host 0's relaunched trainer finds
  # the attempt pending on its peers, rebuilds its piece from their parity, writes it
  # and commits the step, bit-exact.
  d = s3_server.url()
  attempt = "run1-s5-0"
  persist = {"directory": d, "interval_steps": 5, "max_to_keep": None, "timeout_secs": 120.0,
             "hold_until_committed": True}         # what a manager with parity asks for
  with Cluster(*sandbox, 1, persist=persist) as c:
    with s3_server.paused():
      c.save(5, attempt=attempt)
      with c.manager() as mgr:
        mgr.wait_until_protected(5, timeout_secs=60)
      c.lose([0])
    _wait.until(lambda: u.missing_parts(d, 5, attempt, of=[1, 2, 3]) == [], timeout_secs=60,
                late=lambda: f"parts {u.missing_parts(d, 5, attempt, of=[1, 2, 3])} not written")
    for h in (1, 2, 3):             # written, and still held: nothing committed it yet
      assert c.stores[h].persist_status().attempts == (PendingAttempt(5, attempt, d),), h
    c.stores[0].recover_persists(0)
    _wait.until(lambda: 5 in u.all_steps(d), timeout_secs=60,
                late=lambda: f"step 5 was not committed: parts missing "
                f"{u.missing_parts(d, 5, attempt, HOSTS)}")
    reader = u.open_step(d, 5)
    for k, want in state(5).items():
      np.testing.assert_array_equal(reader.read(f"['{k}']"), want, err_msg=k)
    _wait.until(lambda: all(s.persist_status().pending == () for s in c.stores[1:]),
                timeout_secs=30, late=lambda: "hosts 1-3 still persist step 5 after its commit")
    _no_repersist_thread()          # it unpins its peers' pieces: before they stop
    assert [e for s in c.stores for e in s.persist_errors()] == []


def test_an_agent_that_outlived_its_run_recovers_nothing_it_dropped(sandbox, tmp_path):
  # Host 3's agent dropped step 5 on purpose (the job rolled back to step 4 there) while
  # the others still persist it: a relaunch must not bring the abandoned step back.
  d = str(tmp_path / "ckpt")
  persist = {"directory": d, "interval_steps": 5, "max_to_keep": None, "timeout_secs": 60.0}
  with Cluster(*sandbox, 1, persist=persist) as c:
    c.save(3)
    c.save(5, hosts=[0, 1, 2], attempt="run1-s5-0")
    c.save(4, hosts=[3])
    c.stores[3].recover_persists(3)
    assert not any(t.name == "jaxckpt-repersist" for t in threading.enumerate())
    assert u.missing_parts(d, 5, "run1-s5-0", of=[3]) == [3]


def test_a_relaunch_that_persists_elsewhere_leaves_an_earlier_runs_persist_alone(
    sandbox, tmp_path):
  # Host 0's commit of step 5 to d1 waits for host 3, which was lost before its save.
  # Host 3's relaunched trainer persists to d2: it must not rebuild the earlier run's
  # attempt into d2 (a part there commits nothing, and d1's commit would still wait).
  d1, d2 = str(tmp_path / "d1"), str(tmp_path / "d2")
  persist = {"directory": d1, "interval_steps": 5, "max_to_keep": None, "timeout_secs": 60.0}
  with Cluster(*sandbox, 1, persist=persist) as c:
    c.save(5, hosts=[0, 1, 2], attempt="run1-s5-0")
    _wait.until(lambda: c.stores[0].persist_status().pending == (5,)
                and u.missing_parts(d1, 5, "run1-s5-0", HOSTS) == [3], timeout_secs=60,
                late=lambda: f"hosts 0-2 did not write their parts: {c.stores[0].persist_status()}")
    c.lose([3])
    c.stores[3].close()
    c.stores[3] = AgentStore(jc.AgentOptions(job_name=c.job, run_root=c.root), host=3,
                             max_snapshots=2, limit_bytes=1 << 30, parity=c.config,
                             persist=dict(persist, directory=d2))
    c.stores[3].recover_persists(3)
    assert not any(t.name == "jaxckpt-repersist" for t in threading.enumerate())
    assert c.stores[3].persist_errors() == []
    assert not os.path.exists(d2) or u.all_steps(d2) == []


def test_a_rollback_or_a_delete_fences_a_persist_rebuilt_after_a_lost_agent(sandbox):
  # A persist of step 5 rebuilt by this trainer (after its agent was lost) must not
  # commit once the job rolls back below it (a save of step 4) or deletes it.
  from jaxckpt.agent.trainer._repersist import _Fenced  # pylint: disable=import-outside-toplevel
  with Cluster(*sandbox, 1) as c:
    st = c.stores[0]
    st.repersist.running.update({(5, "r-s5-0"), (3, "r-s3-0")})
    c.save(4, hosts=[0])                          # a new timeline from step 4 on
    with pytest.raises(_Fenced):
      st.repersist.check(5, "r-s5-0")
    st.repersist.check(3, "r-s3-0")                    # (older: goes on)
    st.repersist.fence(lambda s: s == 3)          # (what discard does)
    with pytest.raises(_Fenced):
      st.repersist.check(3, "r-s3-0")


def test_a_replaced_agent_is_announced_to_its_peers_and_parity_goes_on(sandbox):
  # As after a multi-host discover: every agent knows its peers by the addresses the job
  # published. Host 0's agent dies and its trainer starts a new one (ensure_alive): the
  # new one must be announced, or the peers keep pulling from the dead address and no
  # later step is ever protected.
  with Cluster(*sandbox, 1, timeout_secs=60.0) as c:
    infos = {str(h): c.stores[h].info for h in range(HOSTS)}
    for st in c.stores:                           # what AgentStore.discover sets up
      st.job.directory, st.job.peers = list(infos.values()), dict(infos)
      st.call(_requests.Peers(peers=infos))
    c.protect(1)
    dead = c.stores[0].pid
    os.kill(dead, signal.SIGKILL)
    processes.wait_gone(dead, 10, "host 0's killed agent")
    c.stores[0].ensure_alive()
    assert c.stores[0].pid != dead
    assert all(a["pid"] != dead for a in c.stores[0].agents())
    c.save(2)
    with c.manager() as mgr:
      mgr.wait_until_protected(2, timeout_secs=30)


def test_an_agent_that_died_after_its_persist_ended_is_not_reported_as_losing_it(
    sandbox, tmp_path):
  # The trainer last heard "step 5 pending" (its commit's reply); the persist then ended
  # on storage and the agent died. Its replacement must not report step 5 as lost.
  d = str(tmp_path / "ckpt")
  persist = {"directory": d, "interval_steps": 5, "max_to_keep": None, "timeout_secs": 60.0}
  with Cluster(*sandbox, 1, persist=persist) as c:
    c.save(5, attempt="run1-s5-0")
    assert c.stores[1].persist_status(ask=False).pending == (5,)
    _wait.until(lambda: 5 in u.all_steps(d), timeout_secs=60, late=lambda: "step 5 not committed")
    dead = c.stores[1].pid
    os.kill(dead, signal.SIGKILL)
    processes.wait_gone(dead, 10, "host 1's killed agent")
    c.stores[1].ensure_alive()
    _no_repersist_thread()
    assert c.stores[1].persist_errors(ask=False) == []
    assert u.all_steps(d) == [5]


def test_one_more_lost_host_than_parity_names_the_group_and_hosts(sandbox):
  with Cluster(*sandbox, 1) as c:
    with c.manager() as mgr:
      for step in (1, 2):
        c.save(step)
        mgr.wait_until_protected(step, timeout_secs=60)
      assert mgr.protected_steps() == [1, 2]
    c.lose([1, 3])
    with c.manager() as mgr:
      with pytest.raises(errors.UnrecoverableLossError,
                         match=r"step 2: parity=1 rebuilds at most 1 lost host\(s\) per group, "
                         r"but group 0 \(hosts \[0, 1, 2, 3\]\) lost hosts \[1, 3\]"):
        mgr.restore(target=target())
      with pytest.raises(errors.UnrecoverableLossError, match=r"step 1: .* lost hosts \[1, 3\]"):
        mgr.restore(step=1, target=target())


def test_unrecoverable_loss_falls_back_to_storage(sandbox, tmp_path):
  root, job = sandbox
  with Cluster(root, job, 1) as c:
    c.save(1)
    for h in range(HOSTS):      # what the agents' persist thread writes, one step on storage
      with c.stores[h].read(1) as (manifest, buf):
        jc.universal.write_process_shards(str(tmp_path), manifest, buf, attempt="t")
    jc.universal.commit_step(str(tmp_path), 1, process_count=HOSTS, timeout_secs=30, attempt="t")
    c.protect(2)
    c.lose([0, 2])
    with c.manager(str(tmp_path)) as mgr:
      assert_restores(mgr, 1, "storage")


def test_corrupted_parity_block_is_detected(sandbox):
  with Cluster(*sandbox, 1) as c:
    c.protect(1)
    # Host 1 holds the parity of stripe 1, in which host 2 is a data host.
    with open(os.path.join(_paths.agent_dir(c.root, c.job, 1), "parity0.bin"), "r+b") as f:
      block = bytearray(f.read(16))
      f.seek(0)
      f.write(bytes(b ^ 0xFF for b in block))
    c.lose([2])
    with c.manager() as mgr:
      with pytest.raises(errors.CorruptSnapshotError,
                         match=r"stripe 1 of group 0 lost hosts \[2\] .*failed its checksum"):
        mgr.restore(target=target())


def test_a_parity_file_truncated_under_its_agent_is_damage_and_the_agent_lives(sandbox, caplog):
  """Host 1's parity file of step 1 is truncated again and again while its agent encodes
  into it (16-byte sub-blocks: hundreds of pulls from its peers), then once more after:
  the agent writes and reads it through its descriptor, never a map (a touch past the
  file's new end: SIGBUS, the agent and every step it holds lost). It lives; a restore
  that needs that parity (host 2 lost) takes the short read for a missing piece and
  reports the step unrecoverable."""
  with Cluster(*sandbox, 1, sub_block_bytes=16) as c:
    pid = c.stores[1].pid
    path = os.path.join(_paths.agent_dir(c.root, c.job, 1), "parity0.bin")
    c.save(1)
    _wait.until(lambda: os.path.exists(path) or c.parity_status(1)["steps"][0][1] != "pending",
                timeout_secs=60, late=lambda: "host 1's agent never created its parity file")
    truncations = 0

    def encoding() -> bool:
      nonlocal truncations
      os.truncate(path, 0)
      truncations += 1
      try:
        return c.parity_status(1)["steps"][0][1] == "pending"
      except errors.AgentUnavailableError:
        return False
    _wait.until(lambda: not encoding(), timeout_secs=120,
                late=lambda: "host 1's agent did not finish the parity of step 1")
    assert processes.pid_alive(pid), f"host 1's agent died (SIGBUS) after {truncations} truncations"
    assert truncations > 1, "host 1 encoded step 1 before its file was truncated"
    assert c.parity_status(1)["steps"][0][1] == "done", c.parity_status(1)
    with c.manager() as mgr:
      mgr.wait_until_protected(1, timeout_secs=120)      # (its peers' parity, too)
    os.truncate(path, 0)
    c.lose([2])
    with c.manager() as mgr:
      with pytest.raises(errors.UnrecoverableLossError,
                         match=r"stripe \d of group 0 lost hosts \[2\], and hosts \[1\] could "
                         "not serve its survivors' bytes"):
        mgr.restore(target=target())
    assert f"parity file {path} is 0 bytes" in caplog.text and "truncated" in caplog.text
    assert processes.pid_alive(pid), "host 1's agent died (SIGBUS) serving its parity"
    c.save(2)                                   # and protects the next step
    with c.manager() as mgr:
      mgr.wait_until_protected(2, timeout_secs=60)


@pytest.mark.slow
def test_corrupted_parity_block_is_left_out_when_another_can_stand_in(sandbox):
  with Cluster(*sandbox, 2) as c:
    c.protect(1)
    with open(os.path.join(_paths.agent_dir(c.root, c.job, 1), "parity0.bin"), "r+b") as f:
      f.write(b"\xff" * 16)
    c.lose([3])
    with c.manager() as mgr:
      assert_restores(mgr, 1, "parity")


def test_parity_memory_per_host_is_what_the_layout_says(sandbox):
  with Cluster(*sandbox, 1) as c:
    c.protect(1)
    sizes = [c.stores[h].call(_requests.Manifest(step=1))["manifest"] for h in range(HOSTS)]
    sizes = [SnapshotManifest.from_json(js).nbytes for js in sizes]
    want = StripeLayout.build(sizes, c.options).parity_bytes_per_host()
    got = tuple(c.stores[h].call(_requests.Status())["parity_bytes"] for h in range(HOSTS))
    assert got == want
    # m / (g - m) = 1/3 of the group's snapshot bytes, up to the padding of uneven hosts.
    assert sum(sizes) / 3 <= sum(got) <= max(sizes) * 4 / 3 + 64 * 4, (got, sizes)


def test_a_host_that_never_commits_is_named_by_the_timeout(sandbox):
  with Cluster(*sandbox, 1, timeout_secs=1.0) as c:
    c.save(1, hosts=[0, 1, 2])
    deadline = time.monotonic() + 30
    while c.parity_status(0)["steps"][0][1] == "pending" and time.monotonic() < deadline:
      time.sleep(0.05)
    _, state_, _, error, *_ = c.parity_status(0)["steps"][0]
    assert state_ == "failed"
    assert ("SnapshotTimeoutError: parity of step 1 on host 0: hosts [3] of parity group "
            "[0, 1, 2, 3] did not commit step 1 within 1.0 s") in error


def test_a_wait_for_protection_names_the_hosts_that_skipped_the_step(sandbox):
  with Cluster(*sandbox, 1, timeout_secs=60.0) as c:
    c.save(1, hosts=[0, 1, 2])                # host 3 skipped step 1
    with c.manager() as mgr:
      with pytest.raises(errors.SnapshotTimeoutError,
                         match=r"step 1 was not protected within 1.0 s: hosts \[3\] do not hold "
                               r"step 1 \(they skipped it, or lost it\); hosts \[0, 1, 2\] hold "
                               r"no finished parity of it"):
        mgr.wait_until_protected(1, timeout_secs=1.0)


@pytest.mark.parametrize("empty,lost", [((3,), 2), ((3,), 3), ((1, 2, 3), 0), ((1, 2, 3), 2)])
def test_hosts_that_hold_no_bytes_are_protected_and_rebuilt(sandbox, empty, lost):
  with Cluster(*sandbox, 1, empty=empty) as c:
    c.protect(1)
    assert all(c.parity_status(h)["steps"][0][1] == "done" for h in range(HOSTS))
    c.lose([lost])
    with c.manager() as mgr:
      assert mgr.all_steps() == [1]
      assert_restores(mgr, 1, "parity")


def test_parity_on_a_one_host_job_is_refused_at_manager_creation(sandbox):
  root, job = sandbox
  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                              parity=jc.ParityOptions(group_size=4, parity=1))
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"at least 2 hosts, but a job of 1 host\(s\).*parity=None"):
    jc.CheckpointManager(options=opts)


def test_a_group_too_small_for_its_parity_fails_fast_with_the_reason(sandbox):
  # 2 hosts, parity 2: the agents refuse it; wait_until_protected says why at once.
  root, job = sandbox
  config = _parity_config.ParityConfig(4, 2, 60.0).to_obj()
  stores = [AgentStore(jc.AgentOptions(job_name=job, run_root=root), host=h, max_snapshots=2,
                       limit_bytes=1 << 30, parity=config) for h in range(2)]
  try:
    for h, store in enumerate(stores):
      data = np.full(64, h, np.uint8)
      slot = store.reserve(1, 64, timeout_secs=5)
      slot.buffer[:64] = data
      leaf = LeafRecord("['x']", "numpy", (128,), "uint8",
                        (ShardRecord(((64 * h, 64 * h + 64),), 0, 64, checksum(data)),))
      store.commit(slot, SnapshotManifest(step=1, leaves=(leaf,), nbytes=64, process_index=h,
                                          process_count=2))
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root, host_id=0),
                                parity=jc.ParityOptions(group_size=4, parity=2), handle_sigterm=False)
    with jc.CheckpointManager(options=opts, store=stores[0]) as mgr:
      t0 = time.monotonic()
      with pytest.raises(errors.ParityError, match=r"host 0: .*at least 3 hosts"):
        mgr.wait_until_protected(1, timeout_secs=60)
      assert time.monotonic() - t0 < 30
  finally:
    for s in stores:
      s.close()


def test_parity_needs_agents():
  with pytest.raises(ValueError, match="needs agents"):
    jc.CheckpointOptions(parity=jc.ParityOptions(group_size=4, parity=1))


def test_memory_budget_counts_parity_slots(sandbox):
  root, job = sandbox
  config = _parity_config.ParityConfig(4, 1).to_obj()
  store = AgentStore(jc.AgentOptions(job_name=job, run_root=root), host=0, max_snapshots=2,
                     limit_bytes=1 << 20, parity=config)
  try:
    with pytest.raises(errors.HostMemoryBudgetError,
                       match=r"2 snapshots kept \(max_snapshots=2\) \+ 1 being saved: 3 slots x 0\.3 MiB \+ 3 parity slots x 0\.1 MiB = "
                       r"1\.2 MiB exceed host_memory_limit_bytes=1048576"):
      store.reserve(1, 300 << 10, timeout_secs=0)     # 0.9 MiB of slots alone would fit
  finally:
    store.close()
