"""The host side of a paged MLA cache: which device pages each sequence's positions live in.

The device pool is `[n_mla, num_pages, page_size, latent]`: position p of a sequence lives at
offset p % page_size of page `table[p // page_size]`. Pages are handed out as sequences grow and
come back when they finish, so a sequence holds memory for the tokens it has, not for the
longest context the server accepts.

- Page 0 is the null page: never handed out, it is where every unused table entry points and
  where padding tokens of a fixed-shape step write. Nothing reads it as a real position, so its
  contents never matter (tests fill it with garbage).
- Pages are reference counted: a prefix-cache hit maps the cached pages into a new sequence's
  table (`share`) instead of copying them. A shared page is never written: before a sequence
  writes into a page someone else also holds, `writable` gives it a page of its own and says
  which copy the device must make first (copy-on-write).
- Every call either does all it says or nothing: a reservation that does not fit raises
  `OutOfPages` and leaves the allocator as it was, so the caller can preempt and retry.

Pure host bookkeeping (numpy and lists): the scheduler plans with it without a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from k3text.config import Config
from k3text.models.state import cache_length

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """A reservation needs more free pages than the pool has; nothing was taken."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"needs {needed} more pages, {free} free")
        self.needed, self.free = needed, free


@dataclasses.dataclass(frozen=True)
class PageCopy:
    """Copy page `source` into page `target` on the device (copy-on-write)."""

    source: int
    target: int


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions."""
    return -(-tokens // page_size)


def pool_size(cfg: Config) -> tuple[int, int]:
    """(pages, positions per page) of a server's paged pool: `pagedattn_num_pages` (0: enough
    for every slot at the longest cache, and the null page) of `pagedattn_tokens_per_page`."""
    page = cfg.pagedattn_tokens_per_page
    pages = cfg.pagedattn_num_pages or cfg.global_batch_size * pages_for(cache_length(cfg),
                                                                        page) + 1
    return pages, page


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"a page pool needs at least 2 pages (one is the null page) of at "
                             f"least 1 token, got {num_pages} pages of {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._refs = np.zeros(num_pages, np.int32)
        self._refs[NULL_PAGE] = 1  # held for ever
        # Lowest ids first, so a run is reproducible (and a fresh pool's tables are 1, 2, ...).
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._held = np.zeros(num_pages, np.int32)  # references taken by `hold`

    # ---- queries --------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def usable_pages(self) -> int:
        """Every page but the null page."""
        return self.num_pages - 1

    def pages(self, seq: Hashable) -> list[int]:
        """The sequence's table: its pages in position order."""
        return list(self._tables.get(seq, ()))

    def capacity(self, seq: Hashable) -> int:
        """Positions the sequence's pages hold."""
        return len(self._tables.get(seq, ())) * self.page_size

    def needed(self, seq: Hashable, tokens: int) -> int:
        """Free pages `reserve(seq, tokens)` would take."""
        return max(0, pages_for(tokens, self.page_size) - len(self._tables.get(seq, ())))

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    def table(self, seqs: Sequence[Hashable | None], width: int) -> np.ndarray:
        """Page tables [len(seqs), width] int32, one row per sequence (None: an empty row), the
        unused entries the null page."""
        out = np.full((len(seqs), width), NULL_PAGE, np.int32)
        for row, seq in enumerate(seqs):
            pages = self._tables.get(seq, ()) if seq is not None else ()
            if len(pages) > width:
                raise ValueError(f"sequence {seq!r} holds {len(pages)} pages, more than a "
                                 f"table row of {width}")
            out[row, : len(pages)] = pages
        return out

    # ---- changes --------------------------------------------------------------------------

    def reserve(self, seq: Hashable, tokens: int) -> list[int]:
        """Grow the sequence's table (a new sequence starts empty) until it holds `tokens`
        positions; returns the pages taken. Raises `OutOfPages`, taking nothing, when the pool
        has too few."""
        table = self._tables.setdefault(seq, [])
        need = pages_for(tokens, self.page_size) - len(table)
        if need <= 0:
            return []
        if need > len(self._free):
            if not table:
                del self._tables[seq]
            raise OutOfPages(need, len(self._free))
        taken = [self._free.pop() for _ in range(need)]
        self._refs[taken] = 1
        table.extend(taken)
        return taken

    def share(self, seq: Hashable, pages: Iterable[int]) -> None:
        """Start a new sequence on pages someone else holds (a cached prefix): each gains a
        reference; the sequence must not write them (`writable`)."""
        pages = list(pages)
        if self._tables.get(seq):
            raise ValueError(f"sequence {seq!r} already holds pages")
        if any(p == NULL_PAGE or not 0 < p < self.num_pages or self._refs[p] < 1
               for p in pages):
            raise ValueError(f"only pages in use can be shared, got {pages}")
        np.add.at(self._refs, pages, 1)
        self._tables[seq] = pages

    def hold(self, pages: Iterable[int]) -> None:
        """One more reference on pages in use, held by something other than a sequence (the
        prefix cache keeping a finished prefix); `drop` returns it."""
        pages = list(pages)
        if any(p == NULL_PAGE or self._refs[p] < 1 for p in pages):
            raise ValueError(f"only pages in use can be held, got {pages}")
        np.add.at(self._refs, pages, 1)
        np.add.at(self._held, pages, 1)

    def drop(self, pages: Iterable[int]) -> None:
        """Return references taken by `hold`; a page nobody holds any more is free."""
        for page in pages:
            if self._held[page] < 1:
                raise ValueError(f"page {page} is not held")
            self._held[page] -= 1
            self._unref(page)

    def writable(self, seq: Hashable, position: int) -> PageCopy | None:
        """Make the page holding the sequence's `position` its own before it writes there: when
        another holder shares it, the sequence gets a fresh page in its table and the copy to
        make first is returned (None when the page is already its own). Raises `OutOfPages`
        when there is no page to copy into."""
        table = self._tables.get(seq, [])
        index = position // self.page_size
        if index >= len(table):
            raise ValueError(f"position {position} of sequence {seq!r} is past its "
                             f"{len(table)} pages; reserve first")
        page = table[index]
        if self._refs[page] == 1:
            return None
        if not self._free:
            raise OutOfPages(1, 0)
        fresh = self._free.pop()
        self._refs[fresh] = 1
        self._refs[page] -= 1
        table[index] = fresh
        return PageCopy(page, fresh)

    def release(self, seq: Hashable) -> list[int]:
        """The sequence is done (finished, cancelled or preempted): its references are returned
        and the pages nobody else holds are free again; returns those."""
        freed = []
        for page in self._tables.pop(seq, []):
            if self._unref(page):
                freed.append(page)
        return freed

    def _unref(self, page: int) -> bool:
        if page == NULL_PAGE or self._refs[page] < 1:
            raise ValueError(f"page {page} is not in use")
        self._refs[page] -= 1
        if self._refs[page]:
            return False
        self._free.append(page)
        return True

    def check(self) -> None:
        """Every page either free or referenced exactly as often as tables and holds say (a
        leak or a double free is an AssertionError); for tests and the soak."""
        counted = self._held.astype(np.int64)
        counted[NULL_PAGE] += 1
        for table in self._tables.values():
            np.add.at(counted, table, 1)
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert NULL_PAGE not in free, "the null page is on the free list"
        for page in range(self.num_pages):
            assert (page in free) == (counted[page] == 0), \
                f"page {page}: {counted[page]} holders, {'' if page in free else 'not '}free"
            assert self._refs[page] == counted[page], \
                f"page {page}: {self._refs[page]} references, {counted[page]} holders"
