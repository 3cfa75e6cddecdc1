"""WireBuffers: size classes, best fit, reuse only after give, the caps, inference mode, and racing threads."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ncclkv.engine._buffers import KEEP_PEAKS, PEAK_WINDOW_S, WireBuffers, capacity_class

from fake_time import FakeTime

CAP = 64 << 20


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 5 << 10, 1 << 20, (1 << 20) + 1, 9_999_999, 64 << 20])
def test_capacity_class_holds_the_bytes_with_at_most_a_quarter_spare(nbytes: int) -> None:
    capacity = capacity_class(nbytes)
    assert capacity >= nbytes
    assert capacity <= max(4096, nbytes * 5 // 4 + 1)
    assert capacity_class(capacity) == capacity  # a class maps to itself


def test_capacity_classes_grow_with_the_size() -> None:
    sizes = range(1, 1 << 16, 97)
    classes = [capacity_class(n) for n in sizes]
    assert classes == sorted(classes)


def test_a_given_buffer_is_reused_and_a_taken_one_never_twice() -> None:
    pool = WireBuffers("cpu", CAP)
    first = pool.take((2, 100, 8, 128), torch.bfloat16)
    second = pool.take((2, 100, 8, 128), torch.bfloat16)
    assert first.data_ptr() != second.data_ptr()  # both out: distinct memory
    assert first.shape == (2, 100, 8, 128) and first.dtype == torch.bfloat16 and first.is_contiguous()
    ptr = first.data_ptr()
    pool.give(first)
    assert pool.cached_bytes == capacity_class(first.nbytes)
    assert capacity_class(2 * 104 * 8 * 128 * 2) == capacity_class(first.nbytes)
    again = pool.take((2, 104, 8, 128), torch.bfloat16)  # a nearby size shares the class
    assert again.data_ptr() == ptr and again.shape == (2, 104, 8, 128)
    assert pool.cached_bytes == 0
    third = pool.take((2, 100, 8, 128), torch.bfloat16)
    assert third.data_ptr() not in (ptr, second.data_ptr())


def test_a_take_of_the_shape_given_back_returns_that_very_tensor() -> None:
    pool = WireBuffers("cpu", CAP)
    buf = pool.take((2, 64, 8, 128), torch.bfloat16)
    pool.give(buf)
    same = pool.take((2, 64, 8, 128), torch.bfloat16)
    assert same is buf  # no new view made (two torch calls saved per tensor)
    pool.give(same)
    other = pool.take((2, 60, 8, 128), torch.bfloat16)  # the same memory as another shape: a new view
    assert other is not buf and other.data_ptr() == buf.data_ptr() and other.shape == (2, 60, 8, 128)
    pool.give(other)
    as_float = pool.take((2, 60, 8, 64), torch.float32)
    assert as_float.dtype == torch.float32 and as_float.data_ptr() == buf.data_ptr()


@pytest.mark.parametrize("given", ["offset", "strided", "inference"])
def test_a_buffer_given_back_not_as_taken_comes_back_as_a_fresh_view_of_its_memory(given: str) -> None:
    pool = WireBuffers("cpu", CAP)
    buf = pool.take((4, 1024), torch.float32)
    if given == "offset":
        back = buf[1:]
    elif given == "strided":
        back = buf.t()
    else:
        with torch.inference_mode():
            back = torch.empty(0, dtype=torch.float32).set_(buf.untyped_storage(), 0, (4, 1024))
        assert back.is_inference()
    pool.give(back)
    again = pool.take((4, 1024), torch.float32)
    assert again is not back and again is not buf
    assert again.data_ptr() == buf.data_ptr() and again.is_contiguous() and not again.is_inference()
    again.add_(1.0)  # writable outside inference mode


def test_giving_twice_keeps_one_copy() -> None:
    pool = WireBuffers("cpu", CAP)
    buf = pool.take((1000,), torch.float32)
    pool.give(buf)
    pool.give(buf)
    assert pool.cached_bytes == capacity_class(4000)
    assert pool.take((1000,), torch.float32).data_ptr() == buf.data_ptr()
    assert pool.take((1000,), torch.float32).data_ptr() != buf.data_ptr()


def test_foreign_tensors_are_not_kept() -> None:
    pool = WireBuffers("cpu", CAP)
    out = pool.take((4096,), torch.uint8)  # something is out, so the recent peak allows keeping one
    pool.give(torch.empty(1000, dtype=torch.float32))  # 4000 B: not a class size
    pool.give(torch.empty(4096, dtype=torch.uint8))  # a class size, but not lent by this pool
    assert pool.cached_bytes == 0
    pool.give(out)
    assert pool.cached_bytes == 4096


def test_a_buffer_dropped_without_give_is_not_counted_twice_when_its_memory_comes_back() -> None:
    pool = WireBuffers("cpu", CAP)
    for _ in range(50):  # each dropped at once: glibc hands the same memory to the next take, as a rule
        pool.take((64 << 10,), torch.uint8)
    assert pool.recent_peak_bytes < 50 * (64 << 10)
    kept = pool.take((64 << 10,), torch.uint8)
    pool.give(kept)
    assert pool.cached_bytes == 64 << 10


def test_a_take_reuses_the_smallest_free_buffer_up_to_twice_its_class() -> None:
    pool = WireBuffers("cpu", CAP)
    big, bigger, huge = (pool.take((n,), torch.uint8) for n in (28 << 10, 40 << 10, 72 << 10))
    for buf in (huge, bigger, big):
        pool.give(buf)
    small = pool.take((20 << 10,), torch.uint8)  # 28 KiB and 40 KiB fit within twice 20 KiB: the smaller
    assert small.data_ptr() == big.data_ptr() and small.shape == (20 << 10,)
    middle = pool.take((20 << 10,), torch.uint8)
    assert middle.data_ptr() == bigger.data_ptr()
    beyond = pool.take((20 << 10,), torch.uint8)  # 72 KiB is more than twice: a new buffer
    assert beyond.data_ptr() not in (big.data_ptr(), bigger.data_ptr(), huge.data_ptr())
    assert pool.cached_bytes == capacity_class(72 << 10)


def test_an_exact_take_reuses_only_a_buffer_of_its_own_class() -> None:
    """Staged KV is held until its request comes: a buffer twice its class would pin twice what staging counts."""
    pool = WireBuffers("cpu", CAP)
    bigger = pool.take((40 << 10,), torch.uint8)
    pool.give(bigger)
    staged = pool.take((20 << 10,), torch.uint8, exact=True)
    assert staged.data_ptr() != bigger.data_ptr() and pool.cached_bytes == capacity_class(40 << 10)
    same_class = pool.take((40 << 10,), torch.uint8)
    pool.give(same_class)
    assert pool.take((40 << 10,), torch.uint8, exact=True).data_ptr() == same_class.data_ptr()


def test_a_forgotten_buffer_stops_counting_as_out_and_is_never_reused() -> None:
    """A failed send or receive may leave its buffer with the backend: it must not come back, nor stay counted
    as out (that held the cache's bound, twice the recent peak, up for good)."""
    pool = WireBuffers("cpu", CAP)
    failed = pool.take((64 << 10,), torch.uint8)
    kept = pool.take((64 << 10,), torch.uint8)
    pool.forget(failed)
    pool.forget(failed)  # twice: counted off once
    assert pool._lent_bytes == capacity_class(64 << 10)  # kept alone is out
    pool.give(failed)  # given after all: not one of ours any more, so not kept
    pool.give(kept)
    assert pool._lent_bytes == 0 and pool.cached_bytes == capacity_class(64 << 10)
    assert pool.take((64 << 10,), torch.uint8).data_ptr() == kept.data_ptr()


def test_the_free_buffers_kept_follow_the_recent_peak_down() -> None:
    clock = FakeTime()
    pool = WireBuffers("cpu", CAP, clock=clock)
    bufs = [pool.take((64 << 10,), torch.uint8) for _ in range(8)]
    for buf in bufs:
        pool.give(buf)
    assert pool.cached_bytes == 8 * (64 << 10) and pool.recent_peak_bytes == 8 * (64 << 10)
    clock.t += PEAK_WINDOW_S  # the next window: the last one's peak still counts
    pool.give(pool.take((64 << 10,), torch.uint8))
    assert pool.cached_bytes == 8 * (64 << 10)
    clock.t += PEAK_WINDOW_S  # two windows with one buffer out at a time: the old peak is forgotten
    one = pool.take((64 << 10,), torch.uint8)
    assert pool.recent_peak_bytes == 64 << 10
    pool.give(one)
    assert pool.cached_bytes == KEEP_PEAKS * (64 << 10)
    kept = [pool.take((64 << 10,), torch.uint8) for _ in range(KEEP_PEAKS)]  # held: still out below
    assert one.data_ptr() in {buf.data_ptr() for buf in kept}  # the most recently given stayed
    clock.t += 3 * PEAK_WINDOW_S  # idle longer than a window: nothing of before counts
    assert pool.recent_peak_bytes == KEEP_PEAKS * (64 << 10)  # ...but what is out now does


def test_varied_lengths_do_not_pile_up_buffers_class_by_class() -> None:
    """Waves of 16 slices of random lengths: what stays cached is bounded by the most out at once.

    Keyed by exact class alone, each of the ~25 classes between 4 and 256 KiB would keep the most it
    ever needed in one wave, several times what any wave holds."""
    pool = WireBuffers("cpu", CAP)
    rng = random.Random(7)
    most_out = 0
    for _ in range(300):
        wave = [pool.take((rng.randint(1, 256) << 10,), torch.uint8) for _ in range(16)]
        most_out = max(most_out, sum(b.untyped_storage().nbytes() for b in wave))
        for buf in wave:
            pool.give(buf)
        assert pool.cached_bytes <= KEEP_PEAKS * pool.recent_peak_bytes <= KEEP_PEAKS * most_out
    assert pool.recent_peak_bytes <= most_out


def test_the_cap_drops_the_least_recently_given() -> None:
    pool = WireBuffers("cpu", max_cached_bytes=3 * 8192)
    bufs = [pool.take((8192,), torch.uint8) for _ in range(4)]
    for buf in bufs:
        pool.give(buf)
    assert pool.cached_bytes == 3 * 8192
    kept = {pool.take((8192,), torch.uint8).data_ptr() for _ in range(3)}
    assert kept == {b.data_ptr() for b in bufs[1:]}  # the first given went first


def test_a_buffer_taken_under_inference_mode_is_writable_outside_it() -> None:
    pool = WireBuffers("cpu", CAP)
    with torch.inference_mode():
        buf = pool.take((4, 4), torch.float32)
        buf.fill_(1.0)
    assert not buf.is_inference()
    buf.add_(1.0)  # an inference tensor would refuse this
    assert torch.equal(buf, torch.full((4, 4), 2.0))


def test_off_the_cpu_it_only_allocates() -> None:
    pool = WireBuffers("meta", CAP)  # stands in for CUDA: any non-CPU device keeps nothing
    buf = pool.take((3, 5), torch.float16)
    assert buf.device.type == "meta" and buf.shape == (3, 5)
    pool.give(buf)
    assert pool.cached_bytes == 0


def test_bad_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_cached_bytes"):
        WireBuffers("cpu", max_cached_bytes=-1)


def test_racing_threads_never_share_a_buffer() -> None:
    pool = WireBuffers("cpu", max_cached_bytes=16 * 8192)
    outstanding: set[int] = set()
    guard = threading.Lock()
    clashes: list[int] = []
    start = threading.Barrier(4, timeout=30)

    def work(seed: int) -> None:
        start.wait()
        for i in range(300):
            buf = pool.take((4096 + (seed * 31 + i) % 4000,), torch.uint8)
            with guard:
                if buf.data_ptr() in outstanding:
                    clashes.append(buf.data_ptr())
                outstanding.add(buf.data_ptr())
            buf.fill_(seed)
            if not int(buf.min()) == int(buf.max()) == seed:  # somebody else wrote it meanwhile
                clashes.append(-seed)
            with guard:
                outstanding.discard(buf.data_ptr())
            pool.give(buf)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not clashes
    assert 0 < pool.cached_bytes <= 16 * 8192
