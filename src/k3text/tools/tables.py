"""Plain-text tables and number formatting shared by the operator tools."""

from __future__ import annotations

from collections.abc import Sequence

GiB = 2**30
GB = 1e9


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> str:
    """A fixed-width table: first column left-aligned, the rest right-aligned (numbers).
    A row ("-",) prints a rule (e.g. above a total)."""
    cells = [list(headers)] + [list(r) for r in rows if len(r) > 1]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = (cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    out = [title] if title else []
    out += [line(headers), rule]
    for row in rows:
        out.append(rule if tuple(row) == ("-",) else line(row))
    return "\n".join(out)


def count(n: float) -> str:
    """A parameter or FLOP count with a T/B/M/K suffix (B = 1e9)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:,.4g} {suffix}"
    return f"{n:,.0f}"


def flops(n: float) -> str:
    """A FLOP count with a P/T/G/M prefix."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(n) >= scale:
            return f"{n / scale:,.4g} {prefix}FLOPs"
    return f"{n:,.0f} FLOPs"


def gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def nbytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (exact below 1 KiB)."""
    for scale, unit in ((GiB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def exact_bytes(n: float) -> str:
    """An exact byte count, with decimal MB alongside from 1 MB up."""
    text = f"{n:,.0f} B"
    return text if n < 1e6 else f"{text} ({n / 1e6:,.2f} MB)"


def tokens(n: float) -> str:
    return f"{n:,.0f}"
