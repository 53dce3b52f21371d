"""The lighthouse against real clients on loopback (port 0)."""

import dataclasses
import threading
import time
from datetime import timedelta

import pytest
import zmq

from jaxckpt.ft.lighthouse import Heartbeat, Lighthouse, LighthouseClient, LighthouseOptions, Member

FAST = LighthouseOptions(min_replicas=1, heartbeat_timeout=timedelta(seconds=0.5),
                         join_timeout=timedelta(seconds=0.2), straggler_timeout=timedelta(seconds=2))


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
  """The launcher's secret, as every process of a job gets it."""
  monkeypatch.setenv("JAXCKPT_JOB_SECRET", "lighthouse-test-secret")
  return "lighthouse-test-secret"


def _member(g: str, step: int = 0) -> Member:
  return Member(group_id=g, address=f"127.0.0.1:{1000 + int(g[1:])}", step=step, digest=step)


def _ask_all(address: str, members: list[Member], timeout: float = 3.0) -> dict:
  ctx, out = zmq.Context(), {}
  def ask(m):
    client = LighthouseClient(ctx, address, resend_secs=0.2)
    out[m.group_id] = client.quorum(m, timedelta(seconds=timeout))
    client.close()
  threads = [threading.Thread(target=ask, args=(m,)) for m in members]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  ctx.term()
  return out


def test_one_quorum_for_all_pending_groups_sorted_by_id():
  with Lighthouse("127.0.0.1:0", dataclasses.replace(FAST, min_replicas=3)) as lh:
    got = _ask_all(lh.address, [_member("g2", 5), _member("g0", 4), _member("g1", 5)])
  ids = {q.quorum_id for q in got.values()}
  assert len(ids) == 1
  q = got["g0"]
  assert [m.group_id for m in q.members] == ["g0", "g1", "g2"]
  assert q.max_step == 5 and q.leader.group_id == "g1" and q.rank("g2") == 2
  assert [m.group_id for m in q.healthy] == ["g1", "g2"]


def test_min_replicas_is_enforced_and_times_out_cleanly():
  opts = LighthouseOptions(min_replicas=2, heartbeat_timeout=timedelta(seconds=0.5),
                           join_timeout=timedelta(seconds=0.1))
  with Lighthouse("127.0.0.1:0", opts) as lh:
    t0 = time.monotonic()
    got = _ask_all(lh.address, [_member("g0")], timeout=0.6)
    assert got["g0"] is None and time.monotonic() - t0 < 2
    assert lh.status()["pending"] == ["g0"]


def _beats(ctx, address, groups):
  return [Heartbeat(ctx, address, g, timedelta(milliseconds=50)) for g in groups]


def test_dead_group_is_not_waited_for_and_reported_dropped():
  ctx = zmq.Context()
  with Lighthouse("127.0.0.1:0", FAST) as lh:
    beats = _beats(ctx, lh.address, ["g0", "g1"])
    time.sleep(0.3)
    first = _ask_all(lh.address, [_member("g0"), _member("g1")])
    assert [m.group_id for m in first["g0"].members] == ["g0", "g1"]
    beats[1].stop()  # g1 dies: no heartbeat, no request
    t0 = time.monotonic()
    second = _ask_all(lh.address, [_member("g0", 1)])
    waited = time.monotonic() - t0
    beats[0].stop()
  ctx.term()
  assert [m.group_id for m in second["g0"].members] == ["g0"]
  assert second["g0"].dropped == ("g1",)
  assert waited < FAST.heartbeat_timeout.total_seconds() + 1.0


def test_heartbeating_straggler_is_waited_for_then_dropped():
  ctx = zmq.Context()
  with Lighthouse("127.0.0.1:0", FAST) as lh:
    beats = _beats(ctx, lh.address, ["g0", "g1"])
    try:
      time.sleep(0.3)
      first = _ask_all(lh.address, [_member("g0"), _member("g1")])
      assert len(first["g0"].members) == 2
      t0 = time.monotonic()  # g1 keeps beating but never asks again (stuck)
      got = _ask_all(lh.address, [_member("g0", 1)], timeout=5)
      waited = time.monotonic() - t0
    finally:
      for b in beats:
        b.stop()
  ctx.term()
  assert [m.group_id for m in got["g0"].members] == ["g0"]
  assert FAST.straggler_timeout.total_seconds() - 0.3 < waited < FAST.straggler_timeout.total_seconds() + 1.5


def test_restart_on_the_same_port_serves_waiting_clients():
  lh = Lighthouse("127.0.0.1:0", FAST).start()
  address = lh.address
  lh.stop()
  result = {}
  t = threading.Thread(target=lambda: result.update(_ask_all(address, [_member("g0")], timeout=4)))
  t.start()
  time.sleep(0.5)
  with Lighthouse(address, FAST):
    t.join()
  assert result["g0"] is not None and result["g0"].members[0].group_id == "g0"


def test_options_are_validated():
  with pytest.raises(ValueError, match="min_replicas"):
    LighthouseOptions(min_replicas=0)
  with pytest.raises(ValueError, match="join_timeout"):
    LighthouseOptions(join_timeout=timedelta(0))
  with pytest.raises(ValueError, match="HOST:PORT"):
    Lighthouse("nohost")


def test_a_member_claiming_steps_ahead_of_the_job_cannot_stall_it():
  opts = dataclasses.replace(FAST, min_replicas=2)
  with Lighthouse("127.0.0.1:0", opts) as lh:
    for step in range(3):                 # two honest groups advance a step per quorum
      got = _ask_all(lh.address, [_member("g1", step), _member("g2", step)])
      assert got["g1"] is not None and got["g1"].max_step == step
    # A liar one and many steps ahead of the job (at 2, so at most 3 is admissible):
    ahead = _ask_all(lh.address, [_member("g0", 4)], timeout=1.0)
    assert ahead["g0"] is None and "g0" not in lh.status()["pending"]
    far = _ask_all(lh.address, [_member("g0", 10**9)], timeout=1.0)
    assert far["g0"] is None
    got = _ask_all(lh.address, [_member("g1", 3), _member("g2", 3)])
    q = got["g1"]
    assert q is not None and [m.group_id for m in q.members] == ["g1", "g2"] and q.max_step == 3


def test_one_member_with_a_wrong_digest_cannot_make_the_others_look_diverged():
  with Lighthouse("127.0.0.1:0", dataclasses.replace(FAST, min_replicas=3)) as lh:
    liar = Member(group_id="g0", address="127.0.0.1:1000", step=5, digest=666)
    got = _ask_all(lh.address, [liar, _member("g1", 5), _member("g2", 5)])
  q = got["g1"]
  assert [m.group_id for m in q.healthy] == ["g1", "g2"] and q.leader.group_id == "g1"


def test_a_member_catching_up_is_not_waited_for_until_it_says_it_is_ready():
  opts = LighthouseOptions(min_replicas=2, heartbeat_timeout=timedelta(seconds=30),
                           join_timeout=timedelta(seconds=3), straggler_timeout=timedelta(seconds=30))
  with Lighthouse("127.0.0.1:0", opts) as lh:
    ctx = zmq.Context()
    beats = [Heartbeat(ctx, lh.address, g, timedelta(milliseconds=50)) for g in ("g0", "g1", "g2")]
    time.sleep(opts.join_timeout.total_seconds())          # the grace period after a start
    first = _ask_all(lh.address, [_member("g0", 5), _member("g1", 5), _member("g2", 2)])
    q1 = first["g0"]
    assert [m.group_id for m in q1.healthy] == ["g0", "g1"]   # g2 is behind: it catches up
    t0 = time.monotonic()
    second = _ask_all(lh.address, [_member("g0", 6), _member("g1", 6)])
    assert time.monotonic() - t0 < 1.5, "the lighthouse waited for a member that is catching up"
    assert [m.group_id for m in second["g0"].healthy] == ["g0", "g1"]
    client = LighthouseClient(ctx, lh.address)
    client.ready("g2")                                      # caught up but for the step in flight
    client.close()
    got = {}
    t = threading.Thread(target=lambda: got.update(_ask_all(lh.address, [_member("g0", 7),
                                                                          _member("g1", 7)])))
    t.start()
    time.sleep(0.5)
    assert not got, "a quorum formed without the member that said it is ready"
    got.update(_ask_all(lh.address, [_member("g2", 7)]))
    t.join()
    assert [m.group_id for m in got["g0"].healthy] == ["g0", "g1", "g2"]
    for b in beats:
      b.stop()
    ctx.term()
