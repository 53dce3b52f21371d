"""The goodput simulator: research code, kept in the repository and out of the wheel.

* :mod:`tools.goodput.simulator`: the discrete-event simulator (synchronous restart vs
  replica groups vs replica groups with host snapshots), its calibrated inputs, the
  paper's figures and the sensitivity report;
* :mod:`tools.goodput.plots`: PNG plots of results and of a sensitivity report;
* :mod:`tools.goodput.simulate_cli`: ``jaxckpt simulate`` (run from a checkout:
  :mod:`jaxckpt.goodput._research` finds it).

What ships, and what ``jaxckpt plan`` needs, stays in :mod:`jaxckpt.goodput`: the closed
forms the simulator is checked against and the inputs read from the benchmarks. Both
are re-exported here, so that ``from tools import goodput as sim`` (the benchmarks) has
the whole of it.
"""

from jaxckpt.goodput import *  # noqa: F401,F403  (the closed forms and inputs)
from jaxckpt.goodput import __all__ as _shipped
from tools.goodput.plots import plot, plot_tornado
from tools.goodput.simulate_cli import register_cli, run_cli
from tools.goodput.simulator import (MODES, PAPER_ACCELERATORS, PAPER_FIGURES,
                                     SENSITIVITY_ACCELERATORS, Mode, SimulationConfig,
                                     SimulationResult, explain, log_scale, paper_comparison,
                                     sensitivity, simulate, sweep)

__all__ = sorted([*_shipped, "MODES", "Mode", "PAPER_ACCELERATORS", "PAPER_FIGURES",
                  "SENSITIVITY_ACCELERATORS", "SimulationConfig", "SimulationResult", "explain",
                  "log_scale", "paper_comparison", "plot", "plot_tornado", "register_cli",
                  "run_cli", "sensitivity", "simulate", "sweep"])
