"""Orbax checkpoints in and out of the universal format (``jaxckpt import-orbax`` and
``export-orbax``).

:func:`import_orbax` reads a checkpoint written by ``ocp.CheckpointManager``
(``StandardSave``) or ``ocp.StandardCheckpointer``: orbax's own metadata API
gives the tree, shapes and dtypes; each array is then opened lazily as the
tensorstore array orbax wrote (zarr, inside OCDBT when orbax used it) and
copied chunk by chunk, so no host holds a whole tensor. The universal step can
then be restored onto any mesh (:func:`jaxckpt.universal.restore_arrays`).

:func:`export_orbax` writes a universal step (optionally converted by a
:class:`~jaxckpt.universal.convert.ConversionSpec`) with
``ocp.StandardCheckpointer().save``, so ``ocp.StandardCheckpointer().restore``
reads it. The tree it saves is nested from the leaf paths: ``['k']`` is a dict
key, ``[0]`` a list index (a level whose keys are exactly 0..n-1 becomes a
list, otherwise a dict with int keys), ``.name`` an attribute, saved as a dict
key because the class is not known. So ``['a'][0].b`` and ``['a'][1].b``
become ``{'a': [{'b': ...}, {'b': ...}]}``. Arrays are saved as numpy arrays
and scalars as Python scalars; PRNG keys as their key data. Orbax holds the
whole tree in host memory while it saves.

Reading orbax's files (one step's items, tree and arrays) is the universal
format's (``jaxckpt.universal._orbax_files``), which a restore of an orbax step
where it lies shares; this module copies what it reads, and writes orbax's.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orbax.checkpoint as ocp

from jaxckpt import errors
from jaxckpt.tree import nest, path_keys  # pylint: disable=unused-import (public here too)
from jaxckpt.universal import _commit
from jaxckpt.universal import _manifest as man
from jaxckpt.universal import _orbax_files as of
from jaxckpt.universal import _orbax_steps
from jaxckpt.universal import _read
from jaxckpt.universal import _write
from jaxckpt.universal import convert as cv
# (public here too: the layouts import_orbax writes, and the bytes it copies)
from jaxckpt.universal._orbax_files import LAYOUTS, nnx_path, nnx_paths, orbax_nbytes  # pylint: disable=unused-import

log = logging.getLogger(__name__)


def import_orbax(orbax_dir: str, dst_dir: str, *, step: int | None = None,
                 item: str | None = None, dst_step: int | None = None,
                 progress: Any = None, layout: str = "auto") -> int:
  """Copies an orbax checkpoint into a committed universal-format step.

  Args:
    orbax_dir: a ``CheckpointManager`` directory (steps inside) or one
      ``StandardCheckpointer`` save.
    dst_dir: universal-format directory (path or kvstore URL).
    step: the orbax step (default: the latest); ignored for a bare save.
    item: the manager's item name (default: the only one, e.g. ``default``).
    dst_step: the step to write (default: the orbax step, 0 for a bare save).
    progress: anything with ``update(nbytes)`` (a tqdm bar).
    layout: ``"nnx"`` writes every leaf at its Flax NNX path (see
      :func:`nnx_path`), so the step restores straight into
      ``nnx.state(nnx.eval_shape(...))``; ``"plain"`` keeps orbax's paths;
      ``"auto"`` (default) writes NNX paths for each NNX state in the tree
      (see :func:`nnx_paths`: the whole tree, or e.g. the ``"train"`` entry
      of ``{"train": nnx.State, "data": {...}}``) and orbax's paths elsewhere.
      In every layout, arrays orbax saved from typed PRNG keys (it records
      their implementation) are typed keys again.

  Returns:
    The universal step written. Leaf paths are the ``jax.tree_util.keystr``
    of orbax's tree (``['params']['w']``, ``['layers'][0]['b']``), or their
    NNX form.
  """
  of.check_layout(layout)
  orbax_dir = of.local_dir(orbax_dir)
  source = of.selected(orbax_dir, step, item)
  found = source.step
  dst_step = (found or 0) if dst_step is None else dst_step
  if dst_step in _commit.stored_steps(dst_dir):
    raise errors.StepAlreadyExistsError(
        f"step {dst_step} is already in {dst_dir!r} (imported before?); import into another "
        f"step (dst_step=, --dst-step) or directory, or delete it first "
        f"({_commit.delete_command(dst_dir, dst_step)})")
  got = of.read_source(source, orbax_dir, progress, layout)
  metadata = dict(got.metadata)
  metadata["imported_from"] = {
      "orbax": orbax_dir, "step": found,
      "item": None if found is None else (next(iter(got.kinds)) if got.single
                                          else sorted(got.kinds))}
  _write.write_leaves(dst_dir, dst_step, got.leaves, got.sources, metadata=metadata)
  log.info("imported %d leaves of %s (items %s) into step %d of %s", len(got.leaves), orbax_dir,
           sorted(got.kinds), dst_step, dst_dir)
  return dst_step


def import_orbax_steps(orbax_dir: str, dst_dir: str, *, steps: list[int] | None = None,
                       item: str | None = None, progress: Any = None,
                       layout: str = "auto") -> list[int]:
  """Copies a whole orbax run (every finalized step of a ``CheckpointManager`` directory, or
  ``steps``) into committed universal-format steps of the same numbers, as
  :func:`import_orbax` copies one (a bare ``StandardCheckpointer`` save: its one step, 0).

  Every step asked for is checked first: one that orbax does not hold, or that ``dst_dir``
  holds already, is refused before anything is copied, naming them all.

  Returns:
    The steps written, ascending.
  """
  of.check_layout(layout)
  orbax_dir = of.local_dir(orbax_dir)
  if is_one_save(orbax_dir) and steps is None and of.not_importable(orbax_dir) is None:
    return [import_orbax(orbax_dir, dst_dir, item=item, progress=progress, layout=layout)]
  wanted = run_steps(orbax_dir, dst_dir, steps)
  for s in wanted:
    import_orbax(orbax_dir, dst_dir, step=s, item=item, progress=progress, layout=layout)
  return wanted


def run_steps(orbax_dir: str, dst_dir: str, steps: list[int] | None = None) -> list[int]:
  """The steps :func:`import_orbax_steps` copies (every finalized step, or ``steps``),
  ascending, once each is known to be in ``orbax_dir`` and not yet in ``dst_dir``.

  Raises:
    StepNotFoundError: naming the steps orbax does not hold, and those it holds.
    StepAlreadyExistsError: naming the steps ``dst_dir`` holds already.
  """
  held = orbax_manager_steps(orbax_dir)
  wanted = held if steps is None else sorted(set(steps))
  if not wanted or (missing := [s for s in wanted if s not in held]):
    raise errors.StepNotFoundError(
        f"orbax steps {missing if wanted else steps} are not in {orbax_dir!r}; it has {held}")
  if (there := sorted(set(wanted) & set(_commit.stored_steps(dst_dir)))):
    rest = ",".join(str(s) for s in wanted if s not in there)
    raise errors.StepAlreadyExistsError(
        f"steps {there} are already in {dst_dir!r} (imported before?); nothing was imported. "
        + (f"Import the others (--steps {rest}) or into another directory" if rest else
           "Import into another directory, or delete them there first"))
  return wanted


def is_one_save(orbax_dir: str) -> bool:
  """Whether ``orbax_dir`` is one ``StandardCheckpointer`` save (not a manager's steps)."""
  try:
    return os.path.exists(os.path.join(of.local_dir(orbax_dir), "_METADATA"))
  except errors.InvalidArgumentError:     # a URL: the import that follows says why
    return False


def orbax_manager_steps(orbax_dir: str) -> list[int]:
  """The finalized steps of an orbax CheckpointManager directory, ascending.

  Raises:
    InvalidArgumentError: ``orbax_dir`` is no directory import_orbax reads (naming what to pass).
    StepNotFoundError: it holds no finalized step.
  """
  orbax_dir = of.local_dir(orbax_dir)
  if (why := of.not_importable(orbax_dir)):
    raise errors.InvalidArgumentError(why)
  steps = sorted(_orbax_steps.orbax_steps(orbax_dir))
  if not steps:
    raise errors.StepNotFoundError(
        f"{orbax_dir!r} holds neither an orbax checkpoint (_METADATA) nor finalized "
        "CheckpointManager steps")
  return steps


def _exportable(path: str, info: man.LeafInfo) -> None:
  if not info.is_array and not isinstance(info.scalar, (bool, int, float)):
    raise errors.UnsupportedLeafError(
        f"leaf {path!r} is a {type(info.scalar).__name__} scalar ({info.scalar!r}); orbax "
        "StandardSave takes only arrays and numbers: Drop it with a conversion spec")
  if info.is_array and 0 in info.shape:
    raise errors.UnsupportedLeafError(
        f"leaf {path!r} has shape {list(info.shape)}; orbax cannot save zero-size arrays: "
        "Drop it with a conversion spec")


def export_orbax(src_dir: str, dst_orbax_dir: str, *, step: int | None = None,
                 spec: cv.ConversionSpec | None = None, force: bool = False,
                 progress: Any = None) -> str:
  """Writes a universal step as an orbax checkpoint that ``StandardCheckpointer`` restores.

  Args:
    src_dir: universal-format directory.
    dst_orbax_dir: the checkpoint directory to create
      (``ocp.StandardCheckpointer().restore(dst_orbax_dir)`` reads it).
    step: the universal step (default: the latest).
    spec: an optional conversion applied on the way.
    force: overwrite ``dst_orbax_dir`` if it exists.
    progress: anything with ``update(nbytes)``, told of each leaf read.

  Returns:
    The absolute path written.
  """
  out = of.local_dir(dst_orbax_dir, writing=True)
  reader = _read.open_step(src_dir, step)
  view = reader if spec is None else cv.apply(spec, reader)
  flat = {}
  for path, info in view.leaves.items():
    _exportable(path, info)
    flat[path] = view.read(path) if info.is_array else info.scalar
    if progress is not None:
      progress.update(info.nbytes)
  tree = nest(flat)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(out, tree, force=force)
    ckptr.wait_until_finished()
  log.info("exported step %d of %s (%d leaves) to orbax at %s", reader.step, src_dir,
           len(flat), out)
  return out
