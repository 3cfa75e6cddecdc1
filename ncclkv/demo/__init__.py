"""``ncclkv demo`` with real vLLM engines, and the engine-process harness it shares with the tests.

- :class:`EngineProcess` runs one ``vllm.LLM`` in a child interpreter (pinned
  to a core) and drives it with deadlines: ``launch`` / ``wait_ready`` /
  ``generate`` / ``drain`` / ``metrics`` / ``close``; :func:`close_all`
  closes several at once, with a deadline, then kills.
- :func:`run_demo` starts a prefill and a decode engine with
  ``NcclKVConnector``, sends a batch through them (pull and push), runs the
  same batch on a single engine and returns a :class:`DemoReport`.

Importing this package imports neither vLLM nor rich; the engine children import vLLM.
"""

from ._devices import DemoDevices, DeviceCountError, EngineDevice, demo_devices, gpus_here
from ._engine_proc import EngineError, EngineOptions, EngineProcess, RequestResult, close_all
from ._pd import DEMO_SPEC, Placement, connector_config, run_demo
from ._progress import Reporter, rich_available
from .._signals import Stopped, signals_deferred, stop_on_signals
from ._summary import DemoReport, PhaseResult, Table, format_plain, summary_table
from ._workload import MODES, DemoSettings, make_prompts, prompt_lengths

__all__ = [
    "DEMO_SPEC", "MODES", "DemoDevices", "DemoReport", "DemoSettings", "DeviceCountError", "EngineDevice", "EngineError", "EngineOptions", "EngineProcess", "PhaseResult",
    "Placement", "Reporter", "RequestResult", "Stopped", "Table", "close_all", "connector_config", "format_plain",
    "demo_devices", "gpus_here", "make_prompts", "prompt_lengths", "rich_available", "run_demo", "signals_deferred", "stop_on_signals",
    "summary_table",
]
