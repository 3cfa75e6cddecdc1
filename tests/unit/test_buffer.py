"""Lookup and store buffers: matching rules, LRU eviction, capacity, refusals, threads, close."""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclkv.buffer import BufferStats, KVLookupBuffer, KVStoreBuffer, LookupEntry
from ncclkv.errors import CapacityError, ClosedError, TransferTimeout
from ncclkv.layout import KVGeometry, Roi, Span, SpanSet


def blob(nbytes: int, tag: int = 0) -> torch.Tensor:
    return torch.full((nbytes,), tag % 256, dtype=torch.uint8)


def box(t0: int, t1: int, layers: tuple[int, int] = (0, 4), heads: tuple[int, int] = (0, 2)) -> Roi:
    return Roi(SpanSet.range(t0, t1), Span(*layers), Span(*heads))


# ---------------------------------------------------------------- store buffer


def test_store_put_get_delete_and_sizes() -> None:
    store = KVStoreBuffer(100)
    store.put("a", blob(30, 1))
    store.put("b", blob(20, 2))
    assert len(store) == 2 and store.used_bytes == 50 and store.capacity_bytes == 100
    got = store.get("a")
    assert got is not None and int(got[0]) == 1
    assert store.get("zz") is None
    store.put("a", None)
    store.put("never-there", None)
    assert store.get("a") is None and len(store) == 1 and store.used_bytes == 20
    store.put("b", blob(60, 3))  # replace: the old bytes are given back
    assert store.used_bytes == 60 and int(store.get("b")[0]) == 3  # type: ignore[index]
    assert store.stats == BufferStats(hits=2, misses=2, inserts=3, evictions=0, evicted_bytes=0, refusals=0)


def test_store_evicts_least_recently_used_and_get_refreshes() -> None:
    evicted: list[tuple[str, int]] = []
    store = KVStoreBuffer(30, on_evict=lambda key, t: evicted.append((key, t.numel())))
    for key in "abc":
        store.put(key, blob(10))
    assert store.get("a") is not None  # a is now the most recent: b goes first
    store.put("d", blob(10))
    assert evicted == [("b", 10)]
    store.put("e", blob(20))
    assert evicted == [("b", 10), ("c", 10), ("a", 10)]
    assert store.used_bytes == 30 and "d" in store and "e" in store
    assert store.stats.evictions == 3 and store.stats.evicted_bytes == 30


def test_store_refusals_change_nothing() -> None:
    store = KVStoreBuffer(50)
    store.put("a", blob(40, 7))
    with pytest.raises(CapacityError, match="entry of 51 bytes is larger than the capacity of 50 bytes"):
        store.put("a", blob(51))
    assert int(store.get("a")[0]) == 7 and store.used_bytes == 40  # type: ignore[index]

    full = KVStoreBuffer(50, evict=False)
    full.put("a", blob(30))
    with pytest.raises(CapacityError, match="eviction off: entry of 30 bytes, 30 of 50 bytes used"):
        full.put("b", blob(30))
    full.put("a", blob(50))  # replacing may reuse the old entry's bytes
    assert full.used_bytes == 50 and len(full) == 1 and full.stats.refusals == 1


def test_store_rejects_bad_arguments() -> None:
    store = KVStoreBuffer(10)
    with pytest.raises(TypeError, match="key must be a str, got int"):
        store.put(3, blob(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a torch.Tensor or None, got list"):
        store.put("a", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_bytes must be >= 1, got 0"):
        KVStoreBuffer(0)


def test_store_evict_callback_error_reaches_caller_after_insert() -> None:
    def boom(key: str, tensor: torch.Tensor) -> None:
        raise RuntimeError(f"offload of {key} failed")

    store = KVStoreBuffer(10, on_evict=boom)
    store.put("a", blob(10))
    with pytest.raises(RuntimeError, match="offload of a failed"):
        store.put("b", blob(10))
    assert "b" in store and "a" not in store


op_st = st.tuples(st.sampled_from(["put", "get", "del"]), st.sampled_from("abcdef"), st.integers(0, 70))


@settings(max_examples=80, deadline=None)
@given(evict=st.booleans(), ops=st.lists(op_st, max_size=40))
def test_store_matches_lru_model_and_never_exceeds_capacity(evict: bool, ops: list) -> None:
    capacity = 60
    store = KVStoreBuffer(capacity, evict=evict)
    model: OrderedDict[str, int] = OrderedDict()
    for op, key, size in ops:
        if op == "put":
            fits = size <= capacity and (evict or sum(model.values()) - model.get(key, 0) + size <= capacity)
            if not fits:
                with pytest.raises(CapacityError):
                    store.put(key, blob(size))
            else:
                store.put(key, blob(size))
                model.pop(key, None)
                while sum(model.values()) + size > capacity:
                    model.popitem(last=False)
                model[key] = size
        elif op == "get":
            got = store.get(key)
            assert (got is None) == (key not in model)
            if key in model:
                model.move_to_end(key)
        else:
            store.put(key, None)
            model.pop(key, None)
        assert store.used_bytes == sum(model.values()) <= capacity
        assert len(store) == len(model)
    for key in "abcdef":  # exactly the model's survivors remain
        assert (key in store) == (key in model)


def test_store_close() -> None:
    store = KVStoreBuffer(10)
    store.put("a", blob(5))
    store.close()
    store.close()  # idempotent
    assert store.closed and len(store) == 0 and store.used_bytes == 0
    with pytest.raises(ClosedError):
        store.get("a")
    with pytest.raises(ClosedError):
        store.put("a", blob(1))


# ---------------------------------------------------------------- lookup buffer


def test_covering_roi_and_equal_prefix_match() -> None:
    buf = KVLookupBuffer(10_000, index_block_size=4)
    tokens = list(range(100, 140))
    buf.insert(tokens, box(0, 40), blob(8, 1), blob(8, 2), blob(4, 3))
    # A sub-box with a hole, fewer layers and one head, on a shorter prefix: match.
    asked = Roi(SpanSet([(4, 9), (12, 20)]), Span(1, 3), Span(1, 2))
    entry = buf.select(tokens[:25] + [0, 0, 0], asked)
    assert isinstance(entry, LookupEntry) and entry.token_ids == tuple(tokens) and entry.roi == box(0, 40)
    got_tokens, got_roi, key, value, hidden = buf.drop_select(torch.tensor(tokens), box(0, 40))
    assert int(key[0]) == 1 and int(value[0]) == 2 and int(hidden[0]) == 3  # type: ignore[index]
    assert got_tokens.tolist() == tokens and got_roi == box(0, 40)  # type: ignore[union-attr]
    assert len(buf) == 0 and buf.used_bytes == 0


@pytest.mark.parametrize(
    ("asked_tokens", "asked_roi", "why"),
    [
        (list(range(100, 141)), box(10, 41), "asks a token past the stored roi"),
        (list(range(100, 140)), box(8, 40), "stored roi starts at 10"),
        (list(range(100, 140)), box(10, 40, layers=(0, 5)), "asks a layer the entry lacks"),
        (list(range(100, 140)), box(10, 40, heads=(1, 3)), "asks a head the entry lacks"),
        (list(range(100, 139)) + [0], box(10, 40), "last token differs"),
        ([0] + list(range(101, 140)), box(10, 40), "token 0 differs, before the roi but in the prefix"),
        (list(range(100, 110)) + [1] + list(range(111, 140)), box(20, 30), "token 10 differs (bucket path)"),
        ([100, 101, 0], box(1, 3), "short query, different token (scan path)"),
    ],
)
def test_non_covering_or_different_tokens_do_not_match(asked_tokens: list[int], asked_roi: Roi, why: str) -> None:
    buf = KVLookupBuffer(10_000, index_block_size=4)
    tokens = list(range(100, 141))
    buf.insert(tokens, Roi(SpanSet.range(10, 40), Span(0, 4), Span(0, 2)), blob(8), blob(8))
    assert buf.drop_select(asked_tokens, asked_roi) == [None] * 5, why
    assert buf.drop_select_entry(asked_tokens, asked_roi) is None, why
    assert len(buf) == 1 and buf.stats.misses == 2
    assert buf.select(tokens[:40], box(10, 40)) is not None  # the control: this does match


def test_tokens_after_the_asked_roi_may_differ() -> None:
    buf = KVLookupBuffer(10_000, index_block_size=4)
    buf.insert([1] * 16 + [2] * 16, box(0, 32), blob(4), blob(4))
    assert buf.select([1] * 16 + [9] * 16, box(0, 16)) is not None
    assert buf.select([1] * 16 + [9] * 16, box(0, 17)) is None


def test_several_matches_return_least_recently_used_and_select_refreshes() -> None:
    buf = KVLookupBuffer(10_000, index_block_size=4)
    tokens = list(range(12))
    for tag in (1, 2, 3):
        buf.insert(tokens, box(0, 12), blob(4, tag), blob(4))
    assert int(buf.select(tokens, box(0, 8)).key[0]) == 1  # type: ignore[union-attr]
    assert int(buf.select(tokens, box(0, 3)).key[0]) == 2  # type: ignore[union-attr]
    # Recency is now 3, 1, 2: asked through the index (8 tokens) and by a scan (3 tokens).
    order = [int(buf.drop_select(tokens, box(0, n))[2][0]) for n in (8, 3, 8)]  # type: ignore[index]
    assert order == [3, 1, 2]
    assert buf.drop_select(tokens, box(0, 3)) == [None] * 5


def test_drop_select_any_returns_lru_for_offloading() -> None:
    buf = KVLookupBuffer(10_000)
    for tag in (1, 2, 3):
        buf.insert([tag] * 5, box(0, 5), blob(4, tag), blob(4))
    buf.select([1] * 5, box(0, 5))
    tags = [int(buf.drop_select(None, None)[2][0]) for _ in range(3)]  # type: ignore[index]
    assert tags == [2, 3, 1]
    assert buf.drop_select(None, None) == [None] * 5 and buf.used_bytes == 0
    with pytest.raises(ValueError, match="both be None"):
        buf.drop_select([1], None)


def test_lookup_evicts_lru_and_reports_entries() -> None:
    evicted: list[LookupEntry] = []
    buf = KVLookupBuffer(48, on_evict=evicted.append, index_block_size=2)
    for tag in (1, 2, 3):
        buf.insert([tag] * 4, box(0, 4), blob(8, tag), blob(8))
    assert buf.select([1] * 4, box(0, 4)) is not None
    buf.insert([4] * 4, box(0, 4), blob(8, 4), blob(8))
    assert [e.token_ids[0] for e in evicted] == [2]
    buf.insert([5] * 4, box(0, 4), blob(30, 5), blob(2))  # needs 32 bytes: two more go
    assert [e.token_ids[0] for e in evicted] == [2, 3, 1]
    assert buf.used_bytes == 48 and len(buf) == 2 and buf.stats.evictions == 3
    assert buf.select([2] * 4, box(0, 4)) is None  # evicted entries are gone from the index too


def test_lookup_refusals() -> None:
    buf = KVLookupBuffer(40, evict=False)
    with pytest.raises(CapacityError, match="entry of 41 bytes is larger than the capacity of 40"):
        buf.insert([1], box(0, 1), blob(20), blob(20), blob(1))
    buf.insert([1], box(0, 1), blob(15), blob(15))
    with pytest.raises(CapacityError, match="eviction off: entry of 20 bytes, 30 of 40 bytes used"):
        buf.insert([2], box(0, 1), blob(10), blob(10))
    assert len(buf) == 1 and buf.used_bytes == 30 and buf.stats.refusals == 2


def test_lookup_argument_checks() -> None:
    buf = KVLookupBuffer(100)
    with pytest.raises(ValueError, match="reaches token 5, beyond the 4 input tokens"):
        buf.insert([1, 2, 3, 4], box(0, 5), blob(1), blob(1))
    with pytest.raises(ValueError, match="is empty"):
        buf.select([1, 2], box(1, 1))
    with pytest.raises(ValueError, match="must be 1-D, got shape"):
        buf.select(torch.zeros(2, 2, dtype=torch.long), box(0, 1))
    with pytest.raises(ValueError, match=r"input_tokens\[1\]=-5"):
        buf.select([1, -5], box(0, 1))
    with pytest.raises(TypeError, match="value must be a torch.Tensor"):
        buf.insert([1], box(0, 1), blob(1), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token mask needs the buffer's geometry"):
        buf.select([1, 2], torch.tensor([True, False]))
    with pytest.raises(ValueError, match=re.escape("wait_select: timeout must be a finite number of seconds > 0 "
                                                   "(at most 1e+09), got 0")):
        buf.wait_select([1], box(0, 1), 0)


def test_boolean_token_mask_roi_with_geometry() -> None:
    geometry = KVGeometry(num_layers=4, num_kv_heads=2, head_size=8, dtype="float16", use_mla=False)
    buf = KVLookupBuffer(100, geometry=geometry)
    tokens = torch.arange(6)
    buf.insert(tokens, torch.tensor([True] * 6), blob(4), blob(4))
    assert buf.select(tokens, box(0, 6)) is not None  # a full mask is every layer and head
    assert buf.select(tokens, torch.tensor([False, True, True, False, True, False])) is not None
    with pytest.raises(ValueError, match=r"needs 6 bools \(one per token\), got 5$"):
        buf.select(tokens, torch.tensor([True] * 5))
    with pytest.raises(TypeError, match=r"^insert: a token-mask roi must hold bools, got int 0 at index 2$"):
        buf.insert(tokens, [True, True, 0, 1, True, True], blob(4), blob(4))
    with pytest.raises(TypeError, match=r"^select: a token-mask roi must hold bools, got str 'x' at index 0$"):
        buf.select(tokens, ["x"] * 6)
    assert len(buf) == 1


def test_drop_select_returns_tokens_and_the_roi_the_entry_holds_in_vllms_order() -> None:
    """vLLM's lookup buffers return [input_tokens, roi, key, value, hidden]: a match may cover more than was
    asked (one entry serves two consumers' heads), and without its roi the caller could not tell which rows
    are its own."""
    geometry = KVGeometry(num_layers=4, num_kv_heads=2, head_size=8, dtype="float16", use_mla=False)
    buf = KVLookupBuffer(1000, geometry=geometry)
    tokens = list(range(50, 58))
    buf.insert(tokens, torch.tensor([False, False] + [True] * 6), blob(8, 1), blob(8, 2))  # the seed's mask
    buf.insert(tokens, Roi(SpanSet.range(0, 8), Span(0, 4), Span(0, 2)), blob(8, 3), blob(8, 4))
    # Asked for tokens 4..8 of head 1 only: the older entry (a mask: every layer and head) is taken whole.
    got_tokens, got_roi, key, value, hidden = buf.drop_select(tokens, Roi(SpanSet.range(4, 8), Span(0, 4), Span(1, 2)))
    assert isinstance(got_tokens, torch.Tensor) and got_tokens.dtype == torch.int64 and got_tokens.tolist() == tokens
    assert isinstance(got_roi, torch.Tensor) and got_roi.tolist() == [False, False] + [True] * 6
    assert int(key[0]) == 1 and int(value[0]) == 2 and hidden is None  # type: ignore[index]
    # The next match is given as a Roi whenever its layers or heads are not all of the geometry's.
    buf.insert(tokens, Roi(SpanSet.range(0, 8), Span(1, 3), Span(0, 2)), blob(8, 5), blob(8, 6))
    full = buf.drop_select(tokens, box(0, 8))[1]  # every layer and head: the seed's mask
    assert isinstance(full, torch.Tensor) and full.tolist() == [True] * 8
    assert buf.drop_select(tokens, Roi(SpanSet.range(0, 4), Span(1, 2), Span(0, 1)))[1] == Roi(
        SpanSet.range(0, 8), Span(1, 3), Span(0, 2))
    assert len(buf) == 0


def test_insert_refuses_token_ids_drop_select_cannot_return_as_int64() -> None:
    """drop_select returns the token ids as an int64 tensor (vLLM's order): an id of 2**63 or more, which the
    hashing takes, cannot be returned, so insert refuses it naming it; before, insert took it and drop_select
    removed the entry, then failed converting the ids ("Overflow when unpacking long long"): the entry lost."""
    buf = KVLookupBuffer(1000)
    with pytest.raises(ValueError, match=re.escape(f"insert: input_tokens[1]={2**63} does not fit in int64")):
        buf.insert([1, 2**63], box(0, 2), blob(4), blob(4))
    assert len(buf) == 0 and buf.used_bytes == 0
    buf.insert([1, 2**63 - 1], box(0, 2), blob(4, 7), blob(4))
    got_tokens, _, key, _, _ = buf.drop_select([1, 2**63 - 1], box(0, 2))
    assert got_tokens.tolist() == [1, 2**63 - 1] and int(key[0]) == 7  # type: ignore[union-attr, index]


def test_capacity_counts_the_storage_a_view_keeps_alive() -> None:
    base = torch.zeros(4096, dtype=torch.uint8)
    store = KVStoreBuffer(1024)
    # Before: a 16-byte view was counted as 16 bytes while the store kept all 4096 alive.
    with pytest.raises(CapacityError, match=r"entry of 4096 bytes is larger than the capacity of 1024 bytes \(its "
                                            r"tensors hold 16 bytes but view storages of 4096: clone them"):
        store.put("view", base[:16])
    store.put("clone", base[:16].clone())
    assert store.used_bytes == 16
    store.put("expanded", torch.zeros(1, dtype=torch.uint8).expand(2000))  # 2000 elements, one byte held
    assert store.used_bytes == 17
    lookup = KVLookupBuffer(4096)
    shared = torch.zeros(1000, dtype=torch.uint8)
    lookup.insert([1, 2], box(0, 2), shared[:500], shared[500:])  # one storage, counted once
    assert lookup.used_bytes == 1000
    with pytest.raises(CapacityError, match=r"full with eviction off|larger than the capacity"):
        KVLookupBuffer(600, evict=False).insert([1, 2], box(0, 2), shared[:100], shared[100:200])


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_lookup_matches_a_brute_force_model(data: st.DataObject) -> None:
    capacity = 64
    buf = KVLookupBuffer(capacity, index_block_size=3)
    model: list[tuple[int, tuple[int, ...], Roi, int]] = []  # oldest first: (tag, tokens, roi, nbytes)
    tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=10).map(tuple)

    def pick_roi(num_tokens: int) -> Roi:
        t0 = data.draw(st.integers(0, num_tokens - 1))
        t1 = data.draw(st.integers(t0 + 1, num_tokens))
        l0 = data.draw(st.integers(0, 2))
        h0 = data.draw(st.integers(0, 1))
        return box(t0, t1, (l0, data.draw(st.integers(l0 + 1, 3))), (h0, data.draw(st.integers(h0 + 1, 2))))

    for tag in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["insert", "insert", "drop", "select", "any"]))
        if op == "insert":
            tokens = data.draw(tokens_st)
            roi, size = pick_roi(len(tokens)), data.draw(st.integers(1, 20))
            buf.insert(tokens, roi, blob(size, tag), blob(size))
            model.append((tag, tokens, roi, 2 * size))
            while sum(m[3] for m in model) > capacity:
                model.pop(0)
        elif op == "any":
            got = buf.drop_select_entry(None, None)
            assert (got is None) == (not model)
            if model:
                assert int(got.key[0]) == model.pop(0)[0] % 256  # type: ignore[union-attr]
        else:
            tokens = data.draw(tokens_st | st.sampled_from([m[1] for m in model] or [(0,)]))
            roi = pick_roi(len(tokens))
            stop = roi.tokens.bounds.stop
            want = next((i for i, m in enumerate(model) if m[2].covers(roi) and m[1][:stop] == tokens[:stop]), None)
            got = buf.drop_select_entry(tokens, roi) if op == "drop" else buf.select(tokens, roi)
            assert (got is None) == (want is None)
            if want is not None:
                record = model.pop(want)
                assert int(got.key[0]) == record[0] % 256 and got.token_ids == record[1]  # type: ignore[union-attr]
                if op == "select":
                    model.append(record)
        assert buf.used_bytes == sum(m[3] for m in model) <= capacity
        assert len(buf) == len(model)


def _run_threads(targets: list, timeout: float = 20.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn):  # noqa: ANN001, ANN202
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread missed its deadline"
    if errors:
        raise errors[0]


def test_concurrent_insert_and_wait_select() -> None:
    buf = KVLookupBuffer(1 << 20, index_block_size=4)
    num_pairs, per_thread = 4, 6
    start = threading.Barrier(2 * num_pairs, timeout=10)
    results: dict[int, list[int]] = {}

    def producer(p: int) -> None:
        start.wait()
        for i in range(per_thread):
            buf.insert([p, i] * 5, box(0, 10), blob(16, p * 10 + i), blob(16))

    def consumer(p: int) -> None:
        start.wait()
        got = []
        for i in reversed(range(per_thread)):  # ask in the other order than inserted
            # The deadline is past the join deadline, so a lost wake-up fails the test.
            entry = buf.wait_select([p, i] * 5, box(2, 9, (0, 2)), timeout=60)
            got.append(int(entry.key[0]))
        results[p] = got

    _run_threads([lambda p=p: producer(p) for p in range(num_pairs)] + [lambda p=p: consumer(p) for p in range(num_pairs)])
    assert results == {p: [p * 10 + i for i in reversed(range(per_thread))] for p in range(num_pairs)}
    assert len(buf) == 0 and buf.used_bytes == 0 and buf.stats.hits == num_pairs * per_thread


def test_concurrent_evicting_inserts_account_for_every_entry() -> None:
    evicted: list[LookupEntry] = []
    lock = threading.Lock()

    def on_evict(entry: LookupEntry) -> None:
        with lock:
            evicted.append(entry)

    buf = KVLookupBuffer(100, on_evict=on_evict)
    taken: list[LookupEntry] = []
    peak = [0]

    def producer(p: int) -> None:
        for i in range(50):
            buf.insert([p, i], box(0, 2), blob(10 + i % 7), blob(10))
            peak[0] = max(peak[0], buf.used_bytes)

    def taker() -> None:
        for _ in range(60):
            entry = buf.drop_select_entry(None, None)
            if entry is not None:
                taken.append(entry)

    _run_threads([lambda: producer(0), lambda: producer(1), taker])
    assert 0 < peak[0] <= 100
    assert len(taken) + len(evicted) + len(buf) == 100
    assert buf.stats.evictions == len(evicted)


def test_wait_select_times_out() -> None:
    buf = KVLookupBuffer(100)
    buf.insert([1, 2], box(0, 2), blob(1), blob(1))
    began = time.monotonic()
    with pytest.raises(TransferTimeout, match="no entry for 2 tokens") as info:
        buf.wait_select([1, 3], box(0, 2), timeout=0.05)
    assert isinstance(info.value, TimeoutError) and 0.04 <= time.monotonic() - began < 5
    assert buf.stats.misses == 1 and len(buf) == 1


def test_close_wakes_waiters_and_refuses_later_calls() -> None:
    buf = KVLookupBuffer(100)
    buf.insert([1], box(0, 1), blob(2), blob(2))
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            buf.wait_select([7], box(0, 1), timeout=30)
        except ClosedError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    began = time.monotonic()
    buf.close()
    thread.join(10)
    assert not thread.is_alive() and len(outcome) == 1 and time.monotonic() - began < 10
    buf.close()  # idempotent
    assert buf.closed and len(buf) == 0 and buf.used_bytes == 0
    for call in (
        lambda: buf.insert([1], box(0, 1), blob(1), blob(1)),
        lambda: buf.drop_select([1], box(0, 1)),
        lambda: buf.drop_select(None, None),
        lambda: buf.select([1], box(0, 1)),
        lambda: buf.wait_select([1], box(0, 1), 1.0),
    ):
        with pytest.raises(ClosedError, match="KVLookupBuffer is closed"):
            call()


def test_store_put_counts_what_the_caller_says_when_told() -> None:
    """The engine's staging counts a wire buffer as its tensor's bytes (the pool owns the class slack)."""
    base = torch.zeros(4096, dtype=torch.uint8)
    store = KVStoreBuffer(1024, evict=False)
    store.put("a", base[:1000], nbytes=1000)
    assert store.used_bytes == 1000
    with pytest.raises(CapacityError, match=r"full with eviction off: entry of 100 bytes, 1000 of 1024 bytes used$"):
        store.put("b", base[1000:1100], nbytes=100)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^nbytes for key 'c' must be an int >= 0, got {bad!r}$"):
            store.put("c", base[:1], nbytes=bad)  # type: ignore[arg-type]
    assert len(store) == 1


def test_peak_used_bytes_is_the_high_water_mark_and_resets_to_what_is_held() -> None:
    """The most held at once, even when it was never held at a moment anyone looked (eviction included)."""
    store = KVStoreBuffer(1000, evict=True)
    assert store.peak_used_bytes == 0
    store.put("a", torch.zeros(400, dtype=torch.uint8))
    store.put("b", torch.zeros(500, dtype=torch.uint8))
    store.put("a", None)
    assert store.used_bytes == 500 and store.peak_used_bytes == 900
    store.put("c", torch.zeros(700, dtype=torch.uint8))  # evicts b first: never more than the capacity
    assert store.used_bytes == 700 and store.peak_used_bytes == 900
    assert store.reset_peak_used() == 900 and store.peak_used_bytes == 700  # a new mark from what is held now
    store.put("c", None)
    assert store.peak_used_bytes == 700 and store.reset_peak_used() == 700 and store.peak_used_bytes == 0
    lookup = KVLookupBuffer(1 << 20)
    assert lookup.peak_used_bytes == 0 and lookup.reset_peak_used() == 0
