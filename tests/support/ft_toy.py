"""A tiny FSDP-sharded MLP trained with optax adam: the workload of the ft tests and benchmark."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import xxhash
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BATCH, DIM, HIDDEN = 8, 16, 32
TX = optax.adam(1e-2)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(DIM)(nn.relu(nn.Dense(HIDDEN)(x)))


def fsdp(mesh: Mesh, x: Any) -> NamedSharding:
  """Shards the first dimension over the mesh when it divides, else replicates."""
  n = mesh.devices.size
  spec = P("fsdp") if np.ndim(x) >= 1 and np.shape(x)[0] % n == 0 else P()
  return NamedSharding(mesh, spec)


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
  return Mesh(np.array(devices), ("fsdp",))


def init_state(mesh: Mesh, seed: int = 0) -> dict[str, Any]:
  """Params and adam state, every leaf placed FSDP-style on ``mesh`` (same seed, same values)."""
  params = MLP().init(jax.random.key(seed), jnp.zeros((1, DIM)))["params"]
  state = {"params": params, "opt": TX.init(params)}
  return jax.tree.map(lambda x: jax.device_put(x, fsdp(mesh, x)), state)


def batch(index: int) -> tuple[np.ndarray, np.ndarray]:
  """Deterministic synthetic batch number ``index`` (targets: a fixed linear map)."""
  rng = np.random.default_rng(index)
  x = rng.standard_normal((BATCH, DIM), dtype=np.float32)
  return x, np.tanh(x[:, ::-1] * 0.5)


@jax.jit
def _grad(state: dict[str, Any], x: jax.Array, y: jax.Array) -> Any:
  def loss(params):
    return jnp.mean((MLP().apply({"params": params}, x) - y) ** 2)
  return jax.grad(loss)(state["params"])


def grad_fn(state: dict[str, Any], x: np.ndarray, y: np.ndarray) -> Any:
  """Gradients of the params, sharded like the params (so ``grads_like=params`` holds)."""
  grads = _grad(state, x, y)
  return jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), grads, state["params"])


@jax.jit
def apply_fn(state: dict[str, Any], grads: Any) -> dict[str, Any]:
  updates, opt = TX.update(grads, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def host_values(tree: Any) -> Any:
  """Whole values of ``tree``'s leaves as numpy arrays, also when they span several processes.

  With several processes this is a collective: every process of the job must call it.
  """
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def fingerprint(state: Any) -> str:
  """xxh3-64 hex of every leaf's bytes: equal fingerprints mean bit-identical states."""
  h = xxhash.xxh3_64()
  for leaf in jax.tree.leaves(host_values(state)):
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()
