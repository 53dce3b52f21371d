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
from tests.support import fixtures as _fixtures
from jaxckpt.universal import convert as cv
from jaxckpt.orbax import interop as ox

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
  assert r.leaves["['n']"].scalar == 3


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


def _manager_checkpoint(directory: str) -> dict:
  """A checkpoint the CheckpointManager wrote, holding Python scalars, a typed key and bf16."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  state = {"w": W, "b": jnp.arange(4, dtype=jnp.bfloat16), "step": 3, "lr": 0.1, "done": False,
           "key": jax.random.key(7)}
  with jc.CheckpointManager(directory) as mgr:
    assert mgr.save(3, state)
    mgr.wait_until_finished()
  return state


def test_export_of_a_manager_checkpoint_with_scalars_and_keys_restores_in_orbax(tmp_path):
  state = _manager_checkpoint(str(tmp_path / "ck"))
  out = ox.export_orbax(str(tmp_path / "ck"), str(tmp_path / "orbax"))
  restored = ocp.StandardCheckpointer().restore(out)
  assert restored["step"] == 3 and type(restored["step"]) is int
  assert restored["lr"] == 0.1 and restored["done"] is False
  np.testing.assert_array_equal(restored["w"], W)
  assert restored["b"].dtype == jnp.bfloat16 and restored["b"].tobytes() == state["b"].tobytes()
  np.testing.assert_array_equal(restored["key"], jax.random.key_data(state["key"]))  # key data


def test_scalars_have_one_encoding_and_inspect_shows_values(orbax_manager_dir, tmp_path, capsys):
  from jaxckpt import cli  # pylint: disable=import-outside-toplevel
  _manager_checkpoint(str(tmp_path / "ck"))
  ox.import_orbax(orbax_manager_dir, str(tmp_path / "imp"), step=2)
  for d, want in ((tmp_path / "ck", {"['step']": 3, "['lr']": 0.1, "['done']": False}),
                  (tmp_path / "imp", {"['lr']": 0.25})):          # (its step is an array)
    leaves = u.open_step(str(d)).leaves
    for path, value in want.items():
      assert set(leaves[path].value) == {"type", "v"}             # one stored form
      assert leaves[path].scalar == value and type(leaves[path].scalar) is type(value)
    assert cli.main(["inspect", str(d)]) == 0
    text = capsys.readouterr().out
    for path, value in want.items():
      assert f"= {value!r}" in text.split(path, 1)[1].splitlines()[0], text
    assert "'type'" not in text


def test_an_imported_step_with_scalars_restores_through_the_manager(orbax_manager_dir, tmp_path):
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  d = str(tmp_path / "imp")
  ox.import_orbax(orbax_manager_dir, d, step=2)
  with jc.CheckpointManager(d) as mgr:
    out = mgr.restore(2)                                  # no target: the saved tree
    assert out["step"] == 2 and out["lr"] == 0.25
    np.testing.assert_array_equal(out["params"]["w"], W * 2)
    typed = mgr.restore(2, target=jax.tree.map(
        lambda x: np.zeros_like(x) if isinstance(x, np.ndarray) else x, out))
    assert typed["lr"] == 0.25 and type(typed["lr"]) is float and typed["step"] == 2


def test_import_with_relative_paths_and_an_empty_import_is_an_error(orbax_manager_dir, tmp_path,
                                                                  monkeypatch):
  monkeypatch.chdir(os.path.dirname(orbax_manager_dir))
  rel = os.path.basename(orbax_manager_dir)
  assert ox.import_orbax(rel, "imported_rel", step=2) == 2
  leaves = u.open_step("imported_rel").leaves
  assert "['params']['w']" in leaves and len(leaves) > 3
  empty = tmp_path / "empty"
  with ocp.StandardCheckpointer() as ck:
    ck.save(str(empty), {"nothing": None})           # a tree without leaves
  with pytest.raises(errors.ManifestError, match="holds no leaves"):
    ox.import_orbax(str(empty), str(tmp_path / "nothing"))
  assert not os.path.exists(tmp_path / "nothing" / "commits")


def _nnx_model_and_optimizer(seed: int):
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.l1 = nnx.Linear(4, 8, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)
      self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])

  def build():
    model = Model(nnx.Rngs(seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  return build, nnx


def test_an_nnx_optax_checkpoint_imports_into_the_abstract_nnx_state(tmp_path):
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  from jaxckpt import cli  # pylint: disable=import-outside-toplevel
  build, nnx = _nnx_model_and_optimizer(3)
  state = nnx.state(build())
  with ocp.StandardCheckpointer() as ck:
    ck.save(str(tmp_path / "orbax"), state)
  assert cli.main(["import-orbax", str(tmp_path / "orbax"), str(tmp_path / "u"),
                   "--no-progress"]) == 0
  abstract = nnx.state(nnx.eval_shape(build))              # what an NNX user restores into
  with jc.CheckpointManager(str(tmp_path / "u")) as mgr:
    restored = mgr.restore(0, target=abstract)
  want = jax.tree_util.tree_flatten_with_path(state)[0]
  got = dict(jax.tree_util.tree_flatten_with_path(restored)[0])
  assert len(got) == len(want) == 22
  for path, x in want:
    y = got[path]
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key), jax.tree_util.keystr(path)
      assert jax.random.key_impl(y) == jax.random.key_impl(x)
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert y.dtype == x.dtype and np.asarray(y).tobytes() == np.asarray(x).tobytes(), path
  plain = ox.import_orbax(str(tmp_path / "orbax"), str(tmp_path / "p"), layout="plain")
  assert "['0']['l1']['kernel']['value']" in u.open_step(str(tmp_path / "p"), plain).leaves



def test_a_manager_opened_on_an_nnx_orbax_directory_says_it_reads_not_writes(tmp_path, caplog):
  # It logged "Flax NNX layout; writing NNX paths" while it only read orbax's step.
  import logging  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  build, nnx = _nnx_model_and_optimizer(3)
  state = nnx.state(build())
  with ocp.CheckpointManager(str(tmp_path / "orbax")) as m:
    m.save(7, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  before = sorted(os.listdir(tmp_path / "orbax"))
  with caplog.at_level(logging.INFO, logger="jaxckpt"):
    with jc.CheckpointManager(str(tmp_path / "orbax")) as mgr:
      assert mgr.all_steps() == [7]
      restored = mgr.restore(7, target=nnx.state(nnx.eval_shape(build)))
  assert len(jax.tree_util.tree_leaves(restored)) == len(jax.tree_util.tree_leaves(state))
  said = [r.getMessage() for r in caplog.records]
  assert any("a Flax NNX layout: its leaves are taken at their NNX paths" in m for m in said), said
  assert not [m for m in said if "writing" in m], said
  assert sorted(os.listdir(tmp_path / "orbax")) == before        # (and it wrote nothing)


def _assert_same_tree(restored, state):
  want = jax.tree_util.tree_flatten_with_path(state)[0]
  got = jax.tree_util.tree_flatten_with_path(restored)[0]
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, y), (_, x) in zip(got, want):
    if not hasattr(x, "dtype"):
      assert type(y) is type(x) and y == x, path
      continue
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key), jax.tree_util.keystr(path)
      assert jax.random.key_impl(y) == jax.random.key_impl(x)
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert y.dtype == x.dtype and np.asarray(y).tobytes() == np.asarray(x).tobytes(), path


@pytest.mark.parametrize("layout", [None, "nnx"])
def test_a_dict_wrapped_nnx_state_with_typed_keys_imports_and_restores(tmp_path, layout):
  """{"train": nnx.State, "data": {...}, "data_key": key} saved by orbax: NNX paths under
  "train", orbax's paths elsewhere, and every typed key (threefry or rbg, inside the NNX state or
  not) typed again."""
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  from jaxckpt import cli  # pylint: disable=import-outside-toplevel
  build, nnx = _nnx_model_and_optimizer(5)

  def wrapped(train, key):
    return {"train": train,
            "data": {"epoch": 2, "position": np.int64(17), "shuffle_key": key(9, impl="rbg")},
            "data_key": key(4)}
  state = wrapped(nnx.state(build()), jax.random.key)
  with ocp.StandardCheckpointer() as ck:
    ck.save(str(tmp_path / "orbax"), state)
  argv = ["import-orbax", str(tmp_path / "orbax"), str(tmp_path / "u"), "--no-progress"]
  assert cli.main(argv + ([] if layout is None else ["--layout", layout])) == 0
  leaves = u.open_step(str(tmp_path / "u"), 0).leaves
  assert leaves["['data_key']"].kind == "prng_key"
  assert leaves["['data']['shuffle_key']"].key_impl == "rbg"
  abstract = wrapped(nnx.state(nnx.eval_shape(build)),
                     lambda seed, **kw: jax.eval_shape(lambda: jax.random.key(seed, **kw)))
  abstract["data"].update(epoch=0, position=np.int64(0))
  with jc.CheckpointManager(str(tmp_path / "u")) as mgr:
    restored = mgr.restore(0, target=abstract)
  _assert_same_tree(restored, state)
  assert len(jax.tree_util.tree_leaves(restored)) == 22 + 4      # the NNX state, the data, the key


def test_auto_layout_keeps_orbax_paths_outside_nnx_states():
  paths = ["['train']['0']['w']['value']", "['train']['1']['opt_state']['0']['count']['value']",
           "['data']['value']", "['data']['0']", "['cfg']['value']['0']"]
  assert ox.nnx_paths(paths) == {
      "['train']['0']['w']['value']": "['train'][0]['w'].value",
      "['train']['1']['opt_state']['0']['count']['value']": "['train'][1]['opt_state'][0]['count'].value",
      "['data']['value']": "['data']['value']",          # a plain dict key "value": no attribute above
      "['data']['0']": "['data']['0']",
      "['cfg']['value']['0']": "['cfg']['value']['0']"}
  whole = ["['0']['w']['value']", "['1']['step']['value']"]
  assert ox.nnx_paths(whole) == {p: ox.nnx_path(p) for p in whole}


def _grain_iter():
  import grain  # pylint: disable=import-outside-toplevel
  return iter(grain.MapDataset.range(200).shuffle(seed=3).batch(4).to_iter_dataset())


def test_every_item_of_a_composite_step_is_imported_and_restores_through_the_manager(tmp_path):
  """A ported loop's Composite step: state, a JSON item, an array and a Grain iterator.
  Imported whole, the manager's Composite restore gives each item back and the iterator
  resumes at the next batch; --item imports one alone; importing twice says what to do."""
  import grain  # pylint: disable=import-outside-toplevel
  import jaxckpt as jc  # pylint: disable=import-outside-toplevel
  src, dst = str(tmp_path / "orbax"), str(tmp_path / "jc")
  it = _grain_iter()
  for _ in range(3):
    next(it)
  state = {"w": W, "key": jax.random.key(4)}
  with ocp.CheckpointManager(src) as mgr:
    mgr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        data_iter=grain.checkpoint.CheckpointSave(it),
                                        metadata=ocp.args.JsonSave({"lr": 0.5, "tags": ["a"]}),
                                        counts=ocp.args.ArraySave(np.arange(6))))
  expected = [next(it) for _ in range(2)]
  assert ox.import_orbax(src, dst) == 7
  with pytest.raises(errors.StepAlreadyExistsError, match=r"step 7 is already in .*--dst-step"):
    ox.import_orbax(src, dst)
  fresh = _grain_iter()
  with jc.CheckpointManager(dst) as m:
    out = m.restore(7, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"w": np.zeros_like(W), "key": jax.random.key(0)}),
        data_iter=grain.checkpoint.CheckpointRestore(fresh), metadata=ocp.args.JsonRestore(),
        counts=ocp.args.ArrayRestore()))
  np.testing.assert_array_equal(out.state["w"], W)
  np.testing.assert_array_equal(jax.random.key_data(out.state["key"]),
                                jax.random.key_data(state["key"]))
  assert out.metadata == {"lr": 0.5, "tags": ["a"]}
  np.testing.assert_array_equal(out.counts, np.arange(6))
  for want in expected:
    np.testing.assert_array_equal(next(fresh), want)
  assert ox.import_orbax(src, dst, item="data_iter", dst_step=8) == 8
  fresh = _grain_iter()
  with jc.CheckpointManager(dst) as m:
    m.restore(8, args=grain.checkpoint.CheckpointRestore(fresh))
  np.testing.assert_array_equal(next(fresh), expected[0])


def test_an_item_import_orbax_cannot_read_is_refused_naming_it(tmp_path):
  from google.protobuf import struct_pb2  # pylint: disable=import-outside-toplevel
  src = str(tmp_path / "orbax")
  with ocp.CheckpointManager(src) as mgr:
    mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": W}),
                                        proto=ocp.args.ProtoSave(struct_pb2.Struct())))
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"cannot import item\(s\) 'proto' \(saved by .*ProtoCheckpointHandler"
                     r"\).*--item NAME"):
    ox.import_orbax(src, str(tmp_path / "jc"))
  assert ox.import_orbax(src, str(tmp_path / "jc"), item="state") == 1
  np.testing.assert_array_equal(u.open_step(str(tmp_path / "jc"), 1).read("['w']"), W)
