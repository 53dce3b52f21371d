"""docs/planning.md: every table and command output on the page is what jaxckpt.goodput.plan computes."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from jaxckpt import cli
from jaxckpt.goodput import plan as gp
from jaxckpt.goodput.closed_form import daly_optimal_interval

_PAGE = pathlib.Path(__file__).resolve().parent / "planning.md"


def _page() -> str:
  return _PAGE.read_text()


def memory_table() -> str:
  s = 8
  rows = ["| option | formula | host memory per host (8 GiB state) |", "| --- | --- | --- |"]
  for k in (1, 2, 3):
    rows.append(f"| agent or in-process, `max_snapshots={k}` | ({k} + 1) x S | "
                f"{gp.host_memory_gib(s, k):.1f} GiB |")
  for g, m in ((4, 1), (8, 1), (16, 1), (8, 2)):
    share = gp.parity_fraction(64, g, m)
    rows.append(f"| agent, `max_snapshots=2`, parity g={g}, m={m} | 3 x S x (1 + {m}/{g - m}) | "
                f"{gp.host_memory_gib(s, 2, share):.1f} GiB |")
  rows.append(f"| storage-only | one staging buffer | {gp.STAGING_GIB:.1f} GiB |")
  return "\n".join(rows)


def persist_table() -> str:
  rows = ["| state per host | storage 0.1 GB/s | 1 GB/s | 10 GB/s |", "| --- | --- | --- | --- |"]
  for s in (1, 8, 64):
    cells = [f"{gp.persist_secs(s, b):.1f} s (every {gp.persist_secs(s, b) / gp.PERSIST_BUSY_SHARE:.1f} s)"
             for b in (0.1, 1, 10)]
    rows.append(f"| {s} GiB | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def parity_table() -> str:
  host_mtbf = 33_000 * 3600 / 8
  rows = ["| group g | parity m | memory per snapshot | P(step lost from memory) per host loss |",
          "| --- | --- | --- | --- |"]
  for g, m in ((2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (8, 2), (16, 2)):
    p = gp.loss_beyond_parity(g, m, 600, host_mtbf)
    rows.append(f"| {g} | {m} | +{100 * gp.parity_fraction(g, g, m):.1f}% | {p:.1e} |")
  return "\n".join(rows)


def save_table() -> str:
  delta = gp.measured().save_blocking_secs
  rows = ["| hosts (x 8 accelerators) | job MTBF | Daly's save interval | blocked at that interval | "
          "blocked saving every 1 s step |", "| --- | --- | --- | --- | --- |"]
  for hosts in (8, 64, 512, 4096):
    i = gp.PlanInputs(state_gib_per_host=8, host_ram_gib=512, hosts=hosts, step_secs=1, storage_gbps=1)
    m = gp.job_mtbf_secs(i)
    tau = daly_optimal_interval(m, delta)
    rows.append(f"| {hosts} | {m / 3600:.1f} h | {tau:.0f} s | {100 * delta / tau:.3f}% | "
                f"{100 * delta:.2f}% |")
  return "\n".join(rows)


_WIDE = dict(state_gib_per_host=80, host_ram_gib=512, hosts=64, step_secs=10, storage_gbps=2)
_7B = dict(state_gib_per_host=78, host_ram_gib=128, hosts=8, step_secs=2, storage_gbps=1)


def _flags(kw) -> str:
  return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kw.items())


def _says(kw) -> str:
  r = gp.plan(gp.PlanInputs(**kw)).recommended
  return f"{r.name}, {100 * r.goodput:.3f}% ±{100 * r.error:.3f}"


def cases_table() -> str:
  """The planning page's cases (a wide job, a 7B model, ...), with what `jaxckpt plan` says of each."""
  m = gp.measured()
  wide = gp.plan(gp.PlanInputs(**_WIDE))
  parity, agent, inproc, _ = wide.options
  seven = gp.plan(gp.PlanInputs(**_7B)).recommended
  rows = ["| case | inputs | `plan` recommends | and says |", "| --- | --- | --- | --- |",
          f"| two options within the model's error | `{_flags(_WIDE)}` | {_says(_WIDE)} | "
          f"in-process gets {100 * inproc.goodput:.3f}% ±{100 * inproc.error:.3f}, within the "
          "error: the agent with parity survives more failures from host memory |",
          f"| loading from host memory against storage | the same | | a crash loads from the "
          f"agent's memory in {agent.crash_recovery[1]:.1f} s; storage reads in "
          f"{gp.persist_secs(80, 2):.1f} s and loads in {agent.host_loss_recovery[1]:.1f} s "
          "(a restore from storage also does what one from memory does) |",
          f"| a replicated 7B state (78 GiB with Adam) on 128 GiB hosts | `{_flags(_7B)}` | "
          f"{_says(_7B)} | persists every {seven.options['persist_interval_steps']:,} steps "
          f"({seven.options['persist_interval_steps'] * 2 / 3600:.1f} h), because each persist "
          f"blocks for its {gp.persist_secs(78, 1):.0f} s write and no host tier fits (2 x 78 GiB "
          f"against {gp.budget_gib(gp.PlanInputs(**_7B)):.0f} GiB); sharded over the 8 hosts it is "
          f"{78 / 8:.2f} GiB per host, and the agent fits |"]
  for flag, value in (("state-gib-per-host", "1e308"), ("step-secs", "1e-320")):
    kw = {**_WIDE, flag.replace("-", "_"): value}
    code = cli.main(["plan", *_flags(kw).split()])
    assert code == 2
    rows.append(f"| finite absurd input | `--{flag} {value}` | exit 2 | "
                f"`{_error_line(kw)}` |")
  assert m.host_load_secs_per_gib * 80 == pytest.approx(agent.crash_recovery[1])
  assert wide.recommended.name == parity.name
  return "\n".join(rows)


def _error_line(kw) -> str:
  try:
    gp.PlanInputs(**{k: (int(v) if k == "hosts" else float(v)) for k, v in kw.items()})
  except Exception as e:  # pylint: disable=broad-except
    return gp.cli_message(e)
  raise AssertionError(f"{kw} was taken")


@pytest.mark.parametrize("table", [memory_table, persist_table, parity_table, save_table,
                                   cases_table])
def test_each_table_is_what_the_formulas_give(table):
  assert table() in _page()


def _commands() -> list[tuple[str, str]]:
  return re.findall(r"```bash\n(jaxckpt plan [^\n]*)\n```\n\n```text\n(.*?)```", _page(), re.S)


def test_each_command_prints_what_the_page_shows(capsys):
  commands = _commands()
  assert len(commands) == 4
  for command, shown in commands:
    assert cli.main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.strip() == shown.strip(), command


def test_the_figures_quoted_in_the_text():
  page, m = _page(), gp.measured()
  assert f"`save()` blocks {1000 * m.save_blocking_secs:.1f} ms per save" in page
  assert f"a snapshot's background copy takes {gp.SNAPSHOT_SECS_PER_GIB:.2f} s per GiB" in page
  assert f"host memory {m.host_load_secs_per_gib:.2f} s per GiB" in page
  assert f"{gp.PARITY_REBUILD_FACTOR} times that" in page and f"{gp.ENCODE_GBPS} GB/s" in page
  assert f"newest protected step can be: {gp.protect_secs(8, 1, 12.5):.1f} s for 8 GiB" in page
  assert f"(8.6 s for 8 GiB at 1 GB/s)" in page and f"{gp.persist_secs(8, 1):.1f}" == "8.6"
  i = gp.PlanInputs(state_gib_per_host=8, host_ram_gib=512, hosts=64, step_secs=1, storage_gbps=1)
  assert f"570 s per failure is {100 * 570 / gp.job_mtbf_secs(i):.2f}% of a 64.5 h MTBF" in page
