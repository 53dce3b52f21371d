"""A power loss on the local-filesystem store keeps every step it was told is committed,
with all its bytes, and brings back no step it deleted.

Each program runs under strace; :mod:`jaxckpt.testing.power_loss` replays its calls on
a model of a POSIX filesystem that keeps only what was synced (a file's data as of its
last fsync, a directory entry once its parent was fsynced after it), and says what a
power loss right after the program ended would leave. tensorstore fsyncs each file it
writes and the directory it renames it into, not the directories it makes: before
jaxckpt synced them (``_local.sync_tree`` before the marker), a power loss lost the
first step's ``commits/`` (every step of a new directory gone) and a later step's
directory (its marker kept: a committed step whose files were gone); a delete did not
sync the directory it removed the marker from (the deleted step came back).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxckpt.testing import power_loss
from jaxckpt.universal import _layout as lay

PROGRAM = r'''
import sys, numpy as np, jax, jax.numpy as jnp
import jaxckpt as jc
directory, what, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
opts = jc.CheckpointOptions(handle_sigterm=False, persist_interval_steps=1)
with jc.CheckpointManager(directory, opts) as m:
  if what == "save":
    m.save(step, {"w": jnp.arange(4096, dtype=jnp.float32) * step, "b": np.arange(9) + step,
                  "nested": {"k": jnp.ones((64, 8), jnp.int32) * step}})
    m.wait_until_finished()
  else:
    m.delete(step)
print("STEPS", jc.universal.all_steps(directory))
'''


def _run(tmp_path, directory: str, what: str, step: int, *, trace: bool):
  prog = tmp_path / "program.py"
  prog.write_text(PROGRAM)
  argv = [sys.executable, str(prog), directory, what, str(step)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  if not trace:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    os.sync()                 # all of it on disk before the traced program begins
    return None
  trace_path = str(tmp_path / f"{what}{step}.strace")
  try:
    out = power_loss.traced(argv, trace_path, env=env, timeout=300)
  except power_loss.StraceMissing as e:
    pytest.fail(str(e))
  assert out.returncode == 0, out.stdout + out.stderr
  return power_loss.replay(power_loss.operations(trace_path))


def _step_files(directory: str, step: int) -> list[str]:
  """The files of committed ``step`` (what a restore reads), as they are on disk now."""
  top = os.path.join(directory, lay.step_dir(step))
  files = []
  for here, _, names in os.walk(top):
    if os.path.relpath(here, top).split(os.sep)[0] == "claims":
      continue                # a writer's claim: not part of the step
    files += [os.path.join(here, n) for n in names if not n.endswith(".__lock")]
  return sorted(files)


def _lost(disk, directory: str, step: int) -> list[str]:
  paths = [os.path.join(directory, lay.commit_key(step)), *_step_files(directory, step)]
  return [os.path.relpath(p, directory) for p in paths if not disk.survives(p)]


@pytest.mark.timeout(600)
def test_power_loss_keeps_the_first_committed_step_of_a_new_directory(tmp_path):
  d = str(tmp_path / "ckpt")
  disk = _run(tmp_path, d, "save", 1, trace=True)
  assert len(_step_files(d, 1)) >= 5
  assert _lost(disk, d, 1) == []


@pytest.mark.timeout(600)
def test_power_loss_keeps_every_file_of_a_committed_step(tmp_path):
  d = str(tmp_path / "ckpt")
  _run(tmp_path, d, "save", 1, trace=False)
  disk = _run(tmp_path, d, "save", 2, trace=True)
  assert _lost(disk, d, 2) == []


@pytest.mark.timeout(600)
def test_power_loss_brings_back_no_deleted_step(tmp_path):
  d = str(tmp_path / "ckpt")
  _run(tmp_path, d, "save", 1, trace=False)
  _run(tmp_path, d, "save", 2, trace=False)
  disk = _run(tmp_path, d, "delete", 1, trace=True)
  marker = os.path.join(d, lay.commit_key(1))
  assert not os.path.exists(marker)
  assert not disk.left(marker), "a power loss brings deleted step 1's commit marker back"
  assert disk.survives(os.path.join(d, lay.commit_key(2)))
