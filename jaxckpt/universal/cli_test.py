"""Damaged chunks are caught by restore and by `jaxckpt verify`; inspect output."""

import argparse
import json
import os
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxckpt.universal as u
from jaxckpt import errors
from tests.support import fixtures as _fixtures
from jaxckpt.universal import cli

W = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)


@pytest.fixture
def ckpt(tmp_path):
  d = str(tmp_path)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  leaves = {"['params']['w']": jax.device_put(W, NamedSharding(mesh, P("a", "b"))),
            "['params']['b']": np.ones(5, np.int32), "['lr']": 0.1}
  for manifest, buf in _fixtures.host_snapshots(3, leaves, metadata={"run": "x"}):
    u.write_process_shards(d, manifest, buf, inner_chunk_bytes=256, attempt="t",
                           merged_chunk_bytes=0)   # a chunk per shard: damage one of them
  u.commit_step(d, 3, process_count=1, timeout_secs=5, attempt="t")
  return d


def chunk_file(d, leaf, key):
  info = u.open_step(d, 3).leaves[leaf]
  return os.path.join(d, "step_0000000003", "arrays", info.array, "c", *key.split("."))


def flip_bit(path, offset=100):
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ 0x10]))


def run(*argv):
  parser = argparse.ArgumentParser()
  cli.register(parser.add_subparsers(dest="cmd", required=True))
  args = parser.parse_args(list(argv))
  return args.handler(args)


def test_inspect_shows_tree_sizes_mesh_and_metadata(ckpt, capsys):
  assert run("inspect", ckpt) == 0
  out = capsys.readouterr().out
  assert "step 3" in out and '{"run": "x"}' in out
  line = next(l for l in out.splitlines() if "['params']['w']" in l)
  assert "float32" in line and "[64, 32]" in line and "8.0 KiB" in line
  assert "mesh={'a': 2, 'b': 4}" in line and "chunks=[32, 8]" in line
  assert "['lr']" in out and "= 0.1" in out


def test_verify_passes_intact_checkpoint(ckpt, capsys):
  assert run("verify", ckpt, "--no-progress") == 0
  assert "step 3: OK (3 leaves" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["bitflip", "truncate"])
def test_damaged_chunk_is_caught_by_restore_and_verify(ckpt, capsys, damage):
  path = chunk_file(ckpt, "['params']['w']", "1.2")
  if damage == "bitflip":
    flip_bit(path)
  else:
    os.truncate(path, os.path.getsize(path) // 2)
  reader = u.open_step(ckpt, 3)
  with pytest.raises(errors.CorruptSnapshotError, match=r"leaf \"\['params'\]\['w'\]\" region"):
    u.restore_arrays(reader, {"['params']['w']": None})
  # Reading only intact chunks still works.
  np.testing.assert_array_equal(reader.read("['params']['w']", ((0, 32), (0, 32))), W[:32])
  assert run("verify", ckpt, "--no-progress") == 1
  out = capsys.readouterr().out
  assert "DAMAGED step 3: leaf \"['params']['w']\" chunk 1.2" in out
  assert out.count("DAMAGED") == 1


def test_verify_catches_a_flip_that_passes_tensorstore_checks(ckpt, capsys):
  """A chunk rewritten with valid crc32c but wrong values is caught by xxh3."""
  reader = u.open_step(ckpt, 3)
  with pytest.raises(ValueError, match="does not support writing"):
    reader.open_leaf("['params']['w']")[0, 0].write(np.float32(-1.0)).result()
  info = reader.leaves["['params']['w']"]
  path = os.path.join(ckpt, "step_0000000003", "arrays", info.array)
  store = ts.open({"driver": "zarr3", "kvstore": "file://" + path}, open=True).result()
  store[0, 0].write(np.float32(-1.0)).result()
  assert run("verify", ckpt, "--no-progress") == 1
  assert "chunk 0.0: " in capsys.readouterr().out
  with pytest.raises(errors.CorruptSnapshotError, match=r"checksum [0-9a-f]+ != saved"):
    u.open_step(ckpt, 3).read("['params']['w']")


def test_module_entry_point_and_help(ckpt):
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  help_text = subprocess.run([sys.executable, "-m", "jaxckpt.universal.cli", "verify", "--help"],
                             capture_output=True, text=True, env=env, timeout=60).stdout
  assert "crc32c per inner chunk" in help_text and "--all-steps" in help_text
  flip_bit(chunk_file(ckpt, "['params']['b']", "0"), 20)
  res = subprocess.run([sys.executable, "-m", "jaxckpt.universal.cli", "verify", ckpt],
                       capture_output=True, text=True, env=env, timeout=60)
  assert res.returncode == 1 and "['params']['b']" in res.stdout
  res = subprocess.run([sys.executable, "-m", "jaxckpt.universal.cli", "inspect", ckpt,
                        "--step", "4"], capture_output=True, text=True, env=env, timeout=60)
  assert res.returncode == 2 and "step 4 is not committed" in res.stderr


@pytest.mark.parametrize("verb", ["inspect", "verify"])
@pytest.mark.parametrize("form", ["{}", "{}/", "file://{}"])
def test_file_instead_of_directory_is_a_clear_error(tmp_path, verb, form):
  f = tmp_path / "notes.txt"
  f.write_text("not a checkpoint")
  given = form.format(f)
  out = subprocess.run([sys.executable, "-m", "jaxckpt", verb, given], capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 2
  assert "Traceback" not in out.stderr
  assert f"jaxckpt {verb}: {given!r} is a file, not a checkpoint directory" in out.stderr


def _jaxckpt(*argv):
  return subprocess.run([sys.executable, "-m", "jaxckpt", *argv], capture_output=True, text=True,
                        timeout=300)


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_a_missing_path_is_named_as_missing(tmp_path, verb):
  for given in (str(tmp_path / "nope"), f"file://{tmp_path}/nope/"):
    out = _jaxckpt(verb, given)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"jaxckpt {verb}: {given!r} does not exist;")
    assert len(out.stderr.strip().splitlines()) == 1


def _orbax_saves(root):
  """A CheckpointManager directory (steps 1 and 2, items state and meta) and a bare save."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  tree = {"w": W, "b": np.ones(5, np.int32)}
  with ocp.CheckpointManager(str(root / "mgr"), item_names=("state", "meta")) as mgr:
    for step in (1, 2):
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                             meta=ocp.args.JsonSave({"step": step})))
    mgr.wait_until_finished()
  with ocp.StandardCheckpointer() as ck:
    ck.save(str(root / "bare"), tree)
  return tree


@pytest.mark.parametrize("verb,which,args,kind", [
    ("inspect", "mgr", [], "an orbax CheckpointManager directory (steps [1, 2])"),
    ("verify", "mgr", ["--step", "1"], "an orbax CheckpointManager directory (steps [1, 2])"),
    ("inspect", "bare", [], "an orbax checkpoint (one saved item)"),
    ("verify", "mgr/1", [], "one step of an orbax CheckpointManager directory"),
])
def test_an_orbax_directory_gets_the_import_command_that_works(tmp_path, verb, which, args, kind):
  """The printed command imports the step asked for (the latest, --step N, the step directory
  given), and the printed follow-up then works on the result."""
  tree = _orbax_saves(tmp_path)
  out = _jaxckpt(verb, str(tmp_path / which), *args)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  line, = out.stderr.strip().splitlines()
  assert line.startswith(f"jaxckpt {verb}: {str(tmp_path / which)!r} is {kind}, not a jaxckpt")
  command = line.split("format first: ", 1)[1].split("  (then: ")[0]
  assert command.startswith("jaxckpt import-orbax ")
  imported = _jaxckpt(*shlex.split(command)[1:], "--no-progress")      # the command, as printed
  assert imported.returncode == 0, imported.stderr
  then = line.split("(then: ", 1)[1].rstrip(")")
  assert then.startswith(f"jaxckpt {verb} ")
  again = _jaxckpt(*shlex.split(then)[1:], *(["--no-progress"] if verb == "verify" else []))
  assert again.returncode == 0, again.stderr
  want_step = 1 if "--step" in args or which == "mgr/1" else 0 if which == "bare" else 2
  reader = u.open_step(shlex.split(command)[3])
  assert reader.step == want_step
  prefix = "" if which == "bare" else "['state']"      # a Composite step: every item imported
  np.testing.assert_array_equal(reader.read(f"{prefix}['w']"), tree["w"])
  if which != "bare":
    assert reader.leaves["['meta']"].scalar == json.dumps({"step": want_step})
