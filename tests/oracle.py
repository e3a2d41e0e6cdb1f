"""Oracle side of the runtime tests: models, data and the single-process reference.

The reference is what the numerical contract (README, "The oracle guarantee") names: one
process, the global batch, ``torch.optim.Muon`` on the dedicated matrices and
``torch.optim.AdamW`` on the rest, with the same hyper-parameters. The reference itself
(:class:`dmuon.testing.ReferenceOptimizer`) and ``fp32_newton_schulz``, which patches torch's
Muon to iterate in float32 (the "reference patched to iterate in fp32" of the contract) without
touching its other arithmetic, live in :mod:`dmuon.testing`; this module adds the test models
and data.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from dmuon.testing import (  # noqa: F401 - re-exported for the tests
    ReferenceOptimizer,
    fp32_newton_schulz,
    patched_newton_schulz,
    proxies_for,
    reference_newton_schulz,
)

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adamw_lr=3e-3, adamw_weight_decay=0.01)


class Block(nn.Module):
    """Uneven shapes on purpose: 36x8, 8x36, 5x8, 8x5 (tall, wide, not divisible by N)."""

    def __init__(self, d: int = 8, hidden: int = 36, narrow: int = 5):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.gate = nn.Linear(d, narrow, bias=False)
        self.out = nn.Linear(narrow, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.fc2(F.gelu(self.fc1(h)))
        return x + self.out(torch.tanh(self.gate(h)))


class TinyLM(nn.Module):
    """Token model with blocks at ``layers.N`` (the default hook-boundary heuristic finds them)."""

    def __init__(self, vocab: int = 11, d: int = 8, n_layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class TwoMatrixNet(nn.Module):
    """One boundary with two matrices: with N = 3 or 4 some ranks own nothing."""

    def __init__(self, vocab: int = 7, d: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, 10), nn.Tanh(), nn.Linear(10, d))])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class GatedBlock(nn.Module):
    """Data-parallel corner cases in one boundary.

    ``extra`` is used only by the data-parallel rank ``gate_rank`` (no gradient on the others:
    they must still take part in the reduce, with zeros), ``never`` is used by no rank (every
    rank's flag is 0: Muon skips it, no decay), ``shared`` is applied twice in one forward
    (one reduce of the summed gradient).
    """

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, d, bias=False)
        self.shared = nn.Linear(d, d, bias=False)
        self.extra = nn.Linear(d, d, bias=False)
        self.never = nn.Linear(d, d, bias=False)
        self.rank = 0
        self.gate_rank = 0

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(self.fc(x)))))
        if self.rank == self.gate_rank:
            h = h + self.extra(x)
        return x + h


class GatedLM(TinyLM):
    def __init__(self, vocab: int = 11, d: int = 8, n_layers: int = 2):
        super().__init__(vocab, d, n_layers)
        self.layers = nn.ModuleList(GatedBlock(d) for _ in range(n_layers))

    def set_rank(self, rank: int) -> None:
        for layer in self.layers:
            layer.rank = rank


class CheckpointedBlock(Block):
    """``torch.utils.checkpoint`` (non-reentrant) around the MLP inside the boundary."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.norm(x)
        x = x + checkpoint(lambda t: self.fc2(F.gelu(self.fc1(t))), h, use_reentrant=False)
        return x + self.out(torch.tanh(self.gate(h)))


class ParentCheckpointLM(TinyLM):
    """Each whole block (a hook boundary) checkpointed from its parent: the recomputation runs
    the boundary's forward hooks inside backward."""

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        x = self.embed(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(self.norm(x))


class TiedLM(TinyLM):
    """``head.weight is embed.weight``; vocabulary 11 is divisible by neither 2 nor 3."""

    def __init__(self):
        super().__init__(vocab=11, d=8, n_layers=2)
        self.head.weight = self.embed.weight


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "tiny":
        return TinyLM()
    if kind == "two":
        return TwoMatrixNet()
    if kind == "gated":
        return GatedLM()
    if kind == "ckpt":
        model = TinyLM(n_layers=2)
        model.layers = nn.ModuleList(CheckpointedBlock() for _ in range(2))
        return model
    if kind == "ckpt_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model = TinyLM(n_layers=2)
        model.layers = nn.ModuleList(checkpoint_wrapper(Block()) for _ in range(2))
        return model
    if kind == "tied":
        return TiedLM()
    if kind == "ckpt_parent":
        return ParentCheckpointLM()
    if kind == "frozen":
        model = TinyLM(n_layers=2)
        model.layers[0].fc1.weight.requires_grad_(False)  # stays with FSDP2: never reduced or updated
        model.layers[1].gate.weight.requires_grad_(False)
        return model
    if kind == "compiled":
        model = TinyLM(n_layers=2)
        for layer in model.layers:  # in place: FQNs unchanged, hooks stay on layers.N
            layer.compile(backend="aot_eager")
        return model
    raise ValueError(kind)


def dmuon_muon_kwargs(ns_dtype: torch.dtype = torch.float32, hp=HP) -> dict:
    """``dmuon.Muon``'s keyword arguments for the hyper-parameters :func:`reference_run` gives
    torch's optimizers (for frameworks that build the optimizer from a factory)."""
    return dict(
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        momentum=hp["momentum"],
        nesterov=hp["nesterov"],
        adamw_lr=hp["adamw_lr"],
        adamw_weight_decay=hp["adamw_weight_decay"],
        ns_dtype=ns_dtype,
    )


def dmuon_optimizer(model: nn.Module, ns_dtype: torch.dtype = torch.float32, hp=HP, variant: str = "muon"):
    """``dmuon.Muon`` with the hyper-parameters :func:`reference_run` gives torch's optimizers
    (``variant="normuon"``: NorMuon, against ``reference_run(variant="normuon")``)."""
    import dmuon

    return dmuon.Muon(model, **dmuon_muon_kwargs(ns_dtype, hp), variant=variant)


def train_steps(model: nn.Module, opt, batches, local_loss=None) -> list[float]:
    """Data-parallel steps: rank r trains on its slice of each global batch; returns the
    global-batch loss of each step (mean over ranks), identical on every rank.
    ``local_loss(model, batch, rank, world)`` computes this rank's loss (default: :func:`lm_loss`
    on ``batch.chunk(world)[rank]``)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches:
        if local_loss is None:
            loss = lm_loss(model, batch.chunk(world)[rank])
        else:
            loss = local_loss(model, batch, rank, world)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def global_batches(steps: int, batch: int = 12, seq: int = 5, vocab: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


# The reference's Newton-Schulz patch lives in the package (dmuon.testing, the reference users
# run); these names are the tests' historical spelling of it.
_ns_fp32 = reference_newton_schulz  # torch's iteration with float32 instead of bfloat16


def reference_optimizers(model: nn.Module, dedicated: set[str], hp=HP):
    """``(torch.optim.Muon on the dedicated FQNs, torch.optim.AdamW on the rest)`` of ``model``
    with the hyper-parameters ``hp`` — the single-process reference's optimizers."""
    muon = torch.optim.Muon(
        [p for n, p in model.named_parameters() if n in dedicated],
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        momentum=hp["momentum"],
        nesterov=hp["nesterov"],
    )
    adamw = torch.optim.AdamW(
        [p for n, p in model.named_parameters() if n not in dedicated],
        lr=hp["adamw_lr"],
        weight_decay=hp["adamw_weight_decay"],
    )
    return muon, adamw


def reference_run(
    model: nn.Module,
    dedicated: set[str],
    batches,
    *,
    ns_fp32: bool,
    hp=HP,
    world: int = 1,
    newton_schulz=None,
    grad_norms: list | None = None,
    variant: str = "muon",
):
    """Single process, global batch: Muon on ``dedicated`` FQNs, AdamW on the rest.

    A model with ``set_rank`` (data-dependent per-rank behaviour) gets the loss of the
    data-parallel job it stands for: the mean over ``world`` slices of the global batch, slice
    ``r`` computed with ``set_rank(r)``.

    ``newton_schulz``: a replacement for torch's iteration (:func:`patched_newton_schulz`;
    overrides ``ns_fp32``). ``grad_norms``: a list that receives the 2-norm of all gradients of
    each step, before the optimizers run. ``variant="normuon"``: NorMuon on the dedicated
    matrices (:class:`dmuon.testing.ReferenceOptimizer`'s ``variant``).

    Returns (losses, state_dict of the final model, Newton-Schulz calls per step), where the
    last counts the dedicated matrices that had a gradient (torch.optim.Muon skips the others).
    """
    model = copy.deepcopy(model)
    named = dict(model.named_parameters())
    opt = ReferenceOptimizer(
        model,
        {n: proxies_for(p.shape) for n, p in named.items() if n in dedicated},
        ns_dtype=torch.float32 if ns_fp32 else torch.bfloat16,
        newton_schulz=newton_schulz,
        variant=variant,
        **hp,
    )
    muon_params = [p for n, p in named.items() if n in dedicated]
    losses, ns_calls = [], []
    for batch in batches:
        if hasattr(model, "set_rank"):
            parts = []
            for r, chunk in enumerate(batch.chunk(world)):
                model.set_rank(r)
                parts.append(lm_loss(model, chunk))
            loss = torch.stack(parts).mean()
        else:
            loss = lm_loss(model, batch)
        loss.backward()
        if grad_norms is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_norms.append(torch.nn.utils.get_total_norm(grads).item())
        ns_calls.append(sum(p.grad is not None for p in muon_params))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, ns_calls


def hand_fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """``torch.optim._muon._zeropower_via_newtonschulz`` with ``.bfloat16()`` -> ``.float()``,
    written out by hand (not through :mod:`dmuon.testing`): the tests that validate dmuon's own
    reference patch torch with this one."""
    a, b, c = ns_coefficients
    X = grad.float()
    if grad.size(0) > grad.size(1):
        X = X.T
    X.div_(X.norm().clamp(min=eps))
    for _ in range(ns_steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    if grad.size(0) > grad.size(1):
        X = X.T
    return X
