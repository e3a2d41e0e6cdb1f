r"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534) settings as plan records.

The rescaling rule (MHA and GQA), what the plan's schedule adds and the record helpers: Note:
QK-clip (docs/design.md). The runtime: :mod:`dmuon.exec._optim.qk_clip`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dmuon.plan._records.fields import _check_int

__all__ = [
    "HeadRows",
    "AttentionClip",
    "QKClip",
    "QK_NORM_NAMES",
    "hf_llama_qk_clip",
    "gpt2_qk_clip",
    "attention_qk_clip",
    "check_qk_clip",
]

#: child-module names that mean normalised q / k after the projection (QK-norm): rescaling the
#: projection weights does not change such a model's logits, so QK-clip is refused
QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm", "qk_norm")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeadRows:
    """Where one projection's heads live in a dedicated weight.

    Head ``h`` is the slice ``[offset + h·head_dim, offset + (h+1)·head_dim)`` along ``dim`` of
    the weight ``fqn`` (``dim=0``: rows of an ``nn.Linear`` weight ``(out, in)``; ``dim=1``:
    columns of a GPT-2 ``Conv1D`` weight ``(in, out)``), and the same range of the 1-D ``bias``.
    """

    fqn: str
    num_heads: int
    head_dim: int
    dim: int = 0
    offset: int = 0
    bias: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str) or not self.fqn:
            raise ValueError(f"HeadRows.fqn must be a non-empty str, got {self.fqn!r}")
        _check_int("HeadRows", "num_heads", self.num_heads, 1)
        _check_int("HeadRows", "head_dim", self.head_dim, 1)
        _check_int("HeadRows", "offset", self.offset, 0)
        if self.dim not in (0, 1) or type(self.dim) is not int:
            raise ValueError(f"HeadRows.dim must be 0 or 1, got {self.dim!r}")
        if self.bias is not None and (not isinstance(self.bias, str) or not self.bias):
            raise ValueError(f"HeadRows.bias must be None or an FQN, got {self.bias!r}")

    @property
    def span(self) -> int:
        """Elements of ``dim`` the heads cover: ``num_heads · head_dim``."""
        return self.num_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadRows:
        return cls(**d)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AttentionClip:
    """One attention layer: the module that reports its per-head max logits, and its q / k heads.

    ``module``: FQN of the module that calls :func:`dmuon.exec._optim.qk_clip.record` (``(q.num_heads,)``
    values per call). ``k.num_heads`` must divide ``q.num_heads`` (GQA) and both have the same
    ``head_dim``.
    """

    module: str
    q: HeadRows
    k: HeadRows

    def __post_init__(self) -> None:
        if not isinstance(self.module, str):
            raise TypeError(f"AttentionClip.module must be a str, got {self.module!r}")
        if not isinstance(self.q, HeadRows) or not isinstance(self.k, HeadRows):
            raise TypeError("AttentionClip.q / .k must be HeadRows")
        if self.q.num_heads % self.k.num_heads:
            raise ValueError(
                f"AttentionClip {self.module!r}: {self.q.num_heads} q heads are not a multiple of "
                f"{self.k.num_heads} k heads"
            )
        if self.q.head_dim != self.k.head_dim:
            raise ValueError(
                f"AttentionClip {self.module!r}: q head_dim {self.q.head_dim} != k head_dim {self.k.head_dim}"
            )

    @property
    def gqa(self) -> bool:
        """True when k heads are shared (``H_kv < H``): the q-only rule applies."""
        return self.k.num_heads < self.q.num_heads

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "q": self.q.to_dict(), "k": self.k.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionClip:
        return cls(module=d["module"], q=HeadRows.from_dict(d["q"]), k=HeadRows.from_dict(d["k"]))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class QKClip:
    """QK-clip settings of a plan (Note: QK-clip, docs/design.md).

    Attributes:
        tau: the logit threshold ``τ > 0`` (Kimi K2 uses 100).
        attention: the layers, in the order of the all-reduced vector (their q heads one after
            another).
    """

    tau: float
    attention: tuple[AttentionClip, ...]

    def __post_init__(self) -> None:
        if (
            isinstance(self.tau, bool)
            or not isinstance(self.tau, (int, float))
            or not math.isfinite(self.tau)
            or self.tau <= 0
        ):
            raise ValueError(f"QKClip.tau must be a finite number > 0, got {self.tau!r}")
        object.__setattr__(self, "tau", float(self.tau))
        if (
            type(self.attention) is not tuple
            or not self.attention
            or any(not isinstance(a, AttentionClip) for a in self.attention)
        ):
            raise ValueError("QKClip.attention must be a non-empty tuple of AttentionClip")
        modules = [a.module for a in self.attention]
        if len(set(modules)) != len(modules):
            raise ValueError(f"QKClip: an attention module is listed twice: {modules}")

    @property
    def num_heads(self) -> int:
        """Length of the all-reduced vector: the q heads of every layer."""
        return sum(a.q.num_heads for a in self.attention)

    def describe(self) -> str:
        """``"tau=100.0, 32 layers, 1024 q heads (GQA: q-only rule)"``."""
        gqa = sum(a.gqa for a in self.attention)
        rule = f", {gqa} GQA layers (q-only rule)" if gqa else ""
        return f"tau={self.tau:g}, {len(self.attention)} layers, {self.num_heads} q heads{rule}"

    def to_dict(self) -> dict[str, Any]:
        return {"tau": self.tau, "attention": [a.to_dict() for a in self.attention]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QKClip:
        return cls(tau=d["tau"], attention=tuple(AttentionClip.from_dict(a) for a in d["attention"]))


# ---------------------------------------------------------------------------- helpers


def _has_qk_norm(module) -> str | None:
    for name in QK_NORM_NAMES:
        if getattr(module, name, None) is not None:
            return name
    return None


def _refuse_qk_norm(fqn: str, name: str) -> ValueError:
    return ValueError(
        f"dmuon: QK-clip on {fqn!r}: the module has {name!r} (QK-norm: q and k are normalised after the "
        "projection, e.g. Qwen3, OLMo2), so rescaling W_q / W_k rows does not change its logits. Leave this "
        "layer out of qk_clip (QK-norm already bounds the logits) or turn QK-norm off."
    )


def attention_qk_clip(
    model,
    tau: float,
    *,
    suffix: str,
    q: str,
    k: str,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int,
) -> QKClip:
    """A :class:`QKClip` for every module of ``model`` whose FQN ends with ``suffix`` and that
    has separate ``q`` / ``k`` linear children (``nn.Linear`` weights ``(H·d_h, D)``; a ``bias``
    is rescaled too when present).

    Raises:
        ValueError: no such module; a module with QK-norm (:data:`QK_NORM_NAMES`).
    """
    num_kv_heads = num_kv_heads or num_heads
    found = []
    for fqn, mod in model.named_modules():
        if not (fqn == suffix or fqn.endswith("." + suffix)):
            continue
        qm, km = getattr(mod, q, None), getattr(mod, k, None)
        if qm is None or km is None:
            continue
        norm = _has_qk_norm(mod)
        if norm:
            raise _refuse_qk_norm(fqn, norm)

        def rows(child, name, heads):
            bias = f"{fqn}.{name}.bias" if getattr(child, "bias", None) is not None else None
            return HeadRows(fqn=f"{fqn}.{name}.weight", num_heads=heads, head_dim=head_dim, bias=bias)

        found.append(AttentionClip(module=fqn, q=rows(qm, q, num_heads), k=rows(km, k, num_kv_heads)))
    if not found:
        raise ValueError(f"dmuon: QK-clip found no module '*{suffix}' with '{q}' and '{k}' children")
    return QKClip(tau=tau, attention=tuple(found))


def hf_llama_qk_clip(model, tau: float, config: Any = None) -> QKClip:
    """QK-clip for Hugging Face Llama-style attention (``*.self_attn.q_proj`` / ``k_proj``:
    Llama, Mistral, Qwen2 with its q / k biases). ``config`` defaults to ``model.config``.
    Qwen3 (``q_norm`` / ``k_norm``) is refused."""
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("hf_llama_qk_clip: pass the transformers config (num_attention_heads, num_key_value_heads)")
    H = config.num_attention_heads
    H_kv = getattr(config, "num_key_value_heads", None) or H
    d_h = getattr(config, "head_dim", None) or config.hidden_size // H
    return attention_qk_clip(
        model, tau, suffix="self_attn", q="q_proj", k="k_proj", num_heads=H, num_kv_heads=H_kv, head_dim=d_h
    )


def gpt2_qk_clip(model, tau: float, num_heads: int | None = None) -> QKClip:
    """QK-clip for Hugging Face GPT-2 (``*.attn.c_attn``, a ``Conv1D`` weight ``(D, 3·D)``: q
    columns ``[0, D)``, k columns ``[D, 2·D)``, and the same entries of ``c_attn.bias``)."""
    H = num_heads or getattr(getattr(model, "config", None), "n_head", None)
    if not H:
        raise ValueError("gpt2_qk_clip: pass num_heads (or a model with config.n_head)")
    found = []
    for fqn, mod in model.named_modules():
        c_attn = getattr(mod, "c_attn", None)
        if c_attn is None or not (fqn == "attn" or fqn.endswith(".attn")):
            continue
        norm = _has_qk_norm(mod)
        if norm:
            raise _refuse_qk_norm(fqn, norm)
        D = int(c_attn.weight.shape[0])
        bias = f"{fqn}.c_attn.bias" if getattr(c_attn, "bias", None) is not None else None
        w = f"{fqn}.c_attn.weight"
        found.append(
            AttentionClip(
                module=fqn,
                q=HeadRows(fqn=w, num_heads=H, head_dim=D // H, dim=1, offset=0, bias=bias),
                k=HeadRows(fqn=w, num_heads=H, head_dim=D // H, dim=1, offset=D, bias=bias),
            )
        )
    if not found:
        raise ValueError("dmuon: gpt2_qk_clip found no '*.attn' module with a 'c_attn' child")
    return QKClip(tau=tau, attention=tuple(found))


def check_qk_clip(qk: QKClip, specs, modules, params) -> None:
    """Compile-time checks of ``qk`` against the dedicated ``specs`` (by any alias), the model's
    ``modules`` (FQN -> module) and ``params`` (FQN -> ParamRecord of every parameter).

    Raises:
        ValueError (listing every problem): a W_q / W_k that is not dedicated (dmuon owns the
        rows it rescales), TP-sharded, not 2-D or too small for its heads; a bias that is missing
        or not 1-D; an attention module that does not exist or has QK-norm.
    """
    by_alias = {a: s for s in specs for a in s.aliases}
    problems: list[str] = []
    for a in qk.attention:
        mod = modules.get(a.module)
        if mod is None:
            problems.append(f"  {a.module!r}: no such module")
        else:
            norm = _has_qk_norm(mod)
            if norm:
                raise _refuse_qk_norm(a.module, norm)
        for role, rows in (("W_q", a.q), ("W_k", a.k)):
            spec = by_alias.get(rows.fqn)
            if spec is None:
                problems.append(
                    f"  {a.module!r}: {role} {rows.fqn!r} is not a dedicated parameter (QK-clip rescales rows "
                    "on their owner; select it with predicate)"
                )
                continue
            if spec.tp_size > 1:
                problems.append(
                    f"  {a.module!r}: {role} {rows.fqn!r} is tensor-parallel; QK-clip supports data parallelism only"
                )
                continue
            if len(spec.shape) != 2 or rows.offset + rows.span > spec.shape[rows.dim]:
                problems.append(
                    f"  {a.module!r}: {role} heads [{rows.offset}, {rows.offset + rows.span}) along dim {rows.dim} do "
                    f"not fit {rows.fqn!r} of shape {spec.shape}"
                )
            if rows.bias is not None:
                rec = params.get(rows.bias)
                if rec is None or len(rec.shape) != 1 or rows.offset + rows.span > rec.shape[0]:
                    problems.append(
                        f"  {a.module!r}: {role} bias {rows.bias!r} is missing or not a 1-D vector covering the heads"
                    )
    if problems:
        raise ValueError("dmuon.plan._compile: qk_clip:\n" + "\n".join(problems))
