"""The tiny main-job configuration and corpus the checkpoint tests of ``dmuon._train`` share."""

from __future__ import annotations

TINY = dict(
    d_model=32,
    n_layers=2,
    n_heads=2,
    d_mlp=64,
    seq_len=16,
    batch=4,
    eval_batch=4,
    eval_batches=1,
    steps=4,
    eval_every=2,
    log_every=1,
    ns_dtype="fp32",
    cooldown_frac=0.5,
    quiet=True,
)
"""4 steps with a decaying LR in the last 2 (the resumed half), fp32 Newton-Schulz."""


def write_corpus(tmp_path) -> str:
    """A small deterministic text file under ``tmp_path``; returns its path."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(("".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(400))).encode())
    return str(path)
