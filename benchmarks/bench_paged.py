"""Paged gather/scatter throughput per cache layout, against a plain copy of the same bytes.

Each round runs ``memcpy`` (``wire2.copy_(wire)``), ``gather`` and ``scatter`` once, so
the baseline sees the same machine load as the code it is compared with. The
headline is the ratio ncclkv / memcpy (best and median over the rounds). On the
CPU both kernels run in the same rounds: ``native`` (the default) and ``torch``
(the torch-op path CUDA caches take), and ``vs torch`` is their speed ratio.

    python -m benchmarks.bench_paged [--quick] [--out DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ncclkv.layout import Span
from ncclkv.paged import (
    CacheLayout, PagedCacheSpec, SlotMap, _kernel, amx_views, cache_views, gather, part_views, scatter,
)

from ._common import (
    DEFAULT_OUT, MIB, BenchContext, BenchResult, Column, default_out, machine_info, pyplot, save, standalone_command,
    timed, write_figure,
)

__all__ = ["CPU_LAYOUTS", "NAME", "TITLE", "headline", "main", "plot", "run"]

NAME = "paged"
TITLE = "Paged gather/scatter per cache layout against memcpy of the same bytes"


def _case(
    layout: CacheLayout, slice_bytes: int, partial: bool, args: argparse.Namespace, device: torch.device
) -> list[dict[str, object]]:
    """Measure one layout and slice; partial = half the heads from mid-block on."""
    dtype = getattr(torch, args.dtype)
    mla = layout is CacheLayout.MLA
    heads, dim, bs = (1, args.latent, args.block_size) if mla else (args.num_kv_heads, args.head_size, args.block_size)
    take = Span(0, 1) if mla else (Span(heads // 4, heads // 4 + heads // 2) if partial else Span(0, heads))
    parts = 1 if mla else 2
    num_tokens = max(1, slice_bytes // (parts * len(take) * dim * dtype.itemsize))
    start = bs // 2 if partial else 0
    tokens = Span(start, start + num_tokens)
    num_used = -(-tokens.stop // bs)
    spec = PagedCacheSpec(layout, 2 * num_used + 1, bs, heads, dim, dtype)
    cache = torch.empty(spec.shape, dtype=dtype, device=device).fill_(1.0)
    gen = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(spec.num_blocks, generator=gen)[:num_used].tolist()  # scattered, like a busy cache
    slot_map = SlotMap(block_ids, bs)
    wire = torch.empty(spec.wire_shape(len(tokens), len(take)), dtype=dtype, device=device)
    wire2 = torch.empty_like(wire)
    kernels = ("native", "torch") if device.type == "cpu" else ("torch",)
    ops: dict[str, Callable[[], object]] = {"memcpy": lambda: wire2.copy_(wire)}
    # The torch ops with the cache-side views made once, as the engine keeps them per registered layer.
    views = None if layout is CacheLayout.CPU_AMX else cache_views(cache, spec, take)
    for kernel in kernels:
        v = views if kernel == "torch" else None
        ops[f"gather/{kernel}"] = lambda k=kernel, v=v: gather(cache, spec, slot_map, tokens, take, wire, kernel=k,
                                                               views=v)
        ops[f"scatter/{kernel}"] = lambda k=kernel, v=v: scatter(wire, cache, spec, slot_map, tokens, take, kernel=k,
                                                                 views=v)
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(args.warmup):
        for fn in ops.values():
            fn()
    for _ in range(args.repeats):
        for name, fn in ops.items():
            times[name].append(timed(fn, device))
    for kernel in kernels:
        _check(cache, spec, block_ids, tokens, take, wire, kernel)
    nbytes = wire.numel() * wire.element_size()
    rows = []
    for name in ops:
        if name == "memcpy":
            continue
        op, kernel = name.split("/")
        best, median = min(times[name]), statistics.median(times[name])
        base_best, base_median = min(times["memcpy"]), statistics.median(times["memcpy"])
        torch_median = statistics.median(times[f"{op}/torch"])
        rows.append(
            {
                "layout": layout.name,
                "slice": "partial" if partial else "full",
                "op": op,
                "kernel": kernel,
                "vs_torch": torch_median / median,
                "size_mib": slice_bytes / MIB,
                "bytes": nbytes,
                "tokens": len(tokens),
                "heads": len(take),
                "gbps_best": nbytes / best / 1e9,
                "gbps_median": nbytes / median / 1e9,
                "memcpy_gbps_best": nbytes / base_best / 1e9,
                "memcpy_gbps_median": nbytes / base_median / 1e9,
                "ratio_best": base_best / best,
                "ratio_median": base_median / median,
            }
        )
    return rows


def _check(
    cache: torch.Tensor,
    spec: PagedCacheSpec,
    block_ids: list[int],
    tokens: Span,
    take: Span,
    wire: torch.Tensor,
    kernel: str,
) -> None:
    """The measured code must be right, both ways: compare with advanced indexing (allocating, outside the timing)."""
    slots = torch.tensor([block_ids[t // spec.block_size] for t in tokens], device=cache.device)
    offsets = torch.tensor([t % spec.block_size for t in tokens], device=cache.device)

    def indexed() -> torch.Tensor:  # the slice as the wire holds it, read by indexing
        if spec.layout is CacheLayout.CPU_AMX:
            keys, values = amx_views(cache, spec)
            rows = [keys[slots, offsets // 16, offsets % 16].flatten(-2),
                    values[slots, offsets // 2, offsets % 2].flatten(-2)]
        else:
            rows = [part[slots, offsets] for part in part_views(cache, spec)]
        return torch.stack([part[:, take.start : take.stop] for part in rows])

    cache.uniform_()  # distinct values, in place (no temporary the size of the cache)
    gather(cache, spec, block_ids, tokens, take, wire, kernel=kernel)
    expected = indexed()
    if not torch.equal(wire.view(expected.shape), expected):
        raise AssertionError(f"{kernel} gather of {spec.layout.name} tokens {tokens!r} heads {take!r} is wrong")
    wire.uniform_()  # other values, scattered into the same cells
    scatter(wire, cache, spec, block_ids, tokens, take, kernel=kernel)
    if not torch.equal(indexed(), wire.view(expected.shape)):
        raise AssertionError(f"{kernel} scatter of {spec.layout.name} tokens {tokens!r} heads {take!r} is wrong")


COLUMNS = (
    Column("layout", "layout", align="<"),
    Column("slice", "slice", align="<"),
    Column("size_mib", "MiB", "{:.2f}"),
    Column("op", "op", align="<"),
    Column("kernel", "kernel", align="<"),
    Column("gbps_best", "GB/s best"),
    Column("gbps_median", "median"),
    Column("memcpy_gbps_median", "memcpy"),
    Column("ratio_best", "ratio best"),
    Column("ratio_median", "median"),
    Column("vs_torch", "vs torch"),
)

ANALYSIS = """\
On the CPU the native kernel (ncclkv/paged/_kernel.c) does one memcpy per
contiguous run: a token's heads in the NHD layouts, one head of one token in
the head-major ones, with K and V of each (block, head) back to back (adjacent
in the vLLM CPU layouts, so the cache is read front to back). PACKED is vLLM
0.32's GPU view (K then V of each token and head side by side; here
contiguous, heads before tokens): its runs are one head of one token, K and V
read from the same cache line. On a GPU the torch-op path moves it. CPU_KT (what
vLLM 0.32's CPU backend writes: keys transposed per block) needs a real
transpose of each [head_size, block_size] key tile: 16x16 AVX2 blocks (8x8
SSE2 on ragged tiles or without AVX2; `native_isa` above says which ran), with
the next head's tile prefetched, because the transpose's loads otherwise wait
behind its shuffles. It and CPU_AMX are the slowest layouts. The torch-op
path (`torch` rows; what CUDA caches run, with the cache-side views made once as
the engine keeps them) moves whole blocks with one index_select /
index_copy_ and the partial blocks with strided copies; it pays per indexed
row and about 25 us of Python per call, which is why it trails most on the
head-major layouts and on small slices. CPU_AMX (what vLLM's CPU backend writes
with the AMX ISA: bfloat16, block size a multiple of 32) packs K and V in
16-row tiles of pairs: the native kernel transposes each key tile as a matrix
of element pairs (4-byte words, 4x4 SSE2 blocks) and reads values 16 dims of
a token pair at a time, every other element; the torch ops go through 6-d
tile views (one index_select / index_copy_ for whole blocks, a copy per tile
for partial ones) and trail far behind. Slices of 16 MiB and up measure the
copies against memory; at 1 MiB the memcpy baseline copies a wire buffer that
stays in cache while the cache blocks partly come from memory.
"""


def _default_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the kernel each device uses by default: native on the CPU, torch ops on CUDA."""
    native = [r for r in rows if r["kernel"] == "native"]
    return native or rows


# vLLM's CPU backend writes these; a GPU engine never registers them (measured on a GPU they say how the torch
# ops handle their shapes, not what a GPU deployment moves).
CPU_LAYOUTS = frozenset({"CPU", "CPU_KT", "CPU_AMX"})


def headline(result: BenchResult) -> list[str]:
    """The findings of a result, from its rows and device (RESULTS.md recomputes them: kept JSON follows edits)."""
    return _headline(result.rows, str(result.meta.get("device", "cpu")))


def _ratio_range(rows: list[dict[str, Any]]) -> str:
    worst, best = min(rows, key=lambda r: r["ratio_median"]), max(rows, key=lambda r: r["ratio_median"])
    return (f"{worst['ratio_median']:.2f} ({worst['layout']}, {worst['size_mib']:g} MiB) to "
            f"{best['ratio_median']:.2f} ({best['layout']}, {best['size_mib']:g} MiB)")


def _headline(rows: list[dict[str, Any]], device: str = "cpu") -> list[str]:
    lines, cpu_layouts = [], []
    default = _default_rows(rows)
    gpu = not device.startswith("cpu")
    for op in ("gather", "scatter"):
        full = [r for r in default if r["op"] == op and r["slice"] == "full"]
        mine = [r for r in full if r["layout"] not in CPU_LAYOUTS] if gpu else full
        if mine:
            lines.append(f"{op} / memcpy (median, full slices{', GPU layouts' if gpu else ''}): {_ratio_range(mine)}")
        others = [r for r in full if r["layout"] in CPU_LAYOUTS] if gpu else []
        if others:
            cpu_layouts.append(f"{op} / memcpy of vLLM's CPU-backend layouts, moved on the GPU though a GPU engine "
                               f"never registers them (median, full slices): {_ratio_range(others)}")
    lines += cpu_layouts
    for layout in ("CPU", "CPU_KT", "CPU_AMX"):
        native = [r for r in rows if r["kernel"] == "native" and r["layout"] == layout and r["slice"] == "full"]
        if native:
            low, high = min(r["vs_torch"] for r in native), max(r["vs_torch"] for r in native)
            lines.append(f"native kernel over torch ops, {layout} (median, full slices): {low:.1f}x to {high:.1f}x")
    return lines


def plot(result: BenchResult, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    full = [r for r in _default_rows(result.rows) if r["slice"] == "full"]
    sizes = sorted({float(r["size_mib"]) for r in full})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, op in zip(axes, ("gather", "scatter")):
        for layout in CacheLayout:
            pts = [(r["size_mib"], r["ratio_median"]) for r in full if r["op"] == op and r["layout"] == layout.name]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=layout.name)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set(title=f"{op} / memcpy (median, {full[0]['kernel']} kernel)", xlabel="slice MiB", xscale="log")
        ax.minorticks_off()
        ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
    axes[0].set_ylabel("ratio")
    axes[0].legend(fontsize=8)
    return write_figure(plt, fig, path)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_paged", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small slices, few rounds (a few seconds)")
    parser.add_argument("--out", type=Path, help=f"folder for paged.json / paged.png (default {DEFAULT_OUT.name}/)")
    parser.add_argument("--sizes-mib", type=float, nargs="+", help="slice sizes (default 1 16 64; quick 0.25 1)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 15; quick 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--latent", type=int, default=576, help="MLA latent size")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    args.sizes_mib = args.sizes_mib or ([0.25, 1.0] if args.quick else [1.0, 16.0, 64.0])
    args.repeats = args.repeats or (3 if args.quick else 15)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    if args.repeats < 1 or args.warmup < 0 or min(args.sizes_mib) <= 0:
        parser.error(f"need repeats >= 1, warmup >= 0, sizes > 0; got {args.repeats}, {args.warmup}, {args.sizes_mib}")
    return args


def _measure(args: argparse.Namespace, progress: Callable[[str], None]) -> list[dict[str, object]]:
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, object]] = []
    try:
        for size in args.sizes_mib:
            progress(f"{NAME}: {size:g} MiB slices")
            for partial in (False, True):
                for layout in CacheLayout:
                    if partial and layout is CacheLayout.MLA:
                        continue  # one latent: no head subrange
                    rows.extend(_case(layout, int(size * MIB), partial, args, device))
    finally:
        torch.set_num_threads(threads)  # may run inside another program (tests, ncclkv bench)
    return rows


def _result(args: argparse.Namespace, rows: list[dict[str, object]], command: str) -> BenchResult:
    meta = {
        "machine": machine_info(),
        "command": command,
        "torch": torch.__version__,
        "device": args.device,
        "native_isa": _kernel.isa(),
        "threads": args.threads or torch.get_num_threads(),
        "dtype": args.dtype,
        "block_size": args.block_size,
        "num_kv_heads": args.num_kv_heads,
        "head_size": args.head_size,
        "latent": args.latent,
        "repeats": args.repeats,
        "quick": args.quick,
        "slices": "full: all heads from token 0; partial: half the heads from mid-block",
    }
    findings = _headline(rows, args.device)  # type: ignore[arg-type]
    return BenchResult(NAME, TITLE, COLUMNS, rows, meta, findings, ANALYSIS)  # type: ignore[arg-type]


def run(ctx: BenchContext) -> BenchResult:
    """The benchmark with its defaults (``--quick`` when the context is quick), for ``ncclkv bench``."""
    opts = ctx.options
    argv = ["--threads", "1"]  # as the other benchmarks: two OpenMP threads on a busy 2-core machine stall small copies
    argv += (["--quick"] if opts.quick else []) + ([] if opts.repeats is None else ["--repeats", str(opts.repeats)])
    args = _parse(argv)
    return _result(args, _measure(args, ctx.progress), opts.command)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    rows = _measure(args, lambda _: None)
    command = standalone_command("bench_paged", argv)
    result = _result(args, rows, command)
    print(result.table())
    out = args.out or default_out(args.quick)
    json_path, png_path = save(result, out, None if args.no_plot else plot)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
