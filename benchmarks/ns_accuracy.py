"""Accuracy of dmuon's Newton-Schulz backends on a zoo of matrices.

For every zoo matrix ``G`` (float32, built in float64 with a fixed seed), iteration dtype
(fp32, bf16) and backend, the script runs 5 NS steps and compares the result ``Y`` with the
exact polar factor from a float64 SVD ``G = U diag(σ) Vᵀ`` (thin). Definitions:

- normalised singular values ``s_i = σ_i / ‖G‖_F`` — what every backend's polynomial sees
  (NS normalises by the Frobenius norm);
- nonzero directions ``N = {i : σ_i > max(m, n) · eps_fp32 · σ_1}`` (the numerical rank of
  the fp32 input, numpy's ``matrix_rank`` rule);
- resolved directions ``R = {i : s_i >= 1e-2}``: with 5 steps both presets map every
  ``s >= 3e-3`` into their band ([0.68, 1.20] "muon", [0.87, 1.12] "polar_express") in exact
  arithmetic, smaller ``s`` are not resolved (the gain at ``s = 1e-3`` is 0.47 / 0.84 and
  falls to ~``3.4445**5 · s`` / ``8.1·4.1·3.9·3.3·2.3 · s`` towards 0); 1e-2 leaves a 3x margin;
- ``spread`` = ``[τ_|N|, τ_1]``: the smallest and largest of the ``|N|`` largest singular
  values ``τ`` of ``Y`` (float64 SVD of the result), i.e. the range of output singular values
  over the input's nonzero directions (undefined for the all-zero matrix);
- ``polar`` = ``‖Y V_R − U_R‖_F / sqrt(|R|)`` = ``‖(Y − U Vᵀ) V_R‖_F / ‖U Vᵀ V_R‖_F``: the
  relative Frobenius distance to the exact polar factor on the resolved right-singular
  subspace (leakage into any other output direction counts). In exact arithmetic it is
  ``sqrt(mean_{i∈R} (P(s_i) − 1)²)`` for the schedule's scalar polynomial ``P``, so it
  includes the preset's own approximation error (~0.19 "muon", ~0.09 "polar_express");
- ``err64`` = ``‖(Y − Y₆₄) V_R‖_F / ‖Y₆₄ V_R‖_F`` with ``Y₆₄`` the standard backend in
  float64 with the same coefficients: the rounding error of the backend in this dtype
  (for Gram NS: its departure from the exact-arithmetic polynomial);
- ``finite``: every entry of ``Y`` finite; ``fb``: matrices for which Gram NS fell back to
  the standard iteration (counted with ``gram_newton_schulz(on_fallback=...)``).

Backends (columns): ``standard`` = ``newton_schulz`` with "muon" coefficients (dmuon's and
torch's default); ``polar_express`` = ``newton_schulz`` with the "polar_express" preset;
``gram`` = ``gram_newton_schulz`` (default restarts: before steps 2 and 4) with "muon";
``gram_pe`` = ``gram_newton_schulz`` with "polar_express"; ``auto`` = ``auto_newton_schulz``
with "muon" (Gram NS where it needs fewer FLOPs for the shape, the standard iteration
elsewhere: on the zoo, Gram NS on every matrix but the square ``gauss_1x1``);
``deepseek_v4`` = ``newton_schulz`` with the "deepseek_v4" preset, which runs its own 10 steps
(a fixed-length schedule, :func:`backend_steps`; 2x the FLOPs of the others).

A second table runs ``standard``, ``gram``, ``auto`` and ``deepseek_v4`` on the main job's matrices
(:data:`MAIN_JOB`: block-0 gradients of ``benchmarks/step_time.py``'s GPTs, 128 x 128 to
1024 x 256).

Usage::

    python benchmarks/ns_accuracy.py                 # text table, ~5 s on one CPU thread
    python benchmarks/ns_accuracy.py --markdown      # the tables of docs/newton_schulz.md
    python benchmarks/ns_accuracy.py --json out.json

tests/exec/test_ns_accuracy.py imports this module and holds every backend to stated bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dmuon.exec._optim.ns_backends as ns  # noqa: E402
import dmuon._ns_gram as ns_gram  # noqa: E402
from dmuon.plan._cost import flops  # noqa: E402

STEPS = 5
RESOLVED_S = 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DTYPES = ("fp32", "bf16")
#: backend name -> (function name in dmuon.exec._optim.ns_backends, coefficient preset)
BACKENDS: dict[str, tuple[str, str]] = {
    "standard": ("newton_schulz", "muon"),
    "polar_express": ("newton_schulz", "polar_express"),
    "gram": ("gram_newton_schulz", "muon"),
    "gram_pe": ("gram_newton_schulz", "polar_express"),
    "auto": ("auto_newton_schulz", "muon"),
    "deepseek_v4": ("newton_schulz", "deepseek_v4"),
}
#: backends measured on the main job's matrices (:data:`MAIN_JOB`): the default iteration, Gram
#: NS and the per-shape choice between them (bf16 NS of 256 x 1024 matrices is slow on CPUs)
MAIN_JOB_BACKENDS = ("standard", "gram", "auto", "deepseek_v4")


def backend_steps(backend: str, steps: int = STEPS) -> int:
    """The steps ``backend`` runs: ``steps``, or its preset's own length for a fixed-length preset
    (``"deepseek_v4"``: 10; ``dmuon._update.PRESET_LENGTH_POLICY``)."""
    from dmuon._update import NS_PRESETS, PRESET_LENGTH_POLICY

    preset = BACKENDS[backend][1]
    return len(NS_PRESETS[preset]) if PRESET_LENGTH_POLICY.get(preset) == "fixed" else steps


# ------------------------------------------------------------------------------ the zoo


def _orthonormal(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # unique (Haar) orthonormal columns


def _with_spectrum(m: int, n: int, sigma: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = sigma.numel()
    return (_orthonormal(m, k, g) * sigma) @ _orthonormal(n, k, g).T


def _gauss(m: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cond(m: int, n: int, cond: float, seed: int) -> torch.Tensor:
    k = min(m, n)
    return _with_spectrum(m, n, torch.logspace(0.0, -math.log10(cond), k, dtype=torch.float64), seed)


def _low_rank(m: int, n: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, rank, generator=g, dtype=torch.float64) @ torch.randn(
        rank, n, generator=g, dtype=torch.float64
    )


#: name -> (description, builder of the float64 matrix). Every entry is cast to float32,
#: the dtype of gradients / momentum that reach NS.
ZOO: dict[str, tuple[str, Callable[[], torch.Tensor]]] = {
    "gauss_1x1": ("Gaussian 64x64", lambda: _gauss(64, 64, 1)),
    "gauss_1x4": ("Gaussian 64x256 (wide)", lambda: _gauss(64, 256, 2)),
    "gauss_4x1": ("Gaussian 256x64 (tall)", lambda: _gauss(256, 64, 3)),
    "gauss_1x16": ("Gaussian 64x1024", lambda: _gauss(64, 1024, 4)),
    "cond_1e2": ("64x256, σ log-spaced 1..1e-2", lambda: _cond(64, 256, 1e2, 5)),
    "cond_1e4": ("64x256, σ log-spaced 1..1e-4", lambda: _cond(64, 256, 1e4, 6)),
    "cond_1e6": ("64x256, σ log-spaced 1..1e-6", lambda: _cond(64, 256, 1e6, 7)),
    "cond_1e4_tall": ("256x64, σ log-spaced 1..1e-4 (tall)", lambda: _cond(256, 64, 1e4, 8)),
    "rank4": ("64x256, rank 4 (Gaussian factors)", lambda: _low_rank(64, 256, 4, 9)),
    "rank4_tall": ("256x64, rank 4 (tall)", lambda: _low_rank(256, 64, 4, 10)),
    "rank1": ("64x256, rank 1", lambda: _low_rank(64, 256, 1, 11)),
    "zero": ("64x256, all zero", lambda: torch.zeros(64, 256, dtype=torch.float64)),
}


@functools.lru_cache(maxsize=2)
def _gpt_grads(size: str) -> dict[str, torch.Tensor]:
    """float64 gradients of block 0's matrices of the main job's GPT (``benchmarks/step_time.py``
    sizes, seed 0) after one forward + backward on 4 sequences of the embedded default corpus
    (``dmuon._train.data.stdlib_corpus``, its first bytes): what Muon's first step orthogonalises
    (momentum = gradient up to a scale, which NS normalises away)."""
    from dmuon._train.data import encode, stdlib_corpus
    from dmuon._train.byte_gpt import GPT, GPTConfig, lm_loss

    cfg = dict(
        small=dict(d_model=128, n_layers=4, n_heads=4, d_mlp=512, seq_len=64),
        large=dict(d_model=256, n_layers=8, n_heads=8, d_mlp=1024, seq_len=128),
    )[size]
    model = GPT(GPTConfig(vocab_size=256, **cfg), seed=0)
    tokens = torch.from_numpy(encode(stdlib_corpus(1 << 16))[: 4 * (cfg["seq_len"] + 1)].copy()).long()
    tokens = tokens.reshape(4, cfg["seq_len"] + 1)
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    block = dict(model.layers[0].named_parameters())
    return {name: block[name].grad.double() for name in block if block[name].ndim == 2}


def _gpt_grad(size: str, suffix: str) -> torch.Tensor:
    return next(g for name, g in _gpt_grads(size).items() if name.endswith(suffix))


#: The main job's matrices: gradients of the GPT of both benchmark sizes, one of
#: each shape (block 0), float32 like the zoo.
MAIN_JOB: dict[str, tuple[str, Callable[[], torch.Tensor]]] = {
    "gpt_small_q": ("small GPT q_proj gradient, 128x128", lambda: _gpt_grad("small", "q_proj.weight")),
    "gpt_small_up": ("small GPT up_proj gradient, 512x128 (tall)", lambda: _gpt_grad("small", "up_proj.weight")),
    "gpt_small_down": ("small GPT down_proj gradient, 128x512", lambda: _gpt_grad("small", "down_proj.weight")),
    "gpt_large_q": ("large GPT q_proj gradient, 256x256", lambda: _gpt_grad("large", "q_proj.weight")),
    "gpt_large_up": ("large GPT up_proj gradient, 1024x256 (tall)", lambda: _gpt_grad("large", "up_proj.weight")),
    "gpt_large_down": ("large GPT down_proj gradient, 256x1024", lambda: _gpt_grad("large", "down_proj.weight")),
}


def zoo_matrix(name: str) -> torch.Tensor:
    """The float32 zoo (or :data:`MAIN_JOB`) matrix ``name`` (deterministic)."""
    return (ZOO[name] if name in ZOO else MAIN_JOB[name])[1]().float()


# ------------------------------------------------------------------------------ metrics


@dataclasses.dataclass(frozen=True)
class Reference:
    """float64 facts about one input matrix, shared by all backends and dtypes."""

    u: torch.Tensor  # (m, k) left singular vectors
    sigma: torch.Tensor  # (k,) singular values, descending
    v: torch.Tensor  # (n, k) right singular vectors
    s: torch.Tensor  # normalised singular values sigma / ||G||_F (zeros for G = 0)
    nonzero: int  # |N|
    resolved: torch.Tensor  # bool mask over k

    @classmethod
    def of(cls, g32: torch.Tensor) -> "Reference":
        g = g32.double()
        u, sigma, vh = torch.linalg.svd(g, full_matrices=False)
        fro = torch.linalg.matrix_norm(g)
        s = sigma / fro if fro > 0 else torch.zeros_like(sigma)
        tol = max(g.shape) * torch.finfo(torch.float32).eps * (sigma[0] if sigma.numel() else 0.0)
        nonzero = int((sigma > tol).sum()) if fro > 0 else 0
        resolved = (s >= RESOLVED_S) & (sigma > tol)
        return cls(u=u, sigma=sigma, v=vh.mT, s=s, nonzero=nonzero, resolved=resolved)


@dataclasses.dataclass(frozen=True)
class Metrics:
    matrix: str
    dtype: str
    backend: str
    finite: bool
    nonzero: int
    resolved: int
    spread_min: Optional[float]  # None when there are no nonzero directions
    spread_max: Optional[float]
    polar: Optional[float]  # None when nothing is resolved
    err64: Optional[float]
    fallbacks: int
    max_abs: float  # largest |entry| of Y (0 for the zero matrix)


def run_backend(backend: str, x: torch.Tensor, dtype: torch.dtype, steps: int = STEPS) -> tuple[torch.Tensor, int]:
    """``(Y, fallbacks)``: the backend's result on ``x`` and how many matrices fell back."""
    fn_name, preset = BACKENDS[backend]
    steps = backend_steps(backend, steps)
    fn = getattr(ns, fn_name)
    fell_back: list[int] = []
    kw = {"on_fallback": lambda idx: fell_back.append(idx.numel())} if fn_name == "gram_newton_schulz" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fallbacks are reported in the table
        y = fn(x, coefficients=preset, steps=steps, dtype=dtype, **kw)
    return y, sum(fell_back)


def measure(name: str, x: torch.Tensor, ref: Reference, dtype_name: str, backend: str, steps: int = STEPS) -> Metrics:
    """Every metric of the module docstring for one (matrix, dtype, backend)."""
    y, fallbacks = run_backend(backend, x, DTYPES[dtype_name], steps)
    y64 = y.double()
    finite = bool(torch.isfinite(y64).all())
    spread_min = spread_max = polar = err64 = None
    if finite and ref.nonzero:
        tau = torch.linalg.svdvals(y64)
        spread_min, spread_max = float(tau[ref.nonzero - 1]), float(tau[0])
    k = int(ref.resolved.sum())
    if finite and k:
        vr, ur = ref.v[:, ref.resolved], ref.u[:, ref.resolved]
        polar = float(torch.linalg.matrix_norm(y64 @ vr - ur) / math.sqrt(k))
        preset = BACKENDS[backend][1]
        exact = ns.newton_schulz(
            x.double(), coefficients=preset, steps=backend_steps(backend, steps), dtype=torch.float64
        )
        err64 = float(torch.linalg.matrix_norm((y64 - exact) @ vr) / torch.linalg.matrix_norm(exact @ vr))
    return Metrics(
        matrix=name,
        dtype=dtype_name,
        backend=backend,
        finite=finite,
        nonzero=ref.nonzero,
        resolved=k,
        spread_min=spread_min,
        spread_max=spread_max,
        polar=polar,
        err64=err64,
        fallbacks=fallbacks,
        max_abs=float(y64.abs().max()) if finite else math.inf,
    )


def run(matrices=None, dtypes=None, backends=None, steps: int = STEPS) -> list[Metrics]:
    """Metrics for every (matrix, dtype, backend); defaults: the whole zoo, fp32 and bf16, all backends.
    (``matrices`` may name :data:`MAIN_JOB` entries too.)"""
    rows = []
    for name in matrices or list(ZOO):
        x = zoo_matrix(name)
        ref = Reference.of(x)
        for dt in dtypes or DEFAULT_DTYPES:
            for be in backends or list(BACKENDS):
                rows.append(measure(name, x, ref, dt, be, steps))
    return rows


# ------------------------------------------------------------------------------ output


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _cell(r: Metrics) -> str:
    if not r.finite:
        return "NON-FINITE"
    spread = "-" if r.spread_min is None else f"[{r.spread_min:.2f}, {r.spread_max:.2f}]"
    fb = f" fb{r.fallbacks}" if r.fallbacks else ""
    if r.polar is None:
        return ("all zero" if r.max_abs == 0 else f"{spread} max abs {r.max_abs:.1e}") + fb
    return f"{_fmt(r.polar, '.3f')} / {_fmt(r.err64, '.0e')} {spread}{fb}"


def format_table(rows: list[Metrics], markdown: bool = False) -> str:
    """One line per (matrix, dtype), one cell per backend: ``polar / err64 [spread]``."""
    backends = list(dict.fromkeys(r.backend for r in rows))
    keyed = {(r.matrix, r.dtype, r.backend): r for r in rows}
    lines_keys = list(dict.fromkeys((r.matrix, r.dtype) for r in rows))
    header = ["matrix", "dtype", "#N", "#R", *backends]
    body = []
    for m, dt in lines_keys:
        first = keyed[(m, dt, backends[0])]
        cells = [_cell(keyed[(m, dt, b)]) for b in backends]
        body.append([m, dt, str(first.nonzero), str(first.resolved), *cells])
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        out += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(out)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body])


FLOP_SHAPES = [(1024, 1024), (1024, 2048), (1024, 4096), (1024, 16384), (4096, 4096), (4096, 14336)]


def format_flops(markdown: bool = False, steps: int = STEPS) -> str:
    """Matmul FLOPs of standard vs Gram NS (default restarts and one restart after step 2)."""
    header = ["(d, D)", "standard", "gram (restart 2,4)", "ratio", "gram (restart [2])", "ratio"]
    body = []
    for d, D in FLOP_SHAPES:
        std = flops.ns_flops(d, D, steps)
        g2 = ns_gram.gram_ns_flops(d, D, steps)
        g1 = ns_gram.gram_ns_flops(d, D, steps, restart_every=[2])
        body.append(
            [
                f"({d}, {D})",
                f"{std / 1e9:.1f} G",
                f"{g2 / 1e9:.1f} G",
                f"{g2 / std:.2f}",
                f"{g1 / 1e9:.1f} G",
                f"{g1 / std:.2f}",
            ]
        )
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *body])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="markdown tables (docs/newton_schulz.md)")
    parser.add_argument("--json", type=Path, help="also write every metric to this JSON file")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--matrices", help=f"comma-separated subset of {','.join(ZOO)}")
    parser.add_argument("--dtypes", help="comma-separated subset of fp32,bf16,fp16 (default fp32,bf16)")
    parser.add_argument("--backends", help=f"comma-separated subset of {','.join(BACKENDS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--no-main-job", action="store_true", help="skip the main job's matrices")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    split = lambda s: s.split(",") if s else None  # noqa: E731
    start = time.perf_counter()
    rows = run(split(args.matrices), split(args.dtypes), split(args.backends), args.steps)
    wall = time.perf_counter() - start
    print(f"# NS accuracy, {args.steps} steps; cell: polar / err64 [spread]  (torch {torch.__version__})\n")
    for name, (desc, _) in ZOO.items():
        if not args.matrices or name in args.matrices.split(","):
            print(f"- `{name}`: {desc}" if args.markdown else f"  {name}: {desc}")
    print("\n#N: nonzero directions, #R: resolved directions (s >= 1e-2)\n")
    print(format_table(rows, args.markdown))
    print()
    if not args.matrices and not args.no_main_job:
        main_rows = run(list(MAIN_JOB), split(args.dtypes), list(MAIN_JOB_BACKENDS), args.steps)
        rows += main_rows
        print("# the main job's matrices (block-0 gradients of benchmarks/step_time.py's GPTs)\n")
        for name, (desc, _) in MAIN_JOB.items():
            print(f"- `{name}`: {desc}" if args.markdown else f"  {name}: {desc}")
        print()
        print(format_table(main_rows, args.markdown))
        print()
    print(f"# matmul FLOPs per matrix, {args.steps} steps\n")
    print(format_flops(args.markdown, args.steps))
    print(f"\n({len(rows)} measurements in {wall:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
