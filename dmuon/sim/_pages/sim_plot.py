"""Gantt charts of simulated timelines (matplotlib, imported only when called)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["gantt", "COLORS"]

#: bar colour per op kind
COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "recompute": "#8172b2",
    "newton_schulz": "#c44e52",
    "optimizer": "#937860",
    "broadcast": "#64b5cd",
    "reduce": "#dd8452",
    "all_reduce": "#da8bc3",
    "all_gather": "#8c8c8c",
    "fsdp2_all_gather": "#b0b0b0",
    "fsdp2_reduce_scatter": "#ccb974",
    "fsdp2_all_reduce": "#e0c090",
    "all_to_all": "#9e9ac8",
}
_LANES = ("compute", "bcast", "reduce", "replicate", "fsdp2_ag", "fsdp2_rs", "tp", "a2a")


def gantt(sims: Mapping[str, Any], rank: int, path: str | None = None, *, ax_width: float = 11.0) -> Any:
    """One panel per simulation: ``rank``'s lanes (compute, then each channel used) over time in
    ms, one bar per op coloured by kind. Writes ``path`` if given; returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(sims)
    fig, axes = plt.subplots(len(names), 1, figsize=(ax_width, 1.3 + 1.1 * len(names)), squeeze=False, sharex=True)
    kinds_seen: set[str] = set()
    for ax, name in zip(axes[:, 0], names):
        sim = sims[name]
        bars = sim.timelines.get(rank, ())
        lanes = [lane_name for lane_name in _LANES if any(b.lane == lane_name for b in bars)]
        for y, lane in enumerate(lanes):
            for b in bars:
                if (
                    b.lane != lane or b.end_s <= b.start_s
                ):  # zero-length: a thread's wait that found its collective done
                    continue
                kinds_seen.add(b.kind)
                ax.barh(
                    y,
                    1e3 * (b.end_s - b.start_s),
                    left=1e3 * b.start_s,
                    height=0.8,
                    color=COLORS.get(b.kind, "#333333"),
                    linewidth=0,
                )
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}: step {1e3 * sim.step_s:.1f} ms (rank {rank})", fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms")
    fig.legend(
        handles=[Patch(color=COLORS.get(k, "#333333"), label=k) for k in sorted(kinds_seen)],
        loc="upper right",
        fontsize=6,
        ncol=4,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
