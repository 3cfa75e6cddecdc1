"""Progress lines and the summary table: with rich when it is installed (the ``bench`` extra), plain otherwise.

rich is imported only here, and only when a :class:`Reporter` is made with
``rich_ok=True``: ``import ncclkv`` never needs it.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TextIO

from ._summary import Table, format_plain

__all__ = ["Reporter", "rich_available"]


def rich_available() -> bool:
    return importlib.util.find_spec("rich") is not None


class Reporter:
    """``step(text)``: a spinner (rich) or a start line (plain) while it runs, then a done line with seconds."""

    def __init__(self, *, rich_ok: bool = True, file: TextIO | None = None) -> None:
        self._file = file if file is not None else sys.stdout
        self._console: Any = None
        if rich_ok and rich_available():
            from rich.console import Console

            self._console = Console(file=self._file, highlight=False)

    @property
    def uses_rich(self) -> bool:
        return self._console is not None

    def note(self, text: str) -> None:
        if self._console is not None:
            self._console.print(text, markup=False)
        else:
            print(text, file=self._file, flush=True)

    @contextmanager
    def step(self, text: str) -> Iterator[Callable[[str], None]]:
        """Yields ``update(detail)``, which shows how the step is going (rich: in the spinner line)."""
        started = time.monotonic()
        status: AbstractContextManager[Any] = nullcontext()
        if self._console is not None:
            status = self._console.status(text)
        else:
            print(f"{text} ...", file=self._file, flush=True)
        with status as spinner:
            def update(detail: str) -> None:
                if spinner is not None:
                    spinner.update(f"{text}: {detail}")

            yield update
        seconds = time.monotonic() - started
        if self._console is not None:
            self._console.print(f"[green]done[/green] {_escape(text)} [dim]({seconds:.1f} s)[/dim]")
        else:
            print(f"done {text} ({seconds:.1f} s)", file=self._file, flush=True)

    def table(self, table: Table, title: str) -> None:
        if self._console is None:
            print(f"\n{title}\n{format_plain(table)}", file=self._file, flush=True)
            return
        from rich.table import Table as RichTable

        rich_table = RichTable(title=title, title_justify="left")
        for index, name in enumerate(table.header):
            rich_table.add_column(name, justify="left" if index == 0 else "right", no_wrap=True)
        for row in table.rows:
            rich_table.add_row(*row)
        self._console.print()
        self._console.print(rich_table)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
