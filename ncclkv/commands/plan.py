"""``ncclkv plan``: print the transfer plan between two parallel layouts.

Example::

    ncclkv plan --src tp=4,pp=1 --dst tp=2,pp=2 --layers 32 --kv-heads 8
    ncclkv plan --src tp=8 --dst tp=4 --layers 61 --mla --head-size 576 --json
    ncclkv plan --src tp=2,pp=2,partition=10:22 --dst tp=1 --layers 32 --kv-heads 8 --tokens 0:100,200:300

With ``--mla`` the cache holds one latent per token, so ``--kv-heads`` defaults
to 1 and any other value is an error.

A layout with pp > 1 and no ``partition=`` splits its layers as vLLM would in
this environment: by ``VLLM_PP_LAYER_PARTITION`` (comma-separated layers per
stage, e.g. ``10,22``) when that variable is set, else by vLLM's default split
(``layers // pp`` each, the remainder one each to the stages before the last).
``partition=`` overrides the variable; a pp=1 layout ignores it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping

from .._env import PP_PARTITION_VAR
from .._messages import MAX_MODEL_DIM
from ..layout import DTYPE_SIZES, KVGeometry, ParallelLayout, SpanSet, TransferPlan, plan, pp_layer_spans

__all__ = ["MAX_TOKENS", "add_parser", "parse_layout", "parse_tokens", "run"]

# Far past any model's context. The plan's checks hold a list sized by the token count (len(SpanSet)): a
# count past sys.maxsize raised OverflowError there, and one of 2**40 MemoryError.
MAX_TOKENS = 1 << 30


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="print which rank sends which KV box between two TP/PP layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--src", required=True, metavar="SPEC",
                        help="prefill layout, e.g. tp=4,pp=2[,partition=16:16]; tp and pp default to 1; with pp > 1 "
                             f"and no partition, {PP_PARTITION_VAR} if set, else vLLM's default split")
    parser.add_argument("--dst", required=True, metavar="SPEC", help="decode layout, same form as --src")
    parser.add_argument("--layers", required=True, type=int, help="number of attention layers")
    parser.add_argument("--kv-heads", type=int, default=None, help="number of kv heads (default 1 with --mla, else required)")
    parser.add_argument("--head-size", type=int, default=128, help="elements per head, or per MLA latent (default 128)")
    parser.add_argument("--dtype", default="bfloat16", help=f"cache dtype, one of {', '.join(sorted(DTYPE_SIZES))} (default bfloat16)")
    parser.add_argument("--tokens", default="4096", help="a token count N (tokens 0..N-1) or spans a:b,c:d (default 4096)")
    parser.add_argument("--mla", action="store_true", help="MLA cache: one latent per token, replicated on every TP rank")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.set_defaults(run=run)


def parse_layout(text: str, env: Mapping[str, str] | None = None) -> ParallelLayout:
    """``tp=4,pp=2[,partition=16:16]``; missing tp or pp: 1. Without ``partition`` and with pp > 1, the layers
    per stage are ``env``'s ``VLLM_PP_LAYER_PARTITION`` (``"16,16"``, read as vLLM reads it) when ``env``
    has it, else None (vLLM's default split)."""
    values: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in ("tp", "pp", "partition") or key in values or not value:
            raise ValueError(f"bad layout {text!r}: expected tp=N,pp=N[,partition=a:b:...], got {item!r}")
        values[key] = value
    try:
        tp_size = int(values.get("tp", "1"))
        pp_size = int(values.get("pp", "1"))
        partition = tuple(int(n) for n in values["partition"].split(":")) if "partition" in values else None
    except ValueError:
        raise ValueError(f"bad layout {text!r}: tp, pp and partition must be integers") from None
    from_env = (env or {}).get(PP_PARTITION_VAR)
    if partition is None and pp_size > 1 and from_env is not None:
        try:  # as vLLM: int() of each comma-separated item, so " 16" is 16 and an empty value is an error
            partition = tuple(int(n) for n in from_env.split(","))
        except ValueError:
            raise ValueError(f"{PP_PARTITION_VAR}={from_env!r} is not comma-separated integers "
                             f"(vLLM would refuse it too)") from None
        if len(partition) != pp_size:
            raise ValueError(f"{PP_PARTITION_VAR}={from_env!r} has {len(partition)} stages but layout {text!r} has "
                             f"pp={pp_size}: give it partition=a:b:... or change the variable")
    return ParallelLayout(tp_size, pp_size, partition)


def parse_tokens(text: str) -> SpanSet:
    """``N`` (tokens ``[0, N)``) or comma-separated half-open spans ``a:b,c:d``, every bound <= MAX_TOKENS."""
    try:
        if ":" not in text:
            count = int(text)
            if count < 0:
                raise ValueError
            tokens = SpanSet.range(0, count)
        else:
            spans = []
            for item in text.split(","):
                start, stop = item.split(":")
                spans.append((int(start), int(stop)))
            tokens = SpanSet(spans)
    except (ValueError, TypeError):
        raise ValueError(f"bad --tokens {text!r}: expected a count N >= 0 or spans a:b,c:d with 0 <= a <= b") from None
    if tokens.bounds.stop > MAX_TOKENS:
        raise ValueError(f"bad --tokens {text!r}: tokens must end at {MAX_TOKENS} (2**30) at most, "
                         f"got {tokens.bounds.stop}")
    return tokens


def _geometry(args: argparse.Namespace) -> KVGeometry:
    # Past the handshake's bound no engine runs the model; far past it a span's len() (2**63) or the bytes as a
    # float (10**308) raised OverflowError.
    for option, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads), ("--head-size", args.head_size)):
        if value is not None and value > MAX_MODEL_DIM:
            raise ValueError(f"{option} must be at most {MAX_MODEL_DIM} (what an engine's handshake accepts), got {value}")
    kv_heads = args.kv_heads
    if args.mla:
        if kv_heads not in (None, 1):
            raise ValueError(f"--mla holds one latent per token: --kv-heads must be 1 or omitted, got {kv_heads}")
        kv_heads = 1
    elif kv_heads is None:
        raise ValueError("--kv-heads is required unless --mla is given")
    return KVGeometry(args.layers, kv_heads, args.head_size, args.dtype, args.mla)


def _mib(nbytes: int) -> str:
    return f"{nbytes:>14,d} B ({nbytes / 2**20:,.1f} MiB)"


def _report(result: TransferPlan) -> str:
    lines = [result.grid(), "", "routes:"]
    for route in result.routes:
        lines.append(
            f"  src {route.src:>2} -> dst {route.dst:>2}  layers {route.layers!r:<9} heads {route.heads!r:<8} "
            f"tokens {route.tokens!r:<14} {_mib(route.nbytes(result.geometry))}"
        )
    lines += ["", "bytes per rank:"]
    lines += [f"  src {rank:>2} sends    {_mib(n)}" for rank, n in result.send_bytes().items()]
    lines += [f"  dst {rank:>2} receives {_mib(n)}" for rank, n in result.recv_bytes().items()]
    lines.append(f"  total          {_mib(sum(result.send_bytes().values()))}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    src, dst = parse_layout(args.src, os.environ), parse_layout(args.dst, os.environ)
    geometry = _geometry(args)
    for text, layout in ((args.src, src), (args.dst, dst)):
        if layout.layer_partition is not None and parse_layout(text).layer_partition is None:
            try:  # its partition came from the environment: name the variable if it does not fit the model's layers
                pp_layer_spans(geometry.num_layers, layout.pp_size, layout.layer_partition)
            except ValueError as err:
                raise ValueError(f"{PP_PARTITION_VAR}={os.environ[PP_PARTITION_VAR]!r} (for layout {text!r}): {err}") from None
    result = plan(src, dst, geometry, parse_tokens(args.tokens))
    result.validate()
    print(json.dumps(result.to_json()) if args.json else _report(result))
    return 0
