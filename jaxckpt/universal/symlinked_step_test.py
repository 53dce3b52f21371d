"""No delete, cleanup, set-aside, import or read follows a link out of a checkpoint:
a planted link loses its name only, what it points to stays; a
link, a FIFO or a step directory that is a file is never read through (a restore goes
back to the older step); a hard link loses only its own name."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.universal import _commit
from tests.support import fixtures as _fixtures
from jaxckpt.universal import _layout as lay

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTS = jc.CheckpointOptions(handle_sigterm=False)


@pytest.fixture
def victim(tmp_path):
  """A user's files outside the checkpoint: {relative path: content}, checked intact."""
  root = tmp_path / "home"
  files = {"thesis.tex": "chapter 1", "notes/todo.txt": "read more"}
  for rel, text in files.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
  yield str(root)
  for rel, text in files.items():
    assert (root / rel).read_text() == text, f"the victim's {rel} was touched"


def _step_dir(d: str, step: int) -> str:
  return os.path.join(d, lay.step_dir(step).rstrip("/"))


def _link_step(d: str, step: int, target: str) -> None:
  """Step ``step``'s directory replaced by a link to ``target`` (its marker stays)."""
  shutil.rmtree(_step_dir(d, step))
  os.symlink(target, _step_dir(d, step))


def _cli(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "jaxckpt", *argv], capture_output=True, text=True,
                        timeout=120, cwd=REPO, check=False)


@pytest.mark.parametrize("how", ["cli", "discard_step", "todelete_subdir"])
def test_a_delete_removes_a_linked_step_directory_as_a_link(tmp_path, victim, how):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1, 2)
  _link_step(d, 1, victim)
  if how == "cli":
    p = _cli("delete", d, "--step", "1", "--run-root", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    assert "symbolic link" in p.stderr and "not what it points to" in p.stderr, p.stderr
  elif how == "discard_step":
    jc.universal.discard_step(d, 1)
  else:
    jc.universal.discard_step(d, 1, todelete_subdir="trash")
    assert os.path.islink(os.path.join(d, "trash", lay.step_dir(1).rstrip("/")))
  assert not os.path.lexists(_step_dir(d, 1))
  assert jc.universal.all_steps(d) == [2]


def test_a_manager_s_delete_and_max_to_keep_never_follow_a_linked_step(tmp_path, victim):
  d = str(tmp_path / "ck")
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False, max_to_keep=2,
                                                    persist_interval_steps=1)) as m:
    for s in (1, 2):
      assert m.save(s, {"w": np.full(4, s, np.float32)})
      m.wait_until_finished()
    _link_step(d, 1, victim)
    _link_step(d, 2, victim)
    m.delete(2)
    for s in (3, 4):                 # step 1 dropped by max_to_keep: deleted everywhere
      assert m.save(s, {"w": np.full(4, s, np.float32)})
      m.wait_until_finished()
    assert jc.universal.all_steps(d) == [3, 4]
  assert not os.path.lexists(_step_dir(d, 1)) and not os.path.lexists(_step_dir(d, 2))


def test_an_unfinished_save_that_is_a_link_a_file_or_a_fifo_loses_its_name_only(tmp_path, victim):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1)
  os.symlink(victim, _step_dir(d, 5))
  with open(_step_dir(d, 6), "w") as f:
    f.write("not a directory")
  os.mkfifo(_step_dir(d, 7))
  os.mkdir(os.path.join(d, "step_0000000008\n"))     # not a step's name: left alone
  assert jc.universal.discard_uncommitted(d) == [5, 6, 7]
  assert sorted(os.listdir(d)) == ["commits", "step_0000000001", "step_0000000008\n"]


def test_a_hard_link_in_a_deleted_step_loses_only_its_own_name(tmp_path, victim):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1)
  os.link(os.path.join(victim, "thesis.tex"), os.path.join(_step_dir(d, 1), "thesis.tex"))
  os.symlink(os.path.join(victim, "notes"), os.path.join(_step_dir(d, 1), "notes"))
  os.mkfifo(os.path.join(_step_dir(d, 1), "pipe"))
  jc.universal.discard_step(d, 1)
  assert not os.path.lexists(_step_dir(d, 1))


def test_a_delete_through_a_linked_commits_directory_is_refused(tmp_path, victim):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1)
  shutil.copy(os.path.join(d, lay.commit_key(1)), os.path.join(victim, "0000000001.json"))
  shutil.rmtree(os.path.join(d, "commits"))
  os.symlink(victim, os.path.join(d, "commits"))
  with pytest.raises(errors.PermissionDeniedError, match=r"commits.* is a symbolic link"):
    jc.universal.discard_step(d, 1)
  assert os.path.exists(os.path.join(victim, "0000000001.json"))
  os.unlink(os.path.join(victim, "0000000001.json"))
  p = _cli("delete", d, "--step", "1", "--run-root", str(tmp_path / "run"))
  assert p.returncode == 2 and "symbolic link" in p.stderr and "Traceback" not in p.stderr, p.stderr


def _other_checkpoint(tmp_path) -> str:
  """Another user's checkpoint whose step 1 a forged step links to."""
  return _fixtures.stored_steps(str(tmp_path / "theirs"), 1)


@pytest.mark.parametrize("what", ["step dir", "marker", "manifest", "array file", "fifo marker",
                                  "fifo chunk", "step dir a file"])
def test_a_link_or_special_file_in_the_newest_step_is_damage_never_read(tmp_path, what):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1, 2)
  attempt = _commit.committed_by(d, 2)
  manifest = os.path.join(d, lay.manifest_key(2, attempt))
  chunk = next(os.path.join(r, f) for r, _, fs in os.walk(os.path.join(_step_dir(d, 2), "arrays"))
               for f in fs if f != "zarr.json")
  theirs = _other_checkpoint(tmp_path)
  if what == "step dir":
    _link_step(d, 2, _step_dir(theirs, 1))
  elif what == "marker":
    os.replace(os.path.join(d, lay.commit_key(2)), os.path.join(d, "elsewhere.json"))
    os.symlink(os.path.join(d, "elsewhere.json"), os.path.join(d, lay.commit_key(2)))
  elif what == "manifest":
    os.replace(manifest, manifest + ".real")
    os.symlink(manifest + ".real", manifest)
  elif what == "array file":
    os.replace(chunk, chunk + ".real")
    os.symlink(chunk + ".real", chunk)
  elif what == "fifo marker":
    os.unlink(os.path.join(d, lay.commit_key(2)))
    os.mkfifo(os.path.join(d, lay.commit_key(2)))
  elif what == "fifo chunk":
    os.unlink(chunk)
    os.mkfifo(chunk)
  else:
    shutil.rmtree(_step_dir(d, 2))
    with open(_step_dir(d, 2), "w") as f:
      f.write("{}")
  p = _cli("verify", d, "--step", "2", "--no-progress")
  assert p.returncode != 0 and "OK" not in p.stdout and "Traceback" not in p.stderr, (
      p.stdout, p.stderr)
  assert re.search(r"symbolic link|FIFO|regular file", p.stderr + p.stdout), (p.stdout, p.stderr)
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False)) as m:
    with pytest.raises(errors.CorruptSnapshotError, match=r"symbolic link|FIFO|regular file"):
      m.restore(2)
    out = m.restore()
    assert m.last_restore.step == 1 and [s for s, _ in m.last_restore.skipped] == [2]
    np.testing.assert_array_equal(out["w"], np.arange(8.0))


def test_a_set_aside_never_writes_through_a_linked_quarantine_directory(tmp_path, victim):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1, 2)
  os.symlink(victim, os.path.join(d, "quarantine"))
  with open(os.path.join(victim, lay.quarantine_key(1).split("/")[1]), "w") as f:
    f.write("the victim's file of that name")
  with pytest.raises(errors.PermissionDeniedError, match="quarantine"):
    jc.universal.quarantine_step(d, 2, "a test")
  assert jc.universal.all_steps(d) == [1, 2]
  p = _cli("delete", d, "--step", "1", "--run-root", str(tmp_path / "run"))   # still deletes
  assert p.returncode == 0 and "quarantine" in p.stderr, p.stderr
  assert jc.universal.all_steps(d) == [2] and not os.path.lexists(_step_dir(d, 1))
  assert sorted(os.listdir(victim)) == ["0000000001.json", "notes", "thesis.tex"]
  os.unlink(os.path.join(victim, "0000000001.json"))


def test_a_save_never_writes_through_a_linked_step_directory(tmp_path, victim):
  d = _fixtures.stored_steps(str(tmp_path / "ck"), 1)
  os.symlink(victim, _step_dir(d, 2))
  with pytest.raises(errors.PermissionDeniedError, match="symbolic link"):
    _fixtures.stored_steps(d, 2)
  assert sorted(os.listdir(victim)) == ["notes", "thesis.tex"]


def test_an_import_never_reads_through_a_link_in_the_orbax_checkpoint(tmp_path, victim):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  src = str(tmp_path / "orbax")
  with ocp.CheckpointManager(src) as mgr:
    mgr.save(1, args=ocp.args.StandardSave({"w": np.arange(4.0)}))
    mgr.wait_until_finished()
  os.symlink(os.path.join(victim, "thesis.tex"), os.path.join(src, "1", "default", "stolen"))
  dst = str(tmp_path / "dst")
  p = _cli("import-orbax", src, dst)
  assert p.returncode == 2 and "symbolic link" in p.stderr and "stolen" in p.stderr, p.stderr
  assert jc.universal.all_steps(dst) == [] if os.path.exists(dst) else True
