"""The `jaxckpt` command: every subcommand is wired and explains itself."""

import subprocess
import sys

import pytest

from jaxckpt import cli


@pytest.mark.parametrize("command", ["status", "agent", "inspect", "verify", "delete", "convert", "import-orbax", "export-orbax", "lighthouse", "simulate", "plan"])
def test_each_subcommand_has_help(command, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main([command, "--help"])
  assert e.value.code == 0
  assert len(capsys.readouterr().out) > 200


def test_console_script_runs():
  out = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "--help"], capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0
  for command in ("agent", "inspect", "verify", "lighthouse", "simulate", "plan"):
    assert command in out.stdout


def test_python_dash_m_jaxckpt_runs():
  out = subprocess.run([sys.executable, "-m", "jaxckpt", "--help"], capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("usage: jaxckpt")
  for command in ("agent", "inspect", "verify", "import-orbax", "export-orbax", "lighthouse", "simulate", "plan"):
    assert command in out.stdout


@pytest.mark.parametrize("command", ["status", "agent", "inspect", "verify", "delete", "convert", "import-orbax", "export-orbax", "lighthouse", "simulate", "plan"])
def test_help_is_plain_text(command, capsys):
  with pytest.raises(SystemExit):
    cli.main([command, "--help"])
  out = capsys.readouterr().out
  assert "``" not in out
  for role in (":class:", ":func:", ":meth:", ":mod:", ":attr:", ":data:", ":doc:", ":ref:"):
    assert role not in out, (command, role)
