"""Rules of the conversion language: path patterns, and what each rule produces.

The public face is :mod:`jaxckpt.universal.convert` (module docstring there).
Each rule's ``plan`` takes the tree under conversion (path -> lazy leaf) and
returns groups of (consumed paths, produced leaves); ``convert.apply`` checks
the groups for collisions and builds the next tree.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import tensorstore as ts

from jaxckpt import errors
from jaxckpt.host import snapshot as snap
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _lazy
from jaxckpt.universal import _manifest as man

_KEY_TEXT = r"[^\[\]'\".]"
_HOLE = re.compile(r"(\*\*|\*|\{\w+(?::\*\*)?\})")
_FIELD = re.compile(r"\{(\w+)\}")


def _fail(msg: str) -> errors.ConversionError:
  return errors.ConversionError(msg)


@functools.lru_cache(maxsize=512)
def compile_pattern(pattern: str) -> re.Pattern:
  """The regular expression of a path pattern (syntax: :mod:`jaxckpt.universal.convert`).

  >>> compile_pattern("['layers_{i}']['*']").fullmatch("['layers_3']['w']")["i"]
  '3'
  """
  if pattern.startswith("re:"):
    try:
      return re.compile(pattern[3:])
    except re.error as e:
      raise _fail(f"pattern {pattern!r} is not a valid regular expression: {e}") from None
  out, seen = [], set()
  for tok in _HOLE.split(pattern):
    if tok == "**":
      out.append(".*")
    elif tok == "*":
      out.append(f"{_KEY_TEXT}*")
    elif tok.startswith("{") and tok.endswith("}"):
      name, _, deep = tok[1:-1].partition(":")
      text = ".+?" if deep else f"{_KEY_TEXT}+?"
      out.append(f"(?P={name})" if name in seen else f"(?P<{name}>{text})")
      seen.add(name)
    else:
      out.append(re.escape(tok))
  return re.compile("".join(out))


def captures_of(pattern: str) -> frozenset[str]:
  return frozenset(compile_pattern(pattern).groupindex)


def fill(template: str, values: Mapping[str, Any]) -> str:
  """``template`` with every ``{name}`` replaced by ``values[name]``."""
  def one(m: re.Match) -> str:
    if m.group(1) not in values:
      raise _fail(f"template {template!r} uses {{{m.group(1)}}} but only "
                  f"{sorted(values)} are captured")
    return str(values[m.group(1)])
  return _FIELD.sub(one, template)


def _fields(template: str) -> set[str]:
  return set(_FIELD.findall(template))


class _Leaf:
  """One leaf of a tree under conversion: its LeafInfo and a lazy storage-dtype view."""

  def __init__(self, info: man.LeafInfo, make_view: Callable[[], ts.TensorStore] | None,
               origin: str | None = None):
    self.info, self._make, self.origin = info, make_view, origin

  @functools.cached_property
  def view(self) -> ts.TensorStore:
    if self._make is None:
      raise _fail(f"leaf {self.info.path!r} is a {self.info.kind} (value {self.info.value!r}), "
                  "not an array; only Rename and Drop apply to it")
    return _lazy.zero_origin(self._make())

  def derived(self, path: str, make_view: Callable[[], ts.TensorStore], *,
              shape: Sequence[int] | None = None, dtype: str | None = None) -> "_Leaf":
    """A new leaf computed from this one (no stored layout, no saved sharding)."""
    dtype = dtype or self.info.dtype
    stored = lay.storage_dtype(dtype)
    info = dataclasses.replace(
        self.info, path=path, shape=tuple(self.info.shape if shape is None else shape),
        dtype=dtype, storage_dtype=None if stored == dtype else stored, array=None,
        chunk_shape=None, inner_chunk_shape=None, chunks={}, sharding=None)
    return _Leaf(info, make_view)

  def renamed(self, path: str) -> "_Leaf":
    leaf = _Leaf(dataclasses.replace(self.info, path=path), self._make, self.origin)
    if "view" in self.__dict__:
      leaf.view = self.view
    return leaf


def _array(leaf: _Leaf, rule: "Rule") -> _Leaf:
  if not leaf.info.is_array:
    raise _fail(f"{rule} matched {leaf.info.path!r}, a scalar leaf (value {leaf.info.value!r}); "
                "only Rename and Drop apply to scalars: narrow the pattern")
  return leaf


def _axis(axis: int, rank: int, path: str, rule: "Rule") -> int:
  if not -rank <= axis < max(rank, 1):
    raise _fail(f"{rule}: axis {axis} is out of range for {path!r} of rank {rank}")
  return axis % rank


Tree = dict[str, _Leaf]
Group = tuple[list[str], dict[str, _Leaf]]  # consumed paths, produced leaves


def match(pattern: str, tree: Mapping[str, Any]) -> list[tuple[str, dict[str, str]]]:
  """Every (path, captures) of ``tree`` that ``pattern`` matches, in tree order."""
  rx = compile_pattern(pattern)
  return [(p, m.groupdict()) for p in tree if (m := rx.fullmatch(p))]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """Base of every rule: ``plan`` maps the current tree to (consumed, produced) groups."""

  op: ClassVar[str] = ""

  def patterns(self) -> tuple[str, ...]:
    raise NotImplementedError

  def plan(self, tree: Tree) -> list[Group]:
    raise NotImplementedError

  def __str__(self) -> str:
    fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                       if getattr(self, f.name) != f.default)
    return f"{type(self).__name__}({fields})"

  def _check_template(self, name: str, template: str, allowed: set[str]) -> None:
    extra = _fields(template) - allowed
    if extra:
      raise _fail(f"{type(self).__name__}.{name}={template!r} uses {sorted(extra)}, which the "
                  f"pattern does not capture (it captures {sorted(allowed)})")

  def _tuple(self, name: str, item: type) -> None:
    """Freezes a list field into a tuple; raises unless it holds ``item`` values."""
    v = getattr(self, name)
    if v is None:
      return
    if isinstance(v, list):
      v = tuple(v)
      object.__setattr__(self, name, v)
    if not isinstance(v, tuple) or not all(isinstance(x, item) for x in v):
      raise _fail(f"{type(self).__name__}.{name} must be a list of {item.__name__}, got {v!r}")

  def _check_patterns(self) -> None:
    for p in self.patterns():
      if not isinstance(p, str) or not p:
        raise _fail(f"{type(self).__name__}: a pattern must be a non-empty string, got {p!r}")
      compile_pattern(p)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OneToOne(Rule):
  """A rule that maps each matched leaf to one leaf (in place unless ``dst`` is given)."""

  src: str
  dst: str | None = None

  def patterns(self) -> tuple[str, ...]:
    return (self.src,)

  def __post_init__(self):
    self._check_patterns()
    if self.dst is not None:
      self._check_template("dst", self.dst, set(captures_of(self.src)))
    self._validate()

  def _validate(self) -> None:
    pass

  def plan(self, tree: Tree) -> list[Group]:
    out = []
    for path, caps in match(self.src, tree):
      new = path if self.dst is None else fill(self.dst, caps)
      out.append(([path], {new: self.transform(tree[path], new)}))
    return out

  def transform(self, leaf: _Leaf, path: str) -> _Leaf:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rename(_OneToOne):
  """Moves leaves to a new path: ``Rename(src="['model']['{k}']", dst="['params']['{k}']")``."""

  op: ClassVar[str] = "rename"

  def _validate(self) -> None:
    if self.dst is None:
      raise _fail(f"Rename(src={self.src!r}) needs dst, a template of the new path")

  def transform(self, leaf: _Leaf, path: str) -> _Leaf:
    return leaf.renamed(path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drop(Rule):
  """Removes matched leaves (e.g. optimizer state a target does not have)."""

  op: ClassVar[str] = "drop"
  src: str

  def __post_init__(self):
    self._check_patterns()

  def patterns(self) -> tuple[str, ...]:
    return (self.src,)

  def plan(self, tree: Tree) -> list[Group]:
    return [([p], {}) for p, _ in match(self.src, tree)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transpose(_OneToOne):
  """Permutes axes as ``np.transpose(x, perm)``."""

  op: ClassVar[str] = "transpose"
  perm: tuple[int, ...]

  def _validate(self) -> None:
    self._tuple("perm", int)
    if sorted(self.perm) != list(range(len(self.perm))):
      raise _fail(f"Transpose.perm must be a permutation of 0..n-1, got {self.perm=}")

  def transform(self, leaf: _Leaf, path: str) -> _Leaf:
    shape = _array(leaf, self).info.shape
    if len(shape) != len(self.perm):
      raise _fail(f"{self}: {leaf.info.path!r} has rank {len(shape)} ({list(shape)}), "
                  f"perm has {len(self.perm)} axes")
    perm = list(self.perm)
    return leaf.derived(path, lambda: leaf.view[ts.d[perm].transpose[:]] if perm else leaf.view,
                        shape=[shape[p] for p in perm])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reshape(_OneToOne):
  """Reshapes in C order as ``x.reshape(shape)``; one entry may be -1."""

  op: ClassVar[str] = "reshape"
  shape: tuple[int, ...]

  def _validate(self) -> None:
    self._tuple("shape", int)
    if sum(d == -1 for d in self.shape) > 1 or any(d < -1 for d in self.shape):
      raise _fail(f"Reshape.shape takes sizes >= 0 and at most one -1, got {self.shape=}")

  def transform(self, leaf: _Leaf, path: str) -> _Leaf:
    info = _array(leaf, self).info
    new = _lazy.checked_size(info.shape, self.shape)
    if new is None:
      raise _fail(f"{self}: cannot reshape {info.path!r} of shape {list(info.shape)} "
                  f"to {list(self.shape)}")
    return leaf.derived(path, lambda: _lazy.reshape(leaf.view, info.numpy_dtype, info.dtype, new),
                        shape=new)


_INTEGER = re.compile(r"u?int\d+|bool")


def _keeps_its_dtype(info: man.LeafInfo) -> bool:
  """Leaves a cast leaves alone unless its pattern names them: integers and bools (step
  counters, token ids, and the uint8 rows of JSON and data-iterator items), PRNG keys (their
  key data) and scalars."""
  return (not info.is_array or info.kind == "prng_key" or info.key_impl is not None
          or _INTEGER.fullmatch(info.dtype) is not None)


def names_one_path(pattern: str) -> bool:
  """Whether ``pattern`` is one literal path (no ``*``, ``**``, ``{name}`` or ``re:``)."""
  return not pattern.startswith("re:") and _HOLE.search(pattern) is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cast(_OneToOne):
  """Converts the dtype as numpy's ``astype`` does (``dtype`` by name: ``"bfloat16"``).

  A pattern with holes (``*``, ``**``, ``{name}``, ``re:``) casts only the floating-point
  (and complex) arrays it matches: integer and bool arrays (step counters, the rows of JSON
  and data-iterator items), PRNG keys and scalars are left as they are. To cast one of
  those, name it by its full path (``Cast(src="['opt']['count']", dtype="int64")``).
  """

  op: ClassVar[str] = "cast"
  dtype: str

  def _validate(self) -> None:
    try:
      snap.dtype_from_name(self.dtype)
    except (TypeError, ValueError, KeyError) as e:
      raise _fail(f"Cast.dtype={self.dtype!r} is not a dtype name ({e})") from None

  def plan(self, tree: Tree) -> list[Group]:
    groups, kept, cast = [], [], 0
    for path, caps in match(self.src, tree):
      new = path if self.dst is None else fill(self.dst, caps)
      if not names_one_path(self.src) and _keeps_its_dtype(tree[path].info):
        kept.append(path)                  # as it is (moved along to ``dst``, if given)
        if self.dst is not None:
          groups.append(([path], {new: tree[path].renamed(new)}))
        continue
      groups.append(([path], {new: self.transform(tree[path], new)}))
      cast += 1
    if kept and not cast:
      raise _fail(f"{self} matches only leaves a cast leaves alone unless named ({kept[:20]}: "
                  "integer, bool, PRNG-key and item leaves, and scalars); to cast one, name it "
                  "by its full path")
    return groups

  def transform(self, leaf: _Leaf, path: str) -> _Leaf:
    info = _array(leaf, self).info
    return leaf.derived(path, lambda: _lazy.cast(leaf.view, info.numpy_dtype, info.dtype,
                                                 self.dtype), dtype=self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pad(_OneToOne):
  """Grows ``axis`` at its end to ``to_size`` or the next multiple of ``to_multiple``."""

  op: ClassVar[str] = "pad"
  axis: int
  to_multiple: int | None = None
  to_size: int | None = None
  value: float = 0

  def _validate(self) -> None:
    if (self.to_multiple is None) == (self.to_size is None):
      raise _fail(f"Pad needs exactly one of to_multiple and to_size, got "
                  f"{self.to_multiple=}, {self.to_size=}")
    if (self.to_multiple or 1) <= 0 or (self.to_size is not None and self.to_size < 0):
      raise _fail(f"Pad sizes must be positive, got {self.to_multiple=}, {self.to_size=}")

  def transform(self, leaf: _Leaf, path: str) -> _Leaf:
    info = _array(leaf, self).info
    ax = _axis(self.axis, len(info.shape), info.path, self)
    n = info.shape[ax]
    size = self.to_size if self.to_size is not None else -(-n // self.to_multiple) * self.to_multiple
    if size < n:
      raise _fail(f"{self}: {info.path!r} already has {n} > {size} entries on axis {ax}; "
                  "use Unpad to shrink")
    shape = info.shape[:ax] + (size,) + info.shape[ax + 1:]
    return leaf.derived(path, lambda: _lazy.pad(leaf.view, info.numpy_dtype, info.dtype, shape,
                                                self.value), shape=shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unpad(_OneToOne):
  """Keeps the first ``size`` entries of ``axis`` (a slice: reads nothing else)."""

  op: ClassVar[str] = "unpad"
  axis: int
  size: int

  def _validate(self) -> None:
    if self.size < 0:
      raise _fail(f"Unpad.size must be >= 0, got {self.size=}")

  def transform(self, leaf: _Leaf, path: str) -> _Leaf:
    info = _array(leaf, self).info
    ax = _axis(self.axis, len(info.shape), info.path, self)
    if self.size > info.shape[ax]:
      raise _fail(f"{self}: {info.path!r} has only {info.shape[ax]} entries on axis {ax}, "
                  f"fewer than size={self.size}; use Pad to grow")
    shape = info.shape[:ax] + (self.size,) + info.shape[ax + 1:]
    return leaf.derived(path, lambda: leaf.view[ts.d[ax][:self.size]], shape=shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unstack(Rule):
  """Splits ``axis`` into one leaf per index (a scanned layer axis -> per-layer leaves).

  ``dst`` must contain ``{i}``: ``Unstack(src="['layers']['{p}']", dst="['layer_{i}']['{p}']")``.
  """

  op: ClassVar[str] = "unstack"
  src: str
  dst: str
  axis: int = 0

  def __post_init__(self):
    self._check_patterns()
    caps = set(captures_of(self.src))
    if "i" in caps or "i" not in _fields(self.dst):
      raise _fail(f"Unstack(src={self.src!r}, dst={self.dst!r}): dst must use {{i}} (the index) "
                  "and src must not capture i")
    self._check_template("dst", self.dst, caps | {"i"})

  def patterns(self) -> tuple[str, ...]:
    return (self.src,)

  def plan(self, tree: Tree) -> list[Group]:
    return [([path], self._layers(_array(tree[path], self), caps))
            for path, caps in match(self.src, tree)]

  def _layers(self, leaf: _Leaf, caps: dict[str, str]) -> dict[str, _Leaf]:
    shape = leaf.info.shape
    ax = _axis(self.axis, len(shape), leaf.info.path, self)
    rest = shape[:ax] + shape[ax + 1:]
    out = {}
    for i in range(shape[ax]):
      dst = fill(self.dst, {**caps, "i": i})
      out[dst] = leaf.derived(dst, functools.partial(lambda i: leaf.view[ts.d[ax][i]], i),
                              shape=rest)
    return out


def _same(leaves: Sequence[_Leaf], rule: Rule, *, skip_axis: int | None = None) -> None:
  """Raises unless the leaves agree in dtype and shape (except on ``skip_axis``)."""
  def key(leaf: _Leaf) -> tuple:
    s = list(leaf.info.shape)
    if skip_axis is not None and len(s) > skip_axis:
      s[skip_axis] = None
    return leaf.info.dtype, len(leaf.info.shape), tuple(s)
  if len({key(_array(l, rule)) for l in leaves}) > 1:
    got = {l.info.path: f"{l.info.dtype}{list(l.info.shape)}" for l in leaves}
    raise _fail(f"{rule}: the leaves it combines disagree in dtype or shape: {got}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stack(Rule):
  """Stacks leaves indexed by ``{i}`` (0..n-1) along a new ``axis`` (per-layer -> scanned)."""

  op: ClassVar[str] = "stack"
  srcs: str
  dst: str
  axis: int = 0

  def __post_init__(self):
    self._check_patterns()
    caps = set(captures_of(self.srcs))
    if "i" not in caps:
      raise _fail(f"Stack(srcs={self.srcs!r}) must capture {{i}}, the index of each leaf")
    self._check_template("dst", self.dst, caps - {"i"})

  def patterns(self) -> tuple[str, ...]:
    return (self.srcs,)

  def plan(self, tree: Tree) -> list[Group]:
    groups: dict[tuple, dict[int, str]] = {}
    for path, caps in match(self.srcs, tree):
      if not caps["i"].isdigit():
        raise _fail(f"{self}: {path!r} has {{i}}={caps['i']!r}, not an index; narrow the pattern")
      key = tuple(sorted((k, v) for k, v in caps.items() if k != "i"))
      seen = groups.setdefault(key, {})
      if int(caps["i"]) in seen:
        raise _fail(f"{self}: both {seen[int(caps['i'])]!r} and {path!r} are index "
                    f"{int(caps['i'])}; the rule is ambiguous")
      seen[int(caps["i"])] = path
    out = []
    for key, by_index in groups.items():
      missing = sorted(set(range(max(by_index) + 1)) - set(by_index))
      if missing:
        raise _fail(f"{self}: indices {missing} are missing; found {sorted(by_index.values())}")
      paths = [by_index[i] for i in range(len(by_index))]
      leaves = [tree[p] for p in paths]
      _same(leaves, self)
      rank = len(leaves[0].info.shape) + 1
      ax = _axis(self.axis, rank, paths[0], self)
      shape = list(leaves[0].info.shape)
      shape.insert(ax, len(leaves))
      dst = fill(self.dst, dict(key))
      out.append((paths, {dst: leaves[0].derived(
          dst, lambda leaves=leaves, ax=ax: ts.stack([l.view for l in leaves], axis=ax),
          shape=shape)}))
    return out


def _grouped(rule: Rule, patterns: Sequence[str], tree: Tree) -> list[tuple[dict, list[str]]]:
  """Matches of several patterns grouped by their captures; each group takes one per pattern."""
  groups: dict[tuple, list[str | None]] = {}
  for k, pat in enumerate(patterns):
    for path, caps in match(pat, tree):
      slot = groups.setdefault(tuple(sorted(caps.items())), [None] * len(patterns))
      if slot[k] is not None:
        raise _fail(f"{rule}: pattern {pat!r} matches both {slot[k]!r} and {path!r} with the same "
                    f"captures {dict(caps)}; the rule is ambiguous")
      slot[k] = path
  out = []
  for key, slot in groups.items():
    if None in slot:
      lacking = [patterns[k] for k, p in enumerate(slot) if p is None]
      raise _fail(f"{rule}: for captures {dict(key)} found {[p for p in slot if p]} but nothing "
                  f"matches {lacking}")
    out.append((dict(key), slot))
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ManyToOne(Rule):
  srcs: tuple[str, ...]
  dst: str

  def __post_init__(self):
    self._tuple("srcs", str)
    self._check_patterns()
    if len(self.srcs) < 2:
      raise _fail(f"{type(self).__name__}.srcs needs at least 2 patterns, got {self.srcs=}")
    caps = {captures_of(p) for p in self.srcs}
    if len(caps) > 1:
      raise _fail(f"{type(self).__name__}.srcs must all capture the same names, got {self.srcs=}")
    self._check_template("dst", self.dst, set(caps.pop()))

  def patterns(self) -> tuple[str, ...]:
    return tuple(self.srcs)

  def plan(self, tree: Tree) -> list[Group]:
    out = []
    for caps, paths in _grouped(self, self.srcs, tree):
      dst = fill(self.dst, caps)
      out.append((paths, {dst: self.combine([tree[p] for p in paths], dst)}))
    return out

  def combine(self, leaves: list[_Leaf], path: str) -> _Leaf:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Concat(_ManyToOne):
  """Concatenates leaves along ``axis`` (separate q, k, v -> fused qkv)."""

  op: ClassVar[str] = "concat"
  axis: int = 0

  def combine(self, leaves: list[_Leaf], path: str) -> _Leaf:
    first = _array(leaves[0], self).info
    ax = _axis(self.axis, len(first.shape), first.path, self)
    _same(leaves, self, skip_axis=ax)
    shape = list(first.shape)
    shape[ax] = sum(l.info.shape[ax] for l in leaves)
    return leaves[0].derived(path, lambda: ts.concat([l.view for l in leaves], axis=ax),
                             shape=shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Average(_ManyToOne):
  """The elementwise mean of copies (float64 accumulation, rounded once to the dtype)."""

  op: ClassVar[str] = "average"

  def combine(self, leaves: list[_Leaf], path: str) -> _Leaf:
    _same(leaves, self)
    info = leaves[0].info
    if not np.issubdtype(info.numpy_dtype, np.inexact) and info.dtype not in _FLOAT_EXTRA:
      raise _fail(f"{self}: {[l.info.path for l in leaves]} are {info.dtype}; only floating "
                  "leaves are averaged (Rename one copy and Drop the others instead)")
    return leaves[0].derived(path, lambda: _lazy.average([l.view for l in leaves],
                                                         info.numpy_dtype, info.dtype))


_FLOAT_EXTRA = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float4_e2m1fn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split(Rule):
  """Cuts ``axis`` into consecutive parts, one per ``dsts`` (fused qkv -> q, k, v).

  ``sizes`` gives each part's length; None cuts into equal parts.
  """

  op: ClassVar[str] = "split"
  src: str
  dsts: tuple[str, ...]
  axis: int = 0
  sizes: tuple[int, ...] | None = None

  def __post_init__(self):
    self._tuple("dsts", str)
    self._tuple("sizes", int)
    self._check_patterns()
    if len(self.dsts) < 2:
      raise _fail(f"Split.dsts needs at least 2 templates, got {self.dsts=}")
    if self.sizes is not None and (len(self.sizes) != len(self.dsts) or min(self.sizes) < 0):
      raise _fail(f"Split.sizes needs one size >= 0 per dst, got {self.sizes=} for {self.dsts=}")
    for d in self.dsts:
      self._check_template("dsts", d, set(captures_of(self.src)))

  def patterns(self) -> tuple[str, ...]:
    return (self.src,)

  def plan(self, tree: Tree) -> list[Group]:
    return [([path], self._parts(_array(tree[path], self), caps))
            for path, caps in match(self.src, tree)]

  def _parts(self, leaf: _Leaf, caps: dict[str, str]) -> dict[str, _Leaf]:
    shape = leaf.info.shape
    ax = _axis(self.axis, len(shape), leaf.info.path, self)
    out, start = {}, 0
    for tmpl, n in zip(self.dsts, self._sizes(shape[ax], leaf.info.path)):
      dst = fill(tmpl, caps)
      out[dst] = leaf.derived(dst, functools.partial(lambda a, b: leaf.view[ts.d[ax][a:b]],
                                                     start, start + n),
                              shape=shape[:ax] + (n,) + shape[ax + 1:])
      start += n
    return out

  def _sizes(self, n: int, path: str) -> tuple[int, ...]:
    if self.sizes is None:
      if n % len(self.dsts):
        raise _fail(f"{self}: {path!r} has {n} entries on axis {self.axis}, not divisible into "
                    f"{len(self.dsts)} equal parts; give sizes")
      return (n // len(self.dsts),) * len(self.dsts)
    if sum(self.sizes) != n:
      raise _fail(f"{self}: sizes {list(self.sizes)} sum to {sum(self.sizes)}, but {path!r} has "
                  f"{n} entries on axis {self.axis}")
    return self.sizes


RULES: dict[str, type[Rule]] = {c.op: c for c in (
    Rename, Drop, Stack, Unstack, Split, Concat, Pad, Unpad, Transpose, Reshape, Cast, Average)}
