"""The connector's typed boundary: extra config, kv_transfer_params, stats (no engine, no model)."""

from __future__ import annotations

import json

import pytest

from ncclkv.connector import NcclKVConfig, PrefillIntent, RemotePrefill, parse_params
from ncclkv.connector._config import engine_role
from ncclkv.connector._params import token_hash
from ncclkv.engine import EngineRef
from ncclkv.layout import ParallelLayout
from ncclkv.paged import CacheLayout
from ncclkv.protocol import MAX_ID_CHARS

REF = EngineRef("prefill-a", ParallelLayout(2, 1), ("tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"))


def test_extra_config_defaults_and_values() -> None:
    assert NcclKVConfig.from_extra(None) == NcclKVConfig()
    cfg = NcclKVConfig.from_extra({"deadline_s": 3, "async_load": False, "cache_layout": "flash_nhd",
                                   "staging_bytes": 1 << 20, "corrupt_for_test": True})
    assert (cfg.deadline_s, cfg.async_load, cfg.layout()) == (3, False, CacheLayout.FLASH_NHD)
    assert cfg.corrupt_for_test is True
    assert NcclKVConfig().idle_wait_ms == 2.0 and NcclKVConfig.from_extra({"idle_wait_ms": 0}).idle_wait_ms == 0
    assert NcclKVConfig().piece_bytes == 0 and NcclKVConfig.from_extra({"piece_bytes": 4 << 20}).piece_bytes == 4 << 20
    assert NcclKVConfig().last_piece_bytes == 0
    assert NcclKVConfig().pull_batch_bytes == 4 << 20
    assert NcclKVConfig().free_wait_s == 1.0 and NcclKVConfig.from_extra({"free_wait_s": 0}).free_wait_s == 0
    assert NcclKVConfig.from_extra({"pull_batch_bytes": 0}).pull_batch_bytes == 0
    assert NcclKVConfig.from_extra({"last_piece_bytes": 4 << 20}).last_piece_bytes == 4 << 20
    with pytest.raises(AttributeError):
        cfg.hold_s = 1.0  # type: ignore[misc]


def test_unknown_keys_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown .*\['corupt_for_test', 'zzz'\]"):
        NcclKVConfig.from_extra({"corupt_for_test": True, "zzz": 1, "hold_s": 5.0})


@pytest.mark.parametrize(("extra", "message"), [
    ({"async_load": 1}, "'async_load'.* must be bool, got int"),
    ({"deadline_s": True}, "'deadline_s'.* must be float or None, got bool"),
    ({"deadline_s": 0}, r"'deadline_s'.* must be a finite number of seconds > 0 \(at most 1e\+09\), got 0"),
    ({"hold_s": float("inf")}, r"'hold_s'.* must be a finite number of seconds > 0 .*got inf"),
    ({"hold_s": 1e10}, r"'hold_s'.* must be a finite number of seconds > 0 .*got 10000000000.0"),
    ({"free_wait_s": -1.0}, r"'free_wait_s'\] \(0: never wait\) must be a finite number of seconds > 0 .*got -1.0"),
    ({"free_wait_s": float("nan")}, r"'free_wait_s'.* must be a finite number of seconds > 0 .*got nan"),
    ({"free_wait_s": None}, "'free_wait_s'.* must be float, got NoneType"),
    ({"staging_bytes": 2.5}, "'staging_bytes'.* must be int or None"),
    ({"staging_bytes": 0}, "'staging_bytes'.* must be >= 1"),
    ({"cache_layout": "nhd"}, "'cache_layout'.*'nhd' is not one of"),
    ({"idle_wait_ms": -1.0}, r"'idle_wait_ms'.* must be in \[0, 1000\], got -1.0"),
    ({"idle_wait_ms": 5000}, r"'idle_wait_ms'.* must be in \[0, 1000\], got 5000"),
    ({"idle_wait_ms": True}, "'idle_wait_ms'.* must be float, got bool"),
    ({"ref_path": 3}, "'ref_path'.* must be str or None"),
    ({"piece_bytes": -1}, r"'piece_bytes'.* must be >= 0, got -1"),
    ({"piece_bytes": 1.5}, "'piece_bytes'.* must be int"),
    ({"last_piece_bytes": -4096}, r"'last_piece_bytes'.* must be >= 0, got -4096"),
    ({"pull_batch_bytes": -1}, r"'pull_batch_bytes'.* must be >= 0, got -1"),
    ({"heartbeat_s": 30, "deadline_s": 10}, r"'heartbeat_s'\]=30 must be below 'deadline_s'=10"),
    ({"heartbeat_s": 5.0, "deadline_s": 5.0}, r"'heartbeat_s'\]=5 must be below 'deadline_s'=5"),
])
def test_bad_values_are_rejected(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NcclKVConfig.from_extra(extra)


def test_kv_role_maps_to_engine_role() -> None:
    assert [engine_role(r) for r in ("kv_producer", "kv_consumer", "kv_both")] == ["producer", "consumer", "both"]
    with pytest.raises(ValueError, match="kv_role must be one of"):
        engine_role("kv_lookup")


def _remote(**overrides: object) -> RemotePrefill:
    values: dict = dict(transfer_id="xfer-1", producer=REF, block_ids=(3, 4), num_tokens=45,
                        token_hash=token_hash(list(range(45)), 32), hash_block_size=32)
    values.update(overrides)
    return RemotePrefill(**values)


@pytest.mark.parametrize("pushed_to", [None, "decode-a"])
def test_remote_prefill_round_trips_through_json(pushed_to: str | None) -> None:
    value = _remote(pushed=True, pushed_to=pushed_to)
    data = json.loads(json.dumps(value.to_dict()))
    assert data.get("pushed_to") == pushed_to  # absent when unknown, as an older build wrote it
    assert data["do_remote_prefill"] is True and data["do_remote_decode"] is False
    assert data["remote_engine"]["control_addrs"] == list(REF.control_addrs)
    data["remote_prefill_cached_tokens"] = 0  # vLLM adds keys of its own: ignored
    assert parse_params(data) == value


def test_a_pulled_transfers_hold_number_round_trips_as_hex() -> None:
    """The number its producer holds it under, as a hex string (63 bits pass JSON clients that read doubles);
    absent when not named (0), as an older build wrote it."""
    value = _remote(hold=2**63 - 1)
    data = json.loads(json.dumps(value.to_dict()))
    assert data["hold"] == "0x7fffffffffffffff" and parse_params(data) == value
    assert "hold" not in _remote().to_dict() and parse_params(_remote().to_dict()).hold == 0  # type: ignore[union-attr]
    assert parse_params({**_remote().to_dict(), "hold": 12}).hold == 12  # type: ignore[union-attr]


def test_prefill_intent_accepts_proxy_params() -> None:
    # What vLLM's example P/D proxies send the prefill engine.
    proxy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert parse_params(proxy) == PrefillIntent()
    assert parse_params({"do_remote_decode": True, "remote_decode": REF.to_dict()}) == PrefillIntent(REF)
    assert parse_params(None) is None and parse_params({}) is None
    assert parse_params({"do_remote_decode": False}) is None


@pytest.mark.parametrize(("change", "message"), [
    ({"ncclkv": None}, "not made by NcclKVConnector"),
    ({"remote_num_tokens": "45"}, "remote_num_tokens must be an int"),
    ({"remote_block_ids": [1, -2]}, "remote_block_ids must be ints >= 0"),
    ({"token_hash": "abc"}, "token_hash must be 64 hex chars"),
    ({"token_hash": "g" * 64}, "token_hash must be 64 hex chars"),
    ({"token_hash": "AB" * 32}, "token_hash must be 64 hex chars"),  # .hex() writes lower case
    ({"remote_engine": {"engine_id": "x"}}, "remote_engine.*missing 'tp_size'"),
    ({"remote_engine": {**REF.to_dict(), "control_addrs": ["tcp://a:1"]}}, "1 control addresses for world_size=2"),
    # The protocol carries ids of at most MAX_ID_CHARS: before, a longer one was taken, blocks were allocated for
    # it and the engine's expect() refused it, a load failure instead of a request computed at once.
    ({"transfer_id": "x" * (MAX_ID_CHARS + 1)}, r"transfer_id must be a str of 1-512 chars.*got 513 chars: 'xxx"),
    ({"transfer_id": ""}, "transfer_id must be a str of 1-512 chars.*got 0 chars"),
    # A lone surrogate (JSON's "\ud800", which a server's json.loads takes): the protocol cannot encode it, so it
    # was taken and the pull failed ('cannot encode PullRequest'), a load failure as for the long id above.
    ({"transfer_id": "xfer-\ud800"}, r"transfer_id must be encodable as UTF-8.*got 'xfer-\\ud800'"),
    ({"pushed": "yes"}, "pushed must be a bool"),
    ({"pushed": False, "pushed_to": "decode-a"}, r"pushed_to must be .*only with pushed, got 'decode-a' \(pushed=False\)"),
    ({"pushed": True, "pushed_to": ""}, "pushed_to must be a non-empty engine id"),
    ({"pushed": True, "pushed_to": 7}, "pushed_to must be a non-empty engine id"),
    ({"hold": "12"}, "hold must be a '0x...' hex string, got '12'"),
    ({"hold": 1.5}, "hold must be a '0x...' hex string, got 1.5"),
    ({"hold": -1}, r"hold must be an int in \[0, 2\*\*63\)"),
    ({"hold": "0x8000000000000000"}, r"hold must be an int in \[0, 2\*\*63\)"),
    ({"pushed": True, "hold": "0x5"}, r"and 0 with pushed, got 5 \(pushed=True\)"),
    # JSON's 1e999 is inf: int(inf) raised OverflowError, which nothing caught, in the engine core.
    ({"remote_engine": {**REF.to_dict(), "tp_size": float("inf")}}, "tp_size must be an int, got inf"),
    ({"remote_engine": {**REF.to_dict(), "pp_size": 2.0}}, "pp_size must be an int, got 2.0"),
    ({"remote_engine": {**REF.to_dict(), "layer_partition": ["a"]}}, "layer_partition must be a list of ints"),
    # Before, engine_id None or 5 became 'None' or '5' (a peer to wait deadline_s for), addresses that were not
    # strings failed at wait() in a TransferError, and a list for the reference raised AttributeError.
    ({"remote_engine": {**REF.to_dict(), "engine_id": None}}, "engine_id must be 1-128 chars.*got None"),
    ({"remote_engine": {**REF.to_dict(), "engine_id": 5}}, "engine_id must be 1-128 chars.*got 5"),
    ({"remote_engine": {**REF.to_dict(), "control_addrs": [5001, 5002]}}, r"control addresses must be strs .*\[5001, 5002\]"),
    ({"remote_engine": {**REF.to_dict(), "control_addrs": None}}, "control_addrs must be a list of addresses, got None"),
    # Before, these were taken, and the pull failed at the channel's connect (a load error, not bad params).
    ({"remote_engine": {**REF.to_dict(), "control_addrs": ["tcp://a:1", "not a url"]}},
     r"control address of rank 1: address must be tcp://host:port or ipc://path, got 'not a url'"),
    ({"remote_engine": {**REF.to_dict(), "control_addrs": ["tcp://a:70000", "tcp://a:1"]}},
     r"control address of rank 0: address must be tcp://host:port with a port 1-65535, got 'tcp://a:70000'"),
    # Before, these were taken too (ZMQ's connect refuses them: EINVAL), or refused naming only int()'s parse.
    ({"remote_engine": {**REF.to_dict(), "control_addrs": ["tcp://a:\u0663\u0663", "tcp://a:1"]}},
     "control address of rank 0: address must be tcp://host:port with a port 1-65535, got 'tcp://a:\u0663\u0663'"),
    ({"remote_engine": {**REF.to_dict(), "control_addrs": ["tcp://a:1", "tcp://a:\u00b2"]}},
     "control address of rank 1: address must be tcp://host:port with a port 1-65535, got 'tcp://a:\u00b2'"),
    ({"remote_engine": {**REF.to_dict(), "control_addrs": ["tcp://a b:1", "tcp://a:1"]}},
     "control address of rank 0: address 'tcp://a b:1' has a space in its host"),
    ({"remote_engine": {**REF.to_dict(), "control_addrs": ["tcp://a:1", "ipc://"]}},
     "control address of rank 1: address must be tcp://host:port or ipc://path, got 'ipc://'"),
    ({"remote_engine": {**REF.to_dict(), "control_addrs": "tcp://a:1"}}, "control_addrs must be a list of addresses"),
    ({"remote_engine": [REF.to_dict()]}, "remote_engine must be an EngineRef dict"),
    ({"do_remote_decode": True}, "both do_remote_decode and do_remote_prefill"),
    ({"do_remote_prefill": 1}, "'do_remote_prefill'.* must be a bool"),
])
def test_malformed_params_name_the_key(change: dict, message: str) -> None:
    data = {**_remote().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        parse_params(data)
    missing = _remote().to_dict()
    del missing["transfer_id"]
    with pytest.raises(ValueError, match=r"lack \['transfer_id'\]"):
        parse_params(missing)


def test_a_decode_ref_of_another_kind_is_refused_too() -> None:
    with pytest.raises(ValueError, match="remote_decode.*pp_size must be an int, got -inf"):
        parse_params({"do_remote_decode": True, "remote_decode": {**REF.to_dict(), "pp_size": float("-inf")}})


def test_token_hash_names_exactly_these_tokens() -> None:
    tokens = list(range(100, 145))
    assert token_hash(tokens, 32) == token_hash(list(tokens), 32)
    assert token_hash(tokens, 32) != token_hash(tokens[:44], 32)  # the partial tail counts
    assert token_hash(tokens, 32) != token_hash(tokens, 16)
    assert token_hash(tokens, 32) != token_hash(tokens, 32, ("lora-a", None))
    changed = list(tokens)
    changed[0] += 1
    assert token_hash(changed, 32) != token_hash(tokens, 32)
    with pytest.raises(ValueError, match="empty"):
        token_hash([], 32)


def test_import_ncclkv_connector_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = ("import sys, ncclkv, ncclkv.connector as c; c.NcclKVConfig.from_extra({}); "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_engine_ref_from_dict_refuses_what_is_not_a_reference() -> None:
    with pytest.raises(ValueError, match=r"engine reference must be a dict, got list"):
        EngineRef.from_dict([REF.to_dict()])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"control addresses must be strs .*\[b'tcp://a:1'\]"):
        EngineRef("x", ParallelLayout(1, 1), (b"tcp://a:1",))  # type: ignore[arg-type]
    assert EngineRef.from_dict(json.loads(json.dumps(REF.to_dict()))) == REF
