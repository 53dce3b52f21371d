"""The conversion language: every rule exact against numpy, lazily, and its errors."""

import os

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxckpt.universal as u
from jaxckpt import errors
from tests.support import fixtures as _fixtures
from jaxckpt.universal import convert as cv

L, D, H = 4, 8, 8  # layers, model width, head width
VOCAB, PADDED = 50, 56
RNG = np.random.default_rng(0)
W = RNG.standard_normal((L, D, H)).astype(np.float32)
B = RNG.standard_normal((L, H)).astype(ml_dtypes.bfloat16)
QKV = RNG.standard_normal((L, D, 4 * H)).astype(np.float32)  # q: 2H, k: H, v: H (GQA)
EMBED = np.concatenate([RNG.standard_normal((VOCAB, D)), np.zeros((PADDED - VOCAB, D))]).astype(np.float32)
CODES = RNG.integers(-8, 8, (L, 6)).astype(ml_dtypes.int4)
MU = [RNG.standard_normal((D, H)).astype(np.float32) for _ in range(3)]


def save(d, step, leaves, inner=64):
  for manifest, buf in _fixtures.host_snapshots(step, leaves, metadata={"run": "t"}):
    u.write_process_shards(d, manifest, buf, inner_chunk_bytes=inner, attempt="t",
                           merged_chunk_bytes=0)   # a chunk per shard: reads of parts
  u.commit_step(d, step, process_count=1, timeout_secs=10, attempt="t")


@pytest.fixture(scope="module")
def scanned(tmp_path_factory):
  """A scanned (stacked-layer) model, saved sharded over 8 devices."""
  d = str(tmp_path_factory.mktemp("scanned"))
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  leaves = {
      "['params']['layers']['w']": jax.device_put(W, NamedSharding(mesh, P(None, "a", "b"))),
      "['params']['layers']['b']": jax.device_put(B, NamedSharding(mesh, P("a"))),
      "['params']['layers']['qkv']": jax.device_put(QKV, NamedSharding(mesh, P("a", None, "b"))),
      "['params']['embed']": jax.device_put(EMBED, NamedSharding(mesh, P("b"))),
      "['params']['codes']": CODES,
      **{f"['opt'][{r}]['mu']": m for r, m in enumerate(MU)},
      "['step']": 7,
  }
  save(d, 7, leaves)
  return d


UNSTACK = cv.ConversionSpec(rules=(
    cv.Unstack(src="['params']['layers']['{p}']", dst="['params']['layers_{i}']['{p}']"),))
STACK = cv.ConversionSpec(rules=(
    cv.Stack(srcs="['params']['layers_{i}']['{p}']", dst="['params']['layers']['{p}']"),))


def test_scanned_layers_to_per_layer_and_back_is_exact(scanned, tmp_path):
  per_layer, back = str(tmp_path / "per_layer"), str(tmp_path / "back")
  assert cv.convert(scanned, per_layer, UNSTACK) == 7
  r = u.open_step(per_layer, 7)
  for i in range(L):
    np.testing.assert_array_equal(r.read(f"['params']['layers_{i}']['w']"), W[i])
    assert r.read(f"['params']['layers_{i}']['b']").tobytes() == B[i].tobytes()
    np.testing.assert_array_equal(r.read(f"['params']['layers_{i}']['qkv']"), QKV[i])
  assert r.leaves["['params']['layers_2']['b']"].dtype == "bfloat16"
  assert "['params']['layers']['w']" not in r.leaves
  assert r.leaves["['step']"].scalar == 7 and r.metadata["run"] == "t"
  assert r.metadata["converted_from"]["spec"] == UNSTACK.to_dict()
  cv.convert(per_layer, back, STACK, dst_step=8)
  orig, again = u.open_step(scanned, 7), u.open_step(back, 8)
  assert sorted(again.leaves) == sorted(orig.leaves)
  for path, info in orig.leaves.items():
    if info.is_array:
      assert again.read(path).tobytes() == orig.read(path).tobytes(), path
      assert again.leaves[path].dtype == info.dtype


def test_fused_qkv_split_and_concat_back_exact(scanned):
  qkv = "['params']['layers']['qkv']"
  spec = cv.ConversionSpec(rules=(
      cv.Split(src=qkv, axis=-1, sizes=[2 * H, H, H],
               dsts=["['params']['layers']['q']", "['params']['layers']['k']",
                     "['params']['layers']['v']"]),))
  view = cv.apply(spec, u.open_step(scanned, 7))
  q, k, v = np.split(QKV, [2 * H, 3 * H], axis=-1)
  for name, want in zip("qkv", (q, k, v)):
    np.testing.assert_array_equal(view.read(f"['params']['layers']['{name}']"), want)
  assert qkv not in view.leaves
  np.testing.assert_array_equal(view.read("['params']['layers']['k']", ((1, 3), (2, 5), (0, 4))),
                                k[1:3, 2:5, 0:4])
  back = cv.ConversionSpec(rules=spec.rules + (cv.Concat(
      srcs=["['params']['layers']['q']", "['params']['layers']['k']", "['params']['layers']['v']"],
      dst=qkv, axis=2),))
  np.testing.assert_array_equal(cv.apply(back, u.open_step(scanned, 7)).read(qkv), QKV)


def test_per_layer_split_uses_captures_after_unstack(scanned):
  spec = cv.ConversionSpec(rules=UNSTACK.rules + (
      cv.Split(src="['params']['layers_{i}']['qkv']", axis=1,
               dsts=["['attn_{i}']['a']", "['attn_{i}']['b']"]),))
  view = cv.apply(spec, u.open_step(scanned, 7))
  for i in range(L):
    np.testing.assert_array_equal(view.read(f"['attn_{i}']['b']"), QKV[i][:, 2 * H:])


def test_padded_vocabulary_unpadded_and_padded_again_exact(scanned):
  embed = "['params']['embed']"
  view = cv.apply(cv.ConversionSpec(rules=(cv.Unpad(src=embed, axis=0, size=VOCAB),)),
                  u.open_step(scanned, 7))
  assert view.leaves[embed].shape == (VOCAB, D)
  np.testing.assert_array_equal(view.read(embed), EMBED[:VOCAB])
  spec = cv.ConversionSpec(rules=(cv.Unpad(src=embed, axis=0, size=VOCAB),
                                  cv.Pad(src=embed, axis=0, to_multiple=16, value=-1.5)))
  view = cv.apply(spec, u.open_step(scanned, 7))
  want = np.pad(EMBED[:VOCAB], ((0, 64 - VOCAB), (0, 0)), constant_values=-1.5)
  np.testing.assert_array_equal(view.read(embed), want)
  np.testing.assert_array_equal(view.read(embed, ((45, 60), (3, 8))), want[45:60, 3:8])


def test_transpose_reshape_cast_average_rename_drop_exact(scanned):
  w = "['params']['layers']['w']"
  spec = cv.ConversionSpec(rules=(
      cv.Transpose(src=w, perm=[2, 0, 1], dst="['wt']"),
      cv.Reshape(src="['params']['layers']['qkv']", shape=[L * D, -1], dst="['flat']"),
      cv.Cast(src="['params']['layers']['b']", dtype="float32"),
      cv.Cast(src="['params']['codes']", dtype="float32", dst="['codes_f']"),
      cv.Average(srcs=["['opt'][0]['{k}']", "['opt'][1]['{k}']", "['opt'][2]['{k}']"],
                 dst="['opt']['{k}']"),
      cv.Rename(src="['params']{x:**}", dst="['model']{x}"),
      cv.Drop(src="['step']"),
  ))
  view = cv.apply(spec, u.open_step(scanned, 7))
  np.testing.assert_array_equal(view.read("['wt']"), np.transpose(W, (2, 0, 1)))
  np.testing.assert_array_equal(view.read("['flat']"), QKV.reshape(L * D, -1))
  np.testing.assert_array_equal(view.read("['flat']", ((5, 19), (3, 20))),
                                QKV.reshape(L * D, -1)[5:19, 3:20])
  np.testing.assert_array_equal(view.read("['model']['layers']['b']"), B.astype(np.float32))
  np.testing.assert_array_equal(view.read("['codes_f']"), CODES.astype(np.float32))
  mean = np.mean(np.stack(MU), axis=0, dtype=np.float64).astype(np.float32)
  assert view.read("['opt']['mu']").tobytes() == mean.tobytes()
  np.testing.assert_array_equal(view.read("['model']['embed']"), EMBED)
  assert "['step']" not in view.leaves and "['params']['embed']" not in view.leaves
  cast_back = cv.apply(cv.ConversionSpec(rules=(cv.Cast(src=w, dtype="bfloat16"),)),
                       u.open_step(scanned, 7))
  assert cast_back.read(w).tobytes() == W.astype(ml_dtypes.bfloat16).tobytes()


def test_converted_view_restores_onto_a_new_mesh_reading_only_needed_regions(scanned):
  spec = cv.ConversionSpec(rules=UNSTACK.rules + (
      cv.Unpad(src="['params']['embed']", axis=0, size=48),))
  view = cv.apply(spec, u.open_step(scanned, 7))
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  targets = {"['params']['layers_1']['w']": jax.ShapeDtypeStruct((D, H), np.float32,
                                                                   sharding=NamedSharding(mesh, P("x"))),
             "['params']['embed']": jax.ShapeDtypeStruct((48, D), np.float32,
                                                          sharding=NamedSharding(mesh, P(None, "x"))),
             "['step']": None}
  out = cv.restore_converted(view, targets)
  np.testing.assert_array_equal(np.asarray(out["['params']['layers_1']['w']"]), W[1])
  np.testing.assert_array_equal(np.asarray(out["['params']['embed']"]), EMBED[:48])
  assert out["['params']['embed']"].sharding == targets["['params']['embed']"].sharding
  assert out["['step']"] == 7
  assert view.bytes_needed == W[1].nbytes + EMBED[:48].nbytes  # each distinct box read once
  # The metric is process-wide: a read by another thread can land inside one window, not inside all three.
  deltas = []
  for _ in range(3):
    before = _file_bytes_read()
    view.read("['params']['layers_3']['qkv']", ((0, 1), (0, 1)))
    deltas.append(_file_bytes_read() - before)
  assert 0 < min(deltas) < QKV.nbytes // L, deltas  # one inner chunk, not the leaf


def _file_bytes_read():
  got = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
  return sum(v.get("value", 0) for m in got for v in m.get("values", []))


def test_zarr_python_reads_a_converted_leaf(scanned, tmp_path):
  dst = str(tmp_path / "z")
  cv.convert(scanned, dst, UNSTACK)
  info = u.open_step(dst, 7).leaves["['params']['layers_3']['w']"]
  z = zarr.open_array(os.path.join(dst, "step_0000000007", "arrays", info.array), mode="r")
  np.testing.assert_array_equal(z[...], W[3])


def test_spec_round_trips_through_yaml_json_and_dict(tmp_path):
  text = """
rules:
  - unstack: {src: "['params']['layers']['{p}']", dst: "['params']['layers_{i}']['{p}']"}
  - op: split
    src: "['params']['layers_{i}']['qkv']"
    dsts: ["['q_{i}']", "['k_{i}']", "['v_{i}']"]
    axis: 1
  - {op: pad, src: "re:\\\\['embed.*", axis: 0, to_multiple: 128}
"""
  spec = cv.ConversionSpec.from_yaml(text)
  assert spec.rules[1] == cv.Split(src="['params']['layers_{i}']['qkv']", axis=1,
                                   dsts=("['q_{i}']", "['k_{i}']", "['v_{i}']"))
  assert spec.rules[2].src == "re:\\['embed.*"
  import json
  assert cv.ConversionSpec.from_json(json.dumps(spec.to_dict())) == spec
  p = tmp_path / "rules.yaml"
  p.write_text(text)
  assert cv.ConversionSpec.load(p) == spec


def test_patterns_capture_keys_and_globs():
  rx = cv.compile_pattern("['layers_{i}']['*']")
  assert rx.fullmatch("['layers_12']['w']")["i"] == "12"
  assert rx.fullmatch("['layers_1']['a']['b']") is None  # * stays inside one key
  assert cv.compile_pattern("['opt']**").fullmatch("['opt'][0].mu['x']")
  assert cv.compile_pattern("['{k}']['{k}']").fullmatch("['a']['b']") is None  # same name, same text
  assert cv.compile_pattern("['a']{rest:**}").fullmatch("['a'][0].b['c']")["rest"] == "[0].b['c']"
  assert cv.compile_pattern("re:.*\\['w'\\]").fullmatch("['x'][3]['w']")


# ----- errors name the paths ------------------------------------------------------------------


def err(spec_rules, d):
  with pytest.raises(errors.ConversionError) as e:
    cv.apply(cv.ConversionSpec(rules=tuple(spec_rules)), u.open_step(d, 7))
  return str(e.value)


def test_unmatched_rule_names_pattern_and_leaves(scanned):
  msg = err([cv.Rename(src="['params']['nope']", dst="['x']")], scanned)
  assert "rule #0 Rename(src=\"['params']['nope']\"" in msg and "matches no leaf" in msg
  assert "['params']['embed']" in msg  # lists what the tree has


def test_rule_after_consumption_says_which_earlier_rule_took_it(scanned):
  msg = err([cv.Rename(src="['params']['embed']", dst="['emb']"),
             cv.Cast(src="['params']['embed']", dtype="bfloat16")], scanned)
  assert "rule #1 Cast" in msg and "['params']['embed']" in msg and "#0 rename" in msg


def test_two_sources_producing_one_path_is_ambiguous(scanned):
  msg = err([cv.Rename(src="['opt'][{r}]['mu']", dst="['opt']['mu']")], scanned)
  assert "produces \"['opt']['mu']\" twice" in msg
  assert "['opt'][0]['mu']" in msg and "['opt'][1]['mu']" in msg


def test_producing_over_an_existing_leaf_names_it(scanned):
  msg = err([cv.Rename(src="['params']['codes']", dst="['params']['embed']")], scanned)
  assert "[\"['params']['embed']\"]" in msg and "already holds" in msg


def test_ambiguous_multi_source_rule_names_both_matches(scanned):
  msg = err([cv.Concat(srcs=["['opt'][*]['mu']", "['params']['embed']"], dst="['x']")], scanned)
  assert "matches both \"['opt'][0]['mu']\" and \"['opt'][1]['mu']\"" in msg


def test_stack_with_a_missing_index_names_what_it_found(scanned, tmp_path):
  d = str(tmp_path)
  save(d, 7, {"['l_0']": np.ones(3), "['l_2']": np.ones(3)})
  msg = err([cv.Stack(srcs="['l_{i}']", dst="['l']")], d)
  assert "indices [1] are missing" in msg and "['l_2']" in msg


def test_shape_and_scalar_mismatches_name_the_leaves(scanned):
  msg = err([cv.Concat(srcs=["['params']['embed']", "['params']['codes']"], dst="['x']")], scanned)
  assert "['params']['embed']\": 'float32[56, 8]'" in msg and "int4[4, 6]" in msg
  msg = err([cv.Cast(src="['step']", dtype="float32")], scanned)
  assert "['step']" in msg and "scalar" in msg
  msg = err([cv.Unpad(src="['params']['embed']", axis=0, size=99)], scanned)
  assert "only 56 entries on axis 0" in msg


@pytest.mark.parametrize("obj, text", [
    ({"rules": [{"op": "explode", "src": "a"}]}, "unknown op 'explode'"),
    ({"rules": [{"op": "rename", "src": "a", "dts": "b"}]}, "unknown fields ['dts']"),
    ({"rules": [{"rename": {"src": "['{x}']", "dst": "['{y}']"}}]}, "uses ['y']"),
    ({"rules": [{"op": "pad", "src": "a", "axis": 0}]}, "exactly one of to_multiple and to_size"),
    ({"rules": [{"op": "unstack", "src": "a", "dst": "b"}]}, "dst must use {i}"),
    ({"rules": [{"op": "transpose", "src": "a", "perm": [0, 0]}]}, "permutation"),
    ({"rules": [{"op": "cast", "src": "a", "dtype": "float99"}]}, "'float99' is not a dtype"),
    ({"rules": "rename"}, "a list under 'rules'"),
])
def test_invalid_specs_are_rejected_with_the_field(obj, text):
  with pytest.raises(errors.ConversionError) as e:
    cv.ConversionSpec.from_dict(obj)
  assert text in str(e.value)


def test_the_yaml_example_in_the_docs_applies_as_documented(tmp_path):
  doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "conversion.md")).read()
  text = doc.split("```yaml\n")[1].split("```")[0]
  spec = cv.ConversionSpec.from_yaml(text)
  qkv = RNG.standard_normal((2, 4, 3072)).astype(np.float32)
  embed = RNG.standard_normal((50304, 2)).astype(np.float32)
  d = str(tmp_path)
  save(d, 7, {"['params']['layers']['qkv']": qkv, "['params']['embed']": embed,
              "['opt_state'][0].mu['w']": np.ones(3, np.float32)}, inner=1 << 16)
  view = cv.apply(spec, u.open_step(d, 7))
  assert sorted(view.leaves) == sorted(
      ["['params']['embed']"] + [f"['params']['layers_{i}']['{n}']" for i in range(2) for n in "qkv"])
  assert view.read("['params']['layers_1']['k']").tobytes() == (
      qkv[1][:, 2048:2560].astype(ml_dtypes.bfloat16).tobytes())
  assert view.leaves["['params']['embed']"].shape == (50257, 2)
  assert view.read("['params']['embed']", ((50000, 50257), (0, 2))).tobytes() == (
      embed[50000:50257].astype(ml_dtypes.bfloat16).tobytes())


def test_nested_virtual_views_compose_and_damage_in_a_source_is_reported(tmp_path):
  d = str(tmp_path)
  a, b = (RNG.standard_normal((40, 30)).astype(np.float32) for _ in range(2))
  save(d, 7, {"['a']": a, "['b']": b}, inner=256)
  spec = cv.ConversionSpec(rules=(
      cv.Average(srcs=["['a']", "['b']"], dst="['m']"),
      cv.Pad(src="['m']", axis=1, to_multiple=16, value=2.0),
      cv.Reshape(src="['m']", shape=[-1, 8]),
      cv.Cast(src="['m']", dtype="bfloat16")))
  mean = np.mean(np.stack([a, b]), axis=0, dtype=np.float64).astype(np.float32)
  want = np.pad(mean, ((0, 0), (0, 2)), constant_values=2.0).reshape(-1, 8)
  want = want.astype(ml_dtypes.bfloat16)
  view = cv.apply(spec, u.open_step(d, 7))
  assert view.read("['m']").tobytes() == want.tobytes()
  assert view.read("['m']", ((37, 90), (3, 7))).tobytes() == want[37:90, 3:7].tobytes()
  info = u.open_step(d, 7).leaves["['b']"]
  chunk_dir = os.path.join(d, "step_0000000007", "arrays", info.array, "c")
  victim = os.path.join(chunk_dir, *["0"] * 2)
  with open(victim, "r+b") as f:
    f.seek(40)
    byte = f.read(1)
    f.seek(40)
    f.write(bytes([byte[0] ^ 0xFF]))
  with pytest.raises(errors.CorruptSnapshotError, match=r"\['m'\].*jaxckpt verify"):
    cv.apply(spec, u.open_step(d, 7)).read("['m']")
