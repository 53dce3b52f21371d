"""The lighthouse against real clients on loopback (port 0)."""

import dataclasses
import statistics
import threading
import time
from datetime import timedelta

import hypothesis
import hypothesis.strategies as st
import pytest
import zmq

from jaxckpt import errors
from jaxckpt.ft import _requests
from tests.support.ft_simulate import SimulatedGroups
from jaxckpt.ft.lighthouse import Heartbeat, Lighthouse, LighthouseClient, LighthouseOptions, Member
from jaxckpt.net import _wire

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
  assert list(q.members) == ["g0", "g1", "g2"]
  assert q.max_step == 5 and q.leader == "g1" and q.rank("g2") == 2
  assert list(q.healthy) == ["g1", "g2"]


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
    assert list(first["g0"].members) == ["g0", "g1"]
    beats[1].stop()  # g1 dies: no heartbeat, no request
    t0 = time.monotonic()
    second = _ask_all(lh.address, [_member("g0", 1)])
    waited = time.monotonic() - t0
    beats[0].stop()
  ctx.term()
  assert list(second["g0"].members) == ["g0"]
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
  assert list(got["g0"].members) == ["g0"]
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
  assert result["g0"] is not None and result["g0"].members[0] == "g0"


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
    assert q is not None and list(q.members) == ["g1", "g2"] and q.max_step == 3


def test_one_member_with_a_wrong_digest_cannot_make_the_others_look_diverged():
  with Lighthouse("127.0.0.1:0", dataclasses.replace(FAST, min_replicas=3)) as lh:
    liar = Member(group_id="g0", address="127.0.0.1:1000", step=5, digest=666)
    got = _ask_all(lh.address, [liar, _member("g1", 5), _member("g2", 5)])
  q = got["g1"]
  assert list(q.healthy) == ["g1", "g2"] and q.leader == "g1"


def test_a_member_catching_up_is_not_waited_for_until_it_says_it_is_ready():
  opts = LighthouseOptions(min_replicas=2, heartbeat_timeout=timedelta(seconds=30),
                           join_timeout=timedelta(seconds=3), straggler_timeout=timedelta(seconds=30))
  with Lighthouse("127.0.0.1:0", opts) as lh:
    ctx = zmq.Context()
    beats = [Heartbeat(ctx, lh.address, g, timedelta(milliseconds=50)) for g in ("g0", "g1", "g2")]
    time.sleep(opts.join_timeout.total_seconds())          # the grace period after a start
    first = _ask_all(lh.address, [_member("g0", 5), _member("g1", 5), _member("g2", 2)])
    q1 = first["g0"]
    assert list(q1.healthy) == ["g0", "g1"]   # g2 is behind: it catches up
    t0 = time.monotonic()
    second = _ask_all(lh.address, [_member("g0", 6), _member("g1", 6)])
    assert time.monotonic() - t0 < 1.5, "the lighthouse waited for a member that is catching up"
    assert list(second["g0"].healthy) == ["g0", "g1"]
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
    assert list(got["g0"].healthy) == ["g0", "g1", "g2"]
    for b in beats:
      b.stop()
    ctx.term()


# ---- malformed sealed messages ------------------------------------------------------------------

MEMBER = ["g9", "127.0.0.1:1", 0, 0, "127.0.0.1:2"]
VALID = {"heartbeat": {"op": "heartbeat", "group": "g9"},
         "ready": {"op": "ready", "group": "g9"},
         "quorum": {"op": "quorum", "request_id": 1, "member": MEMBER, "view": ""},
         "status": {"op": "status", "request_id": 1}}
WRONG = [None, True, -1, 1.5, "", "x" * 300, "1", b"\x00", [], [1, 2], {}, {"a": 1}, 2**63, 2**64 - 1]
NAME_OK = lambda v: isinstance(v, str) and 1 <= len(v) <= 256
INT_OK = lambda v: type(v) is int and 0 <= v < 2**63   # pylint: disable=unidiomatic-typecheck
FIELD_OK = {"group": NAME_OK, "request_id": INT_OK, "view": lambda v: isinstance(v, str) and len(v) <= 64,
            "member": lambda v: False}
ELEMENT_OK = [NAME_OK, NAME_OK, INT_OK, lambda v: type(v) is int and 0 <= v < 2**64,  # pylint: disable=unidiomatic-typecheck
              lambda v: isinstance(v, str) and len(v) <= 256]


def malformed_headers():
  """Every op with each field missing or of a wrong type (and the member's elements too)."""
  out = [{}, {"op": None}, {"op": 3}, {"op": "nope"}, {"op": ["quorum"]}, {"op": "quorum"}]
  for op, valid in VALID.items():
    for field in valid:
      if field == "op":
        continue
      if not (op == "status" and field == "request_id") and not field == "view":
        out.append({k: v for k, v in valid.items() if k != field})           # missing
      for value in WRONG:
        if not FIELD_OK[field](value) and not (op == "status" and field == "request_id" and value is None):
          out.append(dict(valid, **{field: value}))
  for i, ok in enumerate(ELEMENT_OK):
    for value in WRONG:
      if not ok(value):
        out.append(dict(VALID["quorum"], member=MEMBER[:i] + [value] + MEMBER[i + 1:]))
  out += [dict(VALID["quorum"], member=MEMBER[:3]), dict(VALID["quorum"], member=MEMBER + ["x"]),
          dict(VALID["quorum"], member={"group_id": "g9"}), dict(VALID["quorum"], member="g9")]
  return out


def _dealer(ctx, address):
  sock = ctx.socket(zmq.DEALER)
  sock.setsockopt(zmq.LINGER, 0)
  sock.connect(f"tcp://{address}")
  return sock


def test_every_malformed_sealed_message_is_refused_with_the_reason_and_the_lighthouse_serves_on(job_secret):
  headers = malformed_headers()
  assert len(headers) > 150
  key = job_secret.encode()
  with Lighthouse("127.0.0.1:0", dataclasses.replace(FAST, min_replicas=2)) as lh:
    ctx = zmq.Context()
    sock = _dealer(ctx, lh.address)
    try:
      unanswered = []
      for header in headers:
        sock.send_multipart(_wire.seal(key, header))
        if not sock.poll(5000):
          unanswered.append(header)
          continue
        reply, _ = _wire.open_(key, sock.recv_multipart())
        assert reply["op"] == "refused" and "refused a message" in reply["error"], (header, reply)
        assert reply["request_id"] == (header.get("request_id") if INT_OK(header.get("request_id")) else None)
      assert not unanswered, unanswered[:3]
      assert lh.malformed == len(headers) and lh.refused == 0
      sock.send_multipart(_wire.seal(key, {"op": "status", "request_id": 7}))
      assert sock.poll(5000)
      status, _ = _wire.open_(key, sock.recv_multipart())
      assert status["op"] == "status" and status["request_id"] == 7 and status["malformed"] == len(headers)
      assert status["pending"] == [] and status["live"] == []        # nothing malformed was applied
    finally:
      sock.close()
      ctx.term()
    got = _ask_all(lh.address, [_member("g0"), _member("g1")])     # honest groups still form quorums
    assert list(got["g0"].members) == ["g0", "g1"] and got["g0"].quorum_id == got["g1"].quorum_id
    assert lh.status()["quorums_formed"] == 1


def test_a_refusal_names_the_field_the_expected_type_and_what_came(job_secret):
  key = job_secret.encode()
  with Lighthouse("127.0.0.1:0", FAST) as lh:
    ctx = zmq.Context()
    sock = _dealer(ctx, lh.address)
    try:
      sock.send_multipart(_wire.seal(key, dict(VALID["quorum"], member=MEMBER[:2] + ["3"] + MEMBER[3:])))
      assert sock.poll(5000)
      reply, _ = _wire.open_(key, sock.recv_multipart())
    finally:
      sock.close()
      ctx.term()
  assert "'quorum' needs member.step (Expected `int`, got `str`), got '3'" in reply["error"]
  assert reply["request_id"] == 1


_SCALARS = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
            | st.text(max_size=6) | st.binary(max_size=6))
_VALUES = _SCALARS | st.lists(_SCALARS, max_size=6) | st.dictionaries(st.text(max_size=4), _SCALARS, max_size=3)
_FIELDS = st.sampled_from(["op", "group", "request_id", "member", "view", "quorum", "step"])


def test_random_sealed_headers_never_stop_the_lighthouse(job_secret):
  key = job_secret.encode()
  with Lighthouse("127.0.0.1:0", dataclasses.replace(FAST, min_replicas=2)) as lh:
    ctx = zmq.Context()
    sock = _dealer(ctx, lh.address)

    @hypothesis.settings(max_examples=150, deadline=None, database=None)
    @hypothesis.given(op=st.sampled_from(list(VALID)) | _SCALARS,
                      fields=st.dictionaries(_FIELDS, _VALUES | st.lists(_SCALARS, min_size=4, max_size=5),
                                             max_size=4))
    def send_then_ask_status(op, fields):
      header = dict(fields, op=op)
      try:
        request = _requests.parse(header)
      except errors.InvalidArgumentError as e:
        assert "needs" in str(e) or "unknown op" in str(e)
      else:   # (a valid quorum request would join the quorum asked for below)
        hypothesis.assume(not isinstance(request, _requests.QuorumRequest))
      sock.send_multipart(_wire.seal(key, header))
      sock.send_multipart(_wire.seal(key, {"op": "status", "request_id": 424242}))
      while True:
        assert sock.poll(5000), f"no status answer after {header!r}"
        reply, _ = _wire.open_(key, sock.recv_multipart())
        assert reply["op"] in ("refused", "status"), reply
        if reply["op"] == "status" and reply["request_id"] == 424242:
          break

    try:
      send_then_ask_status()       # pylint: disable=no-value-for-parameter
    finally:
      sock.close()
      ctx.term()
    got = _ask_all(lh.address, [_member("g0"), _member("g1")])
    assert {"g0", "g1"} <= set(got["g0"].members) and got["g0"].quorum_id == got["g1"].quorum_id


def test_a_resend_of_an_answered_ask_gets_the_same_answer_and_is_not_a_new_request(job_secret):
  # A client resends its request every resend_secs until answered: a resend that crosses the
  # answer must not become a pending request that the next quorum counts on (that member
  # would never hear of that quorum, and its ring partners would wait out their timeout).
  key = job_secret.encode()
  with Lighthouse("127.0.0.1:0", FAST) as lh:
    ctx = zmq.Context()
    sock = _dealer(ctx, lh.address)
    try:
      answers = []
      for rid in (41, 42):
        sock.send_multipart(_wire.seal(key, dict(VALID["quorum"], request_id=rid, ask=41)))
        assert sock.poll(5000)
        answers.append(_wire.open_(key, sock.recv_multipart())[0])
      assert [a["request_id"] for a in answers] == [41, 42]
      assert answers[0]["quorum"]["id"] == answers[1]["quorum"]["id"]
      assert lh.status()["pending"] == [] and lh.status()["quorums_formed"] == 1
    finally:
      sock.close()
      ctx.term()


# ---- scale --------------------------------------------------------------------------------------------


def _rounds(groups: int, steady: int = 5):
  opts = LighthouseOptions(min_replicas=groups, join_timeout=timedelta(milliseconds=10),
                           heartbeat_timeout=timedelta(seconds=120), straggler_timeout=timedelta(seconds=120))
  with Lighthouse("127.0.0.1:0", opts) as lh, SimulatedGroups(lh, groups) as sim:
    cold = sim.round()                      # every member gets the whole view once
    return cold, [sim.round() for _ in range(steady)]


def test_quorum_cost_per_group_stays_flat_as_groups_grow():
  small, large = 64, 1024
  runs = {g: [_rounds(g, steady=5 if i == 0 else 0) for i in range(3)] for g in (small, large)}
  steady_s, steady_l = runs[small][0][1], runs[large][0][1]
  # Bytes: a member's steady-state reply does not grow with the job (it used to list every member).
  per_member = lambda rs, g: statistics.median(r.reply_bytes_total for r in rs) / g
  assert per_member(steady_l, large) <= 1.1 * per_member(steady_s, small), (steady_s[0], steady_l[0])
  assert max(r.reply_bytes_max for r in steady_l) < 512
  # The lighthouse's CPU time per group (its serving thread's: what other processes on a busy
  # machine do not inflate), 16x the groups: a quadratic cost would be ~16x per group (a reply
  # listing every member measured ~20x in wall time); linear ~1x.
  per_group = lambda rs, g, f: statistics.median(getattr(r, f) for r in rs) / g
  ratio = per_group(steady_l, large, "lighthouse_cpu_secs") / per_group(steady_s, small, "lighthouse_cpu_secs")
  assert ratio < 4, (ratio, [r.lighthouse_cpu_secs for r in steady_s], [r.lighthouse_cpu_secs for r in steady_l])
  # The first quorum carries the whole membership to each member, packed once: the
  # lighthouse's CPU per group stays about flat there too (its bytes do grow with G).
  cold = {g: [cold for cold, _ in runs[g]] for g in runs}
  cold_ratio = (per_group(cold[large], large, "lighthouse_cpu_secs")
                / per_group(cold[small], small, "lighthouse_cpu_secs"))
  assert cold_ratio < 6, (cold_ratio, cold)


@pytest.mark.parametrize("same_private_port", [False, True])
def test_a_client_on_the_private_port_follows_a_restarted_lighthouse(same_private_port):
  ctx = zmq.Context()
  lh = Lighthouse("127.0.0.1:0", FAST).start()
  client = None
  try:
    client = LighthouseClient(ctx, lh.address, resend_secs=0.2)
    assert client.quorum(_member("g0", 0), timedelta(seconds=5)) is not None
    assert client.private_port == lh.private_port is not None        # it moved to the private port
    address, private = lh.address, lh.private_port
    lh.stop()
    lh = Lighthouse(address, FAST, private_port=private if same_private_port else 0).start()
    got = client.quorum(_member("g0", 1), timedelta(seconds=10))
    assert got is not None and got.members == ("g0",)
    assert client.private_port == lh.private_port
  finally:
    if client is not None:
      client.close()
    lh.stop()
    ctx.term()


# ---- an attempt ends for every member at once -----------------------------------------------------

SLOW_JOIN = LighthouseOptions(min_replicas=1, heartbeat_timeout=timedelta(seconds=0.5),
                              join_timeout=timedelta(seconds=3), straggler_timeout=timedelta(seconds=60))


class _Beats:
  """Heartbeats of some groups, each one's aborts from the lighthouse in a queue; ``pause(g)`` stops
  a group's heartbeats (as SIGSTOP does) and ``resume(g)`` starts them again."""

  def __init__(self, address: str, groups: list[str]):
    import queue  # pylint: disable=import-outside-toplevel
    self.ctx = zmq.Context()
    self.aborts = {g: queue.Queue() for g in groups}
    self.paused: set[str] = set()
    self.beats = [Heartbeat(self.ctx, address, g, timedelta(milliseconds=50), drop=lambda g=g: g in self.paused,
                            on_abort=lambda q, why, blame, g=g: self.aborts[g].put((q, why, blame)))
                  for g in groups]

  def next_abort(self, g: str, secs: float = 10.0):
    return self.aborts[g].get(timeout=secs)

  def close(self):
    for b in self.beats:
      b.stop()
    self.ctx.term()


def _live(lh, groups):
  deadline = time.monotonic() + 10
  while not set(groups) <= set(lh.status()["live"]):
    assert time.monotonic() < deadline, f"{groups} not live: {lh.status()}"
    time.sleep(0.01)


def test_a_member_that_stops_heartbeating_ends_the_attempt_for_the_others_and_holds_no_quorum():
  with Lighthouse("127.0.0.1:0", SLOW_JOIN) as lh:
    beats = _Beats(lh.address, ["g0", "g1", "g2"])
    try:
      _live(lh, ["g0", "g1", "g2"])
      time.sleep(SLOW_JOIN.join_timeout.total_seconds() - 0.5)      # (the grace after a start)
      q1 = _ask_all(lh.address, [_member("g0"), _member("g1"), _member("g2")], timeout=10)["g0"]
      beats.paused.add("g2")                                     # stopped mid-attempt
      stopped = time.monotonic()
      for g in ("g0", "g1"):
        q, why, blame = beats.next_abort(g)
        assert q == q1.quorum_id and blame == ("g2",), (q, why, blame)
        assert f"group g2 sent the lighthouse no heartbeat for 0.5 s during quorum {q1.quorum_id}'s" in why
      assert time.monotonic() - stopped < 3
      t0 = time.monotonic()
      q2 = _ask_all(lh.address, [_member("g0", 1), _member("g1", 1)])["g0"]
      assert q2.members == ("g0", "g1") and q2.dropped == ("g2",)
      beats.paused.discard("g2")                                 # resumed: told its attempt is over
      q, why, _ = beats.next_abort("g2")
      assert q == q1.quorum_id and "g2" in why
      q3 = _ask_all(lh.address, [_member("g0", 2), _member("g1", 2)])["g0"]   # its beats hold nobody
      assert q3.members == ("g0", "g1")
      assert time.monotonic() - t0 < 2.5, "a quorum waited for a group out of the attempt"
      for g in ("g0", "g1"):        # (repeated until they asked again: a notice may be lost)
        assert {beats.aborts[g].get()[0] for _ in range(beats.aborts[g].qsize())} <= {q1.quorum_id}
    finally:
      beats.close()


def test_a_failure_report_ends_the_attempt_for_the_others_and_whom_it_blames_is_not_waited_for():
  with Lighthouse("127.0.0.1:0", SLOW_JOIN) as lh:
    beats = _Beats(lh.address, ["g0", "g1", "g2"])
    ctx = zmq.Context()
    client = LighthouseClient(ctx, lh.address)
    try:
      _live(lh, ["g0", "g1", "g2"])
      time.sleep(SLOW_JOIN.join_timeout.total_seconds() - 0.5)
      q1 = _ask_all(lh.address, [_member("g0"), _member("g1"), _member("g2")], timeout=10)["g0"]
      client.failed("g0", q1.quorum_id, "the stream from group g2 closed", ("g2",))
      q, why, blame = beats.next_abort("g1")
      assert (q, blame) == (q1.quorum_id, ("g2",))
      assert why == f"group g0 failed quorum {q1.quorum_id}'s attempt: the stream from group g2 closed"
      t0 = time.monotonic()                   # g2 still heartbeats, but is out of the attempt
      q2 = _ask_all(lh.address, [_member("g0", 1), _member("g1", 1)])["g0"]
      assert q2.members == ("g0", "g1") and time.monotonic() - t0 < 2
      assert beats.aborts["g0"].empty()       # (the reporter is not told its own news)
      assert beats.next_abort("g2")[0] == q1.quorum_id
    finally:
      client.close()
      ctx.term()
      beats.close()


def test_a_restarted_lighthouse_forms_at_once_when_the_whole_last_quorum_asks_again():
  opts = dataclasses.replace(FAST, min_replicas=1, join_timeout=timedelta(seconds=3))
  ctx = zmq.Context()
  lh = Lighthouse("127.0.0.1:0", opts).start()
  address = lh.address
  clients = {g: LighthouseClient(ctx, address, resend_secs=0.1) for g in ("g0", "g1")}
  got: dict = {}

  def ask_all(step):
    threads = [threading.Thread(target=lambda g=g: got.update({g: clients[g].quorum(
        _member(g, step), timedelta(seconds=10))})) for g in clients]
    for t in threads:
      t.start()
    for t in threads:
      t.join()

  try:
    ask_all(0)                                # (a first start waits out its grace)
    assert got["g0"].members == ("g0", "g1")
    lh.stop()
    lh = Lighthouse(address, opts).start()
    t0 = time.monotonic()
    ask_all(1)
    assert got["g0"].members == ("g0", "g1") and got["g0"].max_step == 1
    assert time.monotonic() - t0 < 2, "the restarted lighthouse waited out its grace period"
  finally:
    for c in clients.values():
      c.close()
    lh.stop()
    ctx.term()


_BEATING = r"""
import os, sys, time, zmq
from datetime import timedelta
from jaxckpt.ft.lighthouse import Heartbeat
address, private = sys.argv[1], int(sys.argv[2])
beat = Heartbeat(zmq.Context(), address, "g9", timedelta(milliseconds=100), private_port=lambda: private)
print("beating", flush=True)
sys.stdin.readline()
sum(range(2 * 10**8))          # one C call: holds the GIL (as a long garbage collection does)
print("held", flush=True)
time.sleep(600)
"""


def test_a_stopped_process_is_out_of_the_attempt_within_the_connection_timeout_a_busy_one_never():
  # A stopped group is known in about a second whatever the heartbeat timeout, by
  # the pings of its connection, which its ZeroMQ I/O thread answers: a pause of its Python
  # (a GC, a long C call holding the GIL) that stops its heartbeat messages is not a death.
  import os, signal, subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  opts = LighthouseOptions(min_replicas=1, heartbeat_timeout=timedelta(seconds=30), join_timeout=timedelta(seconds=0.2),
                           straggler_timeout=timedelta(seconds=60), connection_timeout=timedelta(seconds=0.75))
  with Lighthouse("127.0.0.1:0", opts) as lh:
    child = subprocess.Popen([sys.executable, "-c", _BEATING, lh.address, str(lh.private_port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
      assert child.stdout.readline().strip() == "beating"
      _live(lh, ["g9"])
      time.sleep(0.5)                                        # (the beats move to the private port)
      q = _ask_all(lh.address, [_member("g9")])["g9"]        # g9 is in the attempt in flight
      assert q is not None and lh.status()["last_members"] == ["g9"]
      child.stdin.write("hold the GIL\n")
      child.stdin.flush()
      assert child.stdout.readline().strip() == "held"      # 2+ s without a heartbeat message
      assert "g9" not in lh.status()["out"] and "g9" in lh.status()["live"]
      os.kill(child.pid, signal.SIGSTOP)
      stopped = time.monotonic()
      _until(lambda: "g9" in lh.status()["out"], "g9 to be out of the attempt", 10)
      assert time.monotonic() - stopped < 3, time.monotonic() - stopped
      assert "g9" not in lh.status()["live"]
    finally:
      os.kill(child.pid, signal.SIGKILL)
      child.wait(timeout=10)


def _until(cond, what, secs):
  deadline = time.monotonic() + secs
  while not cond():
    assert time.monotonic() < deadline, f"waited {secs} s for {what}"
    time.sleep(0.01)


def test_a_new_lighthouse_adopts_the_ring_in_flight_and_calls_it_back_before_a_group_joins():
  # A ring goes on with its quorum without asking, so a restarted lighthouse (or a new
  # leader) learns of it only from heartbeats; a group that asks must not get a quorum without it.
  import queue  # pylint: disable=import-outside-toplevel
  ctx, calls = zmq.Context(), queue.Queue()
  with Lighthouse("127.0.0.1:0", FAST) as lh:
    beats = [Heartbeat(ctx, lh.address, g, timedelta(milliseconds=50), step=lambda: (40, "old-7"),
                       on_call_back=lambda q, g=g: calls.put((g, q))) for g in ("g0", "g1")]
    try:
      deadline = time.monotonic() + 10
      while lh.status()["lineage"] != "old-7" or len(lh.status()["last_members"]) < 2:
        assert time.monotonic() < deadline, lh.status()
        time.sleep(0.01)
      got = {}
      joiner = threading.Thread(target=lambda: got.update(_ask_all(lh.address, [_member("g2", 0)], 8)))
      joiner.start()
      called = {calls.get(timeout=5), calls.get(timeout=5)}
      assert {g for g, _ in called} == {"g0", "g1"} and {q for _, q in called} == {"old-7"}
      assert lh.status()["pending"] == ["g2"]              # (not formed without the ring)
      ring = _ask_all(lh.address, [_member("g0", 40), _member("g1", 40)])
      joiner.join()
    finally:
      for b in beats:
        b.stop()
  ctx.term()
  assert ring["g0"].members == ("g0", "g1", "g2") and ring["g0"].healthy == ("g0", "g1")
  assert got["g2"].max_step == 40 and not got["g2"].in_ring
