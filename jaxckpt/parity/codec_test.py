"""Tests of the RS codec against reedsolo's field arithmetic (the oracle)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import reedsolo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxckpt import errors
from jaxckpt.parity import _gf
from jaxckpt.parity import _kernels
from jaxckpt.parity.codec import ReedSolomon

reedsolo.init_tables(0x11D, 2)  # reedsolo's defaults, initialized explicitly

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _oracle_parity(matrix: np.ndarray, data: list[np.ndarray]) -> list[list[int]]:
  """Parity byte by byte with reedsolo.gf_mul (pure Python)."""
  m, k = matrix.shape
  n = data[0].size if data else 0
  out = [[0] * n for _ in range(m)]
  for j in range(m):
    for i in range(k):
      c = int(matrix[j, i])
      row, col = out[j], data[i].tolist()
      for t in range(n):
        row[t] ^= reedsolo.gf_mul(c, col[t])
  return out


def _random_blocks(seed: int, count: int, nbytes: int) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(count)]


def test_field_matches_reedsolo():
  exp, log = reedsolo.gf_exp, reedsolo.gf_log
  assert list(_gf.EXP[:510]) == list(exp[:510])
  assert list(_gf.LOG[1:256]) == list(log[1:256])
  a, b = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
  want = np.array([[reedsolo.gf_mul(x, y) for y in range(256)] for x in range(256)])
  np.testing.assert_array_equal(_gf.mul(a, b), want)
  np.testing.assert_array_equal(_gf.mul(np.arange(1, 256), _gf.inv(np.arange(1, 256))), 1)


def test_parity_matrix_normalized_and_mds():
  for k, m in [(1, 1), (3, 1), (4, 2), (5, 3), (6, 4)]:
    p = _gf.parity_matrix(k, m)
    assert (p[0] == 1).all() and (p[:, 0] == 1).all(), (k, m, p)
    for size in range(1, min(k, m) + 1):  # every square submatrix is nonsingular
      for rows in itertools.combinations(range(m), size):
        for cols in itertools.combinations(range(k), size):
          _gf.mat_inverse(p[np.ix_(rows, cols)])


def test_mat_inverse_roundtrip_and_singular():
  a = _gf.parity_matrix(7, 7)
  np.testing.assert_array_equal(_gf.matmul(a, _gf.mat_inverse(a)), np.eye(7, dtype=np.uint8))
  with pytest.raises(ZeroDivisionError, match="singular"):
    _gf.mat_inverse(np.array([[1, 2], [1, 2]], np.uint8))


@SETTINGS
@given(k=st.integers(1, 8), m=st.integers(1, 4), nbytes=st.integers(0, 150),
       seed=st.integers(0, 2**32 - 1))
def test_encode_matches_reedsolo(k, m, nbytes, seed):
  # nbytes < 32 runs only the bit-sliced path; >= 32 the AVX2 path plus a tail.
  rs = ReedSolomon(k, m)
  data = _random_blocks(seed, k, nbytes)
  parity = rs.encode(data)
  assert [p.tolist() for p in parity] == _oracle_parity(rs.matrix, data)


@SETTINGS
@given(k=st.integers(1, 6), m=st.integers(1, 4), nbytes=st.integers(0, 80),
       seed=st.integers(0, 2**32 - 1))
def test_decode_every_erasure_pattern(k, m, nbytes, seed):
  rs = ReedSolomon(k, m)
  data = _random_blocks(seed, k, nbytes)
  blocks = data + rs.encode(data)
  for lost_count in range(m + 1):
    for lost in itertools.combinations(range(k + m), lost_count):
      got = rs.decode([None if i in lost else b for i, b in enumerate(blocks)])
      for i in range(k):
        np.testing.assert_array_equal(got[i], data[i], err_msg=f"{k=} {m=} {lost=} block {i}")


def test_m1_is_xor_and_decode_rebuilds_with_xor():
  data = _random_blocks(1, 5, 1000)
  (parity,) = ReedSolomon(5, 1).encode(data)
  np.testing.assert_array_equal(parity, np.bitwise_xor.reduce(np.stack(data)))
  got = ReedSolomon(5, 1).decode(data[:2] + [None] + data[3:] + [parity])
  np.testing.assert_array_equal(got[2], data[2])


@pytest.mark.parametrize("k,m", [(251, 4), (1, 254), (128, 127)])
def test_extreme_shapes(k, m):
  rs = ReedSolomon(k, m)
  data = _random_blocks(k + m, k, 41)
  blocks = data + rs.encode(data)
  lost = list(range(0, k + m, max(1, (k + m) // m)))[:m]
  got = rs.decode([None if i in lost else b for i, b in enumerate(blocks)])
  for i in range(k):
    np.testing.assert_array_equal(got[i], data[i])


def test_accepts_bytes_like_and_writes_into_buffers():
  rs = ReedSolomon(3, 2)
  data = [b"0123456789" * 7, bytearray(b"abcdefghij" * 7), memoryview(b"ABCDEFGHIJ" * 7)]
  parity = [np.zeros(70, np.uint8), bytearray(70)]
  rs.encode_into(data, parity)
  want = rs.encode([np.frombuffer(bytes(d), np.uint8) for d in data])
  np.testing.assert_array_equal(parity[0], want[0])
  assert bytes(parity[1]) == want[1].tobytes()
  out = {0: np.zeros(70, np.uint8), 2: bytearray(70)}
  rs.decode_into([None, data[1], None, parity[0], parity[1]], out)
  assert out[0].tobytes() == data[0] and bytes(out[2]) == bytes(data[2])


def test_survivors_are_returned_as_views():
  rs = ReedSolomon(2, 1)
  a = np.arange(10, dtype=np.uint8)
  got = rs.decode([a, None, np.zeros(10, np.uint8)])
  assert np.shares_memory(got[0], a)
  np.testing.assert_array_equal(got[1], a)  # parity 0 = a ^ b, so b = a here


def test_too_many_erasures_names_them():
  rs = ReedSolomon(3, 2)
  blocks = [b"x"] * 5
  with pytest.raises(errors.UnrecoverableLossError, match=r"m=2 .* 3 are lost: \[0, 2, 4\]"):
    rs.decode([None, b"x", None, b"x", None])
  assert rs.decode(blocks)[0].tobytes() == b"x"


def test_validation_errors_name_values():
  with pytest.raises(ValueError, match="k=0"):
    ReedSolomon(0, 1)
  with pytest.raises(ValueError, match="m=0"):
    ReedSolomon(2, 0)
  with pytest.raises(ValueError, match="k=200 m=56"):
    ReedSolomon(200, 56)
  rs = ReedSolomon(2, 1)
  with pytest.raises(ValueError, match="k=2 data blocks, got 3"):
    rs.encode([b"a", b"b", b"c"])
  with pytest.raises(ValueError, match=r"\{0: 1, 1: 2\}"):
    rs.encode([b"a", b"bb"])
  with pytest.raises(ValueError, match="k \\+ m = 3 blocks .* got 2"):
    rs.decode([b"a", None])
  with pytest.raises(ValueError, match=r"\{0: 1, 2: 3\}"):
    rs.decode([b"a", None, b"ccc"])
  with pytest.raises(ValueError, match=r"exactly the lost data blocks \[1\], got keys \[0\]"):
    rs.decode_into([b"a", None, b"c"], {0: bytearray(1)})
  with pytest.raises(ValueError, match="must be writable"):
    rs.encode_into([b"a", b"b"], [b"c"])
  with pytest.raises(ValueError, match=r"must be 1 bytes long, got sizes \{0: 2\}"):
    rs.encode_into([b"a", b"b"], [bytearray(2)])
  with pytest.raises(ValueError, match="contiguous 1-D uint8"):
    rs.encode([np.zeros(4, np.float32), np.zeros(4, np.float32)])


def test_bit_masks_and_nibble_tables():
  coefs = np.array([[0, 1, 0x8E]], np.uint8)
  masks = _kernels.bit_masks(coefs)
  assert masks[0, 2].tolist() == [0, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0xFF]
  tables = _kernels.nibble_tables(coefs)
  assert tables.shape == (1, 3, 64)
  x = np.arange(256)
  np.testing.assert_array_equal(tables[0, 2, x & 15] ^ tables[0, 2, 32 + (x >> 4)],
                                _gf.mul(0x8E, x))
