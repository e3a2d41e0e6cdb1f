"""Per-parameter plan records: :class:`ParamSpec` (a dedicated parameter as the plan sees it),
:class:`MatrixView` (its blocks orthogonalised separately), :class:`ExpertStack` (how a 3-D
stack holds its experts' matrices) and :class:`Fsdp2Unit` (the parameters FSDP2 keeps).

Every record here is a frozen dataclass (``slots=True, kw_only=True``) holding only ints,
strings and tuples, validated once in ``__post_init__``; derive new ones with
:func:`dataclasses.replace` (which re-validates). They are optree *leaves* of a
:class:`~dmuon.plan._records.plan.ShardingPlan` (see ``plan.py`` for the tree registration).
Owners: :mod:`dmuon.plan._records.owners`; field checks and dtype strings:
:mod:`dmuon.plan._records.fields`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dmuon.plan._records.fields import _check_int, _check_shape, check_dtype_str
from dmuon.plan._records.owners import _offsets

__all__ = [
    "MatrixView",
    "ExpertStack",
    "ParamSpec",
    "Fsdp2Unit",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MatrixView:
    """Blocks of a 2-D parameter that Muon orthogonalises as separate matrices.

    The parameter ``(m, n)`` is cut along ``dim`` into consecutive blocks of ``sizes``
    (``sum(sizes) == shape[dim]``): ``dim=0`` gives row blocks ``(sizes[i], n)`` (per-head
    ``q/k/v_proj`` weights ``(H·d_h, D)``, Megatron's fused ``(D_q + 2·D_kv, D)`` QKV),
    ``dim=1`` column blocks ``(m, sizes[i])`` (per-head ``o_proj`` ``(D, H·d_h)``, GPT-2's
    ``Conv1D`` ``c_attn`` ``(D, 3·D)``). Every block gets its own Newton-Schulz and its own
    ``adjust_lr`` scale from its own shape, exactly as ``torch.optim.Muon`` would treat it as a
    parameter of its own; weight decay is elementwise, so it is unchanged.

    Attributes:
        dim: 0 (row blocks) or 1 (column blocks).
        sizes: elements of ``dim`` in each block, in order (each >= 1).
        label: what the blocks are, for reports (``"heads"``, ``"qkv"``, ``"q|k|v heads"``).
    """

    dim: int
    sizes: tuple[int, ...]
    label: str = ""

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or type(self.dim) is not int:
            raise ValueError(f"MatrixView.dim must be 0 (row blocks) or 1 (column blocks), got {self.dim!r}")
        if type(self.sizes) is not tuple or not self.sizes:
            raise TypeError(f"MatrixView.sizes must be a non-empty tuple of ints, got {self.sizes!r}")
        for v in self.sizes:
            _check_int("MatrixView", "sizes[i]", v, 1)
        if not isinstance(self.label, str):
            raise TypeError(f"MatrixView.label must be a str, got {self.label!r}")

    def blocks(self, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """``(m_i, n_i)`` of each block of a parameter of 2-D ``shape``."""
        m, n = shape
        return tuple((s, n) if self.dim == 0 else (m, s) for s in self.sizes)

    def offsets(self) -> tuple[int, ...]:
        """Start of each block along :attr:`dim`."""
        return _offsets(self.sizes)

    def describe(self, shape: tuple[int, ...]) -> str:
        """``"32 heads of (128, 4096) along dim 0"`` / ``"qkv: (2048, 4096), (512, 4096) x2 along dim 0"``."""
        blocks = self.blocks(shape)
        runs: list[list] = []
        for b in blocks:
            if runs and runs[-1][0] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, 1])
        body = ", ".join(f"{b}" + (f" x{k}" if k > 1 else "") for b, k in runs)
        label = f"{self.label}: " if self.label else ""
        return f"{label}{len(blocks)} blocks {body} along dim {self.dim}"

    def to_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, "sizes": list(self.sizes), "label": self.label}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MatrixView:
        return cls(dim=d["dim"], sizes=tuple(d["sizes"]), label=d.get("label", ""))


_GATE_UP_FORMS = ("", "concat", "interleave")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpertStack:
    """How a 3-D parameter ``(E, a, b)`` holds its experts' Muon matrices.

    Attributes:
        num_experts: ``E``, the leading dim.
        transposed: each expert is stored ``(in, out)`` (gpt-oss), i.e. its ``nn.Linear``
            matrix is ``W[e].T``; False: stored ``(out, in)``.
        gate_up: ``""`` (one projection per expert), ``"concat"`` (gate rows then up rows along
            the output dim) or ``"interleave"`` (gate and up alternate along the output dim).
        split: with a fused ``gate_up``, orthogonalise gate and up separately (default); False
            keeps each expert's fused ``(2F, D)`` matrix whole. Ignored without ``gate_up``.
        layout: what recognised it, for reports (``"hf"``, ``"gpt-oss"``, ``"torchtitan"``,
            ``"generic"``).
        ep_size: expert-parallel degree (``compile(ep=...)``): the model on each of ``ep_size``
            ranks holds ``num_experts // ep_size`` consecutive experts as a plain tensor
            (rank ``j``: experts ``j*E/ep ..``); ``num_experts`` is the global ``E``. 1 = every
            rank's model holds the whole stack. In JSON only when > 1.
    """

    num_experts: int
    transposed: bool = False
    gate_up: str = ""
    split: bool = True
    layout: str = "generic"
    ep_size: int = 1

    def __post_init__(self) -> None:
        _check_int("ExpertStack", "num_experts", self.num_experts, 1)
        if type(self.transposed) is not bool or type(self.split) is not bool:
            raise TypeError("ExpertStack.transposed and .split must be bools")
        if self.gate_up not in _GATE_UP_FORMS:
            raise ValueError(f"ExpertStack.gate_up must be one of {_GATE_UP_FORMS}, got {self.gate_up!r}")
        if not isinstance(self.layout, str):
            raise TypeError(f"ExpertStack.layout must be a str, got {self.layout!r}")
        _check_int("ExpertStack", "ep_size", self.ep_size, 1)
        if self.num_experts % self.ep_size:
            raise ValueError(f"ExpertStack: {self.num_experts} experts do not split over ep_size {self.ep_size} ranks")

    @property
    def local_experts(self) -> int:
        """Experts each expert-parallel rank holds: ``num_experts // ep_size``."""
        return self.num_experts // self.ep_size

    @property
    def matrices_per_expert(self) -> int:
        """2 for a split gate/up projection, else 1."""
        return 2 if self.gate_up and self.split else 1

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(out, in)`` of each Muon matrix of a stack of ``shape`` (``nn.Linear`` orientation)."""
        _, a, b = shape
        out, inp = (b, a) if self.transposed else (a, b)
        if self.matrices_per_expert == 2:
            if out % 2:
                raise ValueError(f"a fused gate/up stack needs an even output dim, got {out} in {shape}")
            out //= 2
        return (out, inp)

    def describe(self, shape: tuple[int, ...]) -> str:
        """``"128 experts x gate|up (768, 2048) [hf]"``."""
        m, n = self.matrix_shape(shape)
        parts = "gate|up " if self.matrices_per_expert == 2 else ("gate+up fused " if self.gate_up else "")
        stored = ", stored (in, out)" if self.transposed else ""
        ep = f", expert-parallel over {self.ep_size}" if self.ep_size > 1 else ""
        return f"{self.num_experts} experts x {parts}({m}, {n}) [{self.layout}{stored}{ep}]"

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "transposed": self.transposed,
            "gate_up": self.gate_up,
            "split": self.split,
            "layout": self.layout,
            **({"ep_size": self.ep_size} if self.ep_size > 1 else {}),  # absent without EP
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExpertStack:
        return cls(
            num_experts=d["num_experts"],
            transposed=d["transposed"],
            gate_up=d["gate_up"],
            split=d["split"],
            layout=d["layout"],
            ep_size=d.get("ep_size", 1),
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """A dedicated parameter as the plan sees it.

    Attributes:
        fqn: canonical FQN (first name of the tensor in ``model.named_parameters()`` order).
        shape: logical shape of the full parameter (elements per dim).
        dtype: storage dtype string, e.g. ``"torch.float32"``.
        numel: ``prod(shape)`` elements.
        matrix_shape: ``(m, n)`` of each matrix Muon orthogonalises: ``shape`` for 2-D, ``(out,
            in * prod(kernel))`` for an ``nn.Conv{1,2,3}d`` weight, ``shape[1:]`` for a 3-D
            expert stack ``(E, m, n)``.
        num_matrices: 1, or ``E`` for an expert stack. ``num_matrices * m * n == numel``.
        aliases: every name of this tensor, ``fqn`` first, in
            ``named_parameters(remove_duplicate=False)`` order.
        module_fqn: FQN of the canonical owning module (``""`` = the root module).
        attr: attribute name of the parameter on that module; ``fqn == module_fqn + "." + attr``
            (or ``attr`` alone when ``module_fqn == ""``).
        tp_size: ``T``, ranks of the tensor-parallel mesh that shards this matrix (1 = no TP).
        tp_shard_dim: the dim of ``shape`` TP shards (``Shard(0)``: colwise ``nn.Linear``
            weight, ``Shard(1)``: rowwise), ``shape[dim] % T == 0``; None without TP.
        tp_ns: how the owner's TP group orthogonalises it: ``"gram"`` (each TP rank keeps its
            shard; one all-reduce of the fp32 Gram ``(d, d)`` per Gram NS segment, ``d`` = the
            side TP does not shard) or ``"gather"`` (all-gather the update, every TP rank runs
            NS on the full matrix and keeps its shard); None without TP.
            See :func:`dmuon.plan._rules.choose_tp_ns`. ``"local"``: the matrix has a
            :class:`MatrixView` whose blocks each lie inside one TP shard (heads split by TP):
            every TP rank orthogonalises its own blocks, no TP collective.
        view: a :class:`MatrixView` (blocks orthogonalised separately: per-head, split QKV) of
            a 2-D parameter, or None (the whole ``matrix_shape`` matrix). With a view,
            ``matrix_shape`` is the parameter's ``(m, n)`` and :attr:`matrices` lists the blocks.
        ns_backend: the Newton-Schulz backend its owner runs, ``"standard"`` (default) or
            ``"gram"`` (``compile(ns_backend=...)``, :func:`dmuon.plan._rules.choose_ns_backend`);
            ``cost_model="ns_flops"`` weighs it by that backend's FLOPs and ``dmuon.Muon``
            checks that it runs it. Always ``"standard"`` for a TP-sharded matrix (``tp_ns``
            decides there).
        experts: an :class:`ExpertStack` for a 3-D expert stack ``(E, a, b)`` (its layout:
            orientation, fused gate/up and whether it is split), else None. Then
            ``matrix_shape`` is one Muon matrix ``(out, in)`` in ``nn.Linear`` orientation and
            ``num_matrices = E * experts.matrices_per_expert`` (``2E`` for a split gate/up).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    matrix_shape: tuple[int, int]
    num_matrices: int
    aliases: tuple[str, ...]
    module_fqn: str
    attr: str
    tp_size: int = 1
    tp_shard_dim: int | None = None
    tp_ns: str | None = None
    view: MatrixView | None = None
    ns_backend: str = "standard"
    experts: ExpertStack | None = None

    @property
    def num_experts(self) -> int:
        """``E`` of an expert stack, 1 otherwise (a stack without an :class:`ExpertStack`
        record, selected by a predicate, counts its leading dim)."""
        if self.experts is not None:
            return self.experts.num_experts
        return self.shape[0] if len(self.shape) == 3 else 1

    @property
    def matrices(self) -> tuple[tuple[int, int], ...]:
        """``(m, n)`` of every matrix Muon orthogonalises: the view's blocks, else
        ``num_matrices`` copies of ``matrix_shape``. NS FLOPs, LPT weights and ``adjust_lr`` use these."""
        if self.view is not None:
            return self.view.blocks(self.shape)
        return (tuple(self.matrix_shape),) * self.num_matrices  # type: ignore[return-value]

    def shard_matrices(self, tp: int) -> tuple[tuple[int, int], ...]:
        """The view blocks TP coordinate ``tp`` orthogonalises when ``tp_ns == "local"`` (those
        inside its shard); :attr:`matrices` otherwise."""
        if self.tp_ns != "local":
            return self.matrices
        per = self.shape[self.tp_shard_dim] // self.tp_size  # type: ignore[index]
        return tuple(
            b
            for b, off in zip(self.matrices, self.view.offsets())
            if tp * per <= off < (tp + 1) * per  # type: ignore[union-attr]
        )

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree of an expert stack (:attr:`ExpertStack.ep_size`), else 1."""
        return self.experts.ep_size if self.experts is not None else 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of one TP rank's shard, or of one expert-parallel rank's experts
        ``(E/ep, a, b)`` (``shape`` without TP or EP): elements per dim."""
        if self.ep_size > 1:
            return (self.shape[0] // self.ep_size,) + tuple(self.shape[1:])
        if self.tp_size == 1:
            return self.shape
        d = self.tp_shard_dim
        return self.shape[:d] + (self.shape[d] // self.tp_size,) + self.shape[d + 1 :]

    @property
    def local_numel(self) -> int:
        """Elements of one TP rank's shard, or one expert-parallel rank's experts (``numel``
        without TP or EP)."""
        return self.numel // (self.tp_size * self.ep_size)

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str) or not self.fqn:
            raise ValueError(f"ParamSpec.fqn must be a non-empty str, got {self.fqn!r}")
        _check_shape("ParamSpec", "shape", self.shape)
        check_dtype_str("ParamSpec", "dtype", self.dtype)
        _check_int("ParamSpec", "numel", self.numel, 0)
        if self.numel != math.prod(self.shape):
            raise ValueError(f"ParamSpec {self.fqn}: numel {self.numel} != prod(shape {self.shape})")
        _check_shape("ParamSpec", "matrix_shape", self.matrix_shape)
        if len(self.matrix_shape) != 2:
            raise ValueError(f"ParamSpec {self.fqn}: matrix_shape must be (m, n), got {self.matrix_shape}")
        _check_int("ParamSpec", "num_matrices", self.num_matrices, 1)
        if self.num_matrices * self.matrix_shape[0] * self.matrix_shape[1] != self.numel:
            raise ValueError(
                f"ParamSpec {self.fqn}: num_matrices * m * n = {self.num_matrices} * "
                f"{self.matrix_shape[0]} * {self.matrix_shape[1]} != numel {self.numel}"
            )
        if type(self.aliases) is not tuple or not self.aliases or self.aliases[0] != self.fqn:
            raise ValueError(f"ParamSpec {self.fqn}: aliases must be a tuple starting with fqn, got {self.aliases!r}")
        if len(set(self.aliases)) != len(self.aliases):
            raise ValueError(f"ParamSpec {self.fqn}: duplicate aliases {self.aliases!r}")
        if not isinstance(self.module_fqn, str) or not isinstance(self.attr, str) or not self.attr:
            raise ValueError(f"ParamSpec {self.fqn}: module_fqn/attr must be strings")
        expected = f"{self.module_fqn}.{self.attr}" if self.module_fqn else self.attr
        if expected != self.fqn:
            raise ValueError(f"ParamSpec {self.fqn}: module_fqn {self.module_fqn!r} + attr {self.attr!r} != fqn")
        _check_int("ParamSpec", "tp_size", self.tp_size, 1)
        if self.tp_size == 1:
            if self.tp_shard_dim is not None or self.tp_ns is not None:
                raise ValueError(f"ParamSpec {self.fqn}: tp_shard_dim/tp_ns need tp_size > 1")
        else:
            if len(self.shape) != 2 or self.num_matrices != 1:
                raise ValueError(f"ParamSpec {self.fqn}: tensor parallelism is supported for 2-D matrices only")
            if self.tp_shard_dim not in (0, 1):
                raise ValueError(f"ParamSpec {self.fqn}: tp_shard_dim must be 0 or 1, got {self.tp_shard_dim!r}")
            if self.shape[self.tp_shard_dim] % self.tp_size:
                raise ValueError(
                    f"ParamSpec {self.fqn}: dim {self.tp_shard_dim} of {self.shape} is not divisible by "
                    f"tp_size {self.tp_size}"
                )
            if self.tp_ns not in ("gram", "gather", "local"):
                raise ValueError(f"ParamSpec {self.fqn}: tp_ns must be 'gram', 'gather' or 'local', got {self.tp_ns!r}")
            if self.tp_ns == "local":
                problem = self.view_tp_problem()
                if problem:
                    raise ValueError(f"ParamSpec {self.fqn}: tp_ns='local' but {problem}")
        if self.view is not None:
            if not isinstance(self.view, MatrixView):
                raise TypeError(f"ParamSpec {self.fqn}: view must be a MatrixView or None, got {self.view!r}")
            if len(self.shape) != 2 or self.num_matrices != 1:
                raise ValueError(f"ParamSpec {self.fqn}: a MatrixView needs a 2-D parameter, got shape {self.shape}")
            if sum(self.view.sizes) != self.shape[self.view.dim]:
                raise ValueError(
                    f"ParamSpec {self.fqn}: view sizes sum to {sum(self.view.sizes)} but dim {self.view.dim} "
                    f"of {self.shape} is {self.shape[self.view.dim]}"
                )
        if self.experts is not None:
            if not isinstance(self.experts, ExpertStack):
                raise TypeError(f"ParamSpec {self.fqn}: experts must be an ExpertStack or None, got {self.experts!r}")
            if len(self.shape) != 3 or self.shape[0] != self.experts.num_experts:
                raise ValueError(
                    f"ParamSpec {self.fqn}: an expert stack needs shape (E, a, b) with E = "
                    f"{self.experts.num_experts}, got {self.shape}"
                )
            if self.experts.ep_size > 1 and self.tp_size > 1:
                raise ValueError(f"ParamSpec {self.fqn}: an expert-parallel stack cannot also be TP-sharded")
            expected = (
                self.experts.matrix_shape(self.shape),
                self.experts.num_experts * self.experts.matrices_per_expert,
            )
            if (tuple(self.matrix_shape), self.num_matrices) != expected:
                raise ValueError(
                    f"ParamSpec {self.fqn}: matrix_shape {self.matrix_shape} x {self.num_matrices} does not match "
                    f"its expert stack {self.experts.describe(self.shape)}"
                )
        if self.ns_backend not in ("standard", "gram"):
            raise ValueError(f"ParamSpec {self.fqn}: ns_backend must be 'standard' or 'gram', got {self.ns_backend!r}")
        if self.tp_size > 1 and self.ns_backend != "standard":
            raise ValueError(f"ParamSpec {self.fqn}: a TP-sharded matrix has ns_backend 'standard' (tp_ns decides)")

    def view_tp_problem(self) -> str | None:
        """Why this TP-sharded matrix's view cannot be orthogonalised shard-locally (None if it can):
        the blocks must cut the dim TP shards, and every shard boundary must be a block boundary."""
        if self.view is None:
            return "it has no matrix view"
        if self.view.dim != self.tp_shard_dim:
            return (
                f"its view cuts dim {self.view.dim} while TP shards dim {self.tp_shard_dim} (every block would be "
                "split across the TP ranks)"
            )
        per = self.shape[self.tp_shard_dim] // self.tp_size  # type: ignore[index]
        cuts = set(self.view.offsets())
        if any(t * per not in cuts for t in range(self.tp_size)):
            return (
                f"its blocks {self.view.sizes} along dim {self.view.dim} straddle the TP shard boundaries "
                f"(multiples of {per})"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        tp = {}
        if self.tp_size > 1:  # absent without TP: plans without TP keep their JSON and fingerprint
            tp = {"tp_size": self.tp_size, "tp_shard_dim": self.tp_shard_dim, "tp_ns": self.tp_ns}
        view = {} if self.view is None else {"view": self.view.to_dict()}  # absent: older plans keep their JSON
        if self.ns_backend != "standard":  # absent by default: older plans keep their JSON
            tp["ns_backend"] = self.ns_backend
        if self.experts is not None:  # absent for matrices: plans without expert stacks keep their JSON
            tp["experts"] = self.experts.to_dict()
        return {
            "fqn": self.fqn,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "numel": self.numel,
            "matrix_shape": list(self.matrix_shape),
            "num_matrices": self.num_matrices,
            "aliases": list(self.aliases),
            "module_fqn": self.module_fqn,
            "attr": self.attr,
            **tp,
            **view,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamSpec:
        return cls(
            fqn=d["fqn"],
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            numel=d["numel"],
            matrix_shape=tuple(d["matrix_shape"]),
            num_matrices=d["num_matrices"],
            aliases=tuple(d["aliases"]),
            module_fqn=d["module_fqn"],
            attr=d["attr"],
            tp_size=d.get("tp_size", 1),
            tp_shard_dim=d.get("tp_shard_dim"),
            tp_ns=d.get("tp_ns"),
            view=MatrixView.from_dict(d["view"]) if d.get("view") is not None else None,
            ns_backend=d.get("ns_backend", "standard"),
            experts=ExpertStack.from_dict(d["experts"]) if d.get("experts") is not None else None,
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Fsdp2Unit:
    """The parameters dmuon does NOT dedicate that one ``fully_shard`` unit manages, as the
    schedule's external FSDP2 ops see them (FSDP2 all-gathers and reduce-scatters them itself).

    Units follow the documented set-up, ``fully_shard`` on every hook boundary, then on the
    root: a parameter belongs to its hook boundary's unit, or to the root's (``fqn == ""``:
    embeddings, final norm, ``lm_head``).

    Attributes:
        fqn: module FQN of the unit (``""`` = the root).
        params: canonical FQNs, ``named_parameters()`` order.
        shapes: each parameter's shape on one TP rank (its full shape without TP).
        dtypes: each parameter's storage dtype string.
        requires_grad: whether each parameter gets a gradient (FSDP2 reduces only those).
    """

    fqn: str
    params: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    requires_grad: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str):
            raise TypeError(f"Fsdp2Unit.fqn must be a str, got {self.fqn!r}")
        n = len(self.params)
        if not n or any(len(getattr(self, f)) != n for f in ("shapes", "dtypes", "requires_grad")):
            raise ValueError(f"Fsdp2Unit {self.fqn!r}: params, shapes, dtypes and requires_grad must align (non-empty)")
        for shape in self.shapes:
            _check_shape("Fsdp2Unit", "shapes[i]", shape)
        for d in self.dtypes:
            check_dtype_str("Fsdp2Unit", "dtypes[i]", d)
        if any(type(g) is not bool for g in self.requires_grad):
            raise TypeError(f"Fsdp2Unit {self.fqn!r}: requires_grad must hold bools")

    def to_dict(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "params": list(self.params),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "requires_grad": list(self.requires_grad),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fsdp2Unit:
        return cls(
            fqn=d["fqn"],
            params=tuple(d["params"]),
            shapes=tuple(tuple(s) for s in d["shapes"]),
            dtypes=tuple(d["dtypes"]),
            requires_grad=tuple(d["requires_grad"]),
        )
