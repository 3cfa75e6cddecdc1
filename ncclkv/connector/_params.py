"""Typed ``kv_transfer_params``: vLLM's P/D convention, as values.

The client (or vLLM's example proxy) sends the prefill engine
``{"do_remote_decode": true}`` (proxies add ``remote_engine_id: null`` and the
like; keys we do not use are ignored). When it also names its decode engine,
``"remote_decode": <EngineRef dict>``, the prefill engine pushes the KV layer by
layer while it computes it. The prefill engine's final output carries a
:class:`RemotePrefill`; the client passes that dict, unchanged, to the decode
engine, which pulls (or takes the pushed KV) keyed by ``transfer_id`` (request
ids differ between engines). No peer is ever parsed out of a request id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..engine import EngineRef
from ..engine._config import hex_int, is_int
from ..hashing import BlockHash, ExtraKeys, hash_block_tokens, hash_request_tokens
from ..protocol import MAX_HOLD, MAX_ID_CHARS, check_encodable_id

__all__ = ["PARAMS_VERSION", "PrefillIntent", "RemotePrefill", "parse_params", "token_hash"]

PARAMS_VERSION = 1
_HEX_64 = re.compile(r"[0-9a-f]{64}")  # token_hash: BlockHash.hex() of a sha256 digest


def token_hash(token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys | None = None) -> str:
    """Hex digest naming exactly these tokens: the chained block hash of the last block (partial or full)."""
    if not token_ids:
        raise ValueError("token_hash of an empty token list")
    full = hash_request_tokens(block_size, token_ids, extra_keys)
    last: BlockHash | None = full[-1] if full else None
    tail = token_ids[len(full) * block_size:]
    if tail:
        last = hash_block_tokens(last, tail, extra_keys)
    assert last is not None
    return last.hex()


@dataclass(frozen=True, slots=True)
class PrefillIntent:
    """What a prefill request asks for: keep its KV for a remote decode, optionally pushing it."""

    push_to: EngineRef | None = None


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """What the decode engine needs to take a prefilled request's KV; the prefill's output params."""

    transfer_id: str
    producer: EngineRef
    block_ids: tuple[int, ...]
    num_tokens: int
    token_hash: str
    hash_block_size: int
    pushed: bool = False
    # The engine id of the decode engine the KV was pushed to (None: pulled, or params of an older build): any
    # other decode engine computes the request instead of waiting deadline_s for a push that never comes.
    pushed_to: str | None = None
    # The number the producer held the transfer under (TransferEngine.finish(..., hold=)), which the decode side's
    # pull and decline name; 0: not named (pushed, or params of an older build).
    hold: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(self.block_ids))
        if not isinstance(self.transfer_id, str) or not 1 <= len(self.transfer_id) <= MAX_ID_CHARS:
            what = f"{len(self.transfer_id)} chars" if isinstance(self.transfer_id, str) else \
                type(self.transfer_id).__name__
            raise ValueError(f"transfer_id must be a str of 1-{MAX_ID_CHARS} chars (what the protocol carries), "
                             f"got {what}: {self.transfer_id!r:.80}")
        check_encodable_id("transfer_id", self.transfer_id)
        if not is_int(self.num_tokens) or self.num_tokens < 1:
            raise ValueError(f"remote_num_tokens must be an int >= 1, got {self.num_tokens!r}")
        if not is_int(self.hash_block_size) or self.hash_block_size < 1:
            raise ValueError(f"hash_block_size must be an int >= 1, got {self.hash_block_size!r}")
        if not all(is_int(b) and b >= 0 for b in self.block_ids):
            raise ValueError(f"remote_block_ids must be ints >= 0, got {list(self.block_ids)!r}")
        if not isinstance(self.token_hash, str) or not _HEX_64.fullmatch(self.token_hash):
            raise ValueError(f"token_hash must be 64 hex chars, got {self.token_hash!r}")
        if not isinstance(self.pushed, bool):
            raise ValueError(f"pushed must be a bool, got {self.pushed!r}")
        if self.pushed_to is not None and (not isinstance(self.pushed_to, str) or not self.pushed_to
                                           or not self.pushed):
            raise ValueError(f"pushed_to must be a non-empty engine id, and only with pushed, got "
                             f"{self.pushed_to!r} (pushed={self.pushed!r})")
        if not is_int(self.hold) or not 0 <= self.hold <= MAX_HOLD or (self.hold and self.pushed):
            raise ValueError(f"hold must be an int in [0, 2**63), and 0 with pushed, got {self.hold!r} "
                             f"(pushed={self.pushed!r})")

    def to_dict(self) -> dict[str, object]:
        """The prefill output's ``kv_transfer_params`` (JSON-safe; the client forwards it to the decode)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "ncclkv": PARAMS_VERSION,
            "transfer_id": self.transfer_id,
            "remote_engine_id": self.producer.engine_id,
            "remote_engine": self.producer.to_dict(),
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "token_hash": self.token_hash,
            "hash_block_size": self.hash_block_size,
            "pushed": self.pushed,
            **({"pushed_to": self.pushed_to} if self.pushed_to is not None else {}),
            **({"hold": f"{self.hold:#x}"} if self.hold else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> RemotePrefill:
        version = data.get("ncclkv")
        if version != PARAMS_VERSION:
            raise ValueError(f"kv_transfer_params with do_remote_prefill were not made by NcclKVConnector "
                             f"version {PARAMS_VERSION} ('ncclkv' is {version!r})")
        missing = [k for k in ("transfer_id", "remote_engine", "remote_block_ids", "remote_num_tokens",
                               "token_hash", "hash_block_size") if k not in data]
        if missing:
            raise ValueError(f"kv_transfer_params lack {missing}")
        engine = data["remote_engine"]
        blocks = data["remote_block_ids"]
        if not isinstance(engine, Mapping):
            raise ValueError(f"remote_engine must be an EngineRef dict, got {engine!r}")
        if not isinstance(blocks, Sequence) or isinstance(blocks, str | bytes):
            raise ValueError(f"remote_block_ids must be a list of ints, got {blocks!r}")
        return cls(
            transfer_id=data["transfer_id"],  # type: ignore[arg-type]
            producer=_engine_ref(engine, "remote_engine"),
            block_ids=tuple(blocks),
            num_tokens=data["remote_num_tokens"],  # type: ignore[arg-type]
            token_hash=data["token_hash"],  # type: ignore[arg-type]
            hash_block_size=data["hash_block_size"],  # type: ignore[arg-type]
            pushed=data.get("pushed", False),  # type: ignore[arg-type]
            pushed_to=data.get("pushed_to"),  # type: ignore[arg-type]
            hold=_hold(data.get("hold")),
        )


def parse_params(params: Mapping[str, object] | None) -> PrefillIntent | RemotePrefill | None:
    """A request's ``kv_transfer_params`` as a typed value; None when it asks for no transfer.

    Raises ValueError naming the offending key for malformed params.
    """
    if not params:
        return None
    if not isinstance(params, Mapping):
        raise ValueError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    decode, prefill = params.get("do_remote_decode", False), params.get("do_remote_prefill", False)
    for key, value in (("do_remote_decode", decode), ("do_remote_prefill", prefill)):
        if not isinstance(value, bool):
            raise ValueError(f"kv_transfer_params[{key!r}] must be a bool, got {value!r}")
    if decode and prefill:
        raise ValueError("kv_transfer_params set both do_remote_decode and do_remote_prefill")
    if prefill:
        return RemotePrefill.from_dict(params)
    if decode:
        target = params.get("remote_decode")
        if target is None:
            return PrefillIntent()
        if not isinstance(target, Mapping):
            raise ValueError(f"kv_transfer_params['remote_decode'] must be an EngineRef dict, got {target!r}")
        return PrefillIntent(_engine_ref(target, "remote_decode"))
    return None


def _hold(value: object) -> int:
    """The params' ``hold`` as :meth:`RemotePrefill.to_dict` writes it (a ``"0x..."`` string; an int taken too);
    absent or null: 0. ValueError naming anything else (RemotePrefill bounds the number)."""
    return 0 if value is None else hex_int(value, "hold must be a '0x...' hex string")


def _engine_ref(data: Mapping[str, object], key: str) -> EngineRef:
    try:
        return EngineRef.from_dict(dict(data))
    except (TypeError, ValueError) as err:
        raise ValueError(f"kv_transfer_params[{key!r}] is not a valid engine reference: {err}") from None
