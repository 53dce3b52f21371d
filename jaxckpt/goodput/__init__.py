"""Goodput: what a job trains, under failures, and the options that make the most of it.

* :mod:`~jaxckpt.goodput.closed_form`: Young's and Daly's closed forms;
* :mod:`~jaxckpt.goodput.inputs`: jaxckpt's own recovery inputs, from its benchmarks' JSON;
* :mod:`~jaxckpt.goodput.plan`: choosing options (``jaxckpt plan``), from the closed forms;
* :mod:`~jaxckpt.goodput._research`: ``jaxckpt simulate``'s door to the discrete-event
  simulator, research code (its paper's figures, its plots) kept in the repository
  (``tools/goodput/``) and out of the wheel: from a checkout it runs, from a wheel it says
  where it is.

The names below are re-exported from those modules.
"""

from jaxckpt.goodput._research import register_cli
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

__all__ = [
    "BENCHMARK_FILES",
    "ClosedFormResult",
    "MEASURED_DIR",
    "SOURCES",
    "SimulationInputError",
    "daly_efficiency",
    "daly_optimal_interval",
    "first_order_efficiency",
    "from_benchmarks",
    "register_cli",
    "simulate_synchronous",
    "young_optimal_interval",
]
