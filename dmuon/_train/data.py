"""Byte-level data for ``python -m dmuon train``.

* Tokenizer: one token per byte (vocab 256); any UTF-8 (or other) text works unchanged.
* Corpus: a ``--data FILE``, or by default the running interpreter's own standard-library
  source (``*.py`` under ``sysconfig.get_paths()["stdlib"]``; test suites, generated tables
  and site-packages skipped; files in the order of the SHA-256 of their relative path, so
  that every part of the library lands in both splits; capped at
  :data:`DEFAULT_CORPUS_NBYTES`). It exists on
  every machine with Python, so the main job runs offline; it is deterministic for a given
  Python build (another Python version gives another, equally usable, corpus).
* Split: the last ``val_fraction`` of the bytes is validation, the rest is training.
* Batches: the GLOBAL batch of a step depends only on (train split, seed, step, batch size,
  seq_len), never on the world size; rank r of N takes rows [r·B/N, (r+1)·B/N). N = 1 and
  N = 4 therefore see the same data, which is what the oracle comparison needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "VOCAB_SIZE",
    "DEFAULT_CORPUS_NBYTES",
    "encode",
    "decode",
    "stdlib_corpus",
    "load_corpus",
    "Corpus",
    "split_val_tokens",
    "unigram_cross_entropy",
]

VOCAB_SIZE = 256
"""Byte tokenizer vocabulary: token id = byte value."""

DEFAULT_CORPUS_NBYTES = 4 * 1024 * 1024
"""Cap of the embedded standard-library corpus, in bytes (4 MiB)."""

_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",  # not the stdlib / not source
        "test",
        "tests",
        "idle_test",  # test suites: odd encodings, huge data literals
        "encodings",
        "pydoc_data",  # generated tables and text blobs, not code
    }
)


def encode(text: str | bytes) -> np.ndarray:
    """Text -> token ids: (n_bytes,) uint8. ``str`` is encoded as UTF-8."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(raw, dtype=np.uint8).copy()


def decode(tokens: np.ndarray | torch.Tensor | list[int]) -> str:
    """Token ids -> text (UTF-8, invalid sequences replaced)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return bytes(np.asarray(tokens, dtype=np.uint8).tobytes()).decode("utf-8", errors="replace")


def stdlib_corpus(max_nbytes: int = DEFAULT_CORPUS_NBYTES, root: str | None = None) -> bytes:
    """The default corpus: standard-library ``*.py`` sources, concatenated.

    Files are ordered by the SHA-256 of their POSIX path relative to ``root`` (default: the
    running interpreter's stdlib directory) -- deterministic, yet mixing packages, so the
    validation tail looks like the training head -- skipping the directories in
    ``_SKIP_DIRS``; each file is followed by a blank line; the result is truncated to
    ``max_nbytes`` bytes.

    Returns: at most ``max_nbytes`` bytes. Raises ``RuntimeError`` when nothing is found.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(base)
        files.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    files.sort(key=lambda rel_path: (hashlib.sha256(rel_path.encode()).hexdigest(), rel_path))
    chunks: list[bytes] = []
    total = 0
    for rel_path in files:
        if total >= max_nbytes:
            break
        try:
            data = (base / rel_path).read_bytes()
        except OSError:
            continue
        chunk = data + b"\n\n"
        chunks.append(chunk)
        total += len(chunk)
    if not chunks:
        raise RuntimeError(f"no *.py files found under {base}; pass --data FILE")
    return b"".join(chunks)[:max_nbytes]


def load_corpus(path: str | os.PathLike | None = None) -> tuple[np.ndarray, str]:
    """Token ids of ``path`` (whole file, as bytes) or of :func:`stdlib_corpus` when None.

    Returns: ((n_tokens,) uint8 array, human-readable description of the source).
    """
    if path is None:
        raw = stdlib_corpus()
        desc = f"python stdlib sources ({len(raw) / 2**20:.2f} MiB)"
    else:
        raw = Path(path).read_bytes()
        desc = f"{path} ({len(raw) / 2**20:.2f} MiB)"
    return encode(raw), desc


def unigram_cross_entropy(train: np.ndarray, val: np.ndarray) -> float:
    """Cross-entropy of the training split's byte distribution on the validation split.

    p(b) = (count_train(b) + 1) / (n_train + 256) (add-one smoothing, so a byte unseen in
    training costs log(n_train + 256) instead of infinity);  H = -mean_{b in val} log p(b).

    Returns: nats/token — what a model that ignores context can reach at best (up to the
    smoothing), the baseline a trained model's validation loss must end well below.
    """
    counts = np.bincount(train, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


def split_val_tokens(n: int, seq_len: int, val_fraction: float) -> int:
    """Validation tokens of a corpus of ``n`` tokens: ``max(seq_len + 1, floor(val_fraction · n))``
    (the last ones). Raises ValueError when ``val_fraction`` is outside (0, 1) or either split
    would hold fewer than ``seq_len + 1`` tokens (one byte = one token, so a file's size in bytes
    is its ``n``: the launcher checks ``--data`` with this rule before spawning ranks)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(seq_len + 1, int(n * val_fraction))
    if n - n_val < seq_len + 1:
        raise ValueError(
            f"corpus of {n} tokens is too small for seq_len={seq_len} (needs at least {2 * (seq_len + 1)} tokens)"
        )
    return n_val


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Corpus:
    """A tokenized corpus with its train/val split and deterministic batch sampling.

    Attributes:
        train: (n_train,) uint8 token ids.
        val: (n_val,) uint8 token ids.
        seq_len: tokens per sequence T (inputs); each sample reads T + 1 tokens.
        seed: sampling seed.
        description: where the text came from.
    """

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    seed: int = 0
    description: str = ""

    @classmethod
    def from_tokens(
        cls,
        tokens: np.ndarray,
        *,
        seq_len: int,
        seed: int = 0,
        val_fraction: float = 0.1,
        description: str = "",
    ) -> "Corpus":
        """Split ``tokens`` (n,) into train = first n - n_val and val = last n_val tokens,
        n_val = max(seq_len + 1, floor(val_fraction · n)). Raises ValueError when either split
        holds fewer than seq_len + 1 tokens."""
        n = int(tokens.shape[0])
        n_val = split_val_tokens(n, seq_len, val_fraction)
        return cls(
            train=tokens[: n - n_val],
            val=tokens[n - n_val :],
            seq_len=seq_len,
            seed=seed,
            description=description,
        )

    @property
    def unigram_val_loss(self) -> float:
        """:func:`unigram_cross_entropy` (train -> val), nats/token."""
        return unigram_cross_entropy(self.train, self.val)

    def _windows(self, split: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len
        idx = starts[:, None] + np.arange(t + 1)[None, :]  # (B, T + 1)
        rows = torch.from_numpy(split[idx].astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def train_batch_starts(self, step: int, global_batch: int) -> np.ndarray:
        """Start offsets of the global batch of ``step``: (global_batch,) int64, uniform in
        [0, n_train - seq_len - 1], drawn from ``np.random.default_rng([seed, 0, step])``."""
        rng = np.random.default_rng([self.seed, 0, step])
        high = self.train.shape[0] - self.seq_len  # exclusive bound: start + T + 1 <= n_train
        return rng.integers(0, high, size=global_batch, dtype=np.int64)

    def train_batch(
        self, step: int, global_batch: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global training batch of ``step``.

        Returns: (inputs, targets), each (global_batch // world_size, seq_len) int64 on CPU;
        targets are inputs shifted by one token. Rank r gets rows
        [r · b, (r + 1) · b) of the global batch, b = global_batch // world_size.
        """
        b = _per_rank(global_batch, world_size)
        starts = self.train_batch_starts(step, global_batch)[rank * b : (rank + 1) * b]
        return self._windows(self.train, starts)

    def val_batch_starts(self, num_batches: int, global_batch: int) -> np.ndarray:
        """Fixed evaluation windows: (num_batches, global_batch) int64 offsets spread evenly
        over the validation split (independent of seed and step)."""
        n = num_batches * global_batch
        high = self.val.shape[0] - self.seq_len - 1
        return np.linspace(0, high, n).round().astype(np.int64).reshape(num_batches, global_batch)

    def val_batches(
        self, num_batches: int, global_batch: int, rank: int = 0, world_size: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slices of the ``num_batches`` fixed evaluation batches; each (inputs,
        targets) pair is (global_batch // world_size, seq_len) int64. Averaging the per-rank
        mean losses over ranks and batches gives the same number for every world size."""
        b = _per_rank(global_batch, world_size)
        starts = self.val_batch_starts(num_batches, global_batch)
        return [self._windows(self.val, row[rank * b : (rank + 1) * b]) for row in starts]


def _per_rank(global_batch: int, world_size: int) -> int:
    if global_batch <= 0 or global_batch % world_size:
        raise ValueError(f"global batch {global_batch} must be a positive multiple of the world size {world_size}")
    return global_batch // world_size
