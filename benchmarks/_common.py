"""Shared helpers of the snapshot benchmarks: CPU mesh, trees, stores, stats.

Import this module before anything that starts the JAX backend: it asks for
8 CPU devices.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Iterator

import jax

try:
  jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
  pass  # backend already started: use what is there

import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

import jaxckpt as jc  # pylint: disable=wrong-import-position

# Saved layout: a (2, 4) mesh with several specs; restore targets use another.
SAVE_SPECS = (P("data", "model"), P("model", None), P(None, "data"), P(("data", "model")))
RESHARD_SPECS = (P(None, ("a", "b")), P("b", "a"), P(("a", "b"), None), P("a"))


def save_mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def reshard_mesh() -> Mesh:
  """A different device order and shape than ``save_mesh``."""
  return Mesh(np.array(jax.devices()[:8][::-1]).reshape(4, 2), ("a", "b"))


def leaf_shapes(size_mib: float, n_params: int = 16) -> list[tuple[int, int]]:
  """``n_params`` float32 matrices whose params + mu + nu total ~``size_mib``."""
  per_leaf = size_mib * 2**20 / 3 / n_params / 4          # elements per param leaf
  cols = 1024 if per_leaf >= 1024 * 64 else 64
  rows = max(8, int(per_leaf // cols) // 8 * 8)
  return [(rows, cols) for _ in range(n_params)]


def shardings(mesh: Mesh, specs: tuple[P, ...], n: int) -> list[NamedSharding]:
  return [NamedSharding(mesh, specs[i % len(specs)]) for i in range(n)]


def abstract_tree(size_mib: float, mesh: Mesh, specs: tuple[P, ...]) -> dict[str, Any]:
  """The Adam-like state (params, mu, nu, count) as ShapeDtypeStructs on ``mesh``."""
  shapes = leaf_shapes(size_mib)
  shs = shardings(mesh, specs, len(shapes))
  def group() -> dict[str, jax.ShapeDtypeStruct]:
    return {f"w{i:02d}": jax.ShapeDtypeStruct(s, np.float32, sharding=sh)
            for i, (s, sh) in enumerate(zip(shapes, shs))}
  count = jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P()))
  return {"params": group(), "opt_state": {"mu": group(), "nu": group(), "count": count}}


def make_tree_fn(abstract: dict[str, Any]) -> Callable[[int], Any]:
  """A jitted ``seed -> tree`` producing fresh arrays of random values with the
  shardings of ``abstract``."""
  leaves, treedef = jax.tree.flatten(abstract)
  outs = jax.tree.unflatten(treedef, [x.sharding for x in leaves])

  def build(seed):        # random values: orbax's writer compresses regular ones
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    vals = [jax.random.bits(k, x.shape, np.uint32).astype(x.dtype) if
            np.issubdtype(x.dtype, np.integer) else jax.random.normal(k, x.shape, x.dtype)
            for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, vals)

  fn = jax.jit(build, out_shardings=outs)
  return lambda seed: jax.block_until_ready(fn(np.int32(seed)))


def tree_nbytes(tree: Any) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def summary(xs: list[float], nd: int = 4) -> dict[str, float]:
  return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd),
          "max": round(max(xs), nd), "n": len(xs)}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def stop_agent(job: str, run_root: str) -> None:
  subprocess.run([sys.executable, "-m", "jaxckpt.agent", "stop", "--job-name", job,
                  "--run-root", run_root], check=False, timeout=60,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def manager(store: str, *, max_snapshots: int = 2, directory: str | None = None,
            **options: Any) -> Iterator[jc.CheckpointManager]:
  """A CheckpointManager on the in-process store ("inproc") or a fresh agent ("agent");
  ``options`` are further ``CheckpointOptions`` fields; ``directory``: persist there."""
  if store == "inproc":
    with jc.CheckpointManager(directory, options=jc.CheckpointOptions(
        max_snapshots=max_snapshots, **options)) as m:
      yield m
    return
  job = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
  root = tempfile.mkdtemp(prefix="jaxckpt-bench-", dir="/dev/shm")
  try:
    opts = jc.CheckpointOptions(max_snapshots=max_snapshots,
                                agent=jc.AgentOptions(job_name=job, run_root=root), **options)
    with jc.CheckpointManager(directory, options=opts) as m:
      yield m
  finally:
    stop_agent(job, root)
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(root, ignore_errors=True)
