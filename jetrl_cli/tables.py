"""Rich tables that stay readable at any console width: a number is never cut.

Rich fits a table that is too wide by wrapping cells at spaces and, when that is not enough, by
cutting cells to ``…`` -- and its shrinking starts with the widest columns, so it can cut a number
even when wrapping the text columns would have made room. A number cut to ``0…`` is worse than
none. Output piped to a file or ``cat`` gets an 80-column console, so every table jetrl prints goes
through ``print_table``:

- each column's narrowest width is its longest word (a number is one word; a ``no_wrap`` column
  keeps whole cells), its widest its longest line;
- if all columns fit at their narrowest, the spare width goes first to the columns that need least
  to be whole (only the widest text wraps), and every column gets an explicit width, so rich
  neither collapses nor cuts anything;
- otherwise the columns are printed as several tables, each repeating the first ``keep`` (label)
  columns -- fewer columns per table instead of cut ones;
- a table that cannot fit even one data column next to its labels folds its cells onto more lines
  (still every character printed).

Cells and headers are data, printed literally: a ``str`` cell is never read as rich markup, so a
name like ``int8[row]`` or ``jetrl[plot]`` keeps its brackets. (Titles and captions are markup;
callers escape what they put there.)
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

_WIDE = 10_000


def _literal(cell):
    return Text(cell) if isinstance(cell, str) else cell


def _cells(table: Table, col) -> list:
    return [_literal(c) for c in ([col.header] if table.show_header else []) + list(col.cells)]


def _content_range(console: Console, table: Table, col) -> tuple[int, int]:
    """(narrowest, widest) content width of a column, padding excluded."""
    opts = console.options.update_width(_WIDE)
    lo, hi = 1, 1
    for cell in _cells(table, col):
        m = Measurement.get(console, opts, cell)
        lo = max(lo, m.maximum if col.no_wrap else m.minimum)
        hi = max(hi, m.maximum)
    return lo, hi


def _overhead(console: Console, table: Table) -> int:
    """Borders and padding: the table's width with every column one character wide, less the columns."""
    saved = [c.width for c in table.columns]
    for c in table.columns:
        c.width = 1
    try:
        total = Measurement.get(console, console.options.update_width(_WIDE), table).maximum
    finally:
        for c, w in zip(table.columns, saved):
            c.width = w
    return total - len(table.columns)


def min_width(console: Console, table: Table) -> int:
    """The narrowest the table can be printed without cutting or folding a word."""
    return sum(_content_range(console, table, c)[0] for c in table.columns) + _overhead(console, table)


def _subtable(table: Table, idx: list[int], title: object, caption: object) -> Table:
    t = Table(title=title, caption=caption, box=table.box, show_header=table.show_header,
              show_edge=table.show_edge, show_lines=table.show_lines, pad_edge=table.pad_edge,
              padding=table.padding, title_justify=table.title_justify, caption_justify=table.caption_justify,
              highlight=table.highlight, header_style=table.header_style, title_style=table.title_style)
    cols = [table.columns[i] for i in idx]
    for c in cols:
        t.add_column(_literal(c.header), justify=c.justify, style=c.style, header_style=c.header_style,
                     no_wrap=c.no_wrap, overflow=c.overflow, vertical=c.vertical)
    cells = [list(c.cells) for c in cols]
    for r, row in enumerate(table.rows):
        t.add_row(*[_literal(cc[r]) for cc in cells], style=row.style, end_section=row.end_section)
    return t


def _set_widths(console: Console, table: Table, width: int) -> None:
    """Give every column an explicit width that fits ``width``; fold cells if even the narrowest layout does not."""
    ranges = [_content_range(console, table, c) for c in table.columns]
    room = width - _overhead(console, table)
    lo = sum(r[0] for r in ranges)
    if lo > room:
        for c in table.columns:
            c.overflow = "fold"
        return
    if sum(r[1] for r in ranges) <= room:
        return  # fits at its natural width: rich changes nothing
    # Spare width goes to the columns that need the least to be whole, so only the widest wrap.
    slack = room - lo
    widths = [low for low, _ in ranges]
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][1] - ranges[i][0]):
        give = min(slack, ranges[i][1] - ranges[i][0])
        widths[i] += give
        slack -= give
    for c, w in zip(table.columns, widths):
        c.width = w


def fit_table(console: Console, table: Table, keep: int = 1, width: int | None = None) -> list[Table]:
    """``table`` as one or more tables no wider than ``width`` (default: the console's); the first
    ``keep`` columns are repeated in each."""
    width = width or console.width
    n = len(table.columns)
    keep = min(keep, n - 1) if n > 1 else 0
    if min_width(console, table) <= width or n - keep <= 1:
        t = _subtable(table, list(range(n)), table.title, table.caption)
        _set_widths(console, t, width)
        return [t]
    groups: list[list[int]] = [[]]
    for i in range(keep, n):
        trial = _subtable(table, list(range(keep)) + groups[-1] + [i], None, None)
        if groups[-1] and min_width(console, trial) > width:
            groups.append([])
        groups[-1].append(i)
    out = []
    for k, g in enumerate(groups):
        title = table.title if k == 0 else (f"{table.title} (continued)" if isinstance(table.title, str) else None)
        t = _subtable(table, list(range(keep)) + g, title, table.caption if k == len(groups) - 1 else None)
        _set_widths(console, t, width)
        out.append(t)
    return out


def print_table(console: Console, table: Table, keep: int = 1) -> None:
    """Print ``table`` on ``console`` without cutting a cell (see the module docstring)."""
    for t in fit_table(console, table, keep):
        console.print(t)
