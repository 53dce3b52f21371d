"""CheckpointManager with the in-process host store: save, restore, rollback, errors."""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import jaxckpt as jc
from jaxckpt import capture, errors, tree


def mesh(shape, names):
  return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])


def put(x, m, *spec):
  return jax.device_put(x, NamedSharding(m, P(*spec)))


def assert_same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


@pytest.fixture
def mgr():
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as m:
    yield m


def save_now(m, step, state, **kw):
  assert m.save(step, state, **kw)
  m.wait_until_finished()


X = np.arange(16 * 24, dtype=np.float32).reshape(16, 24) * 0.37

# (source mesh, source spec) -> (target mesh, target spec): every case bit-exact.
RESHARD_CASES = [
    (((8,), ("x",)), ("x", None), ((4,), ("y",)), ("y", None)),          # 8 -> 4 devices
    (((8,), ("x",)), ("x", None), ((8,), ("x",)), ()),                   # sharded -> replicated
    (((2, 4), ("a", "b")), ("a", "b"), ((4, 2), ("c", "d")), ("d", "c")),  # other mesh + spec
    (((2, 4), ("a", "b")), ("a", None), ((2, 2), ("c", "d")), (None, "d")),  # partial replica
    (((4, 2), ("a", "b")), (None, ("a", "b")), ((1,), ("z",)), ()),       # to one device
    (((8,), ("x",)), (), ((2, 4), ("a", "b")), ("b", "a")),              # replicated -> sharded
    (((2, 4), ("a", "b")), (("a", "b"), None), ((8,), ("x",)), (None, "x")),
]


@pytest.mark.parametrize("src_mesh,src_spec,dst_mesh,dst_spec", RESHARD_CASES)
def test_restore_onto_other_sharding_is_exact(mgr, src_mesh, src_spec, dst_mesh, dst_spec):
  src = put(X, mesh(*src_mesh), *src_spec)
  save_now(mgr, 1, {"w": src})
  dst = NamedSharding(mesh(*dst_mesh), P(*dst_spec))
  out = mgr.restore(target={"w": jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=dst)})
  assert out["w"].sharding == dst
  assert_same(out["w"], X)
  for shard in out["w"].addressable_shards:
    assert_same(shard.data, X[shard.index])


def test_replicated_shards_are_stored_once(mgr):
  m = mesh((2, 4), ("a", "b"))
  save_now(mgr, 1, {"rep": put(X, m), "part": put(X, m, "a", None), "full": put(X, m, "a", "b")})
  assert mgr.stats.last_nbytes == 3 * X.nbytes        # 64-byte aligned shards, each once


def test_single_device_target_and_concrete_target(mgr):
  src = put(X, mesh((8,), ("x",)), "x")
  save_now(mgr, 1, src)
  one = SingleDeviceSharding(jax.devices()[3])
  out = mgr.restore(target=jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=one))
  assert out.sharding == one and out.devices() == {jax.devices()[3]}
  assert_same(out, X)
  concrete = put(np.zeros_like(X), mesh((2, 2), ("a", "b")), "b", "a")
  out = mgr.restore(target=concrete)
  assert out.sharding == concrete.sharding
  assert_same(out, X)


DTYPES = ["bfloat16", "float16", "float32", "float64", "int4", "uint4", "int8", "uint8",
          "int16", "int32", "uint32", "int64", "bool", "complex64", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_bit_exact(mgr, dtype):
  with jax.enable_x64(True) if "64" in dtype else _nullcontext():
    rng = np.random.default_rng(0)
    raw = rng.integers(-8, 8, size=(8, 6)).astype(np.float32) * 0.75
    x = jnp.asarray(raw).astype(dtype) if dtype != "bool" else jnp.asarray(raw > 0)
    src = put(x, mesh((4, 2), ("a", "b")), "a", "b")
    save_now(mgr, 1, {"x": src})
    tgt = jax.ShapeDtypeStruct(x.shape, x.dtype,
                               sharding=NamedSharding(mesh((8,), ("z",)), P(None, None)))
    out = mgr.restore(target={"x": tgt})["x"]
    assert out.dtype == x.dtype
    assert_same(out, x)


class _nullcontext:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


Pair = collections.namedtuple("Pair", ["first", "second"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  params: dict
  step: jax.Array
  note: str = dataclasses.field(metadata=dict(static=False), default="x")


def test_uncommitted_targets_restore_uncommitted():
  with jc.CheckpointManager() as m:
    state = {"count": jnp.zeros([], jnp.int32), "key": jax.random.key(0),
             "abstract": jax.ShapeDtypeStruct((3,), jnp.float32)}
    save_now(m, 1, {"count": jnp.int32(4), "key": jax.random.key(5), "abstract": jnp.ones(3)})
    out = m.restore(target=state)
    w = put(X, mesh((8,), ("x",)), "x")
    assert int(jax.jit(lambda c, w: c + w.sum().astype(jnp.int32))(out["count"], w)) > 0
    assert_same(jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(5)))
    assert_same(out["abstract"], np.ones(3, np.float32))


def test_containers_keys_numpy_scalars_and_strings(mgr):
  m = mesh((8,), ("x",))
  keys = put(jax.random.split(jax.random.key(7), 8), m, "x")
  state = {
      "ts": TrainState(params={"w": put(X, m, "x")}, step=jnp.int32(5), note="hello"),
      "pair": Pair(np.arange(5, dtype=np.int16), (1.5, 2, True, None, "é", b"\x00\xff")),
      "keys": keys, "rbg": jax.random.key(3, impl="rbg"),
      "list": [np.float32(2.5), 3 + 4j, 2**70],
  }
  save_now(mgr, 4, state)
  out = mgr.restore(target=state)
  assert out["ts"].note == "hello" and out["pair"].second == (1.5, 2, True, None, "é", b"\x00\xff")
  assert isinstance(out["pair"], Pair) and isinstance(out["ts"], TrainState)
  assert_same(out["ts"].params["w"], X)
  assert isinstance(out["pair"].first, np.ndarray)
  assert_same(out["pair"].first, np.arange(5, dtype=np.int16))
  assert jax.dtypes.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
  assert out["keys"].sharding == keys.sharding
  assert_same(jax.random.key_data(out["keys"]), jax.random.key_data(keys))
  assert_same(jax.random.key_data(out["rbg"]), jax.random.key_data(state["rbg"]))
  assert_same(jax.random.normal(out["rbg"], (3,)), jax.random.normal(state["rbg"], (3,)))
  assert out["list"][1:] == [3 + 4j, 2**70] and isinstance(out["list"][0], np.float32)
  saved = mgr.restore(target=None)
  assert sorted(saved) == sorted(state) and isinstance(saved["list"], list)
  assert isinstance(saved["ts"]["params"]["w"], np.ndarray)
  assert_same(saved["ts"]["params"]["w"], np.asarray(X)) and saved["list"][2] == 2**70
  assert saved["ts"]["note"] == "hello" and saved["list"][0].shape == ()
  assert saved["list"][0].dtype == np.float32 and saved["list"][0] == np.float32(2.5)


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


def test_nnx_state_and_optax_state_with_abstract_target(mgr):
  model = MLP(nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  opt = optax.adamw(1e-3)
  opt_state = opt.init(params)
  save_now(mgr, 9, {"params": params, "opt": opt_state})
  abstract = nnx.split(nnx.eval_shape(lambda: MLP(nnx.Rngs(1))))[1]
  target = {"params": abstract, "opt": jax.eval_shape(opt.init, abstract)}
  out = mgr.restore(target=target)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves({"params": params, "opt": opt_state})):
    assert_same(a, b)
  restored = nnx.merge(graphdef, out["params"])
  np.testing.assert_array_equal(restored(jnp.ones((2, 8))), model(jnp.ones((2, 8))))


def test_snapshot_is_exact_when_the_next_step_donates_the_saved_arrays(mgr):
  m = mesh((8,), ("x",))
  update = jax.jit(lambda w: w * 2.0 + 1.0, donate_argnums=0)
  w = put(X, m, "x")
  expected = {}
  for step in range(1, 6):
    expected[step] = np.asarray(w).copy()
    assert mgr.save(step, {"w": w}, force=True) or mgr.stats.skipped_busy
    w = update(w)            # donates the array whose snapshot may still be copying
  mgr.wait_until_finished()
  for step in mgr.all_steps():
    out = mgr.restore(step=step, target={"w": jax.ShapeDtypeStruct(X.shape, X.dtype,
                                                                   sharding=w.sharding)})
    assert_same(out["w"], expected[step])


def test_rollback_restores_older_snapshot_and_drops_the_abandoned_timeline():
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=3)) as m:
    for step in (1, 2, 3):
      save_now(m, step, {"w": jnp.full((4,), float(step))})
    assert m.all_steps() == [1, 2, 3]
    out = m.restore(step=1, target={"w": jnp.zeros(4)})
    assert m.last_restore.step == 1 and m.last_restore.tier == "host"
    assert_same(out["w"], np.full((4,), 1.0, np.float32))
    save_now(m, 2, {"w": jnp.full((4,), 20.0)})   # training resumed from step 1
    assert m.all_steps() == [1, 2] and m.latest_step() == 2
    assert_same(m.restore(target={"w": jnp.zeros(4)})["w"], np.full((4,), 20.0, np.float32))


def test_scalar_and_numpy_leaves_are_captured_per_save():
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=3)) as m:
    for step in (1, 2, 3):
      save_now(m, step, {"i": step, "name": f"s{step}", "pos": np.array([step])})
    for step in (1, 2, 3):
      out = m.restore(step=step, target={"i": 0, "name": "", "pos": np.zeros(1, int)})
      assert (out["i"], out["name"], out["pos"].tolist()) == (step, f"s{step}", [step])


def test_restored_arrays_never_see_later_saves():
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=1)) as m:
    src = put(X, mesh((8,), ("x",)), "x")
    save_now(m, 1, {"w": src})
    out = m.restore(target={"w": src})
    rep = m.restore(target={"w": put(np.zeros_like(X), mesh((8,), ("x",)))})
    for step in range(2, 6):
      save_now(m, step, {"w": put(X * step, mesh((8,), ("x",)), "x")})
    assert_same(out["w"], X)
    assert_same(rep["w"], X)
    assert m.restore(target={"w": src})["w"].sum() == (X * 5).sum()


def test_cpu_restore_is_zero_copy_and_donation_never_writes_the_shared_buffer():
  # On CPU a restore from the in-process store lends the slot: restored shards
  # are the snapshot's memory, and so are those of a second restore of the same
  # step, and replicated devices share one buffer. This relies on XLA:CPU never
  # donating an adopted host buffer in place; if a jax upgrade changes that, the
  # donation below writes into the other restore's memory and this test fails.
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=1)) as m:
    src = put(X, mesh((8,), ("x",)), "x")
    save_now(m, 1, {"w": src})
    (slot_buf,) = [s.memory for s in m._core._store._table.slots if s.memory is not None]
    lo, hi = slot_buf.ctypes.data, slot_buf.ctypes.data + slot_buf.nbytes
    in_slot = lambda a: all(lo <= s.data.unsafe_buffer_pointer() < hi for s in a.addressable_shards)
    s1 = m.restore(target={"w": src})["w"]
    s2 = m.restore(target={"w": src})["w"]
    assert in_slot(s1) and in_slot(s2)
    jax.jit(lambda x: x + 1, donate_argnums=0)(s1).block_until_ready()
    assert s1.is_deleted()
    assert_same(s2, X)
    assert_same(m.restore(target={"w": src})["w"], X)
    rep_target = {"w": put(np.zeros_like(X), mesh((8,), ("x",)))}
    rep = m.restore(target=rep_target)["w"]
    assert len({s.data.unsafe_buffer_pointer() for s in rep.addressable_shards}) == 1
    for step in (2, 3):   # 2 slots: step 3 reuses the lent slot's index, with a new buffer
      save_now(m, step, {"w": put(X * step, mesh((8,), ("x",)), "x")})
    assert_same(s2, X)
    assert_same(rep, X)
    assert_same(m.restore(target=rep_target)["w"], X * 3)


def test_numpy_targets_get_arrays_of_their_own():
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=1)) as m:
    save_now(m, 1, {"w": put(X, mesh((8,), ("x",)))})     # replicated: stored as one whole box
    out = m.restore(target={"w": np.zeros_like(X)})["w"]
    out += 1
    assert_same(m.restore(target={"w": np.zeros_like(X)})["w"], X)
    assert_same(m.restore(target={"w": put(np.zeros_like(X), mesh((8,), ("x",)))})["w"], X)


def test_keeps_max_snapshots_and_reuses_slot_buffers(mgr):
  buffers = set()
  for step in range(1, 8):
    save_now(mgr, step, {"w": jnp.full((1024,), float(step))})
    with mgr._core._store.read(step) as (_, buf):   # the store's public read API
      buffers.add(id(buf))
  assert mgr.all_steps() == [6, 7]
  assert len(buffers) == 3                    # max_snapshots + 1 slots, reused


def test_interval_and_busy_skip_are_counted():
  opts = jc.CheckpointOptions(max_snapshots=1, save_interval_steps=2)
  with jc.CheckpointManager(options=opts) as m:
    assert not m.save(1, {"w": jnp.ones(3)})
    assert m.stats.skipped_interval == 1
    big = {"w": put(np.ones((4096, 1024), np.float32), mesh((8,), ("x",)), "x")}
    results = [m.save(2 * i, big) for i in range(1, 6)]
    m.wait_until_finished()
    assert results[0] and m.stats.started + m.stats.skipped_busy == 5
    assert m.stats.started == sum(results)
  opts = jc.CheckpointOptions(max_snapshots=1, on_busy="wait")
  with jc.CheckpointManager(options=opts) as m:
    assert all(m.save(i, big) for i in range(4))
    m.wait_until_finished()
    assert m.stats.committed == 4 and m.latest_step() == 3


def test_unsupported_leaf_names_path_and_type(mgr):
  with pytest.raises(errors.UnsupportedLeafError, match=r"\['opt'\]\['fn'\].*function") as e:
    mgr.save(1, {"opt": {"fn": lambda x: x}})
  assert isinstance(e.value, TypeError)
  with pytest.raises(TypeError, match="dtype=object"):
    mgr.save(1, {"o": np.array([object()])})
  assert mgr.all_steps() == []


@pytest.mark.parametrize("target,match", [
    ({"a": jnp.zeros(4)}, r"lacks \['b'\]"),
    ({"a": jnp.zeros(4), "b": jnp.zeros(2), "c": 1}, r"\['c'\] which was not saved"),
    ({"a": jnp.zeros(5), "b": jnp.zeros(2)}, r"\['a'\] has shape \(5,\).*shape \(4,\)"),
    ({"a": jnp.zeros(4, jnp.int32), "b": jnp.zeros(2)}, r"\['a'\] has dtype int32.*float32"),
    ({"a": jnp.zeros(4), "x": jnp.zeros(2)}, r"leaf #1 is \['x'\].*\['b'\]"),
    ({"a": jnp.zeros(4), "b": 3}, r"\['b'\] has a Python int"),
])
def test_mismatched_target_names_first_bad_path(mgr, target, match):
  save_now(mgr, 1, {"a": jnp.ones(4), "b": jnp.ones(2)})
  with pytest.raises(errors.StructureMismatchError, match=match) as e:
    mgr.restore(target=target)
  assert isinstance(e.value, ValueError)
  assert mgr.last_restore is None


def test_unknown_step_and_closed_manager():
  m = jc.CheckpointManager()
  with pytest.raises(FileNotFoundError, match="no snapshot is held"):
    m.restore()
  save_now(m, 3, {"a": jnp.ones(2)})
  with pytest.raises(errors.StepNotFoundError, match=r"step 4 is not held \(held steps: \[3\]\)"):
    m.restore(step=4)
  m.close()
  m.close()
  with pytest.raises(errors.ManagerClosedError, match="save.*closed") as e:
    m.save(4, {"a": jnp.ones(2)})
  assert isinstance(e.value, RuntimeError)


def test_corrupted_shard_is_detected_and_nothing_restored(mgr):
  src = put(X, mesh((8,), ("x",)), "x")
  save_now(mgr, 1, {"w": src})
  with mgr._core._store.read(1) as (manifest, buf):
    off = manifest.leaves[0].shards[3].offset
    buf[off + 5] ^= 0x10
  with pytest.raises(errors.CorruptSnapshotError, match=r"step 1: shard \[\(6, 8\), \(0, 24\)\]") as e:
    mgr.restore(target={"w": src})
  assert isinstance(e.value, OSError) and "['w']" in str(e.value)


def test_save_rejects_bad_step(mgr):
  with pytest.raises(ValueError, match="step=-1"):
    mgr.save(-1, {"a": 1})


def test_options_validation_names_field():
  with pytest.raises(ValueError, match="on_busy.*'never'"):
    jc.CheckpointOptions(on_busy="never")
  with pytest.raises(ValueError, match="host_memory_limit_bytes=0"):
    jc.CheckpointOptions(host_memory_limit_bytes=0)


def test_budget_error_gives_sizes():
  opts = jc.CheckpointOptions(max_snapshots=2, host_memory_limit_bytes=1 << 20)
  with jc.CheckpointManager(options=opts) as m:
    with pytest.raises(errors.HostMemoryBudgetError, match=r"2 snapshots kept \(max_snapshots=2\) \+ 1 being saved: 3 slots x 2.0 MiB") as e:
      m.save(1, {"w": np.zeros(1 << 19, np.float32)})
    assert isinstance(e.value, MemoryError)


def test_many_small_sharded_leaves_restore_exactly_onto_another_mesh():
  # Enough small fully sharded leaves that save() gathers them with one XLA call.
  src_mesh, dst_mesh = mesh((2, 4), ("a", "b")), mesh((4, 2), ("c", "d"))
  dtypes = (np.float32, jnp.bfloat16, np.int8, np.uint32, np.bool_, np.float16)
  rng = np.random.default_rng(1)
  values = {f"p{i}": (rng.normal(size=(8, 8)) > 0 if dt is np.bool_ else
                      (rng.normal(size=(8, 8)) * 50).astype(dt)) for i, dt in enumerate(dtypes)}
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=1)) as m:
    state = {k: jax.jit(lambda a: a.copy())(put(v, src_mesh, "a", "b")) for k, v in values.items()}
    m.prepare(state)                  # the gather compiled (a first save would not wait for it)
    save_now(m, 1, state)
    plan = capture.Planner().plan(tree.flatten(state)[0])
    assert plan.pack is not None and len(plan.pack.leaves) == len(dtypes)
    out = m.restore(target={k: put(np.zeros_like(v), dst_mesh, "d", "c")
                            for k, v in values.items()})
  for k, v in values.items():
    assert_same(out[k], v)


def test_small_leaves_on_a_one_device_mesh_take_the_per_shard_path():
  one = mesh((1,), ("x",))
  values = {f"p{i}": np.arange(8, dtype=np.float32) + i for i in range(6)}
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=1)) as m:
    state = {k: put(v, one, "x") for k, v in values.items()}
    m.prepare(state)
    save_now(m, 1, state)
    assert capture.Planner().plan(tree.flatten(state)[0], wait=True).pack is None
    out = m.restore(target={k: put(np.zeros_like(v), one, "x") for k, v in values.items()})
  for k, v in values.items():
    assert_same(out[k], v)


def test_restore_without_target_returns_the_saved_tree(tmp_path):
  w = np.arange(6, dtype=np.float32).reshape(2, 3)
  state = {"params": {"w": w, "layers": [np.int8(3), np.zeros(2, np.int64)]}, "step": 7}
  with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=1)) as m:
    m.save(1, state, force=True)
    m.wait_until_persisted(1)
    host = m.restore(1)
    assert m.last_restore.tier == "host"
  with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=1)) as m:
    disk = m.restore(1)
    assert m.last_restore.tier == "storage"
  for out in (host, disk):
    assert sorted(out) == ["params", "step"] and out["step"] == 7
    assert isinstance(out["params"]["layers"], list) and len(out["params"]["layers"]) == 2
    assert type(out["params"]["w"]) is np.ndarray and out["params"]["w"].dtype == np.float32
    np.testing.assert_array_equal(out["params"]["w"], w)
    np.testing.assert_array_equal(out["params"]["layers"][1], np.zeros(2, np.int64))
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=1)) as m:
    m.save(1, w, force=True)
    m.wait_until_finished()
    np.testing.assert_array_equal(m.restore(1), w)


@pytest.mark.parametrize("tier", ["host", "storage"])
def test_metadata_describes_a_step_without_reading_its_bytes(tmp_path, tier):
  mesh = jax.make_mesh((8,), ("x",))
  w = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, P("x")))
  state = {"params": {"w": w, "b": np.zeros(3, np.int8)}, "step": 7, "key": jax.random.key(1)}
  with contextlib.ExitStack() as stack:
    m = stack.enter_context(jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=1)))
    m.save(4, state, metadata={"lr": 0.5}, force=True)
    m.wait_until_persisted(4)
    if tier == "storage":                       # a new process: only storage holds the step
      m = stack.enter_context(jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=1)))
    md = m.metadata(4)
    assert (md.step, md.tier, md.metadata) == (4, tier, {"lr": 0.5})
    assert md.tree["params"]["w"][:3] == ("jax", (8, 2), "float32")
    assert md.tree["params"]["w"].sharding is not None
    assert md.tree["params"]["b"][:3] == ("numpy", (3,), "int8")
    assert md.tree["step"].kind == "scalar" and md.tree["step"].value == 7
    assert md.tree["key"].kind == "prng_key" and md.tree["key"].key_impl == "threefry2x32"
    with pytest.raises(errors.StepNotFoundError, match=r"step 5 is held neither"):
      m.metadata(5)


def test_delete_removes_a_step_from_every_tier(tmp_path):
  x = np.arange(8, dtype=np.float32)
  with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=2)) as m:
    for s in (1, 2):
      m.save(s, {"x": x + s}, force=True)
      m.wait_until_persisted(s)
    m.delete(2)
    assert m.all_steps() == [1] and m.latest_step() == 1
    np.testing.assert_array_equal(m.restore(target={"x": x})["x"], x + 1)
    with pytest.raises(errors.StepNotFoundError, match=r"step 2 is not held"):
      m.delete(2)
  with jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=2)) as m:
    assert m.all_steps() == [1]


@pytest.mark.parametrize("tier", ["host", "storage"])
def test_partial_restore_reads_only_the_leaves_asked_for(tmp_path, tier):
  mesh = jax.make_mesh((8,), ("x",))
  s = NamedSharding(mesh, P("x"))
  params = {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4), s)}
  opt = {"mu": jax.device_put(np.ones((1024, 64), np.float32), s)}
  state = {"params": params, "opt": opt, "step": 3}
  with contextlib.ExitStack() as stack:
    m = stack.enter_context(jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=1)))
    m.save(3, state, force=True)
    m.wait_until_persisted(3)
    if tier == "storage":
      m = stack.enter_context(jc.CheckpointManager(str(tmp_path), jc.CheckpointOptions(max_snapshots=1)))
    want = {"params": {"w": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=s)}}
    with pytest.raises(errors.StructureMismatchError):
      m.restore(3, want)                        # a subset only when asked for
    out = m.restore(3, want, partial=True)
    assert m.last_restore.tier == tier
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(params["w"]))
    assert out["params"]["w"].sharding == s
    assert m.last_restore.nbytes < 64 * 4 * 2     # the 256 KiB optimizer state was not read
    with pytest.raises(errors.StructureMismatchError, match=r"partial restore: target leaf "
                       r"\['params'\]\['b'\] was not saved in step 3"):
      m.restore(3, {"params": {"b": np.zeros(2)}}, partial=True)
