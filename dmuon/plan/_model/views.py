"""Matrix views: which blocks of a dedicated matrix Muon orthogonalises separately.

The mapping or callable ``compile(matrix_views=...)`` takes, the rules (:func:`heads`,
:func:`fused_qkv`) and the model helpers: Note: matrix views (docs/design.md).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from dmuon.plan._records.params import MatrixView

__all__ = [
    "heads",
    "split",
    "fused_qkv",
    "hf_llama_views",
    "hf_qwen_views",
    "gpt2_views",
    "megatron_views",
    "resolve_views",
]

Rule = Callable[[tuple[int, int]], MatrixView]


def split(sizes, *, dim: int = 0, label: str = "") -> MatrixView:
    """A fixed :class:`MatrixView`: blocks of ``sizes`` along ``dim``."""
    return MatrixView(dim=dim, sizes=tuple(int(s) for s in sizes), label=label)


def heads(num_heads: int, *, dim: int = 0, label: str = "heads") -> Rule:
    """Rule: ``num_heads`` equal blocks along ``dim`` (``shape[dim] % num_heads == 0``)."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"heads(num_heads) must be a positive int, got {num_heads!r}")

    def rule(shape: tuple[int, int]) -> MatrixView:
        if shape[dim] % num_heads:
            raise ValueError(f"dim {dim} of {shape} is not divisible by num_heads={num_heads}")
        return MatrixView(dim=dim, sizes=(shape[dim] // num_heads,) * num_heads, label=label)

    rule.__qualname__ = f"heads({num_heads}, dim={dim})"
    return rule


def fused_qkv(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dim: int = 0,
    layout: str = "concat",
    per_head: bool = False,
) -> Rule:
    """Rule for a fused QKV weight (Note: matrix views, docs/design.md): q, k and v blocks (``per_head``: every
    head)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if layout not in ("concat", "grouped"):
        raise ValueError(f"fused_qkv layout must be 'concat' or 'grouped', got {layout!r}")
    g = num_heads // num_kv_heads

    def part(n_heads: int) -> list[int]:
        return [head_dim] * n_heads if per_head else [n_heads * head_dim]

    if layout == "concat":
        sizes = part(num_heads) + part(num_kv_heads) + part(num_kv_heads)
    else:
        sizes = [s for _ in range(num_kv_heads) for s in part(g) + [head_dim, head_dim]]
    total = (num_heads + 2 * num_kv_heads) * head_dim
    label = ("q|k|v heads" if per_head else "q|k|v") + (" (grouped)" if layout == "grouped" else "")

    def rule(shape: tuple[int, int]) -> MatrixView:
        if shape[dim] != total:
            raise ValueError(
                f"dim {dim} of {shape} is not (num_heads + 2*num_kv_heads) * head_dim = "
                f"({num_heads} + 2*{num_kv_heads}) * {head_dim} = {total}"
            )
        return MatrixView(dim=dim, sizes=tuple(sizes), label=label)

    rule.__qualname__ = f"fused_qkv({num_heads}, {num_kv_heads}, {head_dim}, dim={dim}, layout={layout!r})"
    return rule


def _attn_shape(config: Any, num_heads, num_kv_heads, head_dim) -> tuple[int, int, int]:
    if config is not None:
        num_heads = num_heads or getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
        num_kv_heads = num_kv_heads or getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = head_dim or getattr(config, "head_dim", None)
        if head_dim is None:
            hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
            head_dim = hidden // num_heads if hidden and num_heads else None
    num_kv_heads = num_kv_heads or num_heads
    if not num_heads or not head_dim:
        raise ValueError("pass num_heads and head_dim (or a config with num_attention_heads / hidden_size)")
    return int(num_heads), int(num_kv_heads), int(head_dim)


def hf_llama_views(
    config: Any = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    o_proj: bool = True,
    prefix: str = "*",
) -> dict[str, Rule]:
    """Per-head views for Hugging Face Llama-style attention (Llama, Mistral, Qwen2, Qwen3):
    ``q_proj`` as ``H`` row blocks, ``k_proj`` / ``v_proj`` as ``H_kv`` row blocks and (with
    ``o_proj=True``) ``o_proj`` as ``H`` column blocks. ``config``: a transformers config
    (``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or ``hidden_size``)."""
    H, H_kv, _ = _attn_shape(config, num_heads, num_kv_heads, head_dim)
    out: dict[str, Rule] = {
        f"{prefix}.self_attn.q_proj.weight": heads(H),
        f"{prefix}.self_attn.k_proj.weight": heads(H_kv),
        f"{prefix}.self_attn.v_proj.weight": heads(H_kv),
    }
    if o_proj:
        out[f"{prefix}.self_attn.o_proj.weight"] = heads(H, dim=1)
    return out


#: Qwen2 / Qwen3 use the Llama attention names
hf_qwen_views = hf_llama_views


def gpt2_views(
    config: Any = None, *, num_heads: int | None = None, per_head: bool = False, prefix: str = "*"
) -> dict[str, Rule]:
    """Views for Hugging Face GPT-2 (``Conv1D`` weights are ``(in, out)``): ``attn.c_attn``
    ``(D, 3·D)`` split along dim 1 into q | k | v (``per_head``: into ``3·H`` heads) and, with
    ``per_head``, ``attn.c_proj`` ``(D, D)`` as ``H`` row blocks (its input is the heads)."""
    H = num_heads or getattr(config, "n_head", None) or getattr(config, "num_attention_heads", None)
    if not H:
        raise ValueError("gpt2_views: pass num_heads (or a GPT2Config)")

    def c_attn(shape: tuple[int, int]) -> MatrixView:
        D = shape[0]
        if shape[1] != 3 * D or D % H:
            raise ValueError(f"c_attn weight {shape} is not (D, 3*D) with D divisible by num_heads={H}")
        return fused_qkv(H, H, D // H, dim=1, per_head=per_head)(shape)

    out: dict[str, Rule] = {f"{prefix}.attn.c_attn.weight": c_attn}
    if per_head:
        out[f"{prefix}.attn.c_proj.weight"] = heads(H, dim=0)
    return out


def megatron_views(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    per_head: bool = False,
    o_proj: bool = False,
    prefix: str = "*",
) -> dict[str, Rule]:
    """Views for Megatron-LM names: ``self_attention.linear_qkv`` (grouped layout, split along
    dim 0) and, with ``o_proj``, ``self_attention.linear_proj`` as ``H`` column blocks."""
    out: dict[str, Rule] = {
        f"{prefix}.self_attention.linear_qkv.weight": fused_qkv(
            num_heads, num_kv_heads, head_dim, layout="grouped", per_head=per_head
        )
    }
    if o_proj:
        out[f"{prefix}.self_attention.linear_proj.weight"] = heads(num_heads, dim=1)
    return out


def resolve_views(specs, matrix_views) -> dict[str, MatrixView]:
    """``{canonical fqn: MatrixView}`` for the dedicated ``specs`` under ``matrix_views``
    (Note: matrix views, docs/design.md). Pure.

    Raises:
        ValueError: a view for a parameter that is not 2-D, a rule that does not fit its shape,
            a mapping pattern that matches no dedicated parameter, a bad value type. Every
            problem is listed, each with its parameter.
    """
    if matrix_views is None:
        return {}
    problems: list[str] = []
    out: dict[str, MatrixView] = {}
    used: set[str] = set()
    is_map = isinstance(matrix_views, Mapping)
    if not is_map and not callable(matrix_views):
        raise TypeError(
            f"matrix_views must be a mapping {{fqn pattern: view}} or a callable (fqn, shape) -> view, "
            f"got {type(matrix_views).__name__}"
        )
    for spec in specs:
        value = None
        if is_map:
            for pattern, v in matrix_views.items():
                if any(fnmatch.fnmatchcase(a, pattern) for a in spec.aliases):
                    used.add(pattern)
                    value = v
                    break
        else:
            value = matrix_views(spec.fqn, tuple(spec.shape))
        if value is None:
            continue
        if getattr(spec, "experts", None) is not None:
            problems.append(
                f"  {spec.fqn}: shape {spec.shape} is an expert stack ({spec.experts.describe(spec.shape)}): every "
                "expert is already its own Muon matrix; views cut 2-D weights (ExpertPolicy(gate_up=...) chooses "
                "whether a fused gate/up expert is one matrix or two)"
            )
            continue
        if len(spec.shape) != 2 or spec.num_matrices != 1:
            problems.append(f"  {spec.fqn}: shape {spec.shape} is not a 2-D matrix (views cut 2-D weights)")
            continue
        try:
            view = value if isinstance(value, MatrixView) else value(tuple(spec.shape))
            if not isinstance(view, MatrixView):
                raise TypeError(f"the rule returned {view!r}, not a MatrixView")
            if sum(view.sizes) != spec.shape[view.dim]:
                raise ValueError(
                    f"blocks {view.sizes} sum to {sum(view.sizes)}, dim {view.dim} of {spec.shape} is {spec.shape[view.dim]}"
                )
        except (TypeError, ValueError) as exc:
            problems.append(f"  {spec.fqn}: {exc}")
            continue
        out[spec.fqn] = view
    if is_map:
        for pattern in matrix_views:
            if pattern not in used:
                problems.append(f"  pattern {pattern!r} matches no dedicated parameter")
    if problems:
        raise ValueError(
            "dmuon.plan._compile: matrix_views:\n"
            + "\n".join(problems)
            + "\nFix: match the dedicated parameters' FQNs (plan.dedicated), e.g. dmuon.plan._model.views.hf_llama_views(config)"
        )
    return out
