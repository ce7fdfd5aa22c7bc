"""The paged MLA cache: the host page allocator (growth, release, sharing, copy-on-write,
all-or-nothing reservations, the null page) and paged decode attention against the contiguous
reference on the same rows, with garbage in every page a row does not own, one device and the
pages split by offset over 8."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3text import sharding
from k3text.inference.pages import NULL_PAGE, OutOfPages, PageAllocator, PageCopy, pages_for
from k3text.ops import mla as mla_ops

from helpers import mesh_context, tiny_config

HIGHEST = jax.lax.Precision.HIGHEST


# ---- the allocator ----------------------------------------------------------------------------


def test_sequences_take_pages_as_they_grow_and_return_them_when_done():
    pool = PageAllocator(num_pages=9, page_size=4)
    assert pool.usable_pages == pool.free_pages == 8
    assert pool.reserve("a", 5) == [1, 2]  # lowest ids first; never the null page
    assert pool.reserve("a", 8) == [] and pool.capacity("a") == 8
    assert pool.reserve("a", 9) == [3]
    assert pool.reserve("b", 1) == [4]
    assert pool.needed("b", 13) == 3 and pool.needed("a", 2) == 0
    np.testing.assert_array_equal(pool.table(["a", None, "b"], 4),
                                  [[1, 2, 3, 0], [0, 0, 0, 0], [4, 0, 0, 0]])
    assert sorted(pool.release("a")) == [1, 2, 3]
    assert pool.free_pages == 7 and pool.pages("a") == []
    pool.check()
    pool.reserve("b", 5)
    with pytest.raises(ValueError, match="holds 2 pages, more than a table row of 1"):
        pool.table(["b"], 1)
    assert pages_for(0, 4) == 0 and pages_for(4, 4) == 1 and pages_for(5, 4) == 2


def test_a_reservation_that_does_not_fit_takes_nothing():
    pool = PageAllocator(num_pages=5, page_size=2)
    pool.reserve("a", 4)
    with pytest.raises(OutOfPages) as raised:
        pool.reserve("a", 9)  # 3 more pages, 2 free
    assert (raised.value.needed, raised.value.free) == (3, 2)
    assert pool.pages("a") == [1, 2] and pool.free_pages == 2
    with pytest.raises(OutOfPages):
        pool.reserve("new", 7)
    assert pool.pages("new") == [] and pool.free_pages == 2
    pool.check()


def test_shared_pages_are_copied_before_a_sequence_writes_them():
    pool = PageAllocator(num_pages=8, page_size=4)
    pool.reserve("cached", 8)  # pages 1, 2
    pool.hold([1, 2])  # the prefix cache keeps them past the sequence
    assert pool.release("cached") == []  # still held: nothing freed
    pool.share("x", [1, 2])
    pool.share("y", [1, 2])
    assert pool.refs(1) == 3
    assert pool.writable("x", 3) == PageCopy(source=1, target=3)
    assert pool.pages("x") == [3, 2] and pool.refs(1) == 2
    assert pool.writable("x", 2) is None  # its own page now
    pool.reserve("x", 9)  # grows past the shared pages with a fresh one
    assert pool.pages("x") == [3, 2, 4]
    pool.check()
    pool.release("x")
    pool.release("y")
    assert pool.refs(1) == pool.refs(2) == 1 and pool.free_pages == 5  # only the hold left
    pool.drop([1, 2])
    assert pool.free_pages == 7
    pool.check()
    with pytest.raises(ValueError, match="not held"):
        pool.drop([1])
    with pytest.raises(ValueError, match="only pages in use"):
        pool.share("z", [5])
    with pytest.raises(ValueError, match="reserve first"):
        pool.writable("z", 0)


def test_check_finds_a_leak_and_a_double_free():
    pool = PageAllocator(num_pages=4, page_size=2)
    pool.reserve("a", 2)
    pool._refs[1] += 1  # a reference nobody holds: the page would never come back
    with pytest.raises(AssertionError, match="page 1: 2 references, 1 holders"):
        pool.check()
    pool._refs[1] -= 1
    pool.release("a")
    pool._free.append(1)
    with pytest.raises(AssertionError, match="twice"):
        pool.check()


def test_a_pool_needs_a_real_page():
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(num_pages=1, page_size=16)


# ---- paged decode attention ---------------------------------------------------------------------

ROWS, HEADS, WIDTH, PAGE, PAGES, TABLE = 4, 4, 24, 8, 20, 6


# Where the rows' windows start: spread over the whole table, or all within its first two pages
# (the attention then reads only the table's live columns).
STARTS = {"spread": [0, 13, 44, 5], "short": [0, 3, 9, 5]}


def _case(window: int, seed: int = 0, starts: str = "spread"):
    """Four rows over one page pool, each row's pages scattered through it, and the same rows
    as a contiguous cache [ROWS, TABLE x PAGE, C]; every page no row owns (the null page
    included) holds garbage. Row 3 is padding (count 0)."""
    rng = np.random.default_rng(seed)
    pool = PageAllocator(PAGES, PAGE)
    starts = np.asarray(STARTS[starts], np.int32)
    counts = np.asarray([window, min(window, 2), window, 0], np.int32)
    order = rng.permutation(PAGES - 1) + 1  # reserve in a shuffled order: tables are scattered
    pool._free = list(order)
    for row in range(ROWS):
        pool.reserve(row, starts[row] + window)
    table = pool.table(range(ROWS), TABLE)
    contiguous = rng.normal(size=(ROWS, TABLE * PAGE, WIDTH)).astype(np.float32)
    pages = (rng.normal(size=(PAGES, PAGE, WIDTH)) * 1e3).astype(np.float32)  # garbage
    for row in range(ROWS):
        for i, page in enumerate(pool.pages(row)):
            pages[page] = contiguous[row, i * PAGE:(i + 1) * PAGE]
    query = rng.normal(size=(ROWS, window, HEADS, WIDTH)).astype(np.float32)
    latent = rng.normal(size=(ROWS, window, WIDTH)).astype(np.float32)
    return pool, table, starts, counts, contiguous, pages, query, latent


def _expected(contiguous, starts, counts, query, latent):
    """The window written into the contiguous cache, then each query w through
    `attention_reference` at position start + w."""
    cache = contiguous.copy()
    for row in range(ROWS):
        for w in range(counts[row]):
            cache[row, starts[row] + w] = latent[row, w]
    out = np.stack([np.asarray(mla_ops.attention_reference(
        jnp.asarray(query[:, w]), jnp.asarray(cache), jnp.asarray(starts + w), 0.3, HIGHEST,
        jnp.float32)) for w in range(query.shape[1])], axis=1)
    return out, cache


@pytest.mark.parametrize("starts", list(STARTS))
@pytest.mark.parametrize("window", [1, 3])
def test_paged_decode_attention_equals_the_contiguous_reference(window, starts):
    pool, table, starts, counts, contiguous, pages, query, latent = _case(window, 0, starts)
    want, cache = _expected(contiguous, starts, counts, query, latent)
    got, new_pages = jax.jit(mla_ops.paged_decode_attention, static_argnums=(6, 7, 8))(
        *map(jnp.asarray, (query, latent, pages, table, starts, counts)), 0.3, HIGHEST,
        jnp.float32)
    real = counts > 0
    np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=1e-5, rtol=1e-5)
    new_pages = np.asarray(new_pages)
    for row in range(ROWS):  # every row's pages now hold its contiguous rows, window included
        mine = np.concatenate([new_pages[p] for p in pool.pages(row)])
        np.testing.assert_array_equal(mine, cache[row, :len(mine)])
    owned = {p for row in range(ROWS) for p in pool.pages(row)} | {NULL_PAGE}
    for page in set(range(PAGES)) - owned:  # nobody's pages: untouched
        np.testing.assert_array_equal(new_pages[page], pages[page])


@pytest.mark.parametrize("starts", list(STARTS))
@pytest.mark.parametrize("window", [1, 3])
def test_pages_split_by_offset_over_8_devices_equal_one_device(window, starts):
    """Each device holds PAGE / 8 offsets of every page, so every sequence's positions spread
    over all of them; the log-sum-exp merge gives the one-device softmax (heads split over the
    same devices: reduce-scattered)."""
    cfg = tiny_config("k3-tiny", "ici_tensor_parallelism=4", "ici_expert_parallelism=2")
    rules = {name: list(axes) for name, axes in cfg.logical_axis_rules.items()}
    cfg = cfg.replace(logical_axis_rules={**rules, "cache_seq": ["tensor", "expert"]})
    ctx = mesh_context(cfg)
    pool, table, starts, counts, contiguous, pages, query, latent = _case(window, 1, starts)
    args = tuple(map(jnp.asarray, (query, latent, pages, table, starts, counts)))
    want, want_pages = mla_ops.paged_decode_attention(*args, 0.3, HIGHEST, jnp.float32)
    reference = mla_ops.paged_attention_reference(args[0], want_pages, args[3], args[4], 0.3,
                                                  HIGHEST, jnp.float32)
    np.testing.assert_allclose(np.asarray(want)[counts > 0], np.asarray(reference)[counts > 0],
                               atol=1e-5)
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        assert mla_ops.implementation() == "sequence_sharded"
        split = jax.device_put(args[2], ctx.sharding((None, "cache_seq", "kv_lora")))
        got, got_pages = jax.jit(mla_ops.paged_decode_attention, static_argnums=(6, 7, 8))(
            *args[:2], split, *args[3:], 0.3, HIGHEST, jnp.float32)
    assert {s.data.shape[1] for s in got_pages.addressable_shards} == {PAGE // 8}
    real = counts > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_pages)[1:], np.asarray(want_pages)[1:])


def test_live_table_widths_cover_every_length_with_a_few_shapes():
    assert mla_ops.live_table_widths(1) == (1,)
    assert mla_ops.live_table_widths(6) == (1, 2, 4, 6)
    assert mla_ops.live_table_widths(8192)[-3:] == (2048, 4096, 8192)
    assert len(mla_ops.live_table_widths(8192)) == 14
