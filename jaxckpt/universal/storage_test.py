"""Commit, listing, gc, manifests, uneven shards, single-writer path, dtypes."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr

import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.host import snapshot as snap
from tests.support import fixtures as _fixtures
from jaxckpt.universal import _layout


def persist(d, step, leaves, *, processes=1, metadata=None, commit=True):
  for manifest, buf in _fixtures.host_snapshots(step, leaves, process_count=processes,
                                                metadata=metadata):
    u.write_process_shards(d, manifest, buf, attempt="t")
  if commit:
    u.commit_step(d, step, process_count=processes, timeout_secs=10, attempt="t")


def test_only_committed_steps_are_listed_and_opened(tmp_path):
  d = str(tmp_path)
  assert u.all_steps(d) == [] and u.latest_step(d) is None
  persist(d, 1, {"w": np.arange(6.0)})
  persist(d, 2, {"w": np.arange(6.0) + 1}, processes=2, commit=False)
  assert u.all_steps(d) == [1] and u.latest_step(d) == 1
  with pytest.raises(errors.StepNotFoundError, match=r"step 2 is not committed.*\[1\]"):
    u.open_step(d, 2)
  u.commit_step(d, 2, process_count=2, timeout_secs=10, attempt="t")
  assert u.all_steps(d) == [1, 2]
  np.testing.assert_array_equal(u.open_step(d).read("w"), np.arange(6.0) + 1)


def test_a_snapshot_whose_bytes_changed_after_hashing_is_never_stored(tmp_path):
  d = str(tmp_path)
  (manifest, buf), = _fixtures.host_snapshots(4, {"w": np.arange(64.0), "v": np.ones(8)})
  shard = manifest.leaves[1].shards[0]
  buf[shard.offset + 3] ^= 1                  # after its checksum was taken
  with pytest.raises(errors.CorruptSnapshotError,
                     match=f"of leaf '{manifest.leaves[1].path}' is corrupted"):
    u.write_process_shards(d, manifest, buf, attempt="t")
  with pytest.raises(errors.SnapshotTimeoutError):
    u.commit_step(d, 4, process_count=1, timeout_secs=0.5, attempt="t")
  assert u.all_steps(d) == []


def test_commit_timeout_names_the_missing_processes(tmp_path):
  d = str(tmp_path)
  snaps = _fixtures.host_snapshots(3, {"w": np.arange(4.0)}, process_count=4)
  for manifest, buf in [snaps[0], snaps[2]]:
    u.write_process_shards(d, manifest, buf, attempt="t")
  with pytest.raises(errors.SnapshotTimeoutError, match=r"processes \[1, 3\] of 4"):
    u.commit_step(d, 3, process_count=4, timeout_secs=0.2, attempt="t")
  assert u.all_steps(d) == []


def test_commit_rejects_parts_that_do_not_cover_a_leaf(tmp_path):
  d = str(tmp_path)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  x = jax.device_put(np.arange(16.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
  snaps = _fixtures.host_snapshots(4, {"x": x}, process_count=2)
  manifest, buf = snaps[0]
  u.write_process_shards(d, manifest, buf, attempt="t")
  # Process 1 claims to be done but lost its shards.
  lost = snap.SnapshotManifest(step=4, nbytes=0, process_index=1, process_count=2,
                               leaves=(snap.LeafRecord(path="x", kind="jax", shape=(16,),
                                                       dtype=x.dtype.name),))
  u.write_process_shards(d, lost, b"", attempt="t")
  with pytest.raises(errors.ManifestError, match=r"wrote 8 of the 16 elements of leaf 'x'"):
    u.commit_step(d, 4, process_count=2, timeout_secs=5, attempt="t")


def test_persisting_onto_a_committed_step_is_refused(tmp_path):
  d = str(tmp_path)
  persist(d, 5, {"w": np.zeros(3)})
  with pytest.raises(FileExistsError, match="step 5 is already committed"):
    persist(d, 5, {"w": np.ones(3)})
  np.testing.assert_array_equal(u.open_step(d, 5).read("w"), np.zeros(3))


def test_gc_keeps_newest_and_protected_steps(tmp_path):
  d = str(tmp_path)
  for s in range(1, 6):
    persist(d, s, {"w": np.full(3, s)})
  persist(d, 6, {"w": np.full(3, 6)}, commit=False)  # a save in progress
  assert u.gc_steps(d, max_to_keep=2, keep=[2]) == [1, 3]
  assert u.all_steps(d) == [2, 4, 5]
  assert not os.path.exists(os.path.join(d, "step_0000000001"))
  assert os.path.exists(os.path.join(d, "step_0000000006", "attempts", "t", "parts", "process_00000.json"))
  u.commit_step(d, 6, process_count=1, timeout_secs=5, attempt="t")
  np.testing.assert_array_equal(u.open_step(d, 2).read("w"), np.full(3, 2))
  with pytest.raises(ValueError, match="max_to_keep=0"):
    u.gc_steps(d, max_to_keep=0)


def test_tampered_or_off_schema_manifest_is_refused(tmp_path):
  d = str(tmp_path)
  persist(d, 1, {"w": np.arange(3.0)})
  path = os.path.join(d, "step_0000000001", "attempts", "t", "manifest.json")
  doc = json.load(open(path))
  doc["leaves"][0]["shape"] = [4]
  open(path, "w").write(json.dumps(doc))
  with pytest.raises(errors.CorruptSnapshotError, match="does not match the checksum"):
    u.open_step(d, 1)
  snaps = _fixtures.host_snapshots(2, {"w": np.arange(3.0)})
  u.write_process_shards(d, *snaps[0], attempt="t")
  part = os.path.join(d, "step_0000000002", "attempts", "t", "parts", "process_00000.json")
  doc = json.load(open(part))
  doc["leaves"][0]["kind"] = "tensor"
  open(part, "w").write(json.dumps(doc))
  with pytest.raises(errors.ManifestError, match=r"at leaves/0/kind: 'tensor' is not one of"):
    u.commit_step(d, 2, process_count=1, timeout_secs=5, attempt="t")


def uneven_snapshots(step, full, boxes_per_proc):
  """Hand-built snapshots of uneven shards (as jit outputs produce)."""
  out = []
  for p, boxes in enumerate(boxes_per_proc):
    pieces = [np.ascontiguousarray(full[snap.relative_slices(b, snap.full_box(full.shape))])
              for b in boxes]
    offsets = np.cumsum([0] + [snap.align(a.nbytes) for a in pieces])
    buf = np.zeros(max(int(offsets[-1]), 1), np.uint8)
    shards = []
    for b, a, o in zip(boxes, pieces, offsets):
      buf[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
      shards.append(snap.ShardRecord(index=b, offset=int(o), nbytes=a.nbytes,
                                     checksum=snap.checksum(a)))
    rec = snap.LeafRecord(path="u", kind="jax", shape=full.shape, dtype=full.dtype.name,
                          shards=tuple(shards))
    out.append((snap.SnapshotManifest(step=step, leaves=(rec,), nbytes=len(buf),
                                      process_index=p, process_count=len(boxes_per_proc)), buf))
  return out


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_uneven_shards_from_several_processes_round_trip(tmp_path, order):
  d = str(tmp_path)
  full = np.arange(10 * 6, dtype=np.int32).reshape(10, 6)
  boxes = [[((0, 3), (0, 6)), ((3, 6), (0, 6))], [((6, 9), (0, 6)), ((9, 10), (0, 6))]]
  snaps = uneven_snapshots(1, full, boxes)
  for i in order:  # whichever process creates the array fixes the layout
    u.write_process_shards(d, *snaps[i], attempt="t")
  u.commit_step(d, 1, process_count=2, timeout_secs=5, attempt="t")
  reader = u.open_step(d, 1)
  np.testing.assert_array_equal(reader.read("u"), full)
  np.testing.assert_array_equal(reader.read("u", ((2, 7), (1, 4))), full[2:7, 1:4])
  info = reader.leaves["u"]
  assert len(info.chunks) == np.prod([-(-a // b) for a, b in zip(info.shape, info.chunk_shape)])


def test_every_dtype_kind_scalar_and_metadata_round_trip(tmp_path):
  d = str(tmp_path)
  rng = np.random.default_rng(0)
  arrays = {f"a/{np.dtype(dt).name}": rng.integers(0, 7, (3, 4)).astype(dt) for dt in
            ["float32", "float64", "int64", "uint8", "bool", "complex64", ml_dtypes.bfloat16,
             ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float8_e4m3fn, "float16"]}
  arrays["zero"] = np.zeros((0, 3), np.float32)
  arrays["rank0"] = np.array(3.5, np.float64)
  key = jax.random.key_data(jax.random.key(3))
  persist(d, 9, {**arrays, "key": np.asarray(key), "lr": 0.25, "name": "run-1", "on": True},
          metadata={"epoch": 3, "tags": ["a"]})
  reader = u.open_step(d, 9)
  assert reader.metadata == {"epoch": 3, "tags": ["a"]}
  assert reader.leaves["a/uint4"].storage_dtype == "uint8"
  assert reader.leaves["a/bfloat16"].storage_dtype is None
  out = u.restore_arrays(reader, {p: None for p in reader.leaves})
  for p, want in arrays.items():
    assert out[p].dtype == want.dtype and out[p].shape == want.shape, p
    assert out[p].tobytes() == want.tobytes(), p
  np.testing.assert_array_equal(out["key"], key)
  assert (out["lr"], out["name"], out["on"]) == (0.25, "run-1", True)


def test_write_leaves_streams_from_lazy_views_and_zarr_python_reads_it(tmp_path):
  src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
  w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  persist(src, 1, {"w": w, "lr": 0.5})
  reader = u.open_step(src, 1)
  view = reader.open_leaf("w").T[1:5]  # lazy: nothing read yet
  infos = {"wt": u.LeafInfo(path="wt", kind="numpy", shape=(4, 8), dtype="float32",
                            chunk_shape=(2, 8)),
           "lr": reader.leaves["lr"]}
  u.write_leaves(dst, 4, infos, {"wt": view}, metadata={"from": src})
  out = u.open_step(dst, 4)
  assert out.leaves["wt"].chunk_shape == (2, 8) and len(out.leaves["wt"].chunks) == 2
  np.testing.assert_array_equal(out.read("wt"), w.T[1:5])
  assert out.leaves["lr"].scalar == 0.5 and out.metadata == {"from": src}
  z = zarr.open_array(os.path.join(dst, "step_0000000004", "arrays", out.leaves["wt"].array), mode="r")
  np.testing.assert_array_equal(z[...], w.T[1:5])


def test_kvstore_urls_work_beyond_local_paths():
  d = "memory://ckpt"
  persist(d, 2, {"w": np.arange(5)})
  assert u.all_steps(d) == [2]
  np.testing.assert_array_equal(u.open_step(d, 2).read("w"), np.arange(5))
  for url, driver in [("gs://my-bucket/ckpt", "gcs"), ("s3://my-bucket/ckpt", "s3")]:
    spec = _layout.zarr_spec(url, 3, "w-1", shape=(4,), dtype="int32", chunk=(2,), inner=(1,))
    kv = ts.KvStore.Spec(spec["kvstore"]).to_json()
    assert (kv["driver"], kv["bucket"], kv["path"]) == (driver, "my-bucket", "ckpt/step_0000000003/arrays/w-1/")


def _objects_per_leaf(d, step):
  kv = _layout.open_kvstore(d)
  keys = [k.decode() for k in kv.list(_layout.prefix_range(_layout.step_dir(step) + "arrays/"))
          .result()]
  per: dict[str, int] = {}
  for k in keys:
    leaf = k.split("/arrays/", 1)[1].split("/zarr.json")[0].split("/c/")[0]
    per[leaf] = per.get(leaf, 0) + 1
  return per


@pytest.mark.parametrize("processes,objects", [(1, 2), (2, 9)])
def test_a_processs_small_shards_of_a_leaf_are_one_object_and_restore_on_any_mesh(
    tmp_path, processes, objects):
  # One process owns all 8 row shards of each leaf: they form one box, stored as one
  # chunk (zarr.json + 1 object per leaf, not 1 per device). Two simulated processes
  # taking every other shard own no box: a chunk per shard, as before. Both restore
  # bit-exact onto another mesh and another partitioning.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  d = str(tmp_path)
  rng = np.random.default_rng(3)
  mesh = Mesh(np.array(jax.devices()), ("x",))
  values = {f"['l{i}']": rng.standard_normal((64, 32)).astype(np.float32) for i in range(20)}
  persist(d, 1, {p: jax.device_put(v, NamedSharding(mesh, P("x"))) for p, v in values.items()},
          processes=processes)
  assert set(_objects_per_leaf(d, 1).values()) == {objects}
  other = NamedSharding(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b")),
                        P("b", "a"))
  reader = u.open_step(d, 1)
  out = u.restore_arrays(reader, {p: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other)
                                  for p, v in values.items()})
  for p, v in values.items():
    assert np.asarray(out[p]).tobytes() == v.tobytes(), p
    assert out[p].sharding == other
  np.testing.assert_array_equal(reader.read("['l0']", ((5, 6), (7, 9))), values["['l0']"][5:6, 7:9])
  assert u.verify_step(reader) == []


@pytest.mark.parametrize("storage", ["file", "s3"])
def test_of_writers_racing_for_a_commit_marker_exactly_one_wins(tmp_path, storage, request):
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  from jaxckpt.universal import _commit  # pylint: disable=import-outside-toplevel
  d = str(tmp_path) if storage == "file" else request.getfixturevalue("s3_server").url()
  kv = _layout.open_kvstore(d)
  for step in range(5):
    def claim(i, step=step):
      try:
        _commit._write_marker(kv, d, step, {"step": step, "attempt": f"a{i}"})   # pylint: disable=protected-access
        return f"a{i}"
      except errors.StepExistsError:
        return None
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      won = [a for a in pool.map(claim, range(8)) if a]
    assert len(won) == 1, (step, won)
    assert _commit.read_marker(kv, d, step)["attempt"] == won[0]
