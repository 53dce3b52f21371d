"""`jaxckpt plan`: the command against the module's formulas, and the formulas against hand
computations, the closed form and the simulator."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

import jaxckpt as jc
from jaxckpt import cli, errors
from jaxckpt.goodput import plan as gp
from jaxckpt.goodput.closed_form import (daly_efficiency, first_order_efficiency,
                                         first_order_remainder, simulate_synchronous)

GIB = 2**30
CASE = dict(state_gib_per_host=8, host_ram_gib=512, hosts=64, step_secs=1, storage_gbps=1)


def _run_plan(capsys, *argv):
  code = cli.main(["plan", *argv])
  out = capsys.readouterr()
  return code, out.out, out.err


def _argv(**kw):
  return [x for k, v in kw.items() for x in ("--" + k.replace("_", "-"), str(v))]


def _measured_by_hand():
  """The two measured figures, read from the shipped benchmark JSON without the module."""
  with open(f"{gp.MEASURED_DIR}/snapshot.json", encoding="utf-8") as f:
    snap = json.load(f)
  gib = snap["bytes"] / GIB
  return snap["seconds"]["agent_blocking_s"]["median"], \
      snap["seconds"]["agent_restore_same_s"]["median"] / gib


def test_a_hand_computed_case():
  """64 hosts of 8 accelerators, 8 GiB per host, 512 GiB RAM, 1 s steps, 1 GB/s storage."""
  delta, load_per_gib = _measured_by_hand()
  p = gp.plan(gp.PlanInputs(**CASE))
  m = 33_000 * 3600 / (64 * 8)                                     # 232,031 s = 64.5 h
  assert gp.job_mtbf_secs(p.inputs) == pytest.approx(m)
  parity, agent, inproc, storage_only = p.options
  # agent + parity: groups of 4 (the smallest tried), m / (g - m) = 1/3 extra per snapshot.
  assert parity.options["parity"] == {"group_size": 4, "parity": 1}
  assert parity.memory_gib == pytest.approx(3 * 8 * (1 + 1 / 3)) == 32.0
  assert agent.memory_gib == inproc.memory_gib == 3 * 8 == 24.0
  # Saves: Daly's optimum for 4.6 ms of blocking against a 64.5 h MTBF, 46.2 s -> 47 steps.
  x = delta / (2 * m)
  daly = math.sqrt(2 * delta * m) * (1 + math.sqrt(x) / 3 + x / 9) - delta
  assert 46 < daly < 47 and parity.options["save_interval_steps"] == 47
  # Persists: 8 GiB at 1 GB/s = 8.59 s, twice that fits in the 47-step save interval.
  assert gp.persist_secs(8, 1) == pytest.approx(8 * GIB / 1e9)
  assert parity.options["persist_interval_steps"] == 47
  # Goodput: half the failures keep their host's memory (restore from it, 4.55 s), half rebuild
  # from parity (1.53 x); both go back 47 s; restart 570 s.
  host_load = load_per_gib * 8
  want = 1 - delta / 47 - (0.5 / m) * ((47 + delta) / 2 + 570 + host_load) \
      - (0.5 / m) * ((47 + delta) / 2 + 570 + 1.53 * host_load)
  assert parity.goodput == pytest.approx(want, rel=1e-12)
  assert 0.997 < want < 0.998
  assert p.recommended is parity


def test_storage_only_when_no_snapshot_fits():
  """100 GiB per host, 256 GiB RAM: two snapshots (200 GiB) exceed half the RAM."""
  i = gp.PlanInputs(state_gib_per_host=100, host_ram_gib=256, hosts=64, step_secs=5,
                    storage_gbps=2)
  p = gp.plan(i)
  assert [o.fits for o in p.options] == [False, False, False, True]
  r = p.recommended
  assert r.name == "storage-only" and r.options["host_snapshots"] is False
  write = 100 * GIB / 2e9                                           # 53.7 s per save, blocking
  m = gp.job_mtbf_secs(i)
  x = write / (2 * m)
  daly = math.sqrt(2 * write * m) * (1 + math.sqrt(x) / 3 + x / 9) - write
  assert r.options["persist_interval_steps"] == math.ceil(daly / 5)
  tau = r.options["persist_interval_steps"] * 5
  # A restore from storage does what one from host memory does (57.0 s measured for 100 GiB),
  # beside the 53.7 s read: it loads in 57.0 s.
  _, load_per_gib = _measured_by_hand()
  load = max(write, 100 * load_per_gib)
  assert load == 100 * load_per_gib and r.host_loss_recovery[1] == pytest.approx(load)
  # One kind of recovery: the model is the closed form jaxckpt simulate is checked against.
  assert r.goodput == pytest.approx(first_order_efficiency(tau, m, write, 570 + load), rel=1e-12)
  code = gp.options_code(r, i)
  assert code == ("jc.CheckpointOptions(host_snapshots=False, persist_interval_steps="
                  f"{math.ceil(daly / 5)}, host_memory_limit_bytes={GIB})")


def test_one_host_has_no_parity_and_a_small_budget_shrinks_the_staging_buffer():
  p = gp.plan(gp.PlanInputs(state_gib_per_host=0.25, host_ram_gib=1, hosts=1, step_secs=0.1,
                            storage_gbps=0.5))
  assert [o.name for o in p.options] == ["agent", "in-process", "storage-only"]
  assert p.options[-1].memory_gib == 0.5                             # half of 1 GiB
  assert p.recommended.name == "agent"                               # 0.75 GiB fits, 2 snapshots
  assert p.recommended.options["max_snapshots"] == 1                 # 3 x 0.25 > 0.5: one
  assert p.recommended.memory_gib == 0.5


def test_slow_storage_and_many_hosts_make_parity_worth_most():
  i = gp.PlanInputs(**dict(CASE, hosts=1024, storage_gbps=0.1))
  parity, agent, inproc, storage_only = gp.plan(i).options
  assert parity.goodput > agent.goodput > inproc.goodput > storage_only.goodput
  assert parity.goodput - inproc.goodput > 0.01        # a point of goodput at 8K accelerators
  # The agent keeps a crash on host memory (4.6 s to load); a host loss reads storage (85.9 s).
  assert agent.host_loss_recovery[1] == pytest.approx(gp.persist_secs(8, 0.1))
  assert agent.crash_recovery[1] < 5 < agent.host_loss_recovery[1]


def test_the_first_order_goodput_against_the_simulator():
  """One kind of recovery (storage-only): the plan's figure against jaxckpt's failure simulation
  (Daly's model, a million failures): close at a 64 h MTBF, conservative at 4 h."""
  for hosts, tolerance in ((64, 0.001), (1024, 0.015)):
    i = gp.PlanInputs(**dict(CASE, hosts=hosts, storage_gbps=0.1))
    o = gp.plan(i).options[-1]
    tau, load = o.host_loss_recovery
    sim = simulate_synchronous(gp.job_mtbf_secs(i), o.blocked * tau, 570 + load, tau,
                               failures=200_000)
    assert o.goodput <= sim.effective_training_time + 1e-4
    assert sim.effective_training_time - o.goodput < tolerance


@pytest.mark.parametrize("kw", [CASE, dict(CASE, hosts=1024, storage_gbps=0.1),
                                dict(state_gib_per_host=100, host_ram_gib=256, hosts=64,
                                     step_secs=5, storage_gbps=2),
                                dict(state_gib_per_host=0.25, host_ram_gib=24, hosts=1,
                                     step_secs=0.1, storage_gbps=0.5, host_loss_fraction=1)])
def test_the_command_prints_what_the_formulas_give(kw, capsys):
  expected = gp.plan(gp.PlanInputs(**kw))
  code, out, _ = _run_plan(capsys, *_argv(**kw))
  assert code == 0 and out.strip() == gp.render(expected)
  code, out, _ = _run_plan(capsys, *_argv(**kw), "--json")
  assert code == 0 and json.loads(out) == json.loads(json.dumps(expected.to_dict()))
  for o in expected.options:                       # every option it prints is valid as written
    options = eval(gp.options_code(o, expected.inputs), {"jc": jc})  # pylint: disable=eval-used
    assert isinstance(options, jc.CheckpointOptions)


def test_the_text_names_the_recommendation_and_its_options(capsys):
  code, out, _ = _run_plan(capsys, *_argv(**CASE))
  assert code == 0
  assert "recommended: agent + parity (expected goodput 99.73" in out
  assert "parity=jc.ParityOptions(group_size=4, parity=1)" in out
  assert f"host_memory_limit_bytes={256 * GIB}" in out
  for name in gp.PREFERENCE:
    assert any(line.startswith(name) for line in out.splitlines()), name


@pytest.mark.parametrize("argv,message", [
    (_argv(**dict(CASE, hosts=0)), "jaxckpt plan: --hosts must be a positive number, got 0\n"),
    (_argv(**dict(CASE, host_loss_fraction=2)),
     "jaxckpt plan: --host-loss-fraction must be <= 1, got 2.0\n"),
])
def test_bad_inputs_are_one_line_naming_the_flag_and_exit_2(argv, message, capsys):
  # The flag the user gave, not the API's field (PlanInputs.hosts).
  code, out, err = _run_plan(capsys, *argv)
  assert code == 2 and not out
  assert err == message


def test_inputs_are_validated():
  with pytest.raises(errors.InvalidArgumentError, match="step_secs must be a positive number"):
    gp.PlanInputs(**dict(CASE, step_secs=-1))
  with pytest.raises(errors.InvalidArgumentError, match="hosts must be an int"):
    gp.PlanInputs(**dict(CASE, hosts=2.5))


def test_the_console_command_runs():
  out = subprocess.run([sys.executable, "-m", "jaxckpt", "plan", *_argv(**CASE)],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == gp.render(gp.plan(gp.PlanInputs(**CASE)))


# -- sound advice ------------------------------------------------------------------------

WIDE = dict(state_gib_per_host=80, host_ram_gib=512, hosts=64, step_secs=10, storage_gbps=2)
REPLICATED_7B = dict(state_gib_per_host=78, host_ram_gib=128, hosts=8, step_secs=2, storage_gbps=1)


def test_options_within_the_model_error_recommend_the_one_that_survives_more():
  """64 hosts x 80 GiB, 10 s steps, 2 GB/s: in-process and agent + parity differ by less than
  the model's error; the agent with parity (which survives crashes and host losses from host
  memory) is recommended, and the note names the option it was preferred to."""
  p = gp.plan(gp.PlanInputs(**WIDE))
  parity, _, inproc, _ = p.options
  assert abs(inproc.goodput - parity.goodput) < inproc.error + parity.error
  assert p.recommended.name == "agent + parity"
  assert p.recommended.notes[0].startswith(
      f"in-process's goodput ({100 * inproc.goodput:.3f}%) is within the model's error")
  assert "agent + parity survives more failures from host memory" in p.recommended.notes[0]


def test_a_clear_winner_beyond_the_error_is_recommended():
  opt = dataclasses.replace
  base = gp.plan(gp.PlanInputs(**CASE)).options
  parity, agent, inproc, storage = (opt(o, goodput=g, error=1e-5) for o, g in
                                    zip(base, (0.990, 0.991, 0.995, 0.5)))
  assert gp.recommend([parity, agent, inproc, storage]) is inproc       # 0.5 points > 2e-5
  close = opt(inproc, goodput=0.99001)                                   # 1e-5 < 2e-5: a tie
  near = opt(agent, goodput=0.989995)
  assert gp.recommend([parity, near, close, storage]).name == "agent + parity"
  assert gp.recommend([opt(parity, fits=False), near, close, storage]).name == "agent"
  assert gp.recommend([opt(parity, fits=False), opt(agent, goodput=0.98), close, storage]) is close


@pytest.mark.parametrize("kw", [CASE, WIDE, REPLICATED_7B, dict(CASE, hosts=1024, storage_gbps=0.1),
                                dict(CASE, storage_gbps=100), dict(WIDE, storage_gbps=50, hosts=2)])
def test_loading_from_host_memory_is_never_slower_than_from_storage(kw):
  i = gp.PlanInputs(**kw)
  m = gp.measured()
  host = gp.host_load_secs(i.state_gib_per_host, m)
  store = gp.storage_load_secs(i.state_gib_per_host, i.storage_gbps, m)
  assert host <= store
  for o in gp.plan(i).options:
    for _, load in (o.crash_recovery, o.host_loss_recovery):
      assert load >= host - 1e-9, o.name       # every tier does at least a host load's work
    if o.name == "agent":                        # a crash loads from memory, a host loss storage
      assert o.crash_recovery[1] == pytest.approx(host)
      assert o.host_loss_recovery[1] == pytest.approx(store)
  wide = gp.plan(gp.PlanInputs(**WIDE)).options[1]
  assert wide.crash_recovery[1] <= wide.host_loss_recovery[1]     # was 45.6 s against 42.9 s


def test_hours_between_persists_come_with_the_reason():
  """A replicated 7B state (78 GiB with Adam) on 128 GiB hosts: no host tier fits, and the
  storage-only interval of 4.9 h says why, and what would make host snapshots fit."""
  p = gp.plan(gp.PlanInputs(**REPLICATED_7B))
  r = p.recommended
  assert r.name == "storage-only" and r.options["persist_interval_steps"] == 8789
  notes = " ".join(r.notes)
  assert "persists every 4.9 h (8,789 steps)" in notes
  assert "blocks the loop for its 84 s write" in notes and "515.6 h MTBF" in notes
  assert "a failure loses 2.4 h of work on average" in notes
  assert "max_snapshots=1 needs 2 x 78 GiB = 156.0 GiB per host against a budget of 64.0 GiB" \
      in notes
  assert "sharded over the 8 hosts (FSDP) it is 9.75 GiB per host, and host snapshots fit" in notes
  sharded = gp.plan(gp.PlanInputs(**dict(REPLICATED_7B, state_gib_per_host=78 / 8)))
  assert sharded.recommended.name == "agent + parity"                  # as the note says
  # A host tier persisting hours apart says why too (1 TiB per host over 0.1 GB/s).
  slow = gp.plan(gp.PlanInputs(**dict(CASE, state_gib_per_host=1024, host_ram_gib=8192,
                                      storage_gbps=0.1)))
  assert any("persists every 6.2 h: writing 1024 GiB at 0.1 GB/s takes 3.1 h" in n
             for n in slow.recommended.notes)
  short = gp.plan(gp.PlanInputs(**CASE)).recommended
  assert not any("persists every" in n for n in short.notes)


@pytest.mark.parametrize("flag,value", [("state-gib-per-host", "1e308"), ("step-secs", "1e-320"),
                                        ("hosts", "100000000"), ("storage-gbps", "1e-300"),
                                        ("accelerator-mtbf-hours", "1e300"),
                                        ("restart-secs", "1e300")])
def test_finite_absurd_inputs_are_a_clear_error(flag, value, capsys):
  argv = {**{k.replace("_", "-"): str(v) for k, v in WIDE.items()}, flag: value}
  code, out, err = _run_plan(capsys, *[x for k, v in argv.items() for x in ("--" + k, v)])
  assert code == 2 and not out and len(err.splitlines()) == 1, err
  assert err.startswith(f"jaxckpt plan: --{flag} must be between ")


def test_an_absurd_input_at_the_console_is_one_line_and_exit_2():
  out = subprocess.run([sys.executable, "-m", "jaxckpt", "plan", *_argv(**dict(
      WIDE, state_gib_per_host="1e308"))], capture_output=True, text=True, timeout=120)
  assert out.returncode == 2 and not out.stdout and "Traceback" not in out.stderr
  assert out.stderr == ("jaxckpt plan: --state-gib-per-host must be between 1e-06 and 1e+06 "
                        "GiB for the model to hold, got 1e+308\n")


@pytest.mark.parametrize("name", sorted(gp.RANGES))
def test_every_input_at_either_end_of_its_range_gives_a_finite_plan(name):
  lo, hi, _ = gp.RANGES[name]
  for v in (lo, hi):
    if name in ("hosts", "accelerators_per_host"):
      v = int(v)
    p = gp.plan(gp.PlanInputs(**dict(WIDE, **{name: v})))
    for o in p.options:
      assert all(math.isfinite(x) for x in (o.goodput, o.error, o.memory_gib,
                                            *o.crash_recovery, *o.host_loss_recovery)), (name, v)


@pytest.mark.parametrize("tau,mtbf,delta,restart", [(90, 232031, 0.0046, 613),
                                                    (12, 14400, 0.0046, 656),
                                                    (17578, 1.856e6, 84, 654)])
def test_the_remainder_is_what_the_first_order_model_drops(tau, mtbf, delta, restart):
  gap = daly_efficiency(tau, mtbf, delta, restart) - first_order_efficiency(tau, mtbf, delta, restart)
  assert first_order_remainder(tau, mtbf, delta, restart) == pytest.approx(gap, rel=0.1)
