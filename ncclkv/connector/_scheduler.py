"""The scheduler role: decide what each request loads or sends, and tell the workers each step.

Consumer (decode): a request whose params are a :class:`RemotePrefill` for
these very tokens (checked by block hash) loads the tokens it does not
already hold locally, once. Every later lookup of that request (after a
load failure, or a preemption) answers ``(0, False)``: vLLM then recomputes,
or finds the loaded blocks in its own prefix cache.

Producer (prefill): for a request with ``do_remote_decode`` the step that
completes its prompt also tells the workers to hold its blocks for a pull
(from the end of that step, so a consumer can pull while this engine sits
idle) or, when the request names its decode engine, to push its KV layer by
layer during that step. When it finishes, its blocks stay allocated until
the workers report the transfer done, and its final output carries the
:class:`RemotePrefill` the decode engine needs. A preempted request is held
again, under a new transfer id, when its recomputed prompt completes (this can
be in the very step whose output names the preemption, when vLLM preempted it
outside ``schedule()``); one that finishes after a preemption no step has named
yet holds nothing (vLLM freed its blocks at the preemption).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from ..engine import BlockTokens, EngineRef
from ..hashing import ExtraKey, ExtraKeys
from ..protocol import MAX_HOLD
from ._config import NcclKVConfig
from ._events import EventGatherer, NcclKVEvents
from ._metadata import DeclineJob, HoldJob, LoadJob, NcclKVMetadata, PushJob, engine_ref_from_handshakes
from ._params import PrefillIntent, RemotePrefill, parse_params, token_hash

__all__ = ["SchedulerSide", "extra_keys"]

log = logging.getLogger("ncclkv.connector")

_SENT_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_SPENT_KEEP = 4096  # transfer ids loaded or declined here lately: a later request naming one computes locally


@dataclass(slots=True)
class _Produce:
    request: Request
    push_to: EngineRef | None
    transfer_id: str | None = None  # set in the step that completes the prompt (hold or push issued)
    hold: int = 0  # pull: the number the workers hold it under, named in its params (0 for a push)
    preemptions: int = 0  # the request's num_preemptions when that hold or push was issued
    # The prompt tokens that hold or push covers: a streaming-input session (vLLM's resumable request) appends
    # more prompt to the request after it, and its params name what is held, not the grown prompt.
    num_tokens: int = 0


def _prefilled_for(request: Request, remote: RemotePrefill) -> bool:
    """Whether the remote KV is for exactly this request's first ``num_tokens`` tokens (block hashes agree).
    Its prompt as the prefill side hashed it (``_remote_prefill``): ``all_token_ids``, where vLLM puts 0 at the
    positions given as embeddings (``prompt_token_ids`` is None for a prompt of embeddings only)."""
    tokens = list(request.all_token_ids[:min(request.num_prompt_tokens, remote.num_tokens)])
    return len(tokens) == remote.num_tokens and \
        token_hash(tokens, remote.hash_block_size, extra_keys(request, remote.num_tokens)) == remote.token_hash


def extra_keys(request: Request, num_tokens: int) -> ExtraKeys:
    """What besides its first ``num_tokens`` tokens makes their KV differ: the LoRA adapter (first: the KV
    events read it there), the cache salt, each multimodal input placed among them (vLLM's content hash, offset
    and length: two images behind the same placeholder tokens give other KV) and their prompt embeddings."""
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    keys: list[ExtraKey] = [lora, request.cache_salt]
    for feature in request.mm_features:
        position = feature.mm_position
        if position.offset < num_tokens:  # one reaching past them too: their KV depends on all of it
            keys += [feature.identifier, position.offset, position.length]
    if request.prompt_embeds is not None:
        embeds = request.prompt_embeds[:num_tokens].detach().contiguous().cpu().flatten().view(torch.uint8)
        keys.append(hashlib.sha256(embeds.numpy().tobytes()).digest())
    return tuple(keys)


class SchedulerSide:
    def __init__(self, engine_id: str, config: NcclKVConfig, producer: bool, consumer: bool, block_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine_id, self._config, self._block_size = engine_id, config, block_size
        self._clock = clock
        self._producer, self._consumer = producer, consumer
        self._ref: EngineRef | None = None
        self._params: dict[str, PrefillIntent | RemotePrefill | None] = {}
        self._verified: dict[str, bool] = {}
        self._asked: dict[str, int] = {}  # req -> num_computed_tokens of the last positive answer
        self._issued: set[str] = set()  # loads handed to the workers: never load again
        # transfer id -> the request loading it, until that request finishes: the children of an n > 1
        # request (or a client's retry) carry the same params, and one transfer fills one request's blocks.
        self._claims: dict[str, str] = {}
        # Transfer ids loaded or declined here lately: spent, their producer may have freed them already.
        self._spent: OrderedDict[str, None] = OrderedDict()
        self._declines: list[DeclineJob] = []
        self._loading: set[str] = set()  # async loads not yet reported finished
        # Producer: blocks kept until finished_sending -> the clock when request_finished kept them (in that order).
        self._held: dict[str, float] = {}
        # Producer: the clock at the first of the consecutive schedule() calls that has_pending_block_frees answered
        # True (None: the last one did not), and whether the current one did.
        self._stalled_since: float | None = None
        self._stalled_now = False
        self._produce: dict[str, _Produce] = {}
        self._loads: list[LoadJob] = []
        self._releases: list[str] = []
        self._events = EventGatherer(horizon_s=config.hold_s)
        self.num_invalid_params = 0
        self.num_load_errors = 0

    # -- handshake ------------------------------------------------------------------
    def set_handshakes(self, handshakes: dict[tuple[int, int], Any]) -> None:
        if not handshakes:
            log.warning("ncclkv: no worker handshake metadata; this engine cannot produce kv_transfer_params")
            return
        self._ref = engine_ref_from_handshakes(handshakes)
        if self._ref.engine_id != self._engine_id:
            log.warning("ncclkv: workers use engine id %r, the scheduler's config says %r; using the workers'",
                        self._ref.engine_id, self._engine_id)
        if self._config.ref_path:
            _write_json(self._config.ref_path, self._ref.to_dict())

    @property
    def engine_ref(self) -> EngineRef | None:
        return self._ref

    # -- lookups ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        remote = self._params_of(request)
        req_id = request.request_id
        if not isinstance(remote, RemotePrefill) or req_id in self._issued:
            return 0, False
        if not self._consumer:
            log.warning("ncclkv: request %s asks to load remote KV, but this engine is a pure producer", req_id)
            return 0, False
        own_id = self._engine_id if self._ref is None else self._ref.engine_id  # the workers' wins (set_handshakes)
        if remote.pushed and remote.pushed_to is not None and remote.pushed_to != own_id:
            log.warning("ncclkv: request %s: the KV of transfer %s was pushed to decode engine %r, not to this one "
                        "(%r); computing it locally (send the decode request to the engine named in the prefill "
                        "request's remote_decode)", req_id, remote.transfer_id, remote.pushed_to, own_id)
            self._params[req_id] = None  # decided once: later lookups find no remote KV
            return 0, False
        if remote.producer.engine_id == own_id:
            # A kv_both engine given back its own prefill's params: the prompt's full blocks are in its prefix
            # cache (held), and its transfer engine refuses to pull from itself. It computes the rest; the
            # request, never loading, declines the hold when it ends (see _declining).
            log.debug("ncclkv: request %s names transfer %s, prefilled by this engine: computing the rest here",
                      req_id, remote.transfer_id)
            return 0, False
        if not self._verify(request, remote):
            return 0, False
        owner = self._claims.get(remote.transfer_id)
        if (owner is not None and owner != req_id) or (owner is None and remote.transfer_id in self._spent):
            log.warning("ncclkv: request %s names transfer %s, which %s; computing it locally", req_id,
                        remote.transfer_id, f"request {owner} loads" if owner else "was loaded or declined here")
            self._params[req_id] = None  # decided once: later lookups find no remote KV
            return 0, False
        if remote.pushed or self._config.async_load:
            num_new, load_async = remote.num_tokens - num_computed_tokens, True
        else:  # loaded in the forward pass that computes the rest: at least one token must be computed
            num_new, load_async = min(remote.num_tokens, request.num_prompt_tokens - 1) - num_computed_tokens, False
        if num_new <= 0:
            return 0, False
        self._asked[req_id] = num_computed_tokens  # overwritten on a repeated call: still side-effect free
        return num_new, load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        params = self._params_of(request)
        if isinstance(params, PrefillIntent) and self._producer:
            self._produce.setdefault(req_id, _Produce(request, params.push_to))
            return
        if num_external_tokens == 0 or not isinstance(params, RemotePrefill) or req_id in self._issued:
            return
        start = self._asked.pop(req_id, None)
        if start is None:
            raise RuntimeError(f"ncclkv: {num_external_tokens} external tokens allocated for {req_id} "
                               f"without a positive get_num_new_matched_tokens answer")
        (block_ids, *_) = blocks.get_block_ids()
        sync = not (params.pushed or self._config.async_load)
        # A push brings every token, but only those past this engine's own prefix hit are loaded (see LoadJob).
        tokens = ((start, params.num_tokens),) if params.pushed else ((start, start + num_external_tokens),)
        self._loads.append(LoadJob(req_id, params.transfer_id, params.producer, tuple(block_ids), tokens,
                                   params.num_tokens, params.pushed, sync, params.hold))
        self._issued.add(req_id)
        self._claims[params.transfer_id] = req_id
        self._spend(params.transfer_id)
        if not sync:
            self._loading.add(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput, block_ids_of: Any) -> NcclKVMetadata:
        """``block_ids_of(req_id)`` gives a request's block ids per group (vLLM's cache manager)."""
        # The end of a schedule(): a running request that waited in it for held blocks waits on in the next one, and
        # one that did not ends the stall has_pending_block_frees bounds.
        if not self._stalled_now:
            self._stalled_since = None
        self._stalled_now = False
        preempted = frozenset(scheduler_output.preempted_req_ids or ())
        holds, pushes = [], []
        for req_id, produce in self._produce.items():
            # Its blocks are gone: the workers drop the hold (or push) before this step's forward, and a new one
            # follows. vLLM may resume a request preempted outside schedule() (reset_prefix_cache) in this very
            # step: then the new one may be issued now, and the workers register it after dropping the old.
            if req_id in preempted:
                produce.transfer_id = None
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            request = produce.request
            # The step that completes the prompt: after it every layer holds every prompt token.
            if produce.transfer_id is not None or not scheduled or \
                    request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            produce.transfer_id, produce.preemptions = _new_transfer_id(), request.num_preemptions
            produce.num_tokens = request.num_prompt_tokens
            (block_ids, *_) = block_ids_of(req_id)
            if produce.push_to is None:
                # Chosen here, not by the workers: request_finished writes it into the params before the
                # workers' finish() runs, and every worker must hold under the same number.
                produce.hold = _new_hold()
                holds.append(HoldJob(req_id, produce.transfer_id, tuple(block_ids), request.num_prompt_tokens,
                                     produce.hold))
            else:
                num = request.num_prompt_tokens
                blocks = BlockTokens.of_prompt(request.all_token_ids[:num], self._block_size, extra_keys(request, num))
                pushes.append(PushJob(req_id, produce.transfer_id, produce.push_to, tuple(block_ids), num, blocks))
        meta = NcclKVMetadata(tuple(self._loads), tuple(holds), tuple(pushes), tuple(self._releases), preempted,
                              idle=scheduler_output.total_num_scheduled_tokens == 0, declines=tuple(self._declines))
        self._loads, self._releases, self._declines = [], [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._loading.difference_update(output.finished_recving or ())
        for req_id in output.finished_sending or ():
            self._held.pop(req_id, None)
        if isinstance(output.kv_cache_events, NcclKVEvents):
            workers = self._ref.layout.world_size if self._ref is not None else 1
            self._events.add(output.kv_cache_events.get_all_events(), workers)
        if output.invalid_block_ids:
            self.num_load_errors += 1
            log.warning("ncclkv: %d blocks failed to load; vLLM's kv_load_failure_policy decides what follows",
                        len(output.invalid_block_ids))

    # -- finishing ------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        params = self._params_of(request) if self._consumer else None
        if isinstance(params, RemotePrefill):
            if self._claims.get(params.transfer_id) == req_id:
                del self._claims[params.transfer_id]
            elif self._declining(request, params):
                self._declines.append(DeclineJob(params.transfer_id, params.producer, params.pushed, params.hold))
                self._spend(params.transfer_id)
        for table in (self._params, self._verified, self._asked):
            table.pop(req_id, None)
        self._issued.discard(req_id)
        produce = self._produce.pop(req_id, None)
        if produce is None or produce.transfer_id is None:  # the prompt never completed: nothing held
            return False, None
        if request.num_preemptions != produce.preemptions:
            # Preempted outside schedule() since the hold or push was issued (vLLM's reset_prefix_cache with
            # reset_running_requests: LLM.reset_prefix_cache, pause with clear_cache), and finished before a
            # schedule() named the preemption. vLLM freed its blocks then; the next step's preempted_req_ids
            # still name it, so the workers drop the transfer and never report it sent. Nothing is held.
            return False, None
        # The workers hold (or are pushing from) these blocks: free them when they report the transfer done.
        self._held[req_id] = self._clock()
        out = None
        if request.status in _SENT_STATUSES:
            num = produce.num_tokens
            if request.num_prompt_tokens != num:
                # A streaming-input session (resumable) whose prompt grew after the hold or push: the params name
                # the tokens held (a prefix of its prompt), and a decode computes the rest itself.
                log.info("ncclkv: request %s (a streaming-input session) has %d prompt tokens; its first %d were "
                         "held or pushed when their prompt completed, and its params name those",
                         req_id, request.num_prompt_tokens, num)
            out = self._remote_prefill(request, produce, block_ids[:-(-num // self._block_size)], num)
        if out is None and produce.push_to is None:  # no decode will pull: release the hold now
            self._releases.append(produce.transfer_id)
        return True, (out.to_dict() if out is not None else None)

    def has_pending_block_frees(self) -> bool:
        """vLLM, out of blocks for a running request: whether to wait for held blocks rather than preempt. True
        while a request that finished at most ``free_wait_s`` ago holds its blocks for a transfer: its decode
        engine is likely to pull (or decline) soon, and a release or push ends within steps. An older hold's
        decode engine may never come (it ends only after ``hold_s``): waiting for it could stall the running
        requests that long, so vLLM preempts. The blocks freed are not compared with those vLLM needs (it does
        not say): a request still short after the frees waits until the last hold is ``free_wait_s`` old. And
        running requests wait ``free_wait_s`` at most, from the first of the consecutive steps they waited in:
        on a busy engine new holds keep coming, each taking blocks a running request needed, and it would
        never move."""
        if not self._held or self._config.free_wait_s == 0:
            return False
        now = self._clock()
        newest = next(reversed(self._held.values()))  # kept in order
        since = now if self._stalled_since is None else self._stalled_since
        if now - newest >= self._config.free_wait_s or now - since >= self._config.free_wait_s:
            return False
        self._stalled_since, self._stalled_now = since, True
        return True

    def take_events(self) -> Iterable[Any]:
        """Pushed KV stored in / removed from the workers' staging (``medium="ncclkv_staging"``), once
        every worker reported it. Loaded blocks enter vLLM's prefix cache, which reports them itself."""
        return self._events.take()

    @property
    def num_tracked_requests(self) -> int:
        """Requests this role still keeps state for (0 once every request finished and was freed)."""
        tables = (self._params, self._verified, self._asked, self._issued, self._loading, self._held, self._produce,
                  set(self._claims.values()))
        return len(set().union(*tables)) + len(self._loads) + len(self._releases) + len(self._declines)

    # -- internals ---------------------------------------------------------------------------
    def _spend(self, transfer_id: str) -> None:
        self._spent[transfer_id] = None
        while len(self._spent) > _SPENT_KEEP:
            self._spent.popitem(last=False)

    def _declining(self, request: Request, remote: RemotePrefill) -> bool:
        """Whether ``request``, finished, should tell its producer it will not pull: it is the request the
        transfer was prefilled for (its tokens hash alike: another prompt carrying these params must not
        cancel them), or vLLM's stand-in for a decode request its server rejected (``abort_immediately``), it
        never loaded, and no other request here loads or loaded that transfer (a decline counts as this engine's
        pull) or declined it. A pushed one gives back its staging here at once."""
        req_id = request.request_id
        if req_id in self._issued or remote.transfer_id in self._claims \
                or remote.transfer_id in self._spent:
            return False
        if request.abort_immediately:
            # vLLM's stand-in for a decode request its API server rejected before the engine
            # (AsyncLLM.notify_kv_transfer_request_rejected): prompt [0], the rejected request's params, aborted as
            # it is added, only so that the connector frees what the params hold. Its prompt cannot hash alike.
            return True
        verified = self._verified.get(req_id)
        return _prefilled_for(request, remote) if verified is None else verified

    def _params_of(self, request: Request) -> PrefillIntent | RemotePrefill | None:
        req_id = request.request_id
        if req_id not in self._params:
            try:
                self._params[req_id] = parse_params(request.kv_transfer_params)
            except Exception as err:  # noqa: BLE001 - a client's params never stop the engine core: computed here
                self.num_invalid_params += 1
                log.error("ncclkv: request %s: bad kv_transfer_params, computing it locally: %s", req_id, err)
                self._params[req_id] = None
            if isinstance(self._params[req_id], PrefillIntent) and not self._producer:
                # Else silent: no params come back, and the decode side computes every prompt itself.
                log.warning("ncclkv: request %s asks to be prefilled for a remote decode, but this engine is a pure "
                            "consumer (kv_role=kv_consumer): no KV is kept or sent for it", req_id)
        return self._params[req_id]

    def _verify(self, request: Request, remote: RemotePrefill) -> bool:
        """The remote KV is for exactly this request's first ``num_tokens`` tokens (block hashes agree)."""
        req_id = request.request_id
        if req_id not in self._verified:
            same = _prefilled_for(request, remote)
            if not same:
                log.error("ncclkv: request %s: its first %d tokens do not hash to the prefilled ones of transfer %s; "
                          "computing it locally", req_id, remote.num_tokens, remote.transfer_id)
            self._verified[req_id] = same
        return self._verified[req_id]

    def _remote_prefill(self, request: Request, produce: _Produce, block_ids: list[int],
                        num_tokens: int) -> RemotePrefill | None:
        if self._ref is None:
            log.error("ncclkv: request %s wants a remote decode, but the workers' addresses are unknown",
                      request.request_id)
            return None
        tokens = list(request.all_token_ids[:num_tokens])
        digest = token_hash(tokens, self._block_size, extra_keys(request, num_tokens))
        push_to = produce.push_to
        assert produce.transfer_id is not None
        return RemotePrefill(produce.transfer_id, self._ref, tuple(block_ids), num_tokens, digest, self._block_size,
                             push_to is not None, None if push_to is None else push_to.engine_id, produce.hold)


def _new_transfer_id() -> str:
    return f"xfer-{uuid.uuid4().hex}"


def _new_hold() -> int:
    """A hold's number in [1, MAX_HOLD]: unrelated to any other hold's of its id (the connector's ids are fresh
    anyway), so a late pull or decline can never be taken for another hold."""
    return 1 + secrets.randbelow(MAX_HOLD)


def _write_json(path: str, data: dict[str, object]) -> None:
    """Atomically: a reader never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ncclkv-ref-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
