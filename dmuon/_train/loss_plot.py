"""``--png FILE``: validation loss against optimizer step and against training wall time.

Two panels side by side, one line per run (the run, then every optimizer of ``--compare``,
e.g. ``--compare normuon,adamw``), read from the metrics' ``history["val"]`` ([step, loss] pairs) and
``history["val_train_time_s"]`` (rank 0's training wall time at each validation, evaluation
excluded). The unigram baseline is drawn as a dashed line. matplotlib comes with the
``[train]`` extra; the Agg backend is used, so no display is needed.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["plot_runs"]


def _label(m: dict[str, Any]) -> str:
    experts = m.get("experts") or 0
    moe = f", MoE {experts} experts top-{m['top_k']}" if experts else ""
    if (m.get("ep") or 1) > 1:
        moe += f", EP {m['ep']}"
    if m["optimizer"] == "adamw":
        return f"FSDP2 + AdamW{moe}"
    if experts and m.get("router_optimizer") == "adamw":
        moe += ", routers on AdamW"
    name = "dmuon NorMuon" if m["optimizer"] == "normuon" else "dmuon"
    return f"{name} ({m['mode'].upper()}, NS {m['ns_dtype']}{moe})"


def plot_runs(runs: Sequence[dict[str, Any]], path: str) -> None:
    """Write the figure of ``runs`` (metrics dicts of :func:`dmuon._train.loop.train`) to ``path``
    (format from the suffix, e.g. ``.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for m in runs:
        val = m["history"]["val"]
        steps = [s for s, _ in val]
        losses = [v for _, v in val]
        times = m["history"]["val_train_time_s"]
        label = _label(m)
        by_step.plot(steps, losses, marker="o", ms=3, label=label)
        by_time.plot(times, losses, marker="o", ms=3, label=label)
    unigram = runs[0]["unigram_val_loss"]
    for ax in (by_step, by_time):
        ax.axhline(unigram, color="grey", ls="--", lw=1, label="unigram baseline")
        ax.grid(alpha=0.3)
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("training wall time (s, rank 0, evaluation excluded)")
    by_step.set_ylabel("validation loss (nats/token)")
    by_step.legend()
    m0 = runs[0]
    fig.suptitle(
        f"python -m dmuon train: {m0['n_params']:,} parameters, world {m0['world_size']} "
        f"({m0['device']}), global batch {m0['global_batch']} x {m0['seq_len']} tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
