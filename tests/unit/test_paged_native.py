"""ncclkv.paged's native CPU kernel: the paths no cache layout takes, argument checks, and dispatch.

The layouts themselves (every pair, element size, partial block and head range)
are covered through gather/scatter in test_paged.py, under both kernels.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import random
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ncclkv.layout import Span
from ncclkv.paged import CacheLayout, PagedCacheSpec, SlotMap, gather, part_views, scatter, set_copy_threads
from ncclkv.paged import _copy, _kernel
from ncclkv.paged._native import copy_part

from _paged_helpers import LAYOUTS, make_cache, random_bits, ref_gather, same_bytes


def strided_nhd(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """A FLASH_NHD cache whose head dim has stride 2 (every other element of a wider tensor)."""
    wide = random_bits((2, 6, 16, 3, 16), torch.bfloat16, rng)
    return wide[..., ::2], wide


def test_cache_with_a_strided_head_dim_takes_the_element_path() -> None:
    """Neither the head dim nor the token dim is unit-stride: the kernel's element-by-element loop."""
    rng = random.Random(1)
    cache, wide = strided_nhd(rng)
    assert cache.stride(-1) == 2
    spec = PagedCacheSpec.from_tensor(cache, CacheLayout.FLASH_NHD)
    ids, tokens, heads = [4, 1, 5], Span(3, 40), Span(1, 3)
    native = torch.empty(spec.wire_shape(len(tokens), len(heads)), dtype=torch.bfloat16)
    gather(cache, spec, ids, tokens, heads, native, kernel="native")
    assert same_bytes(native, ref_gather(cache.contiguous(), "nhd", 16, ids, tokens, heads))

    wide_before = wide.clone()
    scatter(native, cache, spec, ids, tokens, heads, kernel="native")
    assert same_bytes(wide, wide_before)  # written back where it came from, nothing else touched
    zeros = torch.zeros_like(native)
    scatter(zeros, cache, spec, ids, tokens, heads, kernel="native")
    assert not same_bytes(wide, wide_before)
    assert same_bytes(wide[..., 1::2], wide_before[..., 1::2])  # the elements between were left alone
    check = torch.empty_like(native)
    gather(cache, spec, ids, tokens, heads, check, kernel="torch")
    assert same_bytes(check, zeros)


@pytest.fixture
def cpu_kt() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = PagedCacheSpec(CacheLayout.CPU_KT, 4, 16, 2, 8, torch.float32)
    keys, _ = part_views(torch.zeros(spec.shape), spec)
    return keys, torch.zeros(32, 2, 8), torch.tensor([3, 0], dtype=torch.int64)


def test_copy_part_refuses_mismatched_arguments(cpu_kt) -> None:
    keys, wire, ids = cpu_kt
    with pytest.raises(ValueError, match=r"part is torch.float32, wire is torch.float64"):
        copy_part(True, keys, wire.double(), ids, 16, 0)
    with pytest.raises(ValueError, match=r"contiguous \[tokens, 2, 8\], got \[32, 8, 2\]"):
        copy_part(True, keys, wire.transpose(1, 2), ids, 16, 0)
    with pytest.raises(ValueError, match=r"int64 CPU tensor, got torch.int32"):
        copy_part(True, keys, wire, ids.int(), 16, 0)
    with pytest.raises(ValueError, match=r"1-D int64 CPU tensor, got torch.int64 \[1, 2\] on cpu"):
        copy_part(True, keys, wire, ids[None], 16, 0)
    with pytest.raises(ValueError, match=r"tokens \[1, 33\) run past 2 blocks of 16"):
        copy_part(True, keys, wire, ids, 16, 1)


@pytest.mark.parametrize("bad_id", [4, -1, 1 << 40])
def test_copy_part_refuses_block_ids_outside_the_part(cpu_kt, bad_id: int) -> None:
    """A used id outside [0, num_blocks) is named before C sees it (it wrote out of bounds, 2**40 crashed)."""
    keys, wire, _ = cpu_kt
    ids = torch.tensor([0, bad_id, 1], dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"^block_ids\[1\] = {bad_id} is outside the part's 4 blocks$"):
        copy_part(False, keys, wire, ids, 16, 8)  # tokens [8, 40): blocks 0, 1 and 2 of the table
    before = keys.clone()
    copy_part(False, keys, wire[:8] + 1, ids, 16, 8)  # tokens [8, 16) use block 0 only: the bad id is never read
    assert not torch.equal(keys, before)
    copy_part(False, keys, wire[:0], ids, 16, 40)  # no tokens, no block used


def test_copy_part_refuses_a_bad_geometry(cpu_kt) -> None:
    keys, wire, ids = cpu_kt
    with pytest.raises(ValueError, match=r"block_size must be the part's 16 \(at least 1\), got 64"):
        copy_part(True, keys, torch.empty(40, 2, 8), ids, 64, 0)
    with pytest.raises(ValueError, match=r"token_start must be >= 0, got -16"):
        copy_part(True, keys, wire[:16], ids, 16, -16)
    with pytest.raises(ValueError, match=r"part must be \[num_blocks, block_size, heads, head_size\], got \[4, 16, 2\]"):
        copy_part(True, keys[..., 0], wire, ids, 16, 0)


def test_the_c_entry_point_checks_its_arguments() -> None:
    fixed = [1, 2, 8, 1, 0, 16, 0, 0]  # gather, elem, head_size, num_heads, ids, block_size, start, tokens
    part = [0, 0, 0, 0, 2, 0]  # cache, 4 strides, wire
    for count in (2, len(fixed), len(fixed) + 5, len(fixed) + 3 * len(part)):
        with pytest.raises(TypeError, match=f"copy_parts takes 8 arguments and 6 per part .*, got {count}"):
            _kernel.copy_parts(*(fixed + part * 3)[:count])
    with pytest.raises(TypeError, match="copy_parts: argument 10 must be an int"):
        _kernel.copy_parts(*fixed, 0, 0, "x", 0, 2, 0)
    with pytest.raises(ValueError, match=r"^copy_parts: bad geometry .*block_size=0 .*num_tokens=0$"):
        _kernel.copy_parts(*fixed[:5], 0, 0, 0, *part)


def test_the_amx_entry_point_checks_its_arguments() -> None:
    # gather, elem, head_size, num_heads, ids, block_size, start, tokens, keys, values, s_block, s_head, wires
    amx = [1, 2, 16, 1, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0]
    with pytest.raises(TypeError, match="copy_amx takes 14 arguments, got 13"):
        _kernel.copy_amx(*amx[:-1])
    with pytest.raises(TypeError, match="copy_amx: argument 9 must be an int"):  # named by its own entry
        _kernel.copy_amx(*amx[:9], "x", *amx[10:])
    for at, bad, named in ((5, 24, "block_size=24"), (2, 8, "head_size=8"), (7, -1, "num_tokens=-1")):
        with pytest.raises(ValueError, match=rf"^copy_amx: bad geometry .*{named}.* multiples of 16\)$"):
            _kernel.copy_amx(*amx[:at], bad, *amx[at + 1:])


def test_kernel_choice_and_default() -> None:
    cache = torch.zeros(PagedCacheSpec(CacheLayout.CPU, 2, 16, 1, 16, torch.float32).shape)
    spec = PagedCacheSpec.from_tensor(cache, CacheLayout.CPU)
    assert _copy._use_native(None, cache, spec) == (_copy._default_kernel() == "native")
    assert _copy._use_native("native", cache, spec) and not _copy._use_native("torch", cache, spec)

    with pytest.raises(ValueError, match=r"kernel must be one of native, torch or None, got 'fast'"):
        gather(cache, spec, SlotMap([1], 16), Span(0, 4), Span(0, 1), torch.empty(2, 4, 1, 16), kernel="fast")


def test_native_is_the_default_for_cpu_caches(monkeypatch) -> None:
    """Unless NCCLKV_PAGED_KERNEL says torch: prove which path ran by making the other one fail."""
    spec = PagedCacheSpec(CacheLayout.CPU, 2, 16, 1, 8, torch.float32)
    cache, out = torch.ones(spec.shape), torch.empty(2, 4, 1, 8)

    def boom(*args, **kwargs):
        raise AssertionError("the native kernel ran")

    monkeypatch.delenv("NCCLKV_PAGED_KERNEL", raising=False)
    _copy._default_kernel.cache_clear()
    monkeypatch.setattr(_copy, "move_parts", boom)
    with pytest.raises(AssertionError, match="native kernel ran"):
        gather(cache, spec, [1], Span(0, 4), Span(0, 1), out)
    monkeypatch.setenv("NCCLKV_PAGED_KERNEL", "torch")
    _copy._default_kernel.cache_clear()
    try:
        gather(cache, spec, [1], Span(0, 4), Span(0, 1), out)  # torch ops: move_parts is not called
    finally:
        monkeypatch.delenv("NCCLKV_PAGED_KERNEL")
        _copy._default_kernel.cache_clear()
    assert torch.equal(out, torch.ones_like(out))


def test_kernel_reports_the_transposes_it_runs() -> None:
    """On an x86 CPU with AVX2, whole 16x16 key tiles take the AVX2 transpose (the others SSE2)."""
    import platform

    flags = open("/proc/cpuinfo").read().split() if platform.machine() == "x86_64" else []
    expected = "avx2" if "avx2" in flags else "sse2" if platform.machine() == "x86_64" else "scalar"
    assert _kernel.isa() == expected


# -- one copy on several threads (set_copy_threads) ------------------------------------------------
@pytest.fixture
def copy_threads():
    """Set the process's copy threads for one test; restore them after."""
    before: list[int] = []

    def use(threads: int) -> None:
        previous = set_copy_threads(threads)
        if not before:
            before.append(previous)
    yield use
    if before:
        set_copy_threads(before[0])


def big_case(variant: str, rng: random.Random) -> tuple[torch.Tensor, PagedCacheSpec, list[int], Span, Span]:
    """A cache of ``variant`` and a slice of it of about 1.2 MiB, odd start and end, blocks shuffled."""
    nb, bs, heads, dim = 160, 16, 4, 64
    cache, _ = make_cache(variant, nb, bs, heads, dim, torch.bfloat16, rng)
    spec = PagedCacheSpec.from_tensor(cache, LAYOUTS[variant])
    ids = rng.sample(range(nb), nb)
    return cache, spec, ids, Span(5, nb * bs - 7), Span(0, heads)


@pytest.mark.parametrize("variant", ["nhd", "hnd_view", "cpu", "cpu_kt", "cpu_amx"])
@pytest.mark.parametrize("threads", [2, 3, 16])
def test_a_threaded_copy_moves_what_the_torch_ops_move(copy_threads, variant: str, threads: int) -> None:
    """Each thread takes a range of blocks; together they gather and scatter every byte, and only those."""
    rng = random.Random(threads)
    cache, spec, ids, tokens, heads = big_case(variant, rng)
    shape = spec.wire_shape(len(tokens), len(heads))
    assert torch.Size(shape).numel() * 2 >= 2 * 256 * 1024  # big enough for at least two threads
    expected = torch.empty(shape, dtype=torch.bfloat16)
    gather(cache, spec, ids, tokens, heads, expected, kernel="torch")

    copy_threads(threads)
    threaded = torch.empty_like(expected)
    gather(cache, spec, ids, tokens, heads, threaded, kernel="native")
    assert same_bytes(threaded, expected)
    assert _kernel.pool_workers() >= min(threads, len(tokens) * 4 * 64 * 2 * 2 // (256 * 1024)) - 1

    wire = random_bits(shape, torch.bfloat16, rng)
    by_torch, by_threads = cache.clone(), cache.clone()
    scatter(wire, by_torch, spec, ids, tokens, heads, kernel="torch")
    scatter(wire, by_threads, spec, ids, tokens, heads, kernel="native")
    assert same_bytes(by_threads, by_torch)  # the slice written, the rest of the cache untouched
    assert not same_bytes(by_threads, cache)


def test_copies_on_two_threads_at_once_share_the_pool_without_mixing(copy_threads) -> None:
    """One call holds the pool; another that finds it taken copies on its own thread. Both stay exact."""
    copy_threads(4)
    rng = random.Random(7)
    cases = [big_case("cpu", rng) for _ in range(2)]
    expected = []
    for cache, spec, ids, tokens, heads in cases:
        out = torch.empty(spec.wire_shape(len(tokens), len(heads)), dtype=torch.bfloat16)
        gather(cache, spec, ids, tokens, heads, out, kernel="torch")
        expected.append(out)
    def copy(index: int) -> None:
        cache, spec, ids, tokens, heads = cases[index]
        out = torch.empty_like(expected[index])
        for _ in range(30):
            out.zero_()
            gather(cache, spec, ids, tokens, heads, out, kernel="native")
            assert same_bytes(out, expected[index])

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(copy, i) for i in range(2)]:
            future.result(60)  # raises what its copy raised; a copy stuck past 60 s fails here


def _threaded_gather_in_child(conn) -> None:
    cache, spec, ids, tokens, heads = big_case("cpu", random.Random(3))
    out = torch.empty(spec.wire_shape(len(tokens), len(heads)), dtype=torch.bfloat16)
    gather(cache, spec, ids, tokens, heads, out, kernel="native")
    conn.send((hashlib.sha256(out.view(torch.uint8).numpy().tobytes()).hexdigest(), _kernel.pool_workers()))


def test_a_forked_child_starts_its_own_workers(copy_threads) -> None:
    """A fork copies none of the parent's threads: the child must not wait for workers it does not have."""
    copy_threads(4)
    cache, spec, ids, tokens, heads = big_case("cpu", random.Random(3))
    out = torch.empty(spec.wire_shape(len(tokens), len(heads)), dtype=torch.bfloat16)
    gather(cache, spec, ids, tokens, heads, out, kernel="native")  # the parent's pool exists now
    assert _kernel.pool_workers() >= 3
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_threaded_gather_in_child, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), "the forked child's threaded gather did not finish within 60 s"
        digest, workers = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert digest == hashlib.sha256(out.view(torch.uint8).numpy().tobytes()).hexdigest()
    assert workers >= 3  # started afresh in the child
    assert proc.exitcode == 0


@pytest.mark.parametrize("bad", [0, 17, True, 2.0, "2"])
def test_copy_threads_refuses_what_is_not_1_to_16(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"copy threads must be an int in 1..16, got {re.escape(repr(bad))}"):
        set_copy_threads(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="set_threads: threads must be 1..16, got 0"):
        _kernel.set_threads(0)


def test_copy_threads_come_from_the_environment_until_set(monkeypatch, copy_threads) -> None:
    from ncclkv.paged import _native

    copy_threads(1)
    monkeypatch.setattr(_native, "_threads_chosen", False)
    monkeypatch.setenv("NCCLKV_COPY_THREADS", "3")
    cache, spec, ids, tokens, heads = big_case("cpu", random.Random(5))
    gather(cache, spec, ids, tokens, heads, torch.empty(spec.wire_shape(len(tokens), len(heads)), dtype=torch.bfloat16))
    assert set_copy_threads(1) == 3  # the first copy applied the variable


def test_a_first_copy_reading_the_environment_leaves_a_concurrent_set_copy_threads_standing(monkeypatch,
                                                                                             copy_threads) -> None:
    """A first copy reads NCCLKV_COPY_THREADS while another thread chooses the threads itself: the choice stands.

    The copy had seen no choice made, read the variable, and then applied it over the one made meanwhile."""
    import threading

    from ncclkv.paged import _native

    copy_threads(1)
    monkeypatch.setattr(_native, "_threads_chosen", False)
    monkeypatch.setenv("NCCLKV_COPY_THREADS", "2")
    reading, chosen = threading.Event(), threading.Event()
    real_settings = _native.env_settings

    def settings_read_while_another_thread_chooses():
        settings = real_settings()
        reading.set()
        assert chosen.wait(30), "the other thread never chose"
        return settings

    monkeypatch.setattr(_native, "env_settings", settings_read_while_another_thread_chooses)
    cache, spec, ids, tokens, heads = big_case("cpu", random.Random(5))
    out = torch.empty(spec.wire_shape(len(tokens), len(heads)), dtype=torch.bfloat16)
    with ThreadPoolExecutor(1) as pool:
        copy = pool.submit(gather, cache, spec, ids, tokens, heads, out)
        assert reading.wait(30), "the first copy never read the environment"
        set_copy_threads(4)
        chosen.set()
        copy.result(60)
    assert set_copy_threads(1) == 4  # the choice made, not the variable the copy read before it


def _choose_threads_in_child(conn) -> None:
    conn.send(set_copy_threads(2))


def test_a_child_forked_while_the_threads_lock_was_held_can_still_choose_threads(copy_threads) -> None:
    """The lock that keeps a choice and the variable apart is made anew in a forked child (held by a parent
    thread at the fork, it would be held for good there)."""
    from ncclkv.paged import _native

    copy_threads(3)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    with _native._threads_lock:
        proc = ctx.Process(target=_choose_threads_in_child, args=(child,))
        proc.start()
    try:
        assert parent.poll(60), "the forked child's set_copy_threads did not return within 60 s"
        assert parent.recv() == 3  # what the parent had chosen before the fork
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_copy_workers_are_named_and_take_no_signals(copy_threads) -> None:
    """Signals go to the process's own threads (Python's handlers run on the main one), never to a worker."""
    copy_threads(3)
    cache, spec, ids, tokens, heads = big_case("cpu", random.Random(9))
    gather(cache, spec, ids, tokens, heads, torch.empty(spec.wire_shape(len(tokens), len(heads)), dtype=torch.bfloat16))
    def named(task: Path) -> str:
        try:
            return (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):  # another test's thread ended meanwhile
            return ""

    workers = [task for task in Path("/proc/self/task").iterdir() if named(task) == "ncclkv-copy"]
    assert len(workers) == _kernel.pool_workers() >= 2
    for task in workers:
        blocked = int(next(line for line in (task / "status").read_text().splitlines()
                           if line.startswith("SigBlk:")).split()[1], 16)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1):
            assert blocked >> (signum - 1) & 1, f"worker {task.name} takes signal {signum!r}"
        for signum in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT):
            # blocked, a fault in a copy would end the process without faulthandler's traceback
            assert not blocked >> (signum - 1) & 1, f"worker {task.name} blocks fault signal {signum!r}"


_FEW_BLOCKS = """
import torch
from ncclkv.layout import Span
from ncclkv.paged import CacheLayout, PagedCacheSpec, gather, set_copy_threads, _kernel
spec = PagedCacheSpec(CacheLayout.CPU, 8, 128, 8, 128, torch.bfloat16)  # a block of 128 tokens: 512 KiB of wire
cache = torch.zeros(spec.shape, dtype=torch.bfloat16)
set_copy_threads(16)
gather(cache, spec, [5, 2, 7], Span(0, 384), Span(0, 8), torch.empty(spec.wire_shape(384, 8), dtype=torch.bfloat16))
print(_kernel.pool_workers())
"""


def test_a_slice_of_few_blocks_wakes_no_more_threads_than_blocks() -> None:
    """1.5 MiB in 3 blocks with 16 threads allowed: 6 threads by bytes, 3 by blocks (each thread at least one)."""
    done = subprocess.run([sys.executable, "-c", _FEW_BLOCKS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2"]  # the caller and two workers


def _at_odd_offset(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` one element into a wider buffer: a storage offset that is no multiple of 2 elements."""
    flat = torch.empty(tensor.numel() + 1, dtype=tensor.dtype)
    moved = flat[1:].view(tensor.shape)
    moved.copy_(tensor)
    assert moved.data_ptr() % 4 == 2
    return moved


@pytest.mark.parametrize("odd", ["cache", "wire", "both"])
def test_an_amx_cache_or_wire_at_an_odd_element_offset_moves_what_the_torch_ops_move(odd: str) -> None:
    """CPU_AMX keys move in element pairs; at an odd element offset the pairs are 2-byte aligned, and the kernel
    moves them byte-wise rather than as (misaligned) 4-byte words, which C leaves undefined."""
    rng = random.Random(7)
    cache, _ = make_cache("cpu_amx", 12, 16, 2, 32, torch.bfloat16, rng)
    if odd != "wire":
        cache = _at_odd_offset(cache)
    spec = PagedCacheSpec.from_tensor(cache, LAYOUTS["cpu_amx"])
    ids, tokens, heads = rng.sample(range(12), 12), Span(3, 12 * 16 - 5), Span(0, 2)
    shape = spec.wire_shape(len(tokens), len(heads))
    expected = torch.empty(shape, dtype=torch.bfloat16)
    gather(cache, spec, ids, tokens, heads, expected, kernel="torch")
    got = torch.empty(shape, dtype=torch.bfloat16)
    if odd != "cache":
        got = _at_odd_offset(got)
    gather(cache, spec, ids, tokens, heads, got, kernel="native")
    assert same_bytes(got, expected)

    wire = random_bits(shape, torch.bfloat16, rng)
    if odd != "cache":
        wire = _at_odd_offset(wire)
    by_torch, by_native = cache.clone(), _at_odd_offset(cache) if odd != "wire" else cache.clone()
    scatter(wire, by_torch, spec, ids, tokens, heads, kernel="torch")
    scatter(wire, by_native, spec, ids, tokens, heads, kernel="native")
    assert same_bytes(by_native, by_torch)
    assert not same_bytes(by_native, cache)
