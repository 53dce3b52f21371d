"""The example's model, data and training loop (see train_flax.py)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt as jc

logger = logging.getLogger("train_flax")


class Block(nnx.Module):
  def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class LM(nnx.Module):
  def __init__(self, vocab: int, d: int, layers: int, seq: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, d)) * 0.02)
    self.blocks = nnx.List([Block(d, 4, rngs) for _ in range(layers)])
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln(x))


def fsdp_sharding(mesh: jax.sharding.Mesh, x) -> NamedSharding:
  """Shards the largest dimension divisible by the mesh size; else replicates."""
  n = mesh.size
  dims = [i for i in np.argsort(x.shape)[::-1] if x.shape[i] % n == 0]
  spec = [None] * x.ndim
  if dims:
    spec[dims[0]] = "fsdp"
  return NamedSharding(mesh, P(*spec))


def make_batch(seed: int, step: int, batch: int, seq: int, vocab: int) -> np.ndarray:
  """Synthetic tokens: a deterministic function of (seed, step), learnable patterns."""
  rng = np.random.default_rng([seed, step])
  start = rng.integers(0, vocab, size=(batch, 1))
  stride = rng.integers(1, 4, size=(batch, 1))
  return ((start + stride * np.arange(seq + 1)) % vocab).astype(np.int32)


def init_state(args, mesh):
  model = LM(args.vocab, args.d_model, args.layers, args.seq_len, nnx.Rngs(args.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(lambda x: jax.device_put(x, fsdp_sharding(mesh, x)), params)
  tx = optax.adam(3e-3)
  opt_state = jax.jit(tx.init)(params)
  state = {"params": params, "opt_state": opt_state,
           "rng": jax.random.key(args.seed),
           "losses": np.full((args.steps,), np.nan, np.float32),
           "data": {"next_step": 0, "seed": args.seed},
           "config": {"d_model": args.d_model, "layers": args.layers, "vocab": args.vocab}}
  return graphdef, tx, state


def make_train_step(graphdef, tx):
  def loss_fn(params, tokens, rng):
    model = nnx.merge(graphdef, params)
    logits = model(tokens[:, :-1])
    del rng  # no dropout; kept in the state to show keys round-trip
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @jax.jit
  def step_fn(params, opt_state, tokens, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, jax.random.split(rng)[0]

  return jax.jit(step_fn, donate_argnums=(0, 1))


def agent_job_name(args) -> str | None:
  """The agent job of this process: ``--job-name``, suffixed by the group id in a replica group."""
  if args.job_name and getattr(args, "group_id", None):
    return f"{args.job_name}-{args.group_id}"
  return args.job_name


def manager_for(args) -> jc.CheckpointManager:
  job = agent_job_name(args)
  opts = jc.CheckpointOptions(max_snapshots=args.max_snapshots,
                              save_interval_steps=args.snapshot_interval,
                              agent=jc.AgentOptions(job_name=job, run_root=args.agent_run_root)
                              if job else None)
  return jc.CheckpointManager(directory=args.directory, options=opts)


def run(args: argparse.Namespace) -> int:
  mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  graphdef, tx, state = init_state(args, mesh)
  if args.lighthouse:
    return run_replica_group(args, mesh, graphdef, tx, state)
  train_step = make_train_step(graphdef, tx)
  with manager_for(args) as mgr:
    if args.resume:
      state = resume(mgr, state, args)
    step = state["data"]["next_step"]
    rolled_back = False
    t_start = time.perf_counter()
    while step < args.steps:
      tokens = jnp.asarray(make_batch(args.seed, step, args.batch, args.seq_len, args.vocab),
                           device=NamedSharding(mesh, P("fsdp")))
      params, opt_state, loss, rng = train_step(state["params"], state["opt_state"],
                                                tokens, state["rng"])
      losses = state["losses"].copy()
      losses[step] = float(loss)
      step += 1
      state = dict(state, params=params, opt_state=opt_state, rng=rng, losses=losses,
                   data=dict(state["data"], next_step=step))
      mgr.save(step, state, force=step == args.steps)   # the last step, whatever the plan
      logger.info("step %d loss %.6f", step, losses[step - 1])
      if mgr.reached_preemption(step):
        mgr.wait_until_finished()
        if mgr.latest_step() != step:          # the last save was skipped (busy)
          mgr.save(step, state, force=True)
          mgr.wait_until_finished()
        logger.info("preempted: last snapshot at step %d; exiting", step)
        return 0
      if args.sleep_per_step:
        time.sleep(args.sleep_per_step)
      if args.rollback_at == step and not rolled_back:
        mgr.wait_until_finished()
        state = mgr.restore(step=args.rollback_to, target=state)
        step, rolled_back = args.rollback_to, True
        logger.info("rolled back from step %d to step %d", args.rollback_at, step)
    mgr.wait_until_finished()
    secs = time.perf_counter() - t_start
    logger.info("done: %d steps in %.2f s; snapshots %s", args.steps, secs, mgr.stats)
  if args.dump:
    dump(args.dump, state)
  return 0


def resume(mgr: jc.CheckpointManager, state, args):
  """``state`` restored from the newest step the manager finds (``state`` itself when
  there is none): its ``losses`` as long as ``--steps`` (the saved run may have had
  fewer or more steps: its losses leaf is restored at its saved length)."""
  step = mgr.latest_step()
  if step is None:
    logger.warning("--resume: no snapshot to resume from%s; starting at step 0", "" if (
        args.job_name or args.directory) else " (without --job-name or --directory the "
        "snapshots of a run live in its own process and end with it)")
    return state
  saved = mgr.metadata(step).tree["losses"].shape
  target = dict(state, losses=np.zeros(saved, np.float32))
  state = mgr.restore(step, target=target)
  losses = np.full((max(args.steps, saved[0]),), np.nan, np.float32)
  losses[:saved[0]] = state["losses"]
  logger.info("resumed at step %d from tier %s in %.3f s", mgr.last_restore.step,
              mgr.last_restore.tier, mgr.last_restore.seconds)
  return dict(state, losses=losses)


def make_ft_fns(graphdef, tx, train):
  """``grad_fn(params, tokens) -> (loss, grads)`` and ``apply_fn(train, grads) -> train``.

  Gradients keep the parameters' shardings and updates keep the state's, so an
  update applied after the fault-tolerant all-reduce, one replayed during
  catch-up and one on a state rebuilt from a snapshot run the same program.
  """
  shardings = jax.tree.map(lambda x: x.sharding, train["params"])
  train_shardings = jax.tree.map(lambda x: x.sharding, train)

  def loss_fn(p, tokens):
    logits = nnx.merge(graphdef, p)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  grad_fn = jax.jit(jax.value_and_grad(loss_fn), out_shardings=(None, shardings))

  @functools.partial(jax.jit, out_shardings=train_shardings)
  def apply_fn(train, grads):
    updates, opt_state = tx.update(grads, train["opt_state"], train["params"])
    return {"params": optax.apply_updates(train["params"], updates), "opt_state": opt_state}

  return grad_fn, apply_fn


def run_replica_group(args, mesh, graphdef, tx, state) -> int:
  """Trains as replica group ``--group-id``: grads -> ft.allreduce -> apply if committed.

  Every committed step is snapshotted into this group's agent (job
  ``{--job-name}-{--group-id}``), which serves it to groups that catch up.
  A group that starts late or restarts joins at the quorum's step.
  """
  from jaxckpt import ft as jft  # pylint: disable=import-outside-toplevel
  from datetime import timedelta  # pylint: disable=import-outside-toplevel
  replicated = NamedSharding(mesh, P())
  train = jax.tree.map(lambda x: x if len(x.sharding.device_set) == mesh.size
                       else jax.device_put(x, replicated),
                       {"params": state["params"], "opt_state": state["opt_state"]})
  grad_fn, apply_fn = make_ft_fns(graphdef, tx, train)
  # What every group of the job must hold the same (refused at join otherwise): the batches
  # come from make_batch under the job's seed.
  options = jft.ReplicaGroupOptions(ring_size=args.ring_size, max_groups=args.max_groups,
                                    data_order=f"make_batch(seed={args.seed})",
                                    heartbeat_interval=timedelta(milliseconds=200), host=args.host)
  source = jft.AgentSnapshotSource(run_root=args.agent_run_root, job_name=agent_job_name(args))
  losses = np.full((args.steps,), np.nan, np.float32)
  tokens = jnp.asarray(make_batch(args.seed, 0, args.batch, args.seq_len, args.vocab),
                       device=NamedSharding(mesh, P("fsdp")))
  t0 = time.perf_counter()
  jax.block_until_ready(apply_fn(train, grad_fn(train["params"], tokens)[1]))  # compile first
  logger.info("group %s compiled in %.1f s; joining the lighthouse at %s", args.group_id,
              time.perf_counter() - t0, args.lighthouse)
  with manager_for(args) as mgr, jft.ReplicaGroup(
      lighthouse=args.lighthouse, group_id=args.group_id, options=options,
      timeout=timedelta(seconds=args.ft_timeout), snapshot_source=source) as group:
    mgr.save(0, dict(train, data={"next_step": 0, "seed": args.seed}))  # warms the snapshot path
    mgr.wait_until_finished()
    while group.step < args.steps:
      train = group.start_step(train, apply_fn, grads_like=train["params"])
      index = group.batch_index()
      tokens = jnp.asarray(make_batch(args.seed, index, args.batch, args.seq_len, args.vocab),
                           device=NamedSharding(mesh, P("fsdp")))
      loss, grads = grad_fn(train["params"], tokens)
      grads = group.allreduce(grads)
      if not group.should_commit():
        continue
      train = apply_fn(train, grads)
      losses[group.step - 1] = float(loss)
      mgr.save(group.step, dict(train, data={"next_step": group.step, "seed": args.seed}))
      logger.info("step %d loss %.6f batch %d contributors %s", group.step, float(loss), index,
                  ",".join(group.metrics.contributors))
      if args.sleep_per_step:
        time.sleep(args.sleep_per_step)
    mgr.wait_until_finished()
    logger.info("done: group %s at step %d; %s", args.group_id, group.step, group.counters)
  if args.dump:
    dump(args.dump, dict(train, losses=losses))
  return 0


def dump(path: str, state) -> None:
  flat = {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
  np.savez(path + ".npz", **flat)
  with open(path, "w") as f:
    json.dump({"losses": [float(x) for x in state["losses"]]}, f)
