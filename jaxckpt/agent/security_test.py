"""Nobody without the job's secret can read, stop, redirect or forge an agent's snapshots;
run roots others could write are refused; one live trainer per job and host."""

from __future__ import annotations

import os
import pwd
import re
import socket
import struct
import subprocess
import sys
import textwrap
import time

import msgspec
import numpy as np
import pytest
import zmq

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.agent import _paths, _protocol, _requests
from jaxckpt.testing import processes


@pytest.fixture
def held(tmp_path):
  """A running agent holding step 1 of a 64x8 float32 ``w``; yields (opts, root, job, info)."""
  with processes.agent_sandbox() as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": np.arange(512, dtype=np.float32).reshape(64, 8)})
      m.wait_until_finished()
    yield opts, root, job, processes.agent_address(root, job)


def _nobody() -> pwd.struct_passwd:
  if os.getuid() != 0:
    pytest.skip("needs root to act as another OS user")
  try:
    return pwd.getpwnam("nobody")
  except KeyError:
    pytest.skip("this machine has no 'nobody' user to act as another OS user")


def _raw(endpoint: str, frames: list[bytes]) -> dict:
  """One request sent by hand (an attacker's client), its reply header."""
  sock = zmq.Context.instance().socket(zmq.REQ)
  sock.setsockopt(zmq.LINGER, 0)
  sock.connect(endpoint)
  try:
    sock.send_multipart(frames)
    assert sock.poll(20000), "the agent did not answer"
    return msgspec.msgpack.decode(sock.recv_multipart()[0])
  finally:
    sock.close()


FORGED = [("open", {"pid": 1, "step": 1}), ("stop", {}),
          ("hello", {"pid": 1, "persist": {"directory": "/tmp/evil", "interval_steps": 1}}),
          ("reserve", {"pid": 1, "step": 9, "nbytes": 64}),
          ("commit", {"index": 0, "manifest": "{}"})]


@pytest.mark.parametrize("how", ["no mac", "wrong secret", "mac of another header"])
def test_requests_without_the_secret_are_refused_and_change_nothing(held, how):
  opts, root, job, info = held
  for endpoint in (info["tcp"], info["ipc"]):
    for op, args in FORGED:
      header = msgspec.msgpack.encode({"op": op, "ts": time.time(), **args})
      if how == "no mac":
        frames = [header]
      elif how == "wrong secret":
        frames = [_protocol.sign(b"not the secret", header), header]
      else:
        good = _protocol.request(_paths.job_secret(root, job), _requests.Steps())
        frames = [good[0], header]
      reply = _raw(endpoint, frames)
      assert not reply["ok"] and reply["type"] == "PermissionDeniedError", (op, reply)
  assert processes.pid_alive(info["pid"])                       # not stopped
  assert not os.path.exists("/tmp/evil")                        # not redirected
  with jc.CheckpointManager(options=opts) as m:                 # the real state, intact
    out = m.restore(step=1, target={"w": np.zeros((64, 8), np.float32)})
    assert m.all_steps() == [1] and m.last_restore.tier == "host"
  np.testing.assert_array_equal(out["w"], np.arange(512, dtype=np.float32).reshape(64, 8))


@pytest.mark.parametrize("how", ["no mac", "wrong secret", "mac of another header"])
def test_bulk_reads_without_the_secret_get_no_byte(held, how):
  _, root, job, info = held
  header = msgspec.msgpack.encode({"op": "bulk", "what": "snapshot", "step": 1, "ranges": [[0, 2048]],
                          "ts": time.time()})
  mac = {"no mac": b"", "wrong secret": _protocol.sign(b"not the secret", header),
         "mac of another header": _protocol.request(_paths.job_secret(root, job), _requests.Steps())[0]}
  host, port = info["bulk"].rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=20) as conn:
    conn.sendall(b"".join(struct.pack("!I", len(f)) + f for f in (mac[how], header)))
    got = b""
    while chunk := conn.recv(1 << 16):                 # the agent closes after its refusal
      got += chunk
  (n,) = struct.unpack("!I", got[:4])
  reply = msgspec.msgpack.decode(got[4:4 + n])
  assert not reply["ok"] and reply["type"] == "PermissionDeniedError", reply
  assert len(got) == 4 + n                              # and not one byte of the snapshot


def test_bulk_reads_outside_the_snapshot_are_refused(held):
  _, root, job, info = held
  client = _protocol.Client(info["tcp"], who="test", timeout_secs=20,
                            secret=_paths.job_secret(root, job), bulk=info["bulk"])
  with pytest.raises(errors.InvalidArgumentError, match=r"outside step 1"):
    client.read("snapshot", 1, [(0, 1 << 30)])
  with pytest.raises(errors.StepNotFoundError, match="no step 5"):
    client.read("snapshot", 5, [(0, 8)])
  data, = client.read("snapshot", 1, [(0, 2048)])        # the secret's holder reads
  np.testing.assert_array_equal(data.view(np.float32), np.arange(512, dtype=np.float32))


def test_a_replayed_old_request_is_refused(held):
  _, root, job, info = held
  secret = _paths.job_secret(root, job)
  header = msgspec.msgpack.encode({"op": "stop", "ts": time.time() - 3600, "nonce": b"x"})
  reply = _raw(info["ipc"], [_protocol.sign(secret, header), header])
  assert not reply["ok"] and "too old" in reply["error"]
  assert processes.pid_alive(info["pid"])


def test_the_secret_and_slot_files_are_private_to_the_user(held):
  _, root, job, _ = held
  secret = os.path.join(root, job, "secret")
  assert os.stat(secret).st_mode & 0o777 == 0o600
  assert os.stat(os.path.join(root, job)).st_mode & 0o077 == 0


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "another user"])
def test_a_run_root_others_could_write_is_refused_with_the_fix(tmp_path, how):
  root = tmp_path / "run"
  root.mkdir()
  if how == "another user":
    os.chown(root, _nobody().pw_uid, -1)
    os.chmod(root, 0o700)
  else:
    os.chmod(root, 0o777 if how == "world-writable" else 0o770)
  opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name="j", run_root=str(root)))
  with pytest.raises(errors.PermissionDeniedError, match=r"must be owned by you .*chmod 700") as e:
    jc.CheckpointManager(options=opts)
  assert isinstance(e.value, PermissionError)
  assert not os.path.exists(root / "j")


def test_another_os_user_cannot_read_the_snapshot_or_the_secret(held):
  _, root, job, _ = held
  nobody = _nobody()
  host = _paths.agent_dir(root, job, 0)
  targets = [os.path.join(root, job, "secret")] + [
      os.path.join(host, f) for f in os.listdir(host) if f.startswith("slot")]
  probe = 'for p in "$@"; do if head -c1 "$p" >/dev/null 2>&1; then echo READ; else echo DENIED; fi; done'
  r = subprocess.run(["/bin/sh", "-c", probe, "sh", *targets], capture_output=True, text=True,
                     timeout=60, user=nobody.pw_uid, group=nobody.pw_gid, check=False, cwd="/")
  assert r.stdout.count("DENIED") == len(targets) and "READ" not in r.stdout, (r.stdout, r.stderr)


TRAINER = textwrap.dedent("""
    import sys, time
    import numpy as np
    import jaxckpt as jc
    root, job, value, hold = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
    try:
      with jc.CheckpointManager(options=opts) as m:
        m.save(int(value), {"w": np.full(8, value)})
        m.wait_until_finished()
        print("SAVED", m.all_steps(), flush=True)
        if hold == "hold":
          sys.stdin.readline()
    except jc.errors.PermissionDeniedError as e:
      print("REFUSED", e, flush=True)
""")


def test_one_live_trainer_per_job_and_host_and_a_dead_ones_lease_passes_on():
  with processes.agent_sandbox() as (root, job):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    a = subprocess.Popen([sys.executable, "-c", TRAINER, root, job, "100", "hold"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
      assert a.stdout.readline().startswith("SAVED [100]")
      b = subprocess.run([sys.executable, "-c", TRAINER, root, job, "5", "go"],
                         capture_output=True, text=True, timeout=120, env=env)
      assert f"already has a live trainer, pid {a.pid}" in b.stdout, b.stdout + b.stderr
      assert "REFUSED" in b.stdout and "SAVED" not in b.stdout
    finally:
      a.kill()
      a.wait(timeout=30)
    c = subprocess.run([sys.executable, "-c", TRAINER, root, job, "200", "go"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert "SAVED [100, 200]" in c.stdout, c.stdout + c.stderr      # A's step 100 kept


CLOSE_AND_LINGER = textwrap.dedent("""
    import sys
    import numpy as np
    import jaxckpt as jc
    root, job = sys.argv[1], sys.argv[2]
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root))
    with jc.CheckpointManager(options=opts) as m:      # a notebook kernel: closes, lives on
      m.save(1, {"w": np.full(8, 1.0)})
      m.wait_until_finished()
    print("CLOSED", flush=True)
    sys.stdin.readline()
""")


def test_close_gives_up_the_lease_while_the_process_lives_on():
  with processes.agent_sandbox() as (root, job):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    a = subprocess.Popen([sys.executable, "-c", CLOSE_AND_LINGER, root, job],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
      assert a.stdout.readline().startswith("CLOSED")
      b = subprocess.run([sys.executable, "-c", TRAINER, root, job, "2", "go"],
                         capture_output=True, text=True, timeout=120, env=env)
      assert "SAVED [1, 2]" in b.stdout, b.stdout + b.stderr
      assert a.poll() is None                        # the first process still runs
    finally:
      a.kill()
      a.wait(timeout=30)


def test_a_captured_sealed_request_replayed_later_is_refused(held):
  opts, root, job, info = held
  secret = _paths.job_secret(root, job)
  with jc.CheckpointManager(options=opts) as m:
    assert m.save(2, {"w": np.zeros((64, 8), np.float32)})
    m.wait_until_finished()
    captured = _protocol.request(secret, _requests.Discard(step=2))
    assert _raw(info["ipc"], captured)["ok"]           # the original, applied
    assert m.save(2, {"w": np.ones((64, 8), np.float32)})   # the trainer saves step 2 again
    m.wait_until_finished()
    reply = _raw(info["ipc"], captured)                # the replay, inside the time window
    assert not reply["ok"] and "replayed" in reply["error"]
    assert 2 in m.all_steps()
    np.testing.assert_array_equal(m.restore(2, target={"w": np.zeros((64, 8), np.float32)})["w"],
                                  np.ones((64, 8), np.float32))


@pytest.mark.parametrize("suffix", ["\n", "  \n", "\r\n"])
def test_a_secret_read_from_a_file_works_as_given(suffix):
  with processes.agent_sandbox() as (root, job):
    token = "t0k3n" * 8
    def opts(secret):
      return jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root,
                                                        secret=secret))
    with jc.CheckpointManager(options=opts(token + suffix)) as m:   # a fresh job: written
      assert m.save(1, {"w": np.ones(8)})
      m.wait_until_finished()
    with jc.CheckpointManager(options=opts(token)) as m:            # read back: the same
      assert m.all_steps() == [1]
    with pytest.raises(errors.PermissionDeniedError, match="differs"):
      jc.CheckpointManager(options=opts("another-token-" * 2 + suffix))


@pytest.mark.parametrize("header, why", [
    ({"op": "reserve", "pid": 1, "step": "3", "nbytes": 64},
     r"request 'reserve': field step='3' is refused: Expected `int`, got `str`"),
    ({"op": "reserve", "pid": 1, "step": 3}, "request 'reserve' lacks the required field 'nbytes'"),
    ({"op": "discard", "step": 1, "extra": 2}, r"request 'discard' has no field 'extra'"),
    ({"op": "op_reserve"}, "unknown request op='op_reserve'"),
    ({"op": "commit", "index": 0, "manifest": "{}", "step": 1, "nbytes": 0,
      "process": "x"}, r"request 'commit': field process='x' is refused: Expected `array`"),
    ({"op": "reserve", "pid": 0, "step": 3, "nbytes": 64},
     r"request 'reserve': field pid=0 is refused: Expected `int` >= 1"),
    ({"op": "hello", "pid": 1, "persist": {"directory": "/d", "interval_steps": 1,
                                           "timeout_secs": float("inf")}},
     r"request 'hello': field persist.timeout_secs=inf is refused: Expected `float` <= "),
    ({"op": "hello", "pid": 1, "parity": {"group_size": 3, "parity": 3}},
     r"request 'hello': field parity=.* is refused: parity=3 must be in \[1, group_size - 1\]"),
    ({"op": "close", "pid": 1, "step": 1, "reader": 5},
     r"request 'close': field reader=5 is refused: Expected `int` <= -1"),
])
def test_a_sealed_request_of_the_wrong_shape_is_refused_naming_the_field(held, header, why):
  """Every request is one of agent/_requests.py's Structs, checked (types and bounds) before
  its handler runs."""
  _, root, job, info = held
  reply = _raw(info["ipc"], _protocol._wire.seal(_paths.job_secret(root, job), header))
  assert not reply["ok"] and reply["type"] == "InvalidArgumentError"
  assert re.search(why, reply["error"]), reply["error"]
  steps = _protocol.request(_paths.job_secret(root, job), _requests.Steps())
  assert _raw(info["ipc"], steps)["steps"] == [1]


def _sealed_by_hand(secret: bytes, header: dict) -> list[bytes]:
  """``header`` sealed with the job's secret as it stands (a buggy peer's framing)."""
  body = _protocol.pack(header)
  return [_protocol.sign(secret, body), body]


@pytest.mark.parametrize("op, framing, why", [
    ("steps", {"deadline": "soon"}, r"field deadline='soon' is refused: Expected `float \| null`"),
    ("steps", {"deadline": [1.0]}, r"field deadline=\[1.0\] is refused: Expected `float \| null`"),
    ("steps", {"deadline": float("nan")}, r"field deadline=nan is refused"),
    ("steps", {"ts": "now"}, r"field ts='now' is refused: Expected `float`"),
    ("steps", {"nonce": 7}, r"field nonce=7 is refused: Expected `bytes \| null`"),
    ("discard", {"ts": float("nan")}, r"field ts=nan is refused"),
    ("discard", {"ts": float("inf")}, r"field ts=inf is refused"),
])
@pytest.mark.parametrize("over", ["ipc", "tcp"])
def test_a_sealed_request_with_a_malformed_framing_field_is_refused_and_the_agent_lives(
    held, op, framing, why, over):
  """The framing of a sealed message (its ts, nonce and deadline) is checked by its schema
  before the replay window, the replay set or the deadline use it: a buggy peer holding
  the secret gets a refusal naming the field; nothing is applied (step 1 is not
  discarded) and the agent serves on."""
  _, root, job, info = held
  secret = _paths.job_secret(root, job)
  header = {"op": op, **({"step": 1} if op == "discard" else {}), "ts": time.time(),
            "nonce": os.urandom(8), **framing}
  reply = _raw(info[over], _sealed_by_hand(secret, header))
  assert not reply["ok"] and reply["type"] == "PermissionDeniedError", reply
  assert "malformed framing field" in reply["error"] and re.search(why, reply["error"]), reply
  assert processes.pid_alive(info["pid"]), "the agent died of a malformed request"
  steps = _protocol.request(secret, _requests.Steps())
  assert _raw(info[over], steps)["steps"] == [1]                 # nothing applied


@pytest.mark.parametrize("fields, why", [
    ({"what": "snapshot", "step": "one", "ranges": [[0, 8]]},
     r"bulk request 'bulk': field step='one' is refused: Expected `int`"),
    ({"what": "memory", "step": 1, "ranges": [[0, 8]]}, r"field what='memory' is refused"),
    ({"what": "snapshot", "step": 1, "ranges": [[0, "8"]]}, r"field ranges\[0\]\[1\]='8'"),
    ({"what": "snapshot", "step": 1, "ranges": [[0, 8]], "extra": 1}, r"has no field 'extra'"),
    ({"what": "parity", "step": 1, "ranges": [[0, 8]], "stripe": -1}, r"field stripe=-1"),
])
def test_a_sealed_bulk_request_of_the_wrong_shape_is_refused_naming_the_field(held, fields, why):
  """A bulk read's fields are checked by its schema (agent/_reads.BulkRead) before the
  agent reads anything by them; the agent serves on."""
  _, root, job, info = held
  secret = _paths.job_secret(root, job)
  host, port = info["bulk"].rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=20) as conn:
    mac, body = _protocol._wire.seal(secret, {"op": "bulk", **fields}, timeout_secs=20)
    conn.sendall(b"".join(struct.pack("!I", len(f)) + f for f in (mac, body)))
    got = b""
    while chunk := conn.recv(1 << 16):
      got += chunk
  (n,) = struct.unpack("!I", got[:4])
  reply = _protocol.unpack(got[4:4 + n])
  assert not reply["ok"] and reply["type"] == "InvalidArgumentError", reply
  assert re.search(why, reply["error"]), reply["error"]
  assert processes.pid_alive(info["pid"])
  client = _protocol.Client(info["tcp"], who="test", timeout_secs=20, secret=secret,
                            bulk=info["bulk"])
  data, = client.read("snapshot", 1, [(0, 2048)])            # and serves the next one
  np.testing.assert_array_equal(data.view(np.float32), np.arange(512, dtype=np.float32))
