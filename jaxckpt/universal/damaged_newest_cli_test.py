"""The CLI goes on past a damaged newest step and says what to do:
`verify --all-steps` checks every intact older step and `inspect` shows the newest
intact one, each naming `jaxckpt delete DIR --step N`; `inspect | head -1` ends
quietly; `import-orbax` of a missing path says it does not exist; no message
carries tensorstore's ~1 KB spec."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

import jaxckpt as jc
from jaxckpt.testing import damage
from jaxckpt.universal import _commit
from tests.support import fixtures as _fixtures
from jaxckpt.universal import _layout as lay

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "jaxckpt", *argv], capture_output=True, text=True,
                        timeout=120, cwd=REPO, check=False)


def _damage(d: str, how: str) -> None:
  """Step 3 (the newest) damaged as ``how`` says."""
  if how == "marker not JSON":
    with open(os.path.join(d, lay.commit_key(3)), "w") as f:
      f.write("garbage")
  elif how == "manifest missing":
    os.unlink(os.path.join(d, lay.manifest_key(3, _commit.committed_by(d, 3))))
  elif how == "manifest resealed off-schema":
    damage.reseal_manifest(d, 3, lambda doc, marker: doc.update(leaves="not a list"))
  else:                                       # a leaf's zarr metadata gone
    os.unlink(glob.glob(os.path.join(d, lay.step_dir(3), "arrays", "*", "*", "zarr.json"))[0])


HOWS = ["marker not JSON", "manifest missing", "manifest resealed off-schema", "zarr.json gone"]


@pytest.mark.parametrize("how", HOWS)
def test_verify_all_steps_checks_every_step_past_a_damaged_newest_one(tmp_path, how):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1, 2, 3)
  _damage(d, how)
  p = _cli("verify", d, "--all-steps", "--no-progress")
  assert p.returncode == 1, (p.stdout, p.stderr)
  assert "step 1: OK" in p.stdout and "step 2: OK" in p.stdout, p.stdout
  assert "DAMAGED step 3" in p.stdout, p.stdout
  assert f"jaxckpt delete {d} --step 3" in p.stderr, p.stderr
  assert "discard_step" not in p.stdout + p.stderr and "Traceback" not in p.stderr
  assert "tensorstore_spec" not in p.stdout + p.stderr and len(p.stdout) < 2000, p.stdout


@pytest.mark.parametrize("how", HOWS[:3])
def test_inspect_shows_the_newest_intact_step_past_a_damaged_one(tmp_path, how):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1, 2, 3)
  _damage(d, how)
  p = _cli("inspect", d)
  assert p.returncode == 1, (p.stdout, p.stderr)
  assert p.stdout.startswith(f"{d}: step 2 "), p.stdout
  assert "DAMAGED step 3" in p.stderr and f"jaxckpt delete {d} --step 3" in p.stderr, p.stderr
  p = _cli("inspect", d, "--step", "3")
  assert p.returncode == 2 and f"jaxckpt delete {d} --step 3" in p.stderr, p.stderr
  assert "discard_step" not in p.stderr and "Traceback" not in p.stderr


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
  d = str(tmp_path / "ck")
  leaves = {f"['leaf_{i:05d}']": jc.universal.LeafInfo(path=f"['leaf_{i:05d}']", kind="scalar",
                                                      value="x" * 100) for i in range(1500)}
  jc.universal.write_leaves(d, 1, leaves, {}, metadata={})       # ~200 KB of output
  proc = subprocess.Popen([sys.executable, "-m", "jaxckpt", "inspect", d], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    first = proc.stdout.readline()                # then the reader goes, as `head -1` does
    proc.stdout.close()
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert first.startswith(d.encode()), first
  assert "BrokenPipeError" not in err and "Traceback" not in err and "Exception" not in err, err
  assert code == 141, (code, err)


def test_import_orbax_of_a_missing_path_says_it_does_not_exist(tmp_path):
  p = _cli("import-orbax", str(tmp_path / "nonexistent"), str(tmp_path / "dst"))
  assert p.returncode == 2, p.stderr
  assert f"{str(tmp_path / 'nonexistent')!r} does not exist" in p.stderr, p.stderr
  assert not os.path.exists(tmp_path / "dst")


def test_no_error_message_carries_tensorstore_s_spec(tmp_path):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1)
  os.unlink(glob.glob(os.path.join(d, lay.step_dir(1), "arrays", "*", "*", "zarr.json"))[0])
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False)) as m:
    with pytest.raises(jc.errors.CorruptSnapshotError) as e:
      m.restore(1)
  assert "tensorstore_spec" not in str(e.value) and len(str(e.value)) < 600, str(e.value)
  assert "zarr.json" in str(e.value)
