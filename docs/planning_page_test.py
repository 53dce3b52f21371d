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


@pytest.mark.parametrize("table", [memory_table, persist_table, parity_table, save_table])
def test_each_table_is_what_the_formulas_give(table):
  assert table() in _page()


def _commands() -> list[tuple[str, str]]:
  return re.findall(r"```bash\n(jaxckpt plan [^\n]*)\n```\n\n```text\n(.*?)```", _page(), re.S)


def test_each_command_prints_what_the_page_shows(capsys):
  commands = _commands()
  assert len(commands) == 3
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
