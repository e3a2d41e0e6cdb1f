"""Rank 0's progress bar: tqdm when it is installed (``pip install -e '.[train]'``), on a TTY;
off one :func:`progress_note` says so in one log line.

``progress_bar(total=, initial=, enabled=)`` returns a tqdm bar with ETA writing to stderr when
``enabled`` (rank 0 and not ``--quiet``) and stderr is a terminal; otherwise (no TTY: a log file,
CI, a test; or tqdm absent) a no-op object with the same ``update`` / ``close``. Log lines go
through :func:`write_line`, which prints above an open bar instead of breaking it.
"""

from __future__ import annotations

import sys

__all__ = ["progress_bar", "progress_note", "write_line"]

_ACTIVE: list = []  # the open tqdm bar, if any (rank 0 only)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(*, total: int, initial: int = 0, enabled: bool = True):
    """A bar over optimizer steps (``initial`` already done, e.g. after ``--resume``)."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # the [train] extra is absent: log lines only
        return _NoBar()

    bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr, leave=False)
    _ACTIVE.append(bar)
    close = bar.close

    def _close() -> None:
        if bar in _ACTIVE:
            _ACTIVE.remove(bar)
        close()

    bar.close = _close
    return bar


def progress_note(*, enabled: bool = True, png: str | None = None, log_every: int | None = None) -> str | None:
    """One line saying why rank 0 shows no progress bar (``enabled``, i.e. not ``--quiet``) and
    where the plot is: off a terminal (a log file, CI, a pipe) or without tqdm there is no bar,
    and there is never a plot without ``--png FILE``; None when the bar shows."""
    if not enabled:
        return None
    if not sys.stderr.isatty():
        why = "stderr is not a terminal"
    else:
        try:
            import tqdm  # noqa: F401
        except ImportError:
            why = "tqdm is not installed (pip install -e '.[train]')"
        else:
            return None
    plot = f"the plot goes to {png}" if png else "no plot without --png FILE"
    every = f"a log line every {log_every} steps" if log_every else "log lines only"
    return f"progress: no bar ({why}), {every}; {plot}"


def write_line(msg: str) -> None:
    """Print ``msg`` (stdout), above the bar when one is open."""
    if _ACTIVE:
        _ACTIVE[-1].write(msg, file=sys.stdout)
    else:
        print(msg, flush=True)
