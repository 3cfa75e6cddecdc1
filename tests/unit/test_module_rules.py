"""Rules the code states about itself: exports, the environment module, sorted plans."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
from types import ModuleType

import pytest

from ncclkv._env import EnvSettings, env_settings
from ncclkv.layout import KVGeometry, ParallelLayout, SpanSet, TransferPlan, plan
from ncclkv.protocol import DEFAULT_MAX_FRAME_BYTES


def _public_defined(module: ModuleType) -> set[str]:
    """The functions and classes ``module`` defines itself under a public name."""
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
            and value.__module__ == module.__name__}


@pytest.mark.parametrize("name", ["ncclkv.scenario._transfer", "ncclkv.buffer._entry", "ncclkv.connector._scheduler"])
def test_every_public_function_and_class_is_exported(name: str) -> None:
    module = importlib.import_module(name)
    assert _public_defined(module) <= set(module.__all__), sorted(_public_defined(module) - set(module.__all__))


def test_the_transfer_scenario_exports_what_others_import_and_hides_the_rest() -> None:
    from ncclkv.scenario import _transfer

    assert {"check_kill", "config_from_args", "pair_of"} <= set(_transfer.__all__)
    assert not hasattr(_transfer, "run_rank") and not hasattr(_transfer, "summary_table")  # used only inside


def test_env_settings_reads_the_environment_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """What docs/ARCHITECTURE.md says of _env: not cached, a value set later is seen (tests and the scenario entry
    point rely on it)."""
    monkeypatch.setenv("NCCLKV_DEADLINE_S", "3")
    assert env_settings().deadline_s == 3.0
    monkeypatch.setenv("NCCLKV_DEADLINE_S", "4")
    assert env_settings().deadline_s == 4.0


def test_the_wire_format_does_not_load_the_environment_module() -> None:
    code = "import sys, ncclkv.protocol; print('ncclkv._env' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_protocol_default_frame_limit_is_the_environment_default() -> None:
    assert DEFAULT_MAX_FRAME_BYTES == EnvSettings().max_frame_bytes == env_settings({}).max_frame_bytes


def test_a_plan_built_with_routes_out_of_order_holds_them_sorted() -> None:
    """Both ends of a link enumerate its routes in this order: it must hold whoever built the plan."""
    made = plan(ParallelLayout(2, 1), ParallelLayout(1, 2), KVGeometry(4, 2, 8), SpanSet.range(0, 16))
    assert len(made.routes) >= 2 and list(made.routes) == sorted(made.routes)
    swapped = (made.routes[1], made.routes[0], *made.routes[2:])
    assert TransferPlan(made.src_layout, made.dst_layout, made.geometry, made.tokens, swapped).routes == made.routes
    assert dataclasses.replace(made, routes=tuple(reversed(made.routes))).routes == made.routes
