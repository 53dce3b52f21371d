"""Goodput: what a job trains, under failures, with each way of surviving them.

* :mod:`~jaxckpt.goodput.simulator`: the discrete-event simulator (synchronous restart vs
  replica groups vs replica groups with host snapshots), its calibrated inputs and the
  sensitivity report;
* :mod:`~jaxckpt.goodput.closed_form`: Young's and Daly's closed forms it is checked against;
* :mod:`~jaxckpt.goodput.inputs`: jaxckpt's own recovery inputs, from its benchmarks' JSON;
* :mod:`~jaxckpt.goodput.plots`: PNG plots of results and of a sensitivity report;
* :mod:`~jaxckpt.goodput.simulate_cli`: ``jaxckpt simulate``;
* :mod:`~jaxckpt.goodput.plan`: choosing options (``jaxckpt plan``).

The names below are re-exported from those modules.
"""

from jaxckpt.goodput.closed_form import ClosedFormResult
from jaxckpt.goodput.closed_form import SimulationInputError
from jaxckpt.goodput.closed_form import daly_efficiency
from jaxckpt.goodput.closed_form import daly_optimal_interval
from jaxckpt.goodput.closed_form import first_order_efficiency
from jaxckpt.goodput.closed_form import simulate_synchronous
from jaxckpt.goodput.closed_form import young_optimal_interval
from jaxckpt.goodput.inputs import BENCHMARK_FILES
from jaxckpt.goodput.inputs import MEASURED_DIR
from jaxckpt.goodput.inputs import SOURCES
from jaxckpt.goodput.inputs import from_benchmarks
from jaxckpt.goodput.plots import plot
from jaxckpt.goodput.plots import plot_tornado
from jaxckpt.goodput.simulate_cli import register_cli
from jaxckpt.goodput.simulate_cli import run_cli
from jaxckpt.goodput.simulator import MODES
from jaxckpt.goodput.simulator import PAPER_ACCELERATORS
from jaxckpt.goodput.simulator import PAPER_FIGURES
from jaxckpt.goodput.simulator import SENSITIVITY_ACCELERATORS
from jaxckpt.goodput.simulator import Mode
from jaxckpt.goodput.simulator import SimulationConfig
from jaxckpt.goodput.simulator import SimulationResult
from jaxckpt.goodput.simulator import explain
from jaxckpt.goodput.simulator import log_scale
from jaxckpt.goodput.simulator import paper_comparison
from jaxckpt.goodput.simulator import sensitivity
from jaxckpt.goodput.simulator import simulate
from jaxckpt.goodput.simulator import sweep

__all__ = [
    "BENCHMARK_FILES",
    "ClosedFormResult",
    "MEASURED_DIR",
    "MODES",
    "Mode",
    "PAPER_ACCELERATORS",
    "PAPER_FIGURES",
    "SENSITIVITY_ACCELERATORS",
    "SOURCES",
    "SimulationConfig",
    "SimulationInputError",
    "SimulationResult",
    "daly_efficiency",
    "daly_optimal_interval",
    "explain",
    "first_order_efficiency",
    "from_benchmarks",
    "log_scale",
    "paper_comparison",
    "plot",
    "plot_tornado",
    "register_cli",
    "run_cli",
    "sensitivity",
    "simulate",
    "simulate_synchronous",
    "sweep",
    "young_optimal_interval",
]
