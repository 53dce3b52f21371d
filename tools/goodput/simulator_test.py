"""Tests of the goodput simulator: determinism, calibration, sanity, validation, plot, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import doctest
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from jaxckpt import cli, errors
from tools import goodput as sim
from jaxckpt.errors import JaxckptError
from tools.goodput import MODES, Mode, SimulationConfig, simulate, simulator, sweep

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_same_seed_same_result_other_seed_other_result():
  config = SimulationConfig(simulated_days=3)
  for mode in MODES:
    a, b = simulate(config, mode, seed=7), simulate(config, mode, seed=7)
    assert a == b
    assert a.to_dict() == b.to_dict()
    assert simulate(config, mode, seed=8).effective_training_time != a.effective_training_time


def test_modes_see_the_same_failures_for_a_seed():
  config = SimulationConfig(simulated_days=3)
  counts = {simulate(config, m, seed=3).failures for m in MODES}
  assert len(counts) == 1


# Daly (2006), section 5: R = 10 min, delta = 5 min; his optima for MTBF 24 h, 6 h and 15 min.
_DALY_CASES = [(24.0, 117.0), (6.0, 57.0), (0.25, 9.1)]


@pytest.mark.parametrize("mtbf_hours,daly_minutes", _DALY_CASES)
def test_closed_form_optimum_matches_daly_2006(mtbf_hours, daly_minutes):
  m = mtbf_hours * 3600
  assert sim.daly_optimal_interval(m, 300) / 60 == pytest.approx(daly_minutes, rel=0.01)
  r = sim.simulate_synchronous(m, 300, 600, optimal_interval=True, seed=0)
  assert r.optimal_interval_secs == r.interval_secs
  assert r.optimal_interval_secs / 60 == pytest.approx(daly_minutes, rel=0.02)
  # The simulated effective training time agrees with Daly's exact expectation to the sampling error.
  assert r.effective_training_time == pytest.approx(r.daly_effective_training_time, abs=0.002)


def test_closed_form_first_order_error_is_second_order_in_tau_over_m():
  # Young/Daly's first-order model drops terms of order (delta / tau)^2 and ((tau + delta + R) / M)^2: at
  # tau = 1 h, delta = 5 min its error is under 1% and shrinks towards (delta / tau)^2 with a longer MTBF.
  errors = []
  for hours in (24.0, 96.0):
    r = sim.simulate_synchronous(hours * 3600, 300, 600, 3600.0, seed=1)
    assert r.interval_secs == 3600.0 and r.optimal_interval_secs is None
    err = abs(r.effective_training_time - r.first_order_effective_training_time)
    assert err < (300 / 3600) ** 2 + ((3600 + 300 + 600) / (hours * 3600)) ** 2
    errors.append(err)
  assert errors[1] < errors[0]


def test_closed_form_is_seeded():
  a = sim.simulate_synchronous(21600, 300, 600, optimal_interval=True, seed=3, failures=20_000)
  assert a == sim.simulate_synchronous(21600, 300, 600, optimal_interval=True, seed=3, failures=20_000)
  assert a != sim.simulate_synchronous(21600, 300, 600, optimal_interval=True, seed=4, failures=20_000)


@pytest.mark.parametrize("kwargs,words", [
    ({"mtbf_secs": 0.0}, "mtbf_secs=0.0 must be a positive"),
    ({"checkpoint_secs": -1.0}, "checkpoint_secs=-1.0 must be a positive"),
    ({"restart_secs": -5.0}, "restart_secs=-5.0 must be >= 0"),
    ({"failures": 10}, "failures=10 is too few"),
])
def test_closed_form_rejects_bad_inputs(kwargs, words):
  args = {"mtbf_secs": 3600.0, "checkpoint_secs": 60.0, "restart_secs": 60.0, **kwargs}
  with pytest.raises(sim.SimulationInputError, match=words) as e:
    sim.simulate_synchronous(**args)
  assert isinstance(e.value, ValueError) and isinstance(e.value, JaxckptError)


@pytest.mark.parametrize("mtbf_hours,daly_minutes", _DALY_CASES)
def test_cli_closed_form_json(capsys, mtbf_hours, daly_minutes):
  assert cli.main(["simulate", "--mode", "synchronous", "--mtbf-hours", str(mtbf_hours), "--checkpoint-secs",
                   "300", "--restart-secs", "600", "--optimal-interval", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["optimal_interval_secs"] / 60 == pytest.approx(daly_minutes, rel=0.02)
  assert out["daly_optimal_interval_secs"] / 60 == pytest.approx(daly_minutes, rel=0.01)
  assert out["effective_training_time"] == pytest.approx(out["daly_effective_training_time"], abs=0.002)
  assert 0 < out["effective_training_time"] < 1


def test_cli_closed_form_needs_checkpoint_secs(capsys):
  assert cli.main(["simulate", "--mode", "synchronous", "--mtbf-hours", "6"]) == 2
  assert "needs --mtbf-hours H and --checkpoint-secs C" in capsys.readouterr().err


def test_synchronous_stall_matches_restart_from_scratch_theory():
  # A failure during a restart of nominal length S starts it over, so the stall charged
  # to one failure is min(S, time to the next failure): mean (1 - exp(-rate*S)) / rate.
  config = SimulationConfig(simulated_days=60)
  rate = config.accelerators / (config.accelerator_mtbf_hours * 3600)
  nominal = config.job_restart_secs + config.checkpoint_load_secs
  expected = (1 - math.exp(-rate * nominal)) / rate
  r = simulate(config, Mode.SYNCHRONOUS, seed=0)
  assert r.stall_per_failure_secs == pytest.approx(expected, rel=0.03)
  expected_failures = rate * r.wall_secs
  assert abs(r.failures - expected_failures) < 4 * math.sqrt(expected_failures)


def test_without_failures_only_checkpoint_saves_cost():
  config = SimulationConfig(accelerator_mtbf_hours=1e15, simulated_days=2)
  for mode in MODES:
    r = simulate(config, mode, seed=0)
    assert r.failures == 0
    interval, save = config.checkpoint_interval_secs, config.checkpoint_save_stall_secs
    # 2 days hold 172_800 / 305 = 566 whole cycles plus 170 s of running.
    cycles, rest = divmod(r.wall_secs, interval + save)
    expected = (cycles * interval + min(rest, interval)) / r.wall_secs
    assert r.effective_training_time == pytest.approx(expected, abs=1e-12)
    assert r.stall_per_failure_secs == 0.0


def test_breakdown_sums_to_one_and_matches_effective_training_time():
  for mode in MODES:
    r = simulate(SimulationConfig(simulated_days=5), mode, seed=1)
    assert sum(r.breakdown.values()) == pytest.approx(1.0, abs=1e-9)
    assert r.breakdown["useful"] == r.effective_training_time
    if mode is Mode.SYNCHRONOUS:
      assert r.breakdown["degraded"] == 0.0
      assert r.breakdown["recomputed"] > 0.0
    else:
      assert r.breakdown["degraded"] > 0.0


def test_more_failures_less_goodput():
  for mode in MODES:
    etts = [simulate(SimulationConfig(accelerator_mtbf_hours=h, simulated_days=5), mode, 2)
            .effective_training_time for h in (10_000, 33_000, 100_000, 300_000)]
    assert etts == sorted(etts), (mode, etts)


def test_host_snapshots_never_worse_than_plain_replica_groups():
  config = SimulationConfig(simulated_days=5)
  for seed in range(3):
    for n in (1024, 16_384, 131_072):
      c = dataclasses.replace(config, accelerators=n)
      plain = simulate(c, Mode.REPLICA_GROUPS, seed)
      snap = simulate(c, Mode.REPLICA_GROUPS_HOST_SNAPSHOTS, seed)
      assert snap.effective_training_time >= plain.effective_training_time, (seed, n)
      assert snap.breakdown["degraded"] < plain.breakdown["degraded"], (seed, n)


def test_replica_groups_beat_synchronous_at_scale():
  r = {m: simulate(SimulationConfig(accelerators=131_072, simulated_days=5), m, 0) for m in MODES}
  assert r[Mode.REPLICA_GROUPS].effective_training_time > (
      r[Mode.SYNCHRONOUS].effective_training_time + 0.3)


def test_no_spares_means_waiting_for_repairs():
  base = SimulationConfig(accelerators=4096, simulated_days=10)
  spared = simulate(base, Mode.SYNCHRONOUS, 0)
  starved = simulate(dataclasses.replace(base, spare_fraction=0.0, repair_hours=24), "synchronous", 0)
  assert starved.failures == spared.failures
  # Each failure now waits ~24 h for its repair instead of ~13.5 min for a restart.
  assert starved.stall_per_failure_secs > 10 * spared.stall_per_failure_secs
  assert starved.effective_training_time < 0.5 * spared.effective_training_time


@pytest.mark.parametrize("field, value, words", [
    ("replica_groups", 1, "replica_groups must be in [2, accelerators=98304], got 1"),
    ("accelerators", 8, "replica_groups must be in [2, accelerators=8], got 12"),
    ("accelerator_mtbf_hours", 0.0, "accelerator_mtbf_hours must be > 0, got 0.0"),
    ("job_restart_secs", -1.0, "job_restart_secs must be >= 0, got -1.0"),
    ("checkpoint_interval_secs", 0.0, "checkpoint_interval_secs must be > 0, got 0.0"),
    ("simulated_days", float("nan"), "simulated_days must be a finite number, got nan"),
    ("accelerators", 1000.5, "accelerators must be an int, got 1000.5"),
    ("spare_fraction", 1.5, "spare_fraction must be <= 1, got 1.5"),
    ("repair_hours", True, "repair_hours must be a finite number, got True"),
])
def test_config_validation_names_field_and_value(field, value, words):
  with pytest.raises(ValueError) as e:
    SimulationConfig(**{field: value})
  assert words in str(e.value)


def test_unknown_mode_is_rejected_with_the_choices():
  with pytest.raises(ValueError, match=r"mode='async'.*'synchronous', 'replica_groups'"):
    simulate(SimulationConfig(simulated_days=1), "async")


def test_sweep_covers_every_size_and_mode():
  results = sweep(sim.log_scale(1024, 4096), SimulationConfig(simulated_days=1), seed=0)
  assert [(r.accelerators, r.mode) for r in results] == [
      (n, m) for n in (1024, 2048, 4096) for m in MODES]
  assert sim.log_scale(1000, 131_072)[0] == 1024 and sim.log_scale()[-1] == 131_072


def test_plot_writes_a_png(tmp_path):
  path = tmp_path / "goodput.png"
  sim.plot(sweep([1024, 8192], SimulationConfig(simulated_days=1)), path)
  data = path.read_bytes()
  assert data[:8] == _PNG_MAGIC
  assert len(data) > 10_000


def test_docstring_examples_and_explain_state_every_input():
  assert doctest.testmod(simulator).failed == 0
  text = sim.explain()
  for f in dataclasses.fields(SimulationConfig):
    assert f"--{f.name.replace('_', '-')} = {f.default!r}" in text
    assert f.metadata["why"] in text
  assert "44%" in text and "80%" in text and "10 min" in text and "3 min" in text
  for name in ("accelerator_mtbf_hours=33_000", "job_restart_secs=570", "replica_groups=12",
               "rejoin_stall_secs=25", "checkpoint_interval_secs=300"):
    assert name in simulator.__doc__


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxckpt")
  sim.register_cli(parser.add_subparsers(dest="command"))
  return parser


def test_cli_json_matches_sweep(capsys):
  args = _parser().parse_args(
      ["simulate", "--accelerators", "1024,2048", "--days", "2", "--seed", "5", "--json",
       "--replica-groups", "8"])
  assert args.func(args) == 0
  out = json.loads(capsys.readouterr().out)
  expected = sweep([1024, 2048], SimulationConfig(simulated_days=2, replica_groups=8), seed=5)
  assert out["results"] == [r.to_dict() for r in expected]
  assert out["config"]["replica_groups"] == 8


def test_cli_table_plot_and_explain(capsys, tmp_path):
  png = tmp_path / "p.png"
  args = _parser().parse_args(["simulate", "--accelerators", "4096", "--days", "1",
                               "--plot", str(png)])
  assert args.func(args) == 0
  out = capsys.readouterr().out
  assert png.read_bytes()[:8] == _PNG_MAGIC
  for m in MODES:
    assert m.value in out
  args = _parser().parse_args(["simulate", "--explain", "--job-restart-secs", "60"])
  assert args.func(args) == 0
  assert "--job-restart-secs = 60.0   (changed from the default 570.0)" in capsys.readouterr().out


def test_cli_bad_input_exits_2_with_the_reason(capsys):
  args = _parser().parse_args(["simulate", "--accelerators", "8", "--days", "1"])
  assert args.func(args) == 2
  assert "replica_groups must be in [2, accelerators=8], got 12" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    _parser().parse_args(["simulate", "--help"])
  help_text = " ".join(capsys.readouterr().out.split())
  assert "44%" in help_text and "accelerator_mtbf_hours=33_000" in help_text
  assert "(default 33000.0)" in help_text


def test_sensitivity_halves_and_doubles_every_input():
  config = SimulationConfig(simulated_days=2)
  out = sim.sensitivity(config, accelerators=[16_384], modes=[Mode.SYNCHRONOUS, Mode.REPLICA_GROUPS],
                        seeds=(0, 1))
  assert [(r["accelerators"], r["mode"]) for r in out["results"]] == [
      (16_384, "synchronous"), (16_384, "replica_groups")]
  inputs = [f.name for f in dataclasses.fields(SimulationConfig) if f.name not in ("accelerators", "simulated_days")]
  for r in out["results"]:
    assert list(r["inputs"]) == inputs
    base = np.mean([simulate(dataclasses.replace(config, accelerators=16_384), r["mode"], s).effective_training_time
                    for s in (0, 1)])
    assert r["base"] == pytest.approx(base, abs=1e-12)
    # Rarer failures help and more frequent ones hurt, in every mode.
    assert r["inputs"]["accelerator_mtbf_hours"]["halved"] < 0 < r["inputs"]["accelerator_mtbf_hours"]["doubled"]
  sync = out["results"][0]["inputs"]
  assert sync["job_restart_secs"]["doubled"] < 0 < sync["job_restart_secs"]["halved"]
  # A replica-group-only input does not touch the synchronous job.
  assert sync["rejoin_stall_secs"] == {"halved": 0.0, "doubled": 0.0}


def test_cli_sensitivity_json(capsys):
  assert cli.main(["simulate", "--sensitivity", "--accelerators", "4096", "--days", "1",
                   "--modes", "replica_groups"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert [(r["accelerators"], r["mode"]) for r in out["results"]] == [(4096, "replica_groups")]
  assert set(out["results"][0]["inputs"]["failure_detection_secs"]) == {"halved", "doubled"}


def test_every_input_cites_a_source_and_the_paper_is_only_a_comparison():
  gp = sim
  names = {f.name for f in dataclasses.fields(gp.SimulationConfig)}
  assert names == set(gp.SOURCES) and all(len(gp.SOURCES[n]) > 20 for n in names)
  text = gp.explain()
  assert text.count("source: ") == len(names)
  assert "Comparison points (not inputs)" in text and "44% (synchronous)" in text


def _write_benchmarks(d):
  (d / "snapshot.json").write_text(json.dumps({"bytes": 2 * 2**30, "seconds": {
      "agent_restore_same_s": {"median": 0.5}, "agent_blocking_s": {"median": 0.006}}}))
  (d / "catch_up.json").write_text(json.dumps({"size_mib": 256, "catch_up_secs": 0.7}))
  (d / "catch_up_stall.json").write_text(json.dumps({
      "healthy_worst_step_while_catching_up_s": 0.125, "healthy_median_step_s": 0.1}))


def test_from_benchmarks_derives_jaxckpts_inputs_and_cites_the_files(tmp_path):
  gp = sim
  _write_benchmarks(tmp_path)
  values, cites = gp.from_benchmarks(tmp_path, state_gib_per_host=8)
  assert values == pytest.approx({"host_snapshot_load_secs": 0.5 / 2 * 8,
                                  "peer_state_fetch_secs": 0.7 / 0.25 * 8,
                                  "checkpoint_save_stall_secs": 0.006,
                                  "rejoin_stall_secs": 0.025})
  assert all(str(tmp_path) in c for c in cites.values())
  out = subprocess.run([sys.executable, "-m", "jaxckpt", "simulate", "--from-benchmarks", str(tmp_path),
                        "--accelerators", "1024", "--days", "1", "--json"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  doc = json.loads(out.stdout)
  assert doc["config"]["host_snapshot_load_secs"] == pytest.approx(2.0)
  assert "snapshot.json" in doc["sources"]["host_snapshot_load_secs"]
  assert doc["comparison"]["effective_training_time"]["synchronous"] == 0.44
  (tmp_path / "catch_up.json").unlink()
  with pytest.raises(errors.InvalidArgumentError, match=r"catch_up.json is missing; write it with "
                     r"`python benchmarks/catch_up.py > DIR/catch_up.json`"):
    gp.from_benchmarks(tmp_path, state_gib_per_host=8)
  (tmp_path / "catch_up.json").write_text(json.dumps({"size_mib": 256}))
  with pytest.raises(errors.InvalidArgumentError, match=r"catch_up.json has no field catch_up_secs"):
    gp.from_benchmarks(tmp_path, state_gib_per_host=8)


def test_from_benchmarks_takes_the_replica_group_inputs_from_ft_goodput_when_present(tmp_path):
  # Detection, re-forming and the rejoin stall come from real groups under faults.
  gp = sim
  _write_benchmarks(tmp_path)
  (tmp_path / "ft_goodput.json").write_text(json.dumps({"host": "2 cores", "runs": [{}, {}, {}], "goodput_inputs": {
      "failure_detection_secs": 0.41, "quorum_reform_secs": 0.02, "rejoin_stall_secs": 0.015}}))
  values, cites = gp.from_benchmarks(tmp_path, state_gib_per_host=8)
  assert values["failure_detection_secs"] == 0.41 and values["quorum_reform_secs"] == 0.02
  assert values["rejoin_stall_secs"] == 0.015          # (not catch_up_stall.json's 0.025)
  assert "ft_goodput.json" in cites["failure_detection_secs"] and "3 run(s), 2 cores" in cites["failure_detection_secs"]
  config = dataclasses.replace(SimulationConfig(simulated_days=2), **values)
  measured = simulate(config, Mode.REPLICA_GROUPS, seed=0)
  published = simulate(SimulationConfig(simulated_days=2), Mode.REPLICA_GROUPS, seed=0)
  assert measured.stall_per_failure_secs < published.stall_per_failure_secs / 100
  (tmp_path / "ft_goodput.json").write_text(json.dumps({"goodput_inputs": {"failure_detection_secs": 1}}))
  with pytest.raises(errors.InvalidArgumentError, match=r"ft_goodput.json has no field "
                     r"goodput_inputs.quorum_reform_secs"):
    gp.from_benchmarks(tmp_path, state_gib_per_host=8)


def test_sensitivity_plot_is_a_tornado_png(tmp_path):
  pytest.importorskip("matplotlib")
  report = sim.sensitivity(SimulationConfig(simulated_days=0.5), accelerators=[1024],
                           modes=["synchronous", "replica_groups"], seeds=(0,))
  path = tmp_path / "tornado.png"
  sim.plot_tornado(report, path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
