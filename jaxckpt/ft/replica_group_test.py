"""ReplicaGroup in-process: three groups as threads, each on its own 2 of the 8 CPU devices."""

import dataclasses
import re
import socket
import threading
import time
from datetime import timedelta

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxckpt.ft import (GradientRing, InMemorySnapshotSource, Lighthouse, LighthouseOptions, ReplicaGroup,
                        ReplicaGroupOptions, RingEntry, batch_index, chain_digest, reference_mean)
from jaxckpt.errors import QuorumError
from jaxckpt.testing.fault_injection import EventInjector, InjectedFailure
from tests.support import ft_toy as _toy

OPTS = ReplicaGroupOptions(heartbeat_interval=timedelta(milliseconds=50), ring_size=32, max_groups=4)
LH = LighthouseOptions(min_replicas=1, heartbeat_timeout=timedelta(seconds=0.5),
                       join_timeout=timedelta(seconds=0.3), straggler_timeout=timedelta(seconds=3))


def _train(lh, gid, k, steps, log, *, injector=None, source=None, errors=None, pace=0.0):
  devices = jax.devices()[2 * k:2 * k + 2]
  state = _toy.init_state(_toy.make_mesh(devices))
  jax.block_until_ready(_toy.apply_fn(state, _toy.grad_fn(state, *_toy.batch(0))))  # compile first
  try:
    with ReplicaGroup(lighthouse=lh.address, group_id=gid, timeout=timedelta(seconds=2), options=OPTS, secret=lh.secret,
                      snapshot_source=source, injector=injector) as ft:
      while ft.step < steps:
        state = ft.start_step(state, _toy.apply_fn, grads_like=state["params"])
        index = ft.batch_index()
        time.sleep(pace)
        grads = _toy.grad_fn(state, *_toy.batch(index))
        avg = ft.allreduce(grads)
        if ft.should_commit():
          assert jax.tree.map(lambda a: a.sharding, avg) == jax.tree.map(lambda g: g.sharding, grads)
          state = _toy.apply_fn(state, avg)
          log.append((ft.step, _toy.fingerprint(state), index, ft.metrics))
        elif ft.metrics.caught_up_steps:   # caught up (off the ring): in sync for the next quorum
          log.append((ft.step, _toy.fingerprint(state), index, ft.metrics))
  except InjectedFailure as e:
    if errors is not None:
      errors.append(e)


def _run(lh, specs):
  threads = [threading.Thread(target=_train, args=(lh, *spec[:4]), kwargs=spec[4]) for spec in specs]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads)


def test_three_groups_match_a_plain_mean_bit_for_bit():
  logs = {g: [] for g in ("g0", "g1", "g2")}
  with Lighthouse("127.0.0.1:0", LighthouseOptions(min_replicas=3)) as lh:
    _run(lh, [(g, k, 4, logs[g], {}) for k, g in enumerate(logs)])
  # The same 4 steps without replica groups: mean of the three groups' gradients on the host.
  mesh = _toy.make_mesh(jax.devices()[6:8])
  state = _toy.init_state(mesh)
  for step in range(4):
    # Every step consumes one batch per contributor: batches 3 * step + rank (none skipped).
    grads = [_toy.grad_fn(state, *_toy.batch(batch_index(step, r, 3))) for r in range(3)]
    leaves, treedef = jax.tree.flatten(grads[0])
    mean = reference_mean([[np.asarray(x) for x in jax.tree.leaves(g)] for g in grads])
    avg = jax.tree.unflatten(treedef, [jax.device_put(m, x.sharding) for m, x in zip(mean, leaves)])
    state = _toy.apply_fn(state, avg)
    for g, log in logs.items():
      s, fp, index, metrics = log[step]
      assert (s, fp) == (step + 1, _toy.fingerprint(state)), g
      assert index == batch_index(step, int(g[1]), 3)
      assert metrics.committed and metrics.contributors == ("g0", "g1", "g2") and metrics.quorum_size == 3


def test_failed_group_is_dropped_and_rejoins_by_replaying_the_ring():
  logs = {g: [] for g in ("g0", "g1", "g2")}
  errors = []
  with Lighthouse("127.0.0.1:0", dataclasses.replace(LH, min_replicas=2)) as lh:
    crash = EventInjector().fail_at("g2", 3)
    healthy = [threading.Thread(target=_train, args=(lh, g, k, 60, logs[g]), kwargs={"pace": 0.05})
               for k, g in enumerate(["g0", "g1"])]
    for t in healthy:
      t.start()
    _run(lh, [("g2", 2, 60, logs["g2"], {"injector": crash, "errors": errors, "pace": 0.05})])
    assert len(errors) == 1 and "g2" in str(errors[0])
    assert logs["g2"][-1][0] == 3  # it committed step 3, then crashed starting the next
    time.sleep(1.0)  # g0 and g1 train on without g2
    _run(lh, [("g2", 2, 60, logs["g2"], {"pace": 0.05})])  # restarted from the initial state
    for t in healthy:
      t.join(timeout=60)
  fps = {}
  for g, log in logs.items():
    for s, fp, _, _ in log:
      assert fps.setdefault(s, fp) == fp, (g, s)
  rejoin = [m for s, _, _, m in logs["g2"] if m.caught_up_steps]
  assert rejoin and all(m.snapshot_step is None for m in rejoin)  # from the ring alone
  assert max(m.caught_up_steps for m in rejoin) >= 3
  assert rejoin[-1].committed          # caught up, then joined the next quorum in sync
  assert [s for s, *_ in logs["g2"]][-1] == 60
  g0 = [m for _, _, _, m in logs["g0"]]
  assert any("g2" not in m.contributors for m in g0)  # steps committed while g2 was down


def test_forked_group_without_a_snapshot_to_fetch_sits_out_with_a_reason(caplog):
  log = []
  with Lighthouse("127.0.0.1:0", LH) as lh:
    state = _toy.init_state(_toy.make_mesh(jax.devices()[2:4]))
    t = threading.Thread(target=_train, args=(lh, "g0", 0, 40, log))
    t.start()
    deadline = time.monotonic() + 60
    while not log and time.monotonic() < deadline:  # g0 is training (else g1 would be alone)
      time.sleep(0.01)
    ft = ReplicaGroup(lighthouse=lh.address, group_id="g1", timeout=timedelta(seconds=1), options=OPTS,
                      secret=lh.secret)
    ft.digest = 12345  # a state off g0's lineage: no ring replay can fix it, only a snapshot
    try:
      ft.start_step(state, _toy.apply_fn, grads_like=state["params"])
      ft.allreduce(_toy.grad_fn(state, *_toy.batch(0)))
    finally:
      ft.close()
      t.join(timeout=60)
  assert not ft.should_commit() and ft.step == 0 and ft.metrics.caught_up_steps == 0
  assert "g0 serves no snapshot" in caplog.text


def test_ring_digest_and_mean():
  ring = GradientRing(capacity=3)
  digest = 0
  for s in range(5):
    leaves = (np.full(2, s, np.float32),)
    after = chain_digest(digest, leaves)
    ring.put(RingEntry(step=s, digest_before=digest, digest_after=after, leaves=leaves))
    digest = after
  assert ring.steps() == (2, 3, 4)
  assert ring.covers(3, ring.get(3).digest_before, 5) and not ring.covers(1, 0, 5)
  assert not ring.covers(3, 999, 5)
  a = np.array([1.0, 2.0], ml_dtypes.bfloat16)
  b = np.array([2.0, 2.0078125], ml_dtypes.bfloat16)
  out = reference_mean([[a], [b]])[0]
  assert out.dtype == a.dtype and out.tolist() == [1.5, 2.0]
  with pytest.raises(TypeError, match="floating"):
    reference_mean([[np.arange(2)], [np.arange(2)]])
  with pytest.raises(ValueError, match="max_groups"):
    batch_index(3, 4, 4)
  with pytest.raises(ValueError, match="ring_size"):
    ReplicaGroupOptions(ring_size=0)


def test_dropped_attempts_cut_off_exactly_those_attempts_quorum_request_included():
  # The quorum request of attempt k must be keyed on k, not on k + 1: otherwise a group's last
  # partitioned attempt gets a quorum and then loses its catch-up requests, and the attempt just
  # before the partition gets none.
  state = _toy.init_state(_toy.make_mesh(jax.devices()[:2]))
  committed = []
  with Lighthouse("127.0.0.1:0", LH) as lh, ReplicaGroup(
      lighthouse=lh.address, group_id="g0", timeout=timedelta(seconds=1), options=OPTS, secret=lh.secret,
      injector=EventInjector().drop_messages("g0", [1])) as ft:
    for _ in range(3):
      state = ft.start_step(state, _toy.apply_fn, grads_like=state["params"])
      ft.allreduce(_toy.grad_fn(state, *_toy.batch(ft.batch_index())))
      committed.append((ft.metrics.attempt, ft.metrics.quorum_id is not None, ft.should_commit()))
  assert committed == [(0, True, True), (1, False, False), (2, True, True)]


def test_leader_closing_right_after_a_step_still_delivers_the_result():
  # 32 MiB gradients take a while on the wire: with linger 0 the leader's close dropped the queued result.
  grads = {"g0": np.full(8 << 20, 1.0, np.float32), "g1": np.full(8 << 20, 3.0, np.float32)}
  out, committed = {}, {}

  def one_step(lh, gid):
    with ReplicaGroup(lighthouse=lh.address, group_id=gid, timeout=timedelta(seconds=20), options=OPTS,
                      secret=lh.secret) as ft:
      ft.start_step()
      out[gid] = ft.allreduce(grads[gid])
      committed[gid] = ft.should_commit()
    # close() ran right here: the leader (g0) did not wait for g1 to receive anything.

  with Lighthouse("127.0.0.1:0", LighthouseOptions(min_replicas=2)) as lh:
    threads = [threading.Thread(target=one_step, args=(lh, g)) for g in grads]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
  assert committed == {"g0": True, "g1": True}
  for g in grads:
    np.testing.assert_array_equal(out[g], np.full(8 << 20, 2.0, np.float32))


def _steps(lh, gid, grads_per_step, out):
  with ReplicaGroup(lighthouse=lh.address, group_id=gid, timeout=timedelta(seconds=10), options=OPTS,
                    secret=lh.secret) as ft:
    for grads in grads_per_step:
      ft.start_step()
      avg = ft.allreduce(grads)
      out.append((ft.should_commit(), ft.metrics, avg, ft.step))


def _together(lh, plans):
  out = {g: [] for g in plans}
  threads = [threading.Thread(target=_steps, args=(lh, g, plans[g], out[g])) for g in plans]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not any(t.is_alive() for t in threads)
  return out


F32 = np.float32


@pytest.mark.parametrize("mine, theirs, what", [
    ({"a": np.ones(8, F32)}, {"a": np.ones(4, F32), "b": np.ones(4, F32)}, "tree structure ("),
    ({"a": np.ones(8, F32)}, {"a": np.ones((2, 4), F32)}, "shapes"),
    ({"a": np.ones(8, F32)}, {"a": np.ones(8, ml_dtypes.bfloat16)}, "dtypes"),
    ({"a": np.ones(8, F32)}, {"b": np.ones(8, F32)}, "tree structure"),
])
def test_groups_averaging_differently_laid_out_gradients_commit_nothing_and_name_each_other(
    mine, theirs, what, caplog):
  # Same total size, so the flat ring would have averaged them.
  with Lighthouse("127.0.0.1:0", dataclasses.replace(LH, min_replicas=2)) as lh:
    out = _together(lh, {"g0": [mine, mine], "g1": [theirs, mine]})
  for me, other, grads in (("g0", "g1", theirs), ("g1", "g0", mine)):
    committed, metrics, avg, step = out[me][0]
    assert not committed and step == 0, (me, metrics)
    assert metrics.failure is not None and f"group {other} averages" in metrics.failure, metrics.failure
    assert f"they differ in {what}" in metrics.failure, metrics.failure
    assert f"group {me} does not commit step 0" in caplog.text
  # The next attempt, with the same layout everywhere, commits the plain mean (the abort
  # pieces of the failed attempt are skipped).
  for g in ("g0", "g1"):
    committed, metrics, avg, step = out[g][1]
    assert committed and step == 1 and metrics.failure is None
    np.testing.assert_array_equal(avg["a"], np.ones(8, F32))


def test_one_odd_group_fails_the_whole_ring_at_once_with_its_name():
  same, odd = {"w": np.full(6, 2.0, F32)}, {"w": np.full(6, 2.0, ml_dtypes.bfloat16)}
  with Lighthouse("127.0.0.1:0", dataclasses.replace(LH, min_replicas=3)) as lh:
    out = _together(lh, {"g0": [same], "g1": [same], "g2": [odd]})
  failures = {g: out[g][0][1].failure for g in out}
  assert not any(out[g][0][0] for g in out), failures
  # g0 and g2 each see the other's pieces; g1 (left neighbour g0, same layout) learns it from
  # g0's abort, not by waiting out its timeout, and names the odd group all the same. g2 may
  # hear g0's abort (relayed by the lighthouse) before g1's piece reaches it: either way its
  # failure names its own odd layout against the others'.
  # (g0 may hear the lighthouse's relay of g2's own failure before it reads g2's piece.)
  assert re.search(r"group g2 averages \{'w': bfloat16\[6\]\} where group g0 averages \{'w': float32\[6\]\}|"
                   r"where group g2 averages \{'w': bfloat16\[6\]\}", failures["g0"]), failures["g0"]
  assert re.search(r"group g1 averages \{'w': float32\[6\]\} where group g2 averages \{'w': "
                   r"bfloat16\[6\]\}|group g2 averages \{'w': bfloat16\[6\]\} where group g0 "
                   r"averages \{'w': float32\[6\]\}", failures["g2"]), failures["g2"]
  assert "group g2 averages {'w': bfloat16[6]}" in failures["g1"], failures["g1"]
  assert all(out[g][0][1].allreduce_secs < 5 for g in out), {g: out[g][0][1].allreduce_secs for g in out}


def test_lighthouse_timeout_is_the_time_without_a_quorum_and_its_message_says_so():
  # It used to fire after lighthouse_timeout plus two to four waits of 2 x timeout, and to
  # report the time since the first of those waits ended.
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    nobody = f"127.0.0.1:{s.getsockname()[1]}"
  opts = dataclasses.replace(OPTS, lighthouse_timeout=timedelta(seconds=1))
  with ReplicaGroup(lighthouse=nobody, group_id="g0", timeout=timedelta(seconds=3), options=opts,
                    secret="s") as ft:
    start = time.monotonic()
    with pytest.raises(QuorumError) as e:
      for _ in range(5):
        ft.start_step()
        ft.allreduce({"a": np.ones(2, F32)})
    took = time.monotonic() - start
  assert 1.0 <= took < 2.5, took
  reported = float(re.search(r"for (\d+\.\d)s", str(e.value)).group(1))
  assert abs(reported - took) < 0.5 and f"at {nobody}" in str(e.value), (took, str(e.value))


def test_a_failure_reaches_every_member_even_past_a_neighbour_that_is_not_reading():
  # g0 fails (the odd layout of its left neighbour g3); its right neighbour g1 is stuck in its
  # compute, so the ring cannot pass g0's abort on. The lighthouse relays it: g2 and g3 fail
  # at once instead of waiting for g1 (or their 30 s timeout), and g1 at once when it resumes.
  same, odd = {"w": np.full(6, 2.0, F32)}, {"w": np.full(6, 2.0, ml_dtypes.bfloat16)}
  out: dict = {}

  def member(lh, gid, grads, stall):
    with ReplicaGroup(lighthouse=lh.address, group_id=gid, timeout=timedelta(seconds=30), options=OPTS,
                      secret=lh.secret) as ft:
      ft.start_step()
      time.sleep(stall)
      t0 = time.monotonic()
      ft.allreduce(grads)
      out[gid] = (ft.should_commit(), ft.metrics.failure, time.monotonic() - t0)

  with Lighthouse("127.0.0.1:0", dataclasses.replace(LH, min_replicas=4)) as lh:
    plans = {"g0": (same, 0.0), "g1": (same, 4.0), "g2": (same, 0.0), "g3": (odd, 0.0)}
    threads = [threading.Thread(target=member, args=(lh, g, *plans[g])) for g in plans]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=60)
  assert set(out) == set(plans) and not any(committed for committed, _, _ in out.values()), out
  for g in ("g1", "g2", "g3"):
    failure, secs = out[g][1], out[g][2]
    assert secs < 2.0, (g, secs, failure)
    assert "group g3 averages {'w': bfloat16[6]}" in failure, (g, failure)


def test_a_group_held_by_min_replicas_says_so_at_once_and_its_quorum_error_names_it(caplog):
  # After a group died under `jaxckpt lighthouse --min-replicas 2`, the other logged for
  # lighthouse_timeout (5 min) that it "waits for the control plane ... because it has no
  # quorum" while the lighthouse was up, then raised "is the lighthouse running?".
  opts = dataclasses.replace(OPTS, lighthouse_timeout=timedelta(seconds=3))
  lh_opts = dataclasses.replace(LH, min_replicas=2)
  one = threading.Barrier(2, timeout=60)
  errors, left_at = [], []

  def group(gid, stay):
    with ReplicaGroup(lighthouse=lh.address, group_id=gid, timeout=timedelta(seconds=1), options=opts,
                      secret=lh.secret) as ft:
      while ft.step < 1:
        ft.start_step()
        ft.allreduce({"a": np.ones(2, F32)})
        ft.should_commit()
      one.wait()
      if not stay:
        left_at.append(time.monotonic())
        return
      try:
        while True:
          ft.start_step()
          ft.allreduce({"a": np.ones(2, F32)})
          ft.should_commit()
      except QuorumError as e:
        errors.append((time.monotonic(), e))

  with Lighthouse("127.0.0.1:0", lh_opts) as lh, caplog.at_level("INFO", logger="jaxckpt.ft"):
    threads = [threading.Thread(target=group, args=(g, g == "g0")) for g in ("g0", "g1")]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
  (failed_at, e), = errors
  want = f"the lighthouse at {lh.address} has 1 of the 2 groups a quorum needs (min_replicas=2): g0 asks"
  assert want in str(e) and "--min-replicas 1" in str(e), str(e)
  said = [(r.created, r.getMessage()) for r in caplog.records
          if r.levelname == "WARNING" and "group g0 waits for a quorum because" in r.getMessage()]
  assert said and want in said[0][1], [r.getMessage() for r in caplog.records][-10:]
  assert not [r.getMessage() for r in caplog.records if "group g0 waits for the control plane" in r.getMessage()]
  # Said within about a step of the other group's leaving, not at the QuorumError.
  assert said[0][0] - (time.time() - (time.monotonic() - left_at[0])) < 2.5, said[0]
