"""Orbax checkpoints imported into, and exported from, the universal format, exactly."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import zarr
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.universal import _fixtures
from jaxckpt.universal import convert as cv
from jaxckpt.universal import orbax_interop as ox

RNG = np.random.default_rng(1)
W = RNG.standard_normal((16, 24)).astype(np.float32)
EMB = RNG.standard_normal((12, 8)).astype(ml_dtypes.bfloat16)
LAYERS = [RNG.integers(-100, 100, (8,)).astype(np.int32) for _ in range(3)]


def mesh(shape, names):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


@pytest.fixture(scope="module")
def orbax_manager_dir(tmp_path_factory):
  """Steps 1 and 2 written by ocp.CheckpointManager + StandardSave from a 2x4 mesh."""
  d = str(tmp_path_factory.mktemp("orbax"))
  m = mesh((2, 4), ("a", "b"))
  with ocp.CheckpointManager(d) as mgr:
    for step in (1, 2):
      tree = {"params": {"w": jax.device_put(W * step, NamedSharding(m, P("a", "b"))),
                         "emb": jax.device_put(EMB, NamedSharding(m, P("b"))),
                         "layers": [{"x": jnp.asarray(x)} for x in LAYERS]},
              "step": np.int32(step), "lr": 0.25}
      mgr.save(step, args=ocp.args.StandardSave(tree))
    mgr.wait_until_finished()
  return d


def test_import_orbax_then_restore_onto_a_different_mesh_exact(orbax_manager_dir, tmp_path):
  dst = str(tmp_path)
  assert ox.import_orbax(orbax_manager_dir, dst) == 2  # the latest step
  reader = u.open_step(dst, 2)
  assert sorted(reader.leaves) == sorted(
      ["['params']['w']", "['params']['emb']", "['step']", "['lr']"]
      + [f"['params']['layers'][{i}]['x']" for i in range(3)])
  assert reader.metadata["imported_from"] == {"orbax": orbax_manager_dir, "step": 2,
                                              "item": "default"}
  target = mesh((4,), ("c",))
  targets = {"['params']['w']": jax.ShapeDtypeStruct(W.shape, np.float32,
                                                     sharding=NamedSharding(target, P(None, "c"))),
             "['params']['emb']": jax.ShapeDtypeStruct(EMB.shape, EMB.dtype,
                                                       sharding=NamedSharding(target, P("c"))),
             "['params']['layers'][2]['x']": None, "['step']": None, "['lr']": None}
  out = u.restore_arrays(reader, targets)
  np.testing.assert_array_equal(np.asarray(out["['params']['w']"]), W * 2)
  assert out["['params']['w']"].sharding == targets["['params']['w']"].sharding
  assert np.asarray(out["['params']['emb']"]).tobytes() == EMB.tobytes()
  np.testing.assert_array_equal(out["['params']['layers'][2]['x']"], LAYERS[2])
  assert int(out["['step']"]) == 2 and out["['lr']"] == 0.25
  assert reader.leaves["['params']['w']"].chunk_shape == (8, 6)  # orbax's shards kept as chunks


def test_import_an_older_step_and_a_bare_checkpointer_save(orbax_manager_dir, tmp_path):
  assert ox.import_orbax(orbax_manager_dir, str(tmp_path / "a"), step=1, dst_step=10) == 10
  np.testing.assert_array_equal(u.open_step(str(tmp_path / "a"), 10).read("['params']['w']"), W)
  bare = str(tmp_path / "bare")
  with ocp.StandardCheckpointer() as ck:
    ck.save(bare, {"a": np.arange(6.0).reshape(2, 3), "n": 3})
    ck.wait_until_finished()
  assert ox.import_orbax(bare, str(tmp_path / "b")) == 0
  r = u.open_step(str(tmp_path / "b"), 0)
  np.testing.assert_array_equal(r.read("['a']"), np.arange(6.0).reshape(2, 3))
  assert r.leaves["['n']"].value == 3


def test_import_errors_name_the_steps_and_items(orbax_manager_dir, tmp_path):
  with pytest.raises(errors.StepNotFoundError, match=r"orbax step 5 is not in .* it has \[1, 2\]"):
    ox.import_orbax(orbax_manager_dir, str(tmp_path), step=5)
  with pytest.raises(errors.StepNotFoundError, match=r"has items \['default'\]"):
    ox.import_orbax(orbax_manager_dir, str(tmp_path), item="state")
  with pytest.raises(errors.StepNotFoundError, match="neither an orbax checkpoint"):
    ox.import_orbax(str(tmp_path), str(tmp_path / "x"))


@pytest.fixture
def universal_dir(tmp_path):
  d = str(tmp_path / "u")
  m = mesh((8,), ("x",))
  leaves = {"['params']['w']": jax.device_put(W, NamedSharding(m, P("x"))),
            "['params']['emb']": EMB,
            **{f"['params']['layers'][{i}].x": x for i, x in enumerate(LAYERS)},
            "['step']": 4, "['name']": "run"}
  for manifest, buf in _fixtures.host_snapshots(4, leaves):
    u.write_process_shards(d, manifest, buf, inner_chunk_bytes=128, attempt="t")
  u.commit_step(d, 4, process_count=1, timeout_secs=10, attempt="t")
  return d


def test_export_orbax_restores_exactly_with_standard_checkpointer(universal_dir, tmp_path):
  out = str(tmp_path / "orbax_out")
  spec = cv.ConversionSpec(rules=(cv.Drop(src="['name']"),))  # orbax cannot save strings
  assert ox.export_orbax(universal_dir, out, spec=spec) == out
  restored = ocp.StandardCheckpointer().restore(out)
  assert sorted(restored) == ["params", "step"] and restored["step"] == 4
  np.testing.assert_array_equal(restored["params"]["w"], W)
  assert restored["params"]["emb"].dtype == EMB.dtype
  assert restored["params"]["emb"].tobytes() == EMB.tobytes()
  assert isinstance(restored["params"]["layers"], list)
  for i, x in enumerate(LAYERS):
    np.testing.assert_array_equal(restored["params"]["layers"][i]["x"], x)
  target = NamedSharding(mesh((2,), ("y",)), P("y"))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target)
                          if getattr(a, "ndim", 0) and a.shape[0] % 2 == 0 else a, restored)
  on_mesh = ocp.StandardCheckpointer().restore(out, abstract)
  np.testing.assert_array_equal(np.asarray(on_mesh["params"]["w"]), W)
  assert on_mesh["params"]["w"].sharding == target


def test_export_refuses_what_orbax_cannot_hold_naming_the_leaf(universal_dir, tmp_path):
  with pytest.raises(errors.UnsupportedLeafError, match=r"\['name'\].*Drop it"):
    ox.export_orbax(universal_dir, str(tmp_path / "o"))


def test_import_export_round_trip_is_exact(orbax_manager_dir, tmp_path):
  ox.import_orbax(orbax_manager_dir, str(tmp_path / "u"), step=2)
  ox.export_orbax(str(tmp_path / "u"), str(tmp_path / "o"))
  restored = ocp.StandardCheckpointer().restore(str(tmp_path / "o"))
  np.testing.assert_array_equal(restored["params"]["w"], W * 2)
  np.testing.assert_array_equal(restored["params"]["layers"][1]["x"], LAYERS[1])
  assert restored["lr"] == 0.25 and restored["step"] == 2


def test_zarr_python_reads_an_imported_leaf_without_jaxckpt(orbax_manager_dir, tmp_path):
  ox.import_orbax(orbax_manager_dir, str(tmp_path))
  info = u.open_step(str(tmp_path), 2).leaves["['params']['w']"]
  z = zarr.open_array(os.path.join(str(tmp_path), "step_0000000002", "arrays", info.array),
                      mode="r")
  np.testing.assert_array_equal(z[3:9, 5:20], (W * 2)[3:9, 5:20])


def test_nest_builds_lists_dicts_and_attributes():
  assert ox.nest({"['a'][0].b": 1, "['a'][1].b": 2, "['c']": 3}) == {
      "a": [{"b": 1}, {"b": 2}], "c": 3}
  assert ox.nest({"[3]": 1, "[5]": 2}) == {3: 1, 5: 2}  # not 0..n-1: a dict
  path = jax.tree_util.keystr((jax.tree_util.DictKey("x'y"), jax.tree_util.SequenceKey(2),
                               jax.tree_util.GetAttrKey("z")))
  assert ox.path_keys(path) == ["x'y", 2, "z"]
  with pytest.raises(errors.ConversionError, match="not a jax keystr path"):
    ox.path_keys("params/w")
  with pytest.raises(errors.ConversionError, match="prefix of other leaves"):
    ox.nest({"['a']['b']": 1, "['a']": 2})
