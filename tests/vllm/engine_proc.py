"""The real-vLLM tests' engine harness; it lives in the package (``ncclkv.demo``), shared with ``ncclkv demo``.

:class:`EngineProcess` runs one ``vllm.LLM`` per child interpreter, pinned to
one core, and drives it with deadlines (see :mod:`ncclkv.demo._engine_proc`).
"""

from __future__ import annotations

from ncclkv.demo import EngineError, EngineOptions, EngineProcess, RequestResult

__all__ = ["EngineError", "EngineOptions", "EngineProcess", "RequestResult"]
