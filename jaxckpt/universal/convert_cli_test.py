"""`jaxckpt convert`, `import-orbax` and `export-orbax` through their handlers."""

import argparse

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt.universal as u
from tests.support import fixtures as _fixtures
from jaxckpt.orbax import interop_cli
from jaxckpt.universal import convert_cli

W = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
EMBED = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)

RULES = """
rules:
  - unstack: {src: "['layers']['w']", dst: "['layer_{i}']['w']"}
  - unpad: {src: "['embed']", axis: 0, size: 10}
"""


def run(*argv):
  parser = argparse.ArgumentParser()
  sub = parser.add_subparsers(dest="cmd", required=True)
  convert_cli.register(sub)
  interop_cli.register(sub)
  args = parser.parse_args(list(argv))
  return args.handler(args)


@pytest.fixture
def src(tmp_path):
  d = str(tmp_path / "src")
  leaves = {"['layers']['w']": W, "['embed']": EMBED, "['step']": 5}
  for manifest, buf in _fixtures.host_snapshots(5, leaves):
    u.write_process_shards(d, manifest, buf, attempt="t")
  u.commit_step(d, 5, process_count=1, timeout_secs=10, attempt="t")
  return d


@pytest.fixture
def rules(tmp_path):
  p = tmp_path / "rules.yaml"
  p.write_text(RULES)
  return str(p)


def test_convert_writes_the_converted_step(src, rules, tmp_path, capsys):
  dst = str(tmp_path / "dst")
  assert run("convert", src, dst, "--spec", rules, "--dst-step", "6") == 0
  assert "wrote step 6" in capsys.readouterr().out
  r = u.open_step(dst, 6)
  for i in range(3):
    np.testing.assert_array_equal(r.read(f"['layer_{i}']['w']"), W[i])
  np.testing.assert_array_equal(r.read("['embed']"), EMBED[:10])
  assert r.leaves["['step']"].scalar == 5


def test_convert_dry_run_prints_the_tree_and_writes_nothing(src, rules, tmp_path, capsys):
  dst = str(tmp_path / "dst")
  assert run("convert", src, dst, "--spec", rules, "--dry-run") == 0
  out = capsys.readouterr().out
  assert "['layer_2']['w']  float32 [4, 5]" in out and "['embed']  float32 [10, 4]" in out
  assert u.all_steps(dst) == []


def test_convert_errors_name_the_paths_and_exit_2(src, tmp_path, capsys):
  bad = tmp_path / "bad.json"
  bad.write_text('{"rules": [{"op": "rename", "src": "[\'nope\']", "dst": "[\'x\']"}]}')
  assert run("convert", src, str(tmp_path / "d"), "--spec", str(bad), "--no-progress") == 2
  err = capsys.readouterr().err
  assert "matches no leaf" in err and "['layers']['w']" in err
  (tmp_path / "broken.yaml").write_text("rules: [unstack: {src: ")
  assert run("convert", src, str(tmp_path / "d"), "--spec", str(tmp_path / "broken.yaml")) == 2
  assert "not valid YAML" in capsys.readouterr().err


def test_export_then_import_orbax_round_trip(src, rules, tmp_path, capsys):
  ob = str(tmp_path / "orbax")
  assert run("export-orbax", src, ob, "--spec", rules, "--no-progress") == 0
  restored = ocp.StandardCheckpointer().restore(ob)
  np.testing.assert_array_equal(restored["layer_1"]["w"], W[1])
  np.testing.assert_array_equal(restored["embed"], EMBED[:10])
  assert run("export-orbax", src, ob) == 2  # exists, no --force
  assert "jaxckpt export-orbax:" in capsys.readouterr().err
  assert run("export-orbax", src, ob, "--force") == 0
  back = str(tmp_path / "back")
  assert run("import-orbax", ob, back, "--dst-step", "9") == 0
  assert "into step 9" in capsys.readouterr().out
  r = u.open_step(back, 9)
  np.testing.assert_array_equal(r.read("['layers']['w']"), W)
  assert r.leaves["['step']"].scalar == 5


def test_import_orbax_missing_step_exits_2(tmp_path, capsys):
  assert run("import-orbax", str(tmp_path), str(tmp_path / "d")) == 2
  assert "neither an orbax checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("cmd, words", [
    ("convert", ["unstack", "split", "unpad", "rules.yaml", "{name}"]),
    ("import-orbax", ["CheckpointManager", "StandardCheckpointer", "zarr v3"]),
    ("export-orbax", ["StandardCheckpointer().restore", "['a'][0].b", "--spec"]),
])
def test_help_explains_each_command(cmd, words, capsys):
  with pytest.raises(SystemExit) as e:
    run(cmd, "--help")
  assert e.value.code == 0
  out = capsys.readouterr().out
  for w in words:
    assert w in out, w
