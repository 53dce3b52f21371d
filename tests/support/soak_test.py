"""The chaos soak's short form (benchmarks/soak.py runs the long one): a 4-process
job with parity m=1 persisting to a real SeaweedFS, every kind of fault injected
at least once, nothing lost, every restore bit-exact."""

from __future__ import annotations

import json

import pytest

from tests.support import soak, soak_worker


def test_the_numpy_reference_is_the_step_the_trainers_run():
  """The reference replays from any cached step to the same bits as from step 0."""
  ref, fresh = soak_worker.Reference(3, 16, 8), soak_worker.Reference(3, 16, 8)
  ref.arrays(20)
  for step in (7, 16, 23):
    a, b = ref.arrays(step), fresh.arrays(step)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
  assert ref.key_data(5).tobytes() == fresh.key_data(5).tobytes() != ref.key_data(6).tobytes()


def test_the_schedule_is_seeded_and_has_every_kind():
  n = len(soak.KINDS) + 2
  a, b = soak.plan(7, n, short=True), soak.plan(7, n, short=True)
  assert a == b and len(a) == n and {f.kind for f in a[:len(soak.KINDS)]} == set(soak.KINDS)
  assert all(6 <= f.pause_secs <= 9 for f in a if f.kind in ("s3_pause", "s3_errors"))
  assert all(20 <= f.pause_secs <= 30 for f in soak.plan(7, 10, short=False)
             if f.kind == "s3_pause")


@pytest.mark.parametrize("seed", [0, 1, 11, 23])
def test_the_short_form_loses_process_0s_machine_and_a_long_run_every_machine(seed):
  lost = [f.host for f in soak.plan(seed, len(soak.KINDS), short=True) if f.kind == "lose_host"]
  assert lost[:1] == [0], lost
  lost = [f.host for f in soak.plan(seed, len(soak.KINDS) + soak.HOSTS - 1, short=False)
          if f.kind == "lose_host"]
  assert set(lost) == set(range(soak.HOSTS)), lost


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_soak_short_form_loses_nothing_and_restores_exactly(tmp_path):
  logs = tmp_path / "logs"                     # every trainer's and agent's log, kept by pytest
  logs.mkdir()
  out = soak.run(steps=soak.SHORT_STEPS, seed=0, short=True, log_dir=str(logs))
  report = json.dumps(out, indent=1) + f"\n(logs in {logs})"
  assert out["due_steps"]["lost"] == 0, report
  assert out["wrong_restores"] == 0, report
  assert out["storage_wrong"] == [] and out["delete_violations"] == [], report
  assert out["resurrected"] == 0, report
  # the whole history against the model of docs/reliability.md (tests/support/checker.py)
  assert out["history"]["violations"] == [], report
  assert out["s3_requests_failed_on_purpose"] >= 1, report     # s3_errors answered some
  assert set(out["history"]["faults"]) == set(soak.KINDS), report
  assert set(out["faults_injected"]) == set(soak.KINDS), report
  assert all(n >= 1 for n in out["faults_injected"].values()), report
  assert {"kind": "lose_host", "host": 0}.items() <= next(
      e for e in out["schedule"] if e["kind"] == "lose_host").items(), report
  tries = out["second_managers"]["tries"]
  assert out["second_managers"]["refused_naming_the_first"] == soak.HOSTS * tries >= 4, report
  assert out["damaged_newest"]["skipped_by_the_relaunch"] == out["damaged_newest"]["damaged"]
  assert out["damaged_newest"]["damaged"] >= 2, report      # a flipped byte, an impossible leaf
  truncated = out["truncated_slots"]                        # damage, never SIGBUS
  assert truncated["relaunches_restored"] == truncated["truncations"] >= 1, report
  assert out["dead_claims"].get("committed") == out["dead_claims"]["planted"] >= 1, report
  stray = out["stray_tcp"]                                  # a trainer's requests over tcp
  assert stray["refused"] >= 5 * soak.HOSTS and not stray.get("accepted"), report
  assert stray.get("leased_opens", 0) >= 1 and not stray.get("unleased_opens"), report
  # a relaunch (and its checked restore) after every fault but an S3 stop, a killed agent
  # and a second manager
  assert out["restores"] >= 5 and out["storage_steps_verified"] >= 1, report
  clock = out["checks"]["skewed_clock"]       # a replacement group on a clock 45 s behind
  assert clock.get("replacement_quorums") == 3 and clock["replays_accepted"] == 0, report
  assert clock["stalls"] == 0 and clock["replays_refused"] == clock["replays"] >= 1, report
