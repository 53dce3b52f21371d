"""Every storage read path returns exactly what was saved or raises (local files, S3, GCS).

A chunk that is missing (it would read back as fill values), swapped with
another chunk, copied from another leaf or bit-flipped is refused by the
manager's restore, ``restore_arrays``, conversion views, orbax export and
``verify``, naming the leaf and the chunk; restores that cut across saved
chunks read each stored byte once.
"""

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxckpt as jc
import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.universal import _layout
from jaxckpt.universal import convert as cv
from jaxckpt.orbax import interop as orbax_interop

RNG = np.random.default_rng(12)
# Two layouts: small leaves, whose shards of one process are one chunk (one object), and
# leaves too big for that, stored as a chunk per shard (rows [0, ROWS/2) and [ROWS/2, ROWS)).
LAYOUTS = {"merged": 64, "per-shard": 2 ** 17}    # rows of 16 float32: 4 KiB and 8 MiB
W = {rows: RNG.standard_normal((rows, 16)).astype(np.float32) for rows in LAYOUTS.values()}
V = {rows: RNG.standard_normal((rows, 16)).astype(np.float32) for rows in LAYOUTS.values()}


def _persist(d, rows=64):
  """``w`` and ``v`` (rows x 16 float32) saved over 2 devices with P("x")."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  sh = NamedSharding(mesh, P("x"))
  state = {"w": jax.device_put(W[rows], sh), "v": jax.device_put(V[rows], sh), "n": 5}
  with jc.CheckpointManager(d, jc.CheckpointOptions(max_snapshots=1)) as mgr:
    assert mgr.save(1, state)
    mgr.wait_until_persisted(1)
  return state


def _chunk_keys(d, leaf, rows):
  """The stored chunk keys of ``leaf`` (``.../w-xxxx/c/0/0``), in grid order."""
  reader = u.open_step(d, 1)
  info = reader.leaves[f"['{leaf}']"]
  prefix = f"{_layout.step_dir(1)}arrays/{info.array}/c/"
  kv = _layout.open_kvstore(d)
  keys = sorted(k.decode() for k in kv.list(_layout.prefix_range(prefix)).result())
  assert len(keys) == (1 if rows == LAYOUTS["merged"] else 2), keys
  return kv, keys


def _damage(d, how, rows):
  """Damages the last chunk of ``w`` (holding its last row)."""
  kv, keys = _chunk_keys(d, "w", rows)
  bad = keys[-1]
  if how == "delete":
    kv.delete_range(ts.KvStore.KeyRange(bad, bad + "\0")).result()
  elif how == "swap":
    a, b = kv.read(keys[0]).result().value, kv.read(bad).result().value
    kv.write(keys[0], b).result()
    kv.write(bad, a).result()
  elif how == "foreign":
    _, (v0, *_) = _chunk_keys(d, "v", rows)
    kv.write(bad, kv.read(v0).result().value).result()
  elif how == "bitflip":
    raw = bytearray(kv.read(bad).result().value)
    raw[len(raw) // 3] ^= 0x10
    kv.write(bad, bytes(raw)).result()


def _targets(n=8, spec=P("x"), rows=64):
  mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
  sh = NamedSharding(mesh, spec)
  return {"w": jax.ShapeDtypeStruct(W[rows].shape, np.float32, sharding=sh),
          "v": jax.ShapeDtypeStruct(V[rows].shape, np.float32, sharding=sh), "n": 0}


DAMAGE = ["delete", "swap", "foreign", "bitflip"]
CORRUPT = r"leaf \"\['w'\]\" region \[\[\d+, \d+\], \[0, 16\]\] \(chunk \d\.\d\)"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_chunk_is_refused_by_every_read_path(storage_dir, tmp_path, how, layout):
  rows = LAYOUTS[layout]
  if how == "swap" and layout == "merged":
    pytest.skip("a leaf stored as one chunk has no other chunk to swap with ('foreign' "
                "swaps in another leaf's)")
  _persist(storage_dir, rows)
  _damage(storage_dir, how, rows)
  last = rows - 1                                        # a row of the damaged chunk
  with jc.CheckpointManager(storage_dir) as mgr:          # the manager's storage restore
    with pytest.raises(errors.CorruptSnapshotError, match=CORRUPT):
      mgr.restore(step=1, target=_targets(rows=rows))
  reader = u.open_step(storage_dir, 1)
  with pytest.raises(errors.CorruptSnapshotError, match=CORRUPT):
    u.restore_arrays(reader, {"['w']": _targets(rows=rows)["w"]})
  with pytest.raises(errors.CorruptSnapshotError, match=CORRUPT):
    reader.read("['w']", ((last, last + 1), (0, 1)))     # one element of the bad chunk
  if how != "swap" and layout == "per-shard":            # the undamaged chunk still reads
    np.testing.assert_array_equal(reader.read("['w']", ((0, 32), (0, 16))), W[rows][:32])
  view = u.apply_conversion(cv.ConversionSpec(rules=(
      cv.Transpose(src="['w']", dst="['wt']", perm=(1, 0)),)), reader)
  with pytest.raises((errors.CorruptSnapshotError, ValueError), match=r"\['w'\]"):
    view.read("['wt']", ((0, 4), (last - 4, last)))
  with pytest.raises(errors.CorruptSnapshotError, match=CORRUPT):
    orbax_interop.export_orbax(storage_dir, str(tmp_path / "orbax"), step=1,
                               spec=cv.ConversionSpec(rules=(cv.Drop(src="['n']"),)))
  problems = u.verify_step(u.open_step(storage_dir, 1))
  assert problems and all("['w']" in p for p in problems), problems


def test_good_data_restores_bit_exact_on_every_read_path(storage_dir):
  state = _persist(storage_dir)
  with jc.CheckpointManager(storage_dir) as mgr:
    out = mgr.restore(step=1, target=_targets())
    assert mgr.last_restore.tier == "storage"
  np.testing.assert_array_equal(np.asarray(out["w"]), W[64])
  np.testing.assert_array_equal(np.asarray(out["v"]), V[64])
  assert out["n"] == state["n"]
  reader = u.open_step(storage_dir, 1)
  view = u.apply_conversion(cv.ConversionSpec(rules=(
      cv.Transpose(src="['w']", dst="['wt']", perm=(1, 0)),)), reader)
  np.testing.assert_array_equal(view.read("['wt']"), W[64].T)
  assert u.verify_step(reader) == []


@pytest.mark.parametrize("spec,n", [(P("x"), 8), (P(None, "x"), 8), (P("x"), 4),
                                    (P(("x", "y")), None)])
def test_restores_that_cut_across_chunks_read_each_stored_byte_once(tmp_path, spec, n):
  d = str(tmp_path / "ckpt")
  rows = LAYOUTS["per-shard"]                # two chunks per leaf, cut across by the targets
  _persist(d, rows)
  if n is None:                       # a (4, 2) mesh, rows split 8 ways in another order
    mesh = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("x", "y"))
    sh = NamedSharding(mesh, spec)
    targets = {"w": jax.ShapeDtypeStruct(W[rows].shape, np.float32, sharding=sh),
               "v": jax.ShapeDtypeStruct(V[rows].shape, np.float32, sharding=sh), "n": 0}
  else:
    targets = _targets(n, spec, rows)
  with jc.CheckpointManager(d) as mgr:
    out = mgr.restore(step=1, target=targets)
    read = mgr.last_restore.nbytes
  np.testing.assert_array_equal(np.asarray(out["w"]), W[rows])
  assert read <= 1.1 * (W[rows].nbytes + V[rows].nbytes), read
  reader = u.open_step(d, 1)
  u.restore_arrays(reader, {"['w']": targets["w"], "['v']": targets["v"]})
  assert reader.bytes_read <= 1.1 * reader.bytes_needed, (reader.bytes_read, reader.bytes_needed)
  assert reader.bytes_needed == W[rows].nbytes + V[rows].nbytes


def test_a_manifest_naming_another_step_is_refused(tmp_path):
  d = str(tmp_path / "ckpt")
  _persist(d)
  kv = _layout.open_kvstore(d)
  marker = kv.read(_layout.commit_key(1)).result().value
  kv.write(_layout.commit_key(2), marker).result()         # a marker copied to step 2
  with pytest.raises(errors.CorruptSnapshotError, match="commit marker of step 2"):
    u.open_step(d, 2)
