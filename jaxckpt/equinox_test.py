"""Equinox models and their optax states through CheckpointManager, bit-exact (real ``equinox``)."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxckpt as jc
from jaxckpt import errors, tree


class Net(eqx.Module):
  """Array fields, static fields, non-array leaves, callables, a typed key and BatchNorm state."""
  mlp: eqx.nn.MLP                       # its `activation` is a callable leaf (not static)
  bn: eqx.nn.BatchNorm
  drop: eqx.nn.Dropout                  # p: float leaf, inference: bool leaf
  squash: eqx.nn.Lambda                 # a function leaf
  emb: eqx.nn.Embedding
  noise_key: jax.Array                  # a typed PRNG key
  temperature: float                    # a Python float leaf
  name: str = eqx.field(static=True)
  widths: tuple[int, ...] = eqx.field(static=True)

  def __init__(self, key):
    k = jax.random.split(key, 3)
    self.mlp = eqx.nn.MLP(4, 4, 8, 2, key=k[0])
    self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")
    self.drop = eqx.nn.Dropout(0.25)
    self.squash = eqx.nn.Lambda(jnp.tanh)
    self.emb = eqx.nn.Embedding(10, 4, key=k[1])
    self.noise_key = k[2]
    self.temperature = 0.7
    self.name = "net"
    self.widths = (4, 8, 4)

  def __call__(self, token, state):
    x, state = self.bn(self.mlp(self.emb(token)), state)
    return self.squash(x) / self.temperature, state


def _make(seed):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, model_state = eqx.nn.make_with_state(Net)(jax.random.key(seed))
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
  return model, model_state, opt


def _trained(steps=3):
  """A model, its BatchNorm state and its optax state after a few real updates."""
  model, model_state, opt = _make(0)
  opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, model_state, opt_state, token):
    def loss(m):
      y, s = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
          token, model_state)
      return jnp.sum(y ** 2), s
    (_, model_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), model_state, opt_state

  for i in range(steps):
    model, model_state, opt_state = step(model, model_state, opt_state, jnp.arange(4) + i)
  return {"model": model, "model_state": model_state, "opt": opt_state, "step": steps}


def _bits(x):
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)).tobytes())
  if hasattr(x, "dtype"):
    a = np.asarray(x)
    return (a.dtype.str, a.shape, a.tobytes())
  return (type(x), x)


def assert_bit_exact(got, want):
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)):
    assert _bits(a) == _bits(b), jax.tree_util.keystr(path)


def _abstract():
  """What a restarted program has before it restores: the structure, with no values."""
  model, model_state, opt = _make(1)
  return eqx.filter_eval_shape(lambda: {
      "model": model, "model_state": model_state,
      "opt": opt.init(eqx.filter(model, eqx.is_inexact_array)), "step": 0})


def _same_outputs(a, b):
  ya, _ = eqx.nn.inference_mode(a["model"])(jnp.asarray(3), a["model_state"])
  yb, _ = eqx.nn.inference_mode(b["model"])(jnp.asarray(3), b["model_state"])
  return np.asarray(ya).tobytes() == np.asarray(yb).tobytes()


def test_model_and_optax_state_restore_bit_exact_in_process():
  state = _trained()
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as mgr:
    assert mgr.save(3, state)
    mgr.wait_until_finished()
    for target in (state, _abstract()):
      restored = mgr.restore(target=target)
      assert mgr.last_restore.tier == "host"
      assert_bit_exact(restored, state)
      assert restored["model"].name == "net" and restored["model"].widths == (4, 8, 4)
      assert restored["model"].mlp.activation is jax.nn.relu     # callables: the target's own
      assert restored["model"].temperature == 0.7 and restored["step"] == 3
      assert _same_outputs(restored, state)


def test_model_and_optax_state_restore_bit_exact_from_storage(tmp_path):
  state = _trained()
  opts = jc.CheckpointOptions(max_snapshots=2)
  with jc.CheckpointManager(directory=str(tmp_path / "ckpt"), options=opts) as mgr:
    assert mgr.save(3, state)
    mgr.wait_until_persisted()
  with jc.CheckpointManager(directory=str(tmp_path / "ckpt"), options=opts) as mgr:
    restored = mgr.restore(target=_abstract())
    assert mgr.last_restore.tier == "storage"
  assert_bit_exact(restored, state)
  assert _same_outputs(restored, state)


def test_filtered_arrays_save_alone_and_combine_with_the_static_part():
  state = _trained()
  params, static = eqx.partition(state["model"], eqx.is_array)
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as mgr:
    assert mgr.save(1, {"params": params, "opt": state["opt"]})
    mgr.wait_until_finished()
    abstract_params = eqx.filter_eval_shape(lambda: eqx.filter(_make(1)[0], eqx.is_array))
    restored = mgr.restore(target={"params": abstract_params, "opt": _abstract()["opt"]})
  assert_bit_exact(restored["params"], params)
  assert_bit_exact(restored["opt"], state["opt"])
  model = eqx.combine(restored["params"], static)
  assert_bit_exact(model, state["model"])


def test_without_a_target_the_saved_leaves_come_back_as_nested_dicts_and_lists():
  state = _trained()
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as mgr:
    assert mgr.save(1, state)
    mgr.wait_until_finished()
    raw = mgr.restore()
  assert np.array_equal(raw["model"]["mlp"]["layers"][0]["weight"],
                        state["model"].mlp.layers[0].weight)
  assert "activation" not in raw["model"]["mlp"]            # callables are not saved
  assert raw["model"]["drop"] == {"p": 0.25, "inference": False}
  assert isinstance(raw["model_state"], list)               # eqx.nn.State: flattened indices


def test_a_callable_outside_an_attribute_is_refused_naming_it():
  with jc.CheckpointManager(options=jc.CheckpointOptions(max_snapshots=2)) as mgr:
    with pytest.raises(errors.UnsupportedLeafError, match=r"\['hooks'\]\[0\].*eqx.Module field"):
      mgr.save(1, {"w": jnp.ones(2), "hooks": [jnp.tanh]})


def test_flatten_leaves_attribute_callables_out():
  leaves, _ = tree.flatten({"m": eqx.nn.Lambda(jnp.tanh), "w": jnp.ones(2)})
  assert [leaf.path for leaf in leaves] == ["['w']"]


def test_path_keys_reads_flattened_indices():
  assert tree.path_keys("['s'][<flat index 1>][0]") == ["s", 1, 0]
  assert tree.nest({"[<flat index 0>]": 1, "[<flat index 1>]": 2}) == [1, 2]
