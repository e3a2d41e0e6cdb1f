"""What a failed dmuon wait says (the text of :class:`~dmuon.exec._comm.collective_calls.CollectiveTimeout`
and :class:`~dmuon.exec._comm.collective_calls.CollectiveTransportError`), and which of the two it is.

A leaf: strings in, strings out. The rules: Note: what a failed wait says (docs/design.md).
"""

from __future__ import annotations

import re

__all__ = ["USUAL_CAUSES", "is_timeout", "backend_summary", "backend_peer", "timeout_message", "transport_message"]

#: the usual causes of a collective that fails or never completes, most likely first
USUAL_CAUSES = (
    "a rank stopped early or skipped a whole step (a rank-dependent `break`, early stopping, or the end "
    "of that rank's data): every rank must run the same forwards, backwards and opt.step() calls",
    "a rank died (out of memory, a crash, a kill): read that rank's log first",
    "a rank-dependent number of micro-batches (gradient accumulation over a per-rank count): every rank "
    "must run the same number of forwards and backwards per optimizer step",
)

_TIMEOUT_WORDS = re.compile(r"time[sd]?[ _-]?out|timeout", re.IGNORECASE)
_SOURCE_PREFIX = re.compile(r"^\s*(\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*)+")
_PEER = re.compile(r"\bpeer\s+(\[[^\]]+\](?::\d+)?|[\w.\-]+:\d+)", re.IGNORECASE)
_ADDRESS = re.compile(r"(\[[0-9a-fA-F.:]+\]:\d+)")
_RANK = re.compile(r"\b(?:remote|peer)?\s*rank\s*[:=]?\s*(\d+)", re.IGNORECASE)

#: share of dmuon's timeout after which a raising wait counts as a timeout whatever the backend says
TIMEOUT_SHARE = 0.95


def is_timeout(message: str, waited_s: float, timeout_s: float | None) -> bool:
    """True when a wait that raised ``message`` after ``waited_s`` seconds is a timeout (module
    docstring), False for a transport error."""
    if timeout_s is not None and waited_s >= TIMEOUT_SHARE * timeout_s:
        return True
    return bool(_TIMEOUT_WORDS.search(message))


def backend_summary(message: str, limit: int = 240) -> str:
    """The backend's message, first line, without gloo's / c10d's ``[file.cc:123]`` prefix."""
    first = (message.strip().splitlines() or [""])[0]
    first = _SOURCE_PREFIX.sub("", first).strip()
    return first if len(first) <= limit else first[: limit - 3] + "..."


def backend_peer(message: str) -> str | None:
    """The peer the backend's message names (gloo: ``"[127.0.0.1]:13447"``; NCCL: ``"rank 3"``), or None."""
    m = _PEER.search(message) or _ADDRESS.search(message)
    if m:
        return m.group(1).rstrip(".")
    m = _RANK.search(message)
    return f"rank {m.group(1)}" if m else None


def _position(me: int | None, step: int | None, forwards: int | None, ranks: tuple[int, ...] | None) -> str:
    parts = [f"global rank {me}"] if me is not None else []
    if step is not None:
        parts.append(f"{step} optimizer step(s) done")
    if forwards is not None:
        parts.append(f"{forwards} grad-enabled forward(s) of this boundary since the last step")
    if not parts and ranks is None:
        return ""
    text = "This rank: " + (", ".join(parts) or "?")
    if ranks is not None:
        others = [r for r in ranks if r != me]
        text += f"; the group's global ranks {tuple(ranks)}"
        if len(others) == 1:
            text += f" (the only other rank: {others[0]})"
    return text + "."


def _tail(position: str, last_issued: str | None) -> str:
    causes = " ".join(f"{i}) {c};" for i, c in enumerate(USUAL_CAUSES, 1)).rstrip(";")
    last = f" Last collective dmuon issued on this rank: {last_issued}." if last_issued else ""
    return f" {position + ' ' if position else ''}{last.lstrip() + ' ' if last else ''}Usual causes, most likely first: {causes}."


def transport_message(
    what: str,
    backend: str,
    *,
    waited_s: float,
    timeout_s: float | None,
    me: int | None = None,
    step: int | None = None,
    forwards: int | None = None,
    ranks: tuple[int, ...] | None = None,
    last_issued: str | None = None,
) -> str:
    """The text of a transport error (Note: what a failed wait says, docs/design.md)."""
    peer = backend_peer(backend)
    said = f"the backend names the peer {peer}" if peer else "the backend names no peer"
    limit = f" (dmuon's timeout: {timeout_s:g} s)" if timeout_s is not None else ""
    return (
        f"dmuon: collective for {what} failed in the transport after {waited_s:.2f} s of waiting{limit}: "
        f"{said} ({backend_summary(backend)!r}); a peer closed the connection or the backend reported an error, "
        "this is not a timeout."
        + _tail(_position(me, step, forwards, ranks), last_issued)
        + " The backend's error is chained below."
    )


def timeout_message(
    what: str,
    backend: str | None,
    *,
    waited_s: float,
    timeout_s: float | None,
    me: int | None = None,
    step: int | None = None,
    forwards: int | None = None,
    ranks: tuple[int, ...] | None = None,
    last_issued: str | None = None,
) -> str:
    """The text of a timeout: dmuon's ``timeout_s`` ran out (``backend`` None: ``Work.wait``
    returned False; or the wait raised once that time was up), or the backend raised a time-out
    of its own before it (the process group's timeout fired first)."""
    if backend is None or (timeout_s is not None and waited_s >= TIMEOUT_SHARE * timeout_s):
        head = f"dmuon: collective for {what} did not complete within {timeout_s:g} s (collective_timeout_s)"
    else:
        head = (
            f"dmuon: collective for {what} did not complete within the process group's timeout "
            f"(the backend gave up after {waited_s:.2f} s of dmuon's wait: {backend_summary(backend or '')!r})"
        )
    return head + "." + _tail(_position(me, step, forwards, ranks), last_issued)
