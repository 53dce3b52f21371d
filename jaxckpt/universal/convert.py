"""The conversion language: declarative rules that turn a saved tree into a target tree.

A :class:`ConversionSpec` is a list of rules applied in order, each to the tree
the previous ones produced. Every rule matches tree paths
(``jax.tree_util.keystr`` strings such as ``['params']['layers_0']['w']``),
consumes the leaves it matches and produces new ones; leaves no rule touches
pass through unchanged. :func:`apply` gives lazy tensorstore views: nothing is
read until a region is asked for, and then only the stored regions it needs,
so :func:`restore_converted` onto a sharding reads on each host only the
slices that host's devices hold.

Patterns are the path text itself with three kinds of holes:

* ``{name}`` captures the text of (part of) one key, e.g. ``['layers_{i}']``
  (no ``[ ] ' "`` or ``.`` inside; a name used twice must match the same text);
  ``{name:**}`` captures any text, across keys: ``['params']{rest:**}``;
* ``*`` matches any text inside one key, ``**`` any text at all;
* a pattern that starts with ``re:`` is a Python regular expression instead
  (full match; named groups are the captures).

Templates (``dst``) are paths with ``{name}`` filled from the captures (and
``{i}``, the index, for :class:`Unstack`).

>>> spec = ConversionSpec(rules=(
...     Unstack(src="['params']['layers']['{p}']", dst="['params']['layers_{i}']['{p}']"),
...     Split(src="['params']['layers_{i}']['qkv']", axis=1,
...           dsts=("['params']['layers_{i}']['q']", "['params']['layers_{i}']['k']",
...                 "['params']['layers_{i}']['v']")),
...     Unpad(src="['params']['embed']", axis=0, size=50257),
... ))

The same spec in YAML (:meth:`ConversionSpec.from_yaml`; ``docs/conversion.md``)::

  rules:
    - unstack: {src: "['params']['layers']['{p}']", dst: "['params']['layers_{i}']['{p}']"}
    - split: {src: "['params']['layers_{i}']['qkv']", axis: 1,
              dsts: ["['params']['layers_{i}']['q']", ...]}
    - unpad: {src: "['params']['embed']", axis: 0, size: 50257}

Errors (:class:`jaxckpt.errors.ConversionError`, a ``ValueError``): a rule that
matches no leaf, a leaf two groups of one rule both claim, two sources that
produce the same path, or a produced path that already exists all name the
paths involved.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np
import tensorstore as ts
import yaml

from jaxckpt import errors
from jaxckpt.host import snapshot as snap
from jaxckpt.host.snapshot import Box
from jaxckpt.universal import _failures
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _manifest as man
from jaxckpt.universal import _read, _saved_items, _write
from jaxckpt.universal._rules import (RULES, Average, Cast, Concat, Drop, Pad, Rename, Reshape,
                                      Rule, Split, Stack, Transpose, Unpad, Unstack,
                                      compile_pattern, match)
from jaxckpt.universal._rules import _Leaf

log = logging.getLogger(__name__)

READ_TIMEOUT_SECS = 600.0

__all__ = ["Average", "Cast", "Concat", "ConversionSpec", "ConvertedView", "Drop", "Pad", "Rename",
           "Reshape", "Rule", "Split", "Stack", "Transpose", "Unpad", "Unstack", "apply",
           "compile_pattern", "convert", "match", "restore_converted"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversionSpec:
  """An ordered list of rules; each applies to the tree the previous ones produced."""

  rules: tuple[Rule, ...]

  def __post_init__(self):
    object.__setattr__(self, "rules", tuple(self.rules))
    bad = [r for r in self.rules if not isinstance(r, Rule)]
    if bad:
      raise errors.ConversionError(f"ConversionSpec.rules must be Rule objects, got {bad!r}")

  @classmethod
  def from_dict(cls, obj: Mapping[str, Any]) -> "ConversionSpec":
    """From ``{"rules": [{"op": "rename", "src": ..., "dst": ...}, {"split": {...}}, ...]}``."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("rules"), list):
      raise errors.ConversionError(
          f"a conversion spec is a mapping with a list under 'rules', got {obj!r:.200}")
    return cls(rules=tuple(_rule_from_obj(k, r) for k, r in enumerate(obj["rules"])))

  @classmethod
  def from_json(cls, text: str) -> "ConversionSpec":
    try:
      obj = json.loads(text)
    except ValueError as e:
      raise errors.ConversionError(f"conversion spec is not valid JSON: {e}") from None
    return cls.from_dict(obj)

  @classmethod
  def from_yaml(cls, text: str) -> "ConversionSpec":
    try:
      obj = yaml.safe_load(text)
    except yaml.YAMLError as e:
      raise errors.ConversionError(f"conversion spec is not valid YAML: {e}") from None
    return cls.from_dict(obj)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "ConversionSpec":
    """Reads a ``.json`` or ``.yaml``/``.yml`` file."""
    with open(path, encoding="utf-8") as f:
      text = f.read()
    return cls.from_json(text) if str(path).endswith(".json") else cls.from_yaml(text)

  def to_dict(self) -> dict[str, Any]:
    """The JSON/YAML form (``from_dict(spec.to_dict()) == spec``)."""
    def plain(v: Any) -> Any:
      return list(v) if isinstance(v, tuple) else v
    return {"rules": [{"op": r.op, **{f.name: plain(getattr(r, f.name))
                                      for f in dataclasses.fields(r)
                                      if getattr(r, f.name) != f.default}}
                      for r in self.rules]}


def _rule_from_obj(k: int, obj: Any) -> Rule:
  if isinstance(obj, Mapping) and "op" in obj:
    op, fields = obj["op"], {f: v for f, v in obj.items() if f != "op"}
  elif isinstance(obj, Mapping) and len(obj) == 1 and isinstance(next(iter(obj.values())), Mapping):
    op, fields = next(iter(obj.items()))
  else:
    raise errors.ConversionError(
        f"rule #{k} {obj!r:.200} is neither {{op: NAME, ...fields}} nor {{NAME: {{...fields}}}}")
  cls = RULES.get(op)
  if cls is None:
    raise errors.ConversionError(f"rule #{k}: unknown op {op!r}; the ops are {sorted(RULES)}")
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(fields) - names)
  if unknown:
    raise errors.ConversionError(f"rule #{k} ({op}): unknown fields {unknown}; {op} takes "
                                 f"{sorted(names)}")
  fields = {f: tuple(v) if isinstance(v, list) else v for f, v in fields.items()}
  try:
    return cls(**fields)
  except TypeError as e:
    raise errors.ConversionError(f"rule #{k} ({op}): {e}") from None


class ConvertedView:
  """A step seen through a conversion: the read interface of a StepReader.

  ``leaves``, ``read`` and ``open_leaf`` behave as on
  :class:`~jaxckpt.universal.StepReader`, so :func:`restore_arrays` (and
  :func:`restore_converted`) restore it onto any sharding. Leaves no rule
  changed are read through the source reader (every whole chunk checked
  against its xxh3-64); converted ones through their lazy views (each inner
  chunk checked by its crc32c).

  Attributes:
    source: the StepReader underneath. spec: the conversion.
    step, metadata: the source step's. leaves: path -> LeafInfo after conversion.
  """

  def __init__(self, source: _read.StepReader, spec: ConversionSpec, tree: dict[str, _Leaf]):
    self.source, self.spec, self._tree = source, spec, tree
    self.step, self.metadata = source.step, _true_items(source.metadata, tree)
    self.process_count = 1
    self.leaves: dict[str, man.LeafInfo] = {p: leaf.info for p, leaf in tree.items()}
    self.bytes_needed = 0
    self._lock = threading.Lock()

  def _leaf(self, path: str) -> _Leaf:
    leaf = self._tree.get(path)
    if leaf is None:
      raise errors.StructureMismatchError(
          f"the converted step {self.step} has no leaf {path!r}; it has {sorted(self._tree)[:20]}")
    return leaf

  def open_leaf(self, path: str) -> ts.TensorStore:
    """The lazy tensorstore view of one converted leaf (storage dtype, origin 0)."""
    return self._leaf(path).view

  def region_reader(self, path: str, *, boxes: Any = None, budget: Any = None) -> Any:
    """``read_region(box)`` for one restore of leaf ``path`` (see StepReader.region_reader)."""
    leaf = self._leaf(path)
    if leaf.origin is not None:
      return self.source.region_reader(leaf.origin, boxes=boxes, budget=budget)
    return _ViewRegions(self, path)

  def read(self, path: str, box: Box | None = None) -> np.ndarray:
    """A fresh logical-dtype array holding ``box`` (default: all) of leaf ``path``."""
    leaf = self._leaf(path)
    info = leaf.info
    box = snap.full_box(info.shape) if box is None else tuple(tuple(p) for p in box)
    if len(box) != len(info.shape):
      raise errors.InvalidArgumentError(f"box {list(box)} has {len(box)} dimensions; {path!r} has shape "
                       f"{list(info.shape)}")
    if leaf.origin is not None:
      return self.source.read(leaf.origin, box)
    try:
      raw = leaf.view[tuple(slice(a, b) for a, b in box)].read().result(timeout=READ_TIMEOUT_SECS)
    except TimeoutError:
      raise errors.SnapshotTimeoutError(
          f"reading {path!r} {list(box)} of the converted step {self.step} took over "
          f"{READ_TIMEOUT_SECS} s; check the storage backend") from None
    except errors.CorruptSnapshotError as e:
      raise errors.CorruptSnapshotError(
          f"reading {path!r} {list(box)} of the converted step {self.step}: {e}") from None
    except errors.StorageError:
      raise                    # this attempt's (names the step and the cause): not damage
    except ValueError as e:
      where = (f"reading {path!r} {list(box)} of the converted step {self.step} from "
               f"{self.source.directory!r}")
      raise _failures.classify(e, where, lambda cause: (
          f"{where} failed ({cause}); run `jaxckpt verify` on it")) from None
    arr = lay.logical_view(np.asarray(raw), info.numpy_dtype)
    with self._lock:
      self.bytes_needed += arr.nbytes
    return arr


def _true_items(metadata: dict[str, Any], tree: Mapping[str, _Leaf]) -> dict[str, Any]:
  """``metadata`` with its record of orbax items (``Composite``) kept true after a
  conversion: an item whose leaves were dropped (or computed anew) is no longer listed, one
  moved to another top-level name is listed under it."""
  kept = _saved_items.surviving(metadata, {p: leaf.info for p, leaf in tree.items()},
                                {p: leaf.origin for p, leaf in tree.items()})
  if kept is None:
    return metadata
  out = {k: v for k, v in metadata.items() if k != _saved_items.ITEMS_KEY}
  if kept:
    out[_saved_items.ITEMS_KEY] = kept
  return out


class _ViewRegions:
  """``read_region(box)`` of a converted leaf (its view verifies every stored chunk it reads)."""

  def __init__(self, view: "ConvertedView", path: str) -> None:
    self._view, self._path = view, path

  def __call__(self, box: Box | None = None) -> np.ndarray:
    return self._view.read(self._path, box)

  def close(self) -> None:
    pass


def _stored_leaves(reader: _read.StepReader) -> dict[str, _Leaf]:
  def opener(path: str):
    return lambda: reader.open_leaf(path)
  return {p: _Leaf(info, opener(p) if info.is_array else None, origin=p)
          for p, info in reader.leaves.items()}


def _unmatched(k: int, rule: Rule, tree: Mapping[str, Any], gone: Mapping[str, str]) -> str:
  taken = {p: who for p, who in gone.items() for pat in rule.patterns()
           if compile_pattern(pat).fullmatch(p)}
  why = (f"; it would have matched {sorted(taken)}, which earlier rules consumed "
         f"({sorted(set(taken.values()))})") if taken else ""
  return (f"rule #{k} {rule} matches no leaf{why}. The tree at that point has "
          f"{len(tree)} leaves: {list(tree)[:20]}{' ...' if len(tree) > 20 else ''}")


def _step(k: int, rule: Rule, tree: dict[str, _Leaf], gone: dict[str, str]) -> dict[str, _Leaf]:
  """Applies one rule to ``tree``; checks that every path is consumed and produced once."""
  groups = rule.plan(tree)
  if not groups:
    raise errors.ConversionError(_unmatched(k, rule, tree, gone))
  consumed: dict[str, int] = {}
  produced: dict[str, int] = {}
  for g, (srcs, outs) in enumerate(groups):
    for p in srcs:
      if p in consumed:
        raise errors.ConversionError(
            f"rule #{k} {rule} uses {p!r} twice (with {groups[consumed[p]][0]} and with {srcs}); "
            "the rule is ambiguous")
      consumed[p] = g
    for q in outs:
      if q in produced:
        raise errors.ConversionError(
            f"rule #{k} {rule} produces {q!r} twice: from {groups[produced[q]][0]} and from "
            f"{srcs}; make the destination template distinguish them")
      produced[q] = g
  clash = sorted(q for q in produced if q in tree and q not in consumed)
  if clash:
    raise errors.ConversionError(
        f"rule #{k} {rule} produces {clash}, which the tree already holds and the rule does "
        "not consume; Rename or Drop those leaves first")
  out: dict[str, _Leaf] = {}
  for p, leaf in tree.items():
    if p not in consumed:
      out[p] = leaf
    elif groups[consumed[p]][0][0] == p:  # produced leaves take their first source's place
      out.update(groups[consumed[p]][1])
  gone.update({p: f"#{k} {rule.op}" for p in consumed if p not in produced})
  return out


def apply(spec: ConversionSpec, reader: _read.StepReader) -> ConvertedView:
  """Applies ``spec`` to a step (lazily: reads nothing).

  Raises:
    ConversionError: a rule matched nothing, was ambiguous, or produced a path
      twice or over an existing leaf (the message names the paths).
  """
  tree, gone = _stored_leaves(reader), {}
  for k, rule in enumerate(spec.rules):
    tree = _step(k, rule, tree, gone)
  log.info("step %d: %d rules turn %d leaves into %d", reader.step, len(spec.rules),
           len(reader.leaves), len(tree))
  return ConvertedView(reader, spec, tree)


def restore_converted(view: ConvertedView, targets: Mapping[str, Any], **kwargs: Any
                      ) -> dict[str, Any]:
  """Restores converted leaves onto target shardings, reading only the slices needed.

  The same as :func:`jaxckpt.universal.restore_arrays` (which takes the view
  directly): ``targets`` maps converted paths to ``jax.ShapeDtypeStruct`` with
  a sharding, or None for numpy.
  """
  return _read.restore_arrays(view, targets, **kwargs)


class _Source:
  """A write source over one converted leaf: reads regions through the view, counts bytes."""

  def __init__(self, view: ConvertedView, path: str, progress: Any):
    self._view, self._path, self._progress = view, path, progress
    self.shape = view.leaves[path].shape

  def __getitem__(self, index: Sequence[slice]) -> np.ndarray:
    box = tuple((s.start, s.stop) for s in index)
    arr = self._view.read(self._path, box)
    if self._progress is not None:
      self._progress.update(arr.nbytes)
    return arr


def convert(src_dir: str, dst_dir: str, spec: ConversionSpec, *, step: int | None = None,
            dst_step: int | None = None, progress: Any = None,
            max_inflight_bytes: int = _write.DEFAULT_MAX_INFLIGHT_BYTES) -> int:
  """Writes a converted copy of a step, chunk by chunk, and commits it.

  Args:
    src_dir, dst_dir: universal-format directories (paths or kvstore URLs).
    spec: the conversion.
    step: the source step (default: the latest committed).
    dst_step: the step to write (default: the same number).
    progress: anything with ``update(nbytes)`` (a tqdm bar), told of each chunk.
    max_inflight_bytes: bytes read and not yet written.

  Returns:
    The step written. Its metadata is the source's plus ``converted_from``, with the record
    of orbax items kept true (items the conversion dropped are no longer listed).
  """
  view = apply(spec, _read.open_step(src_dir, step))
  dst_step = view.step if dst_step is None else dst_step
  leaves = view.leaves
  sources = {p: _Source(view, p, progress) for p, info in leaves.items() if info.is_array}
  metadata = {**view.metadata, "converted_from": {"directory": src_dir, "step": view.step,
                                                   "spec": spec.to_dict()}}
  _write.write_leaves(dst_dir, dst_step, leaves, sources, metadata=metadata,
                      max_inflight_bytes=max_inflight_bytes)
  log.info("converted step %d of %s into step %d of %s", view.step, src_dir, dst_step, dst_dir)
  return dst_step


def total_nbytes(view: ConvertedView) -> int:
  """Bytes a full :func:`convert` of ``view`` reads (for progress bars)."""
  return sum(info.nbytes for info in view.leaves.values())
