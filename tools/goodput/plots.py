"""Plots of the goodput simulator's results: effective training time and stall per failure
against the job's size (:func:`plot`), and a tornado chart of a sensitivity report
(:func:`plot_tornado`).

matplotlib is imported on first use, on its own Agg canvas (no pyplot, no global backend
change); it comes with ``pip install 'jaxckpt[plot]'``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tools.goodput.simulator import MODES, PAPER_ACCELERATORS, PAPER_FIGURES, SimulationResult


def _figure(who: str, **kw: Any) -> Any:
  """A matplotlib Figure on its own Agg canvas (no pyplot, no global backend change)."""
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        f"jaxckpt.goodput.{who} needs matplotlib: pip install 'jaxckpt[plot]'") from e
  fig = Figure(**kw)
  FigureCanvasAgg(fig)
  return fig


def plot(results: Sequence[SimulationResult], path: str | os.PathLike[str]) -> None:
  """Writes a PNG of effective training time and stall per failure against N, per mode.

  The paper's figures are drawn as markers at its O(100K) GPUs. Uses matplotlib's Agg
  canvas directly (no pyplot, no global backend change).

  Raises:
    ModuleNotFoundError: matplotlib is not installed (``pip install 'jaxckpt[plot]'``).
  """
  fig = _figure("plot", figsize=(10, 4), dpi=100)
  ett, stall = fig.subplots(1, 2)
  for mode in MODES:
    rs = sorted((r for r in results if r.mode is mode), key=lambda r: r.accelerators)
    if not rs:
      continue
    xs = [r.accelerators for r in rs]
    line, = ett.plot(xs, [100 * r.effective_training_time for r in rs], "o-", label=mode.value)
    stall.plot(xs, [r.stall_per_failure_secs / 60 for r in rs], "o-", color=line.get_color())
    if mode in PAPER_FIGURES:
      fig_ = PAPER_FIGURES[mode]
      ett.plot([PAPER_ACCELERATORS], [100 * fig_["effective_training_time"]], "*",
               ms=14, color=line.get_color(), mec="k")
      stall.plot([PAPER_ACCELERATORS], [fig_["stall_per_failure_min"]], "*",
                 ms=14, color=line.get_color(), mec="k")
  for ax, label in ((ett, "effective training time (%)"), (stall, "stall per failure (min)")):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1024:g}K" if x >= 1024 else f"{x:g}")
    ax.set_xlabel("accelerators (N)")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
  ett.set_ylim(0, 100)
  stall.set_ylim(bottom=0)
  ett.legend(fontsize=8, title="stars: FT-HSDP paper at O(100K)", title_fontsize=8)
  fig.tight_layout()
  fig.savefig(os.fspath(path), format="png")


def plot_tornado(report: dict[str, Any], path: str | os.PathLike[str], top: int = 8) -> None:
  """Writes a PNG tornado chart of a :func:`sensitivity` report: one panel per
  (accelerators, mode), the ``top`` inputs that move the result most, each bar
  spanning its halved and doubled effect on effective training time.

  Raises:
    ModuleNotFoundError: matplotlib is not installed (``pip install 'jaxckpt[plot]'``).
  """
  results = report["results"]
  cols = len({r["mode"] for r in results})
  rows = -(-len(results) // cols)
  fig = _figure("plot_tornado", figsize=(4.2 * cols, 2.6 * rows), dpi=90)
  axes = fig.subplots(rows, cols, squeeze=False).ravel()
  for ax, r in zip(axes, results):
    ranked = sorted(r["inputs"].items(), key=lambda kv: -max(abs(v) for v in kv[1].values()))[:top]
    names = [n for n, _ in ranked][::-1]
    base = 100 * r["base"]
    for y, name in enumerate(names):
      d = r["inputs"][name]
      ax.barh(y, 100 * d["halved"], left=base, color="tab:blue", height=0.7)
      ax.barh(y, 100 * d["doubled"], left=base, color="tab:orange", height=0.7)
    ax.axvline(base, color="k", lw=0.8)
    ax.set_yticks(range(len(names)), [n.replace("_secs", "").replace("_", " ") for n in names],
                  fontsize=7)
    ax.set_title(f"{r['mode']} at {r['accelerators'] / 1024:g}K: {base:.1f}%", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
  for ax in axes[len(results):]:
    ax.set_visible(False)
  fig.supxlabel("effective training time (%): blue halved, orange doubled", fontsize=8)
  fig.tight_layout()
  fig.savefig(os.fspath(path), format="png")
