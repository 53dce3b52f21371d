"""gs:// against a real GCS server: fake-gcs-server (tests/support/gcs.py), reached through
tensorstore's ``gcs`` driver as GCS is. A job persists and keeps its newest steps, with
and without the snapshot agent, and restores onto another mesh bit-exact; writers in three
processes racing for one commit leave exactly one winner, whole; a server that answers 503
and resets connections for a while (tests/support/flaky_http.py in front of it) only slows
the job down: it ends with every step on storage; and a bucket that does not exist, or a
server that does not answer, fails when the manager is created."""

from __future__ import annotations

import contextlib
import json
import textwrap
import urllib.parse

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.testing import processes
from jaxckpt.universal import _layout
from tests.support import fixtures as _fixtures
from tests.support.flaky_http import FlakyProxy


def _state(step: int) -> dict:
  mesh = jax.make_mesh((8,), ("x",))
  w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + 1000 * step
  return {"w": jax.device_put(w, NamedSharding(mesh, P("x"))), "b": np.full(3, step),
          "step": step}


def _prefix(gcs_server, directory: str) -> str:
  return directory.removeprefix(f"gs://{gcs_server.bucket}/")


def _stored_steps(gcs_server, directory: str) -> list[str]:
  """The step directories that hold any object, as the server lists them (not through
  tensorstore): what a deleted step must leave nothing of."""
  prefix = _prefix(gcs_server, directory) + "/"
  return sorted({n[len(prefix):].split("/")[0] for n in gcs_server.object_names(prefix)
                 if n[len(prefix):].startswith("step_")})


@pytest.mark.parametrize("with_agent", [False, True], ids=["in-process", "agent"])
def test_a_job_on_gcs_keeps_its_newest_steps_and_restores_onto_another_mesh(gcs_server,
                                                                            with_agent):
  d = gcs_server.url()
  with contextlib.ExitStack() as stack:
    agent = None
    if with_agent:      # (the agent inherits the server's variables from this process)
      root, job = stack.enter_context(processes.agent_sandbox())
      agent = jc.AgentOptions(job_name=job, run_root=root)
    opts = jc.CheckpointOptions(max_to_keep=2, persist_interval_steps=1, agent=agent)
    with jc.CheckpointManager(d, opts) as mgr:
      for step in (1, 2, 3, 4):
        assert mgr.save(step, _state(step))
        mgr.wait_until_persisted(step)
  assert u.all_steps(d) == [3, 4]
  assert _stored_steps(gcs_server, d) == ["step_0000000003", "step_0000000004"]   # deleted whole
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  target = {"w": jax.ShapeDtypeStruct((64, 8), np.float32,
                                      sharding=NamedSharding(mesh, P("b", "a"))),
            "b": np.zeros(3, np.int64), "step": 0}
  with jc.CheckpointManager(d) as mgr:
    out = mgr.restore(step=4, target=target)
    assert mgr.last_restore.tier == "storage"
  want = _state(4)
  assert np.asarray(out["w"]).tobytes() == np.asarray(want["w"]).tobytes()
  assert out["w"].sharding == target["w"].sharding
  np.testing.assert_array_equal(out["b"], want["b"])
  assert out["step"] == 4
  assert u.verify_step(u.open_step(d, 3)) == []


def test_a_bucket_that_does_not_exist_fails_when_the_manager_is_created(gcs_server):
  """GCS answers a listing of a bucket that does not exist with 404, which tensorstore
  reads as no keys: the manager took gs://no-such-bucket for an empty directory, and its
  first persist failed, after 16 s of retries, in the background."""
  d = f"gs://no-such-{gcs_server.bucket}/run"
  with pytest.raises(errors.StorageError, match=r"'gs://no-such-jaxckpt-test/run' cannot be "
                     r"written: .*NOT_FOUND.*does the bucket exist"):
    jc.CheckpointManager(d, jc.CheckpointOptions(timeout_secs=20))
  u.check_directory(gcs_server.url(), timeout_secs=20)          # (the bucket that exists)
  assert not [n for n in gcs_server.object_names() if ".jaxckpt-probe-" in n]   # (deleted)


def test_a_gcs_that_does_not_answer_fails_on_time_naming_its_endpoint_variable(gcs_server):
  with gcs_server.paused(), pytest.raises(
      errors.StorageError, match=r"took over .* s: GCS endpoint http://127\.0\.0\.1:\d+ did not answer; is it "
      r"reachable \(endpoint: "
      r"TENSORSTORE_GCS_HTTP_URL for a GCS emulator; credentials\)"):
    jc.CheckpointManager(gcs_server.url(), jc.CheckpointOptions(timeout_secs=3))


RACER = textwrap.dedent("""
    import json, sys
    import jaxckpt.universal as u
    from jaxckpt import errors
    d = sys.argv[1]
    print("ready", flush=True)
    for line in sys.stdin:                 # "STEP ATTEMPT": commit it, say who won
      step, attempt = line.split()
      try:
        u.commit_step(d, int(step), process_count=1, timeout_secs=120, attempt=attempt)
        print(json.dumps({"step": int(step), "won": attempt}), flush=True)
      except errors.StepExistsError as e:
        print(json.dumps({"step": int(step), "lost": attempt, "why": str(e)}), flush=True)
""")


WRITERS, STEPS = 3, 6


@pytest.mark.slow
def test_of_processes_racing_for_one_commit_on_gcs_exactly_one_wins_whole(gcs_server):
  """fake-gcs-server (1.54) ignores ``ifGenerationMatch`` on the media uploads tensorstore
  sends (GCS honours it): the marker's conditional write cannot decide here, so what does
  is the commit protocol's claims and its read-back. Three processes, each with its attempt's
  parts written, commit the same step at once, for several steps (with the claims taken out of
  commit_step, two of them won a step in 2 runs of 4)."""
  d = gcs_server.url()
  kv = _layout.open_kvstore(d)
  absent = kv.read("probe").result(timeout=60).stamp.generation
  kv.write("probe", b"first", if_equal=absent).result(timeout=60)
  kv.write("probe", b"second", if_equal=absent).result(timeout=60)
  assert kv.read("probe").result(timeout=60).value == b"second", (
      "fake-gcs-server now honours ifGenerationMatch on media uploads: add gs:// to "
      "storage_test.py's test_of_writers_racing_for_a_commit_marker_exactly_one_wins")
  racers = [processes.Proc(["-c", RACER, d], stdin=True) for _ in range(WRITERS)]
  try:
    for r in racers:
      r.wait_for("ready", 120)
    for step in range(1, STEPS + 1):
      for i in range(WRITERS):
        (manifest, buf), = _fixtures.host_snapshots(step, {"w": np.full(256, 10 * step + i)})
        u.write_process_shards(d, manifest, buf, attempt=f"s{step}-w{i}")
      for i, r in enumerate(racers):
        r.send(f"{step} s{step}-w{i}")
      said = [json.loads(r.wait_for(f'"step": {step}', 240)) for r in racers]
      won = [s["won"] for s in said if "won" in s]
      assert len(won) == 1, said
      for lost in (s for s in said if "lost" in s):
        assert f"step {step} is already committed" in lost["why"] and won[0] in lost["why"], lost
      assert u.committed_by(d, step) == won[0]
      winner = int(won[0][-1])
      np.testing.assert_array_equal(u.open_step(d, step).read("w"), np.full(256, 10 * step + winner))
  finally:
    for r in racers:
      r.kill()
  assert u.all_steps(d) == list(range(1, STEPS + 1))
  left = [n for n in gcs_server.object_names(_prefix(gcs_server, d) + "/") if "/claims/" in n]
  assert left == []                 # every claim withdrawn


TRAINER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxckpt as jc
    d, root, job = sys.argv[1:]
    mesh = jax.make_mesh((8,), ("x",))
    def state(step):                       # (gcs_test._state)
      w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + 1000 * step
      return {"w": jax.device_put(w, NamedSharding(mesh, P("x"))), "b": np.full(3, step),
              "step": step}
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                max_to_keep=3, persist_interval_steps=1)
    with jc.CheckpointManager(d, opts) as mgr:
      print("ready", flush=True)
      sys.stdin.readline()                 # the caller arms the failures first
      for step in range(1, 7):
        assert mgr.save(step, state(step))
        mgr.wait_until_persisted(step)
        print("persisted", step, flush=True)
    print("closed", flush=True)
""")


@pytest.mark.slow
def test_a_job_whose_gcs_fails_for_a_while_ends_with_every_step_on_storage(gcs_server):
  """A trainer (its agent, and so its persists, too) reaches the server through a proxy
  that fails 3 uploads of the commit marker in a row (a 503, a reset before the server
  saw it, a reset after it wrote it) and then 9 requests of any kind: tensorstore retries
  each, the marker read back is the attempt's own, and the job ends as if storage had
  never failed: every step persisted, the newest 3 kept, each bit-exact, nothing left of
  the deleted ones, no claim left behind, and close() raised nothing."""
  d = gcs_server.url()
  marker_uploads = "&name=" + urllib.parse.quote(f"{_prefix(gcs_server, d)}/commits/", safe="")
  with processes.agent_sandbox() as (root, job), FlakyProxy(gcs_server.endpoint) as flaky:
    trainer = processes.Proc(["-c", TRAINER, d, root, job], stdin=True,
                             env={"TENSORSTORE_GCS_HTTP_URL": flaky.endpoint})
    try:
      trainer.wait_for("ready", 180)
      flaky.fail(3, where=marker_uploads)
      flaky.fail(9)
      trainer.send("go")
      flaky.wait_failed(240)
      out = trainer.finish(300)
    finally:
      trainer.kill()
  assert all(f"persisted {s}" in out for s in range(1, 7)) and "closed" in out, out[-3000:]
  assert flaky.failed == {"503": 4, "reset": 4, "reset-after": 4}
  assert u.all_steps(d) == [4, 5, 6]
  assert _stored_steps(gcs_server, d) == [f"step_000000000{s}" for s in (4, 5, 6)]
  for step in (4, 5, 6):
    reader = u.open_step(d, step)
    np.testing.assert_array_equal(reader.read("['w']"), np.asarray(_state(step)["w"]))
    assert u.verify_step(reader) == []
  assert not [n for n in gcs_server.object_names(_prefix(gcs_server, d) + "/") if "/claims/" in n]
