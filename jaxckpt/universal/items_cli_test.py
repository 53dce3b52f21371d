"""A step saved with orbax's Composite, seen through the CLI: `inspect` shows its JSON and
Grain items as saved, `convert` keeps the item records true, and a `cast` leaves integer,
key and item leaves alone unless a rule names them."""

from __future__ import annotations

import argparse
import json

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.universal import cli, convert_cli
from jaxckpt.universal import convert as cv

META = {"lr": 0.1, "tags": ["a", "b"], "nested": {"epoch": 3}}


def run(module, *argv):
  parser = argparse.ArgumentParser()
  module.register(parser.add_subparsers(dest="cmd", required=True))
  args = parser.parse_args(list(argv))
  return args.handler(args)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Step 1 on storage: a state (floats, an int step counter, a PRNG key), a Grain iterator
  two batches in, and JSON."""
  d = str(tmp_path_factory.mktemp("items") / "ckpt")
  it = iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset())
  next(it), next(it)
  state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "count": np.array(7, np.int32),
           "key": jax.random.key(3), "b": np.ones(4, np.float32)}
  opts = jc.CheckpointOptions(host_snapshots=False)
  with jc.CheckpointManager(directory=d, options=opts) as mgr:
    mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        data=grain.checkpoint.CheckpointSave(it),
                                        meta=ocp.args.JsonSave(META)))
    mgr.wait_until_finished()
  return d, it.get_state()


def test_inspect_shows_json_and_grain_items_as_saved(saved, capsys):
  d, grain_state = saved
  assert run(cli, "inspect", d) == 0
  out = capsys.readouterr().out
  assert "uint8" not in out and "65536" not in out                 # no blobs
  assert "jaxckpt.items" not in out
  line = next(l for l in out.splitlines() if l.startswith("  ['meta']"))
  assert "json item, one for the job: see items" in line
  assert f"  meta (json): {json.dumps(META, sort_keys=True)}" in out
  assert "  data (grain iterator state):" in out
  for field, value in grain_state.items():
    assert f"    {field} = {json.dumps(value, sort_keys=True)}" in out
  assert "  state (pytree): 4 leaves" in out


def test_inspect_json_carries_the_items(saved, capsys):
  d, grain_state = saved
  assert run(cli, "inspect", d, "--json") == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["items"]["meta"] == {"kind": "json", "values": [META]}
  assert doc["items"]["data"] == {"kind": "grain", "values": [grain_state]}
  assert doc["items"]["state"]["kind"] == "pytree" and doc["items"]["state"]["leaves"] == 4


def test_a_damaged_item_row_is_named_and_exit_is_1(tmp_path, capsys):
  d = str(tmp_path / "bad")
  row = np.zeros((1, 64), np.uint8)
  row[0, :8] = np.frombuffer((200).to_bytes(8, "little"), np.uint8)     # longer than the row
  from tests.support import fixtures as _fixtures  # pylint: disable=import-outside-toplevel
  for manifest, buf in _fixtures.host_snapshots(
      2, {"['meta']": row}, metadata={"jaxckpt.items": {"meta": "json"}}):
    u.write_process_shards(d, manifest, buf, attempt="t")
  u.commit_step(d, 2, process_count=1, timeout_secs=10, attempt="t")
  assert run(cli, "inspect", d) == 1
  assert ("jaxckpt inspect: DAMAGED item 'meta' (json): item 'meta', row 0: it claims 200 bytes "
          "in a row of 56") in capsys.readouterr().err


def _spec(tmp_path, rules):
  p = tmp_path / "rules.json"
  p.write_text(json.dumps({"rules": rules}))
  return str(p)


def test_convert_drops_the_records_of_items_it_drops(saved, tmp_path, capsys):
  d, _ = saved
  dst = str(tmp_path / "dst")
  spec = _spec(tmp_path, [{"op": "drop", "src": "['data']"}, {"op": "drop", "src": "['meta']"}])
  assert run(convert_cli, "convert", d, dst, "--spec", spec, "--no-progress") == 0
  assert u.open_step(dst, 1).metadata["jaxckpt.items"] == {"state": "pytree"}
  capsys.readouterr()
  assert run(cli, "inspect", dst) == 0
  out = capsys.readouterr().out
  assert "meta (json)" not in out and "data (grain" not in out and "state (pytree)" in out


def test_convert_follows_a_renamed_item_and_forgets_a_changed_one(saved, tmp_path, capsys):
  d, _ = saved
  dst = str(tmp_path / "dst")
  spec = _spec(tmp_path, [{"op": "rename", "src": "['meta']", "dst": "['config']"},
                          {"op": "reshape", "src": "['data']", "shape": [-1]}])
  assert run(convert_cli, "convert", d, dst, "--spec", spec, "--no-progress") == 0
  assert u.open_step(dst, 1).metadata["jaxckpt.items"] == {"state": "pytree", "config": "json"}
  capsys.readouterr()
  assert run(cli, "inspect", dst) == 0
  assert f"config (json): {json.dumps(META, sort_keys=True)}" in capsys.readouterr().out


def test_a_cast_leaves_integer_key_and_item_leaves_alone(saved):
  d, _ = saved
  reader = u.open_step(d, 1)
  view = cv.apply(cv.ConversionSpec(rules=(cv.Cast(src="**", dtype="bfloat16"),)), reader)
  dtypes = {p: i.dtype for p, i in view.leaves.items()}
  assert dtypes["['state']['w']"] == dtypes["['state']['b']"] == "bfloat16"
  assert dtypes["['state']['count']"] == "int32"                       # a step counter
  assert dtypes["['state']['key']"] == reader.leaves["['state']['key']"].dtype   # key data
  assert view.leaves["['state']['key']"].key_impl is not None
  assert dtypes["['data']"] == "uint8"                                 # a Grain state's rows
  np.testing.assert_array_equal(view.read("['data']"), reader.read("['data']"))
  assert view.leaves["['meta']"].scalar == reader.leaves["['meta']"].scalar  # its JSON text
  assert json.loads(view.leaves["['meta']"].scalar) == META
  # Named by its full path, an integer leaf is cast.
  named = cv.apply(cv.ConversionSpec(rules=(cv.Cast(src="['state']['count']", dtype="float32"),)),
                   reader)
  assert named.leaves["['state']['count']"].dtype == "float32"
  assert float(named.read("['state']['count']")) == 7.0


def test_a_cast_that_matches_only_such_leaves_says_so(saved):
  d, _ = saved
  with pytest.raises(errors.ConversionError, match=r"matches only leaves a cast leaves alone "
                     r"unless named \(\[\"\['state'\]\['count'\]\", \"\['state'\]\['key'\]\"\]"):
    rule = cv.Cast(src="re:\\['state'\\]\\['(count|key)'\\]", dtype="bfloat16")
    cv.apply(cv.ConversionSpec(rules=(rule,)), u.open_step(d, 1))


def test_a_cast_with_dst_moves_the_leaves_it_leaves_uncast(saved):
  d, _ = saved
  spec = cv.ConversionSpec(rules=(cv.Cast(src="['state']['{k}']", dst="['half']['{k}']",
                                          dtype="float16"),))
  view = cv.apply(spec, u.open_step(d, 1))
  assert {p: i.dtype for p, i in view.leaves.items() if p.startswith("['half']")} == {
      "['half']['w']": "float16", "['half']['b']": "float16", "['half']['count']": "int32",
      "['half']['key']": u.open_step(d, 1).leaves["['state']['key']"].dtype}
