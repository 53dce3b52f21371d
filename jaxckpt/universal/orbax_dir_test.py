"""A directory that orbax's CheckpointManager wrote is read where it lies.

Its finalized steps are listed beside jaxckpt's own (never its tmp directories, a
step directory that is a link, or a step two directories claim), restored
bit-exact onto another sharding through the restore path's Source, described
by metadata(step), never written over, counted and deleted by retention
(exactly that step's directory), and ``jaxckpt import-orbax`` copies the whole
run or ``--steps``.
"""

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt import cli, errors
from jaxckpt.host.store import InProcessStore
from jaxckpt.restore import _read, _tiers
from tests.support import fixtures as _fixtures

RNG = np.random.default_rng(39)
W = RNG.standard_normal((16, 24)).astype(np.float32)
EMB = RNG.standard_normal((8, 8)).astype(ml_dtypes.bfloat16)
TMP = "300.orbax-checkpoint-tmp-1700000000"       # a save orbax never finalized


def mesh(shape, names, first=0):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[first:first + n]).reshape(shape), names)


def tree(step):
  m = mesh((2, 4), ("a", "b"))
  return {"params": {"w": jax.device_put(W * step, NamedSharding(m, P("a", "b"))),
                     "emb": jax.device_put(EMB, NamedSharding(m, P("b")))},
          "layers": [np.arange(5, dtype=np.int32) + step], "key": jax.random.key(step),
          "lr": 0.25}


def target():
  m = mesh((4,), ("c",), first=4)                     # other devices, another layout
  return {"params": {"w": jax.ShapeDtypeStruct(W.shape, W.dtype,
                                               sharding=NamedSharding(m, P(None, "c"))),
                     "emb": jax.ShapeDtypeStruct(EMB.shape, EMB.dtype,
                                                 sharding=NamedSharding(m, P("c")))},
          "layers": [np.zeros(5, np.int32)], "key": jax.random.key(0), "lr": 0.0}


def check(out, step):
  assert out["params"]["w"].sharding == target()["params"]["w"].sharding
  assert np.asarray(out["params"]["w"]).tobytes() == (W * step).tobytes()
  assert np.asarray(out["params"]["emb"]).tobytes() == EMB.tobytes()
  np.testing.assert_array_equal(out["layers"][0], np.arange(5, dtype=np.int32) + step)
  np.testing.assert_array_equal(jax.random.key_data(out["key"]),
                                jax.random.key_data(jax.random.key(step)))
  assert out["lr"] == 0.25


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """Steps 100 and 200 written by orbax's CheckpointManager, an unfinalized tmp directory,
  and a step directory that is a link to another run's step."""
  d = str(tmp_path_factory.mktemp("orbax_run") / "run")
  with ocp.CheckpointManager(d) as mgr:
    for step in (100, 200):
      mgr.save(step, args=ocp.args.StandardSave(tree(step)),
               custom_metadata={"note": f"s{step}"})
    mgr.wait_until_finished()
  os.makedirs(os.path.join(d, TMP, "default"))
  other = str(tmp_path_factory.mktemp("other_run"))
  shutil.copytree(os.path.join(d, "100"), os.path.join(other, "400"))
  os.symlink(os.path.join(other, "400"), os.path.join(d, "400"))
  return d


@pytest.fixture
def run(written, tmp_path):
  """A copy of the run of this test's own (links copied as links)."""
  d = str(tmp_path / "run")
  shutil.copytree(written, d, symlinks=True)
  return d


def test_orbax_steps_are_listed_beside_jaxckpt_s_own(run):
  assert u.orbax_steps(run) == {100: os.path.join(run, "100"), 200: os.path.join(run, "200")}
  assert u.stored_steps(run) == _tiers.storage_steps(run) == [100, 200]
  assert u.all_steps(run) == []                       # jaxckpt's committed steps: none yet
  _fixtures.stored_steps(run, 300)
  assert u.stored_steps(run) == [100, 200, 300] and u.all_steps(run) == [300]
  assert u.orbax_found(run).startswith(
      f"found 2 steps written by orbax in {run}: 100, 200; they are listed, restored")
  assert u.orbax_found(str(os.path.dirname(run))) is None


def test_an_orbax_step_restores_bit_exact_onto_another_sharding(run):
  source = _tiers.StorageSource(run, 200)             # the restore path's Source
  out = _read.restore_tree(source, target())
  check(out, 200)
  assert source.bytes_read == W.nbytes + EMB.nbytes + 5 * 4 + 2 * 4
  assert _read.restore_tree(_tiers.StorageSource(run, 100), None)["['lr']"] == 0.25
  flat = u.restore_arrays(u.open_stored(run, 100), {       # the universal reader's restore
      "['params']['w']": target()["params"]["w"], "['layers'][0]": None, "['lr']": None})
  assert np.asarray(flat["['params']['w']"]).tobytes() == (W * 100).tobytes()
  assert flat["['params']['w']"].sharding == target()["params"]["w"].sharding
  np.testing.assert_array_equal(flat["['layers'][0]"], np.arange(5, dtype=np.int32) + 100)
  with jc.CheckpointManager(run) as m:                # the manager, as it is, on orbax's run
    assert (m.all_steps(), m.latest_step()) == ([100, 200], 200)
    check(m.restore(target=target()), 200)
    assert (m.last_restore.step, m.last_restore.tier) == (200, "storage")
    check(m.restore(100, target=target()), 100)


def test_metadata_of_an_orbax_step(run):
  tier, leaves, meta = _tiers.step_metadata(
      InProcessStore(max_snapshots=1, host_memory_limit_bytes=1 << 20), run, 100)
  assert tier == "storage"
  assert leaves["['params']['w']"][:3] == ("jax", (16, 24), "float32")
  assert leaves["['params']['emb']"][:3] == ("jax", (8, 8), "bfloat16")
  assert leaves["['key']"].kind == "prng_key" and leaves["['key']"].key_impl == "threefry2x32"
  assert leaves["['lr']"].value == 0.25
  assert meta["note"] == "s100" and meta["jaxckpt.orbax"]["directory"] == os.path.join(run, "100")
  with jc.CheckpointManager(run) as m:
    md = m.metadata(200)
    assert md.tier == "storage" and md.custom_metadata == {"note": "s200"}
    assert md.tree["params"]["w"].shape == (16, 24)


def test_a_damaged_orbax_step_is_skipped_and_left_as_orbax_wrote_it(run, caplog):
  """Only jaxckpt's commit markers are set aside: orbax's directory is never changed."""
  (data,) = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(run, "200", "default", "d"))
             for f in fs]
  body = open(data, "rb").read()
  open(data, "wb").write(body[:len(body) // 2])        # orbax's OCDBT data, truncated
  before = sorted(os.walk(os.path.join(run, "200")))
  with jc.CheckpointManager(run) as m, caplog.at_level(logging.WARNING, logger="jaxckpt"):
    check(m.restore(target=target()), 100)
    (step, why), = m.last_restore.skipped
    assert step == 200 and "CorruptSnapshotError" in why and "200" in why, why
    with pytest.raises(errors.CorruptSnapshotError, match=r"orbax item .*200.* damaged"):
      m.restore(200, target=target())
    assert m.all_steps() == [100, 200]
  assert any("step 200 cannot be restored" in r.getMessage() for r in caplog.records)
  assert sorted(os.walk(os.path.join(run, "200"))) == before
  assert u.stored_steps(run) == [100, 200]


def test_a_step_orbax_holds_is_never_written(run):
  with pytest.raises(errors.StepAlreadyExistsError, match=r"step 100 is already in .*orbax"):
    u.check_not_orbax(run, 100)
  u.check_not_orbax(run, 300)
  info = u.LeafInfo(path="['w']", kind="numpy", shape=(3,), dtype="float32")
  with pytest.raises(errors.StepAlreadyExistsError, match=r"written by orbax .*200"):
    u.write_leaves(run, 200, {"['w']": info}, {"['w']": np.ones(3, np.float32)}, metadata={})
  for manifest, buf in _fixtures.host_snapshots(100, {"['w']": np.ones(3, np.float32)}):
    with pytest.raises(errors.StepAlreadyExistsError):
      u.write_process_shards(run, manifest, buf, attempt="t")
  assert u.all_steps(run) == [] and sorted(os.listdir(run)) == ["100", "200", TMP, "400"]


def test_retention_counts_both_kinds_and_deletes_exactly_a_step_s_directory(run, tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep.txt").write_text("not the checkpoint's")
  os.symlink(outside, os.path.join(run, "100", "link_out"))
  _fixtures.stored_steps(run, 300)
  assert u.gc_steps(run, max_to_keep=2) == [100]
  assert u.stored_steps(run) == [200, 300]
  assert sorted(os.listdir(run)) == ["200", TMP, "400", "commits", "step_0000000300"]
  assert (outside / "keep.txt").read_text() == "not the checkpoint's"   # the link not followed
  assert os.path.isdir(os.readlink(os.path.join(run, "400")))           # nor the linked step
  u.discard_step(run, 200, todelete_subdir="trash")                       # orbax's option
  assert u.stored_steps(run) == [300] and os.listdir(os.path.join(run, "trash")) == ["200"]


def test_a_prefixed_run_and_a_manager_s_cleanup_leave_orbax_s_steps(tmp_path, caplog):
  d = str(tmp_path / "prefixed")
  opts = ocp.CheckpointManagerOptions(step_prefix="step", step_format_fixed_length=10)
  with ocp.CheckpointManager(d, options=opts) as mgr:
    mgr.save(5, args=ocp.args.StandardSave({"w": W}))
    mgr.wait_until_finished()
  assert os.listdir(d) == ["step_0000000005"]         # jaxckpt's own name for a step dir
  assert u.discard_uncommitted(d) == [] and u.stored_steps(d) == [5]
  with jc.CheckpointManager(d, opts) as m:             # cleanup_tmp_directories runs here
    out = m.restore(args=ocp.args.StandardRestore({"w": np.zeros_like(W)}))
    assert out["w"].tobytes() == W.tobytes()
  os.makedirs(os.path.join(d, "5", "default"))         # a second directory claims step 5
  open(os.path.join(d, "5", "_CHECKPOINT_METADATA"), "w").close()
  with caplog.at_level(logging.WARNING, logger="jaxckpt"):
    assert u.stored_steps(d) == []
  assert any("claimed by directories ['5', 'step_0000000005']" in r.getMessage()
             for r in caplog.records)


def test_every_item_kind_of_a_composite_step_restores_in_place(tmp_path):
  grain = pytest.importorskip("grain")
  d = str(tmp_path / "composite")
  it = iter(grain.MapDataset.range(100).shuffle(seed=3).batch(4).to_iter_dataset())
  next(it)
  with ocp.CheckpointManager(d) as mgr:
    mgr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": W}),
                                        data_iter=grain.checkpoint.CheckpointSave(it),
                                        cfg=ocp.args.JsonSave({"lr": 0.5}),
                                        counts=ocp.args.ArraySave(np.arange(6))))
    mgr.wait_until_finished()
  want = next(it)
  fresh = iter(grain.MapDataset.range(100).shuffle(seed=3).batch(4).to_iter_dataset())
  with jc.CheckpointManager(d) as m:
    out = m.restore(7, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"w": np.zeros_like(W)}),
        data_iter=grain.checkpoint.CheckpointRestore(fresh), cfg=ocp.args.JsonRestore(),
        counts=ocp.args.ArrayRestore()))
  assert out.state["w"].tobytes() == W.tobytes() and out.cfg == {"lr": 0.5}
  np.testing.assert_array_equal(out.counts, np.arange(6))
  np.testing.assert_array_equal(next(fresh), want)


def test_import_orbax_takes_the_whole_run_or_the_steps_named(run, tmp_path, capsys):
  dst = str(tmp_path / "all")
  assert cli.main(["import-orbax", run, dst, "--no-progress"]) == 0
  assert "into steps [100, 200] of" in capsys.readouterr().out
  assert u.all_steps(dst) == [100, 200]
  out = _read.restore_tree(_tiers.StorageSource(dst, 100), target())
  check(out, 100)
  some = str(tmp_path / "some")
  assert cli.main(["import-orbax", run, some, "--steps", "200", "--no-progress"]) == 0
  assert u.all_steps(some) == [200]
  assert cli.main(["import-orbax", run, some, "--steps", "100,200", "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert "steps [200] are already in" in err and "nothing was imported" in err, err
  assert u.all_steps(some) == [200]
  assert cli.main(["import-orbax", run, some, "--steps", "100,150", "--no-progress"]) == 2
  assert "orbax steps [150] are not in" in capsys.readouterr().err
  assert u.all_steps(some) == [200]
