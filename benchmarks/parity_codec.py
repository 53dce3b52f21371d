"""Reed-Solomon codec throughput (one thread) vs reedsolo, zfec and np.copyto; parity memory.

Usage: python benchmarks/parity_codec.py [--quick] [--block-mib N] [--reps N] [--plot PATH]

Prints one JSON object. Throughputs are MB/s (1e6 bytes/s) of data bytes
(k blocks) per call, medians of --reps interleaved runs after a warm-up, all
single-threaded. ``encode_into``/``decode_into`` write into reused buffers;
``encode``/``decode`` allocate their outputs (first touch of fresh memory is
slow on this VM), as zfec always does. Decode is the worst case (m data blocks
lost) and the single-loss case. reedsolo runs column by column on a small
sample (--reedsolo-bytes per block) and is scaled.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Callable

import llvmlite.binding
import numba
import numpy as np
import reedsolo
import zfec

from jaxckpt.parity import _kernels
from jaxckpt.parity.codec import ReedSolomon
from jaxckpt.parity.placement import ParityOptions, StripeLayout, encode_stripe

MB = 1e6
CONFIGS = [(3, 1), (4, 2), (6, 2)]


def _time(fn: Callable[[], object]) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def _interleaved(cases: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
  """Median seconds per case; one warm-up each, then reps rounds in turn."""
  for fn in cases.values():
    fn()
  times: dict[str, list[float]] = {name: [] for name in cases}
  for _ in range(reps):
    for name, fn in cases.items():
      times[name].append(_time(fn))
  return {name: statistics.median(ts) for name, ts in times.items()}


def _reedsolo_rates(k: int, m: int, sample: int, data: list[np.ndarray]) -> dict[str, float]:
  """reedsolo MB/s of data, column-wise (each column is a k-byte message)."""
  reedsolo.init_tables(0x11D, 2)
  gen = reedsolo.rs_generator_poly(m)
  cols = [bytearray(np.stack([d[:sample] for d in data], axis=1)[c].tobytes())
          for c in range(sample)]
  start = time.perf_counter()
  coded = [reedsolo.rs_encode_msg(col, m, gen=gen) for col in cols]
  enc = time.perf_counter() - start
  erase = list(range(m))
  start = time.perf_counter()
  for word in coded:
    broken = bytearray(word)
    for i in erase:
      broken[i] = 0
    reedsolo.rs_correct_msg(broken, m, erase_pos=erase)
  dec = time.perf_counter() - start
  return {"encode": k * sample / enc / MB, "decode": k * sample / dec / MB}


def bench_codec(k: int, m: int, nbytes: int, reps: int, rs_sample: int) -> dict[str, object]:
  rng = np.random.default_rng(k * 10 + m)
  rs = ReedSolomon(k, m)
  data = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(k)]
  parity = [np.full(nbytes, 1, np.uint8) for _ in range(m)]
  rs.encode_into(data, parity)
  worst = [None] * m + data[m:] + parity
  one = [None] + data[1:] + parity
  out_worst = {i: np.full(nbytes, 1, np.uint8) for i in range(m)}
  out_one = {0: np.full(nbytes, 1, np.uint8)}
  src = np.concatenate(data)
  dst = np.full(src.size, 1, np.uint8)
  zenc, zdec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
  zdata = [d.tobytes() for d in data]
  zparity = zenc.encode(zdata, list(range(k, k + m)))
  zshares, znums = zdata[m:] + zparity, list(range(m, k + m))
  med = _interleaved({
      "encode_into": lambda: rs.encode_into(data, parity),
      "decode_into_m_lost": lambda: rs.decode_into(worst, out_worst),
      "decode_into_1_lost": lambda: rs.decode_into(one, out_one),
      "encode": lambda: rs.encode(data),
      "decode_m_lost": lambda: rs.decode(worst),
      "np_copyto": lambda: np.copyto(dst, src),
      "zfec_encode": lambda: zenc.encode(zdata, list(range(k, k + m))),
      "zfec_decode_m_lost": lambda: zdec.decode(zshares, znums),
  }, reps)
  for i in range(m):
    if not np.array_equal(out_worst[i], data[i]):
      raise AssertionError(f"decode of ({k}, {m}) block {i} is wrong")
  rates = {name: k * nbytes / s / MB for name, s in med.items()}
  slow = _reedsolo_rates(k, m, rs_sample, data)
  return {
      "k": k, "m": m, "block_bytes": nbytes,
      "MBps": {**{n: round(r, 1) for n, r in rates.items()},
               "reedsolo_encode": round(slow["encode"], 3),
               "reedsolo_decode_m_lost": round(slow["decode"], 3)},
      "decode_over_encode_time": round(med["decode_into_m_lost"] / med["encode_into"], 3),
      "decode1_over_encode_time": round(med["decode_into_1_lost"] / med["encode_into"], 3),
      "encode_x_reedsolo": round(rates["encode_into"] / slow["encode"]),
      "decode_x_reedsolo": round(rates["decode_into_m_lost"] / slow["decode"]),
      "encode_x_zfec": round(rates["encode_into"] / rates["zfec_encode"], 2),
      "decode_x_zfec": round(rates["decode_into_m_lost"] / rates["zfec_decode_m_lost"], 2),
      "encode_over_copyto": round(rates["encode_into"] / rates["np_copyto"], 3),
  }


def bench_memory(host_mib: float, m: int, hosts: int = 8, group_size: int = 4) -> dict[str, object]:
  """Encodes every stripe of a layout of random-sized hosts; parity held per host."""
  rng = np.random.default_rng(m)
  base = int(host_mib * 2**20)
  sizes = [int(base * f) for f in rng.uniform(0.8, 1.2, hosts)]
  layout = StripeLayout.build(sizes, ParityOptions(group_size=group_size, parity=m))
  snaps = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
  held = [0] * hosts
  for stripe in layout.stripes:
    blocks = encode_stripe(stripe, [snaps[p.host][p.start:p.stop] for p in stripe.data])
    for piece, block in zip(stripe.parity, blocks):
      held[piece.host] += block.nbytes
  ratio = [h / s for h, s in zip(held, sizes)]
  return {
      "group_size": group_size, "m": m, "hosts": hosts, "snapshot_bytes": sizes,
      "parity_bytes_held": held, "parity_over_snapshot": [round(r, 4) for r in ratio],
      "expected_m_over_k": round(m / (group_size - m), 4),
      "total_parity_over_total_snapshot": round(sum(held) / sum(sizes), 4),
      "layout_parity_bytes_per_host_matches": list(layout.parity_bytes_per_host()) == held,
  }


_PLOTTED = (("encode_into", "jaxckpt encode"), ("decode_into_m_lost", "jaxckpt decode (m lost)"),
            ("zfec_encode", "zfec encode"), ("zfec_decode_m_lost", "zfec decode (m lost)"),
            ("reedsolo_encode", "reedsolo encode"), ("np_copyto", "np.copyto"))


def plot(result: dict[str, object], path: str) -> None:
  """Grouped bars of MB/s per (k, m) and codec, log scale, written as a PNG."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  codec = result["codec"]
  fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
  width = 0.8 / len(_PLOTTED)
  for i, (key, label) in enumerate(_PLOTTED):
    xs = [c + (i - (len(_PLOTTED) - 1) / 2) * width for c in range(len(codec))]
    ax.bar(xs, [r["MBps"][key] for r in codec], width, label=label)
  ax.set_xticks(range(len(codec)), [f"k={r['k']}, m={r['m']}" for r in codec])
  ax.set_yscale("log")
  ax.set_ylabel("MB/s of data, one thread")
  block = codec[0]["block_bytes"] / 2**20
  ax.set_title(f"Reed-Solomon codec throughput ({block:g} MiB blocks, {result['kernel']})")
  ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small blocks, few runs (< 60 s)")
  parser.add_argument("--block-mib", type=float, default=64)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--reedsolo-bytes", type=int, default=8192)
  parser.add_argument("--plot", default=None, metavar="PATH", help="also write a PNG bar chart")
  args = parser.parse_args()
  block_mib, reps, sample = args.block_mib, args.reps, args.reedsolo_bytes
  if args.quick:
    block_mib, reps, sample = 4, 3, 1024
  nbytes = int(block_mib * 2**20)
  result = {
      "benchmark": "parity_codec",
      "threads": 1,
      "machine": {"cpu": llvmlite.binding.get_host_cpu_name(), "python": platform.python_version(),
                  "numba": numba.__version__, "numpy": np.__version__},
      "kernel": "avx2-nibble-shuffle" if _kernels.HAS_AVX2 else "bit-sliced",
      "reps": reps, "quick": args.quick,
      "codec": [bench_codec(k, m, nbytes, reps, sample) for k, m in CONFIGS],
      "memory": [bench_memory(block_mib / 4, m) for m in (1, 2)],
  }
  if args.plot:
    plot(result, args.plot)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
