"""CLI paths: a step directory or a file given for the checkpoint's root names the root to
pass, and the layout text is true."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from tests.support.fixtures import run_cli, stored_steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUT = "(it holds commits/ and step_NNNNNNNNNN/ directories)"


def jaxckpt(*argv):
  """``jaxckpt ARGV`` as a user runs it: its exit code, stdout and stderr."""
  return subprocess.run([sys.executable, "-m", "jaxckpt", *argv], capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, PYTHONPATH=REPO))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return stored_steps(str(tmp_path_factory.mktemp("paths") / "run1"), 3, 70)


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_a_step_directory_names_the_root_and_the_command_that_works(ckpt, verb):
  given = os.path.join(ckpt, "step_0000000070")
  out = jaxckpt(verb, given)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  line, = out.stderr.strip().splitlines()
  assert line == (f"jaxckpt {verb}: {given!r} is step 70's directory in the checkpoint {ckpt!r}, "
                  f"not its root {LAYOUT}; pass the root: jaxckpt {verb} {ckpt} --step 70")
  again = jaxckpt(*shlex.split(line.split("pass the root: ")[1])[1:])
  assert again.returncode == 0, again.stderr
  assert "step 70" in again.stdout


def test_a_file_inside_a_step_names_the_root(ckpt, capsys):
  inside = os.path.join(ckpt, "step_0000000003", "attempts", "t3", "manifest.json")
  assert os.path.isfile(inside)
  out = run_cli(capsys, "inspect", inside)
  assert out.returncode == 2
  assert out.stderr.strip() == (
      f"jaxckpt inspect: {inside!r} is a file inside the checkpoint {ckpt!r}, not its root "
      f"{LAYOUT}; pass the root: jaxckpt inspect {ckpt} --step 3")


def test_a_plain_file_is_told_the_true_layout(tmp_path, capsys):
  f = tmp_path / "notes.txt"
  f.write_text("x")
  out = run_cli(capsys, "verify", str(f))
  assert out.returncode == 2 and out.stderr.strip() == (
      f"jaxckpt verify: {str(f)!r} is a file, not a checkpoint directory; pass the directory the "
      f"manager or `jaxckpt convert` wrote {LAYOUT}")


def test_convert_and_export_take_the_root_too(ckpt, tmp_path, capsys):
  spec = tmp_path / "r.json"
  spec.write_text('{"rules": [{"op": "rename", "src": "[\'w\']", "dst": "[\'v\']"}]}')
  given = os.path.join(ckpt, "step_0000000003")
  out = run_cli(capsys, "convert", given, str(tmp_path / "dst"), "--spec", str(spec))
  assert out.returncode == 2
  assert out.stderr.strip().endswith(f"pass the root ({ckpt} with --step 3)")
  out = run_cli(capsys, "export-orbax", "file://" + given, str(tmp_path / "ob"))
  assert out.returncode == 2 and f"in the checkpoint {ckpt!r}, not its root" in out.stderr


def test_an_object_store_step_directory_is_told_by_its_name(capsys):
  out = run_cli(capsys, "inspect", "s3://bucket/run1/step_0000000070/")
  assert out.returncode == 2 and out.stderr.strip() == (
      "jaxckpt inspect: 's3://bucket/run1/step_0000000070/' is step 70's directory in the "
      f"checkpoint 's3://bucket/run1', not its root {LAYOUT}; pass the root: jaxckpt inspect "
      "s3://bucket/run1 --step 70")
