"""NorMuon in ``dmuon.Muon``, single process: the second moment's layout for every
kind of Muon matrix against the reference's per-proxy second moments, the owner's normalisation
against :mod:`dmuon.testing._normuon_reference` matrix by matrix, and the refusals.

For each layout (a Linear, a conv weight, expert stacks in every ``ExpertStack`` orientation and
gate/up form, row- and column-block views), a random second moment ``v`` of the layout's shape
(:func:`second_moment_shape`) is broadcast back over the ``in`` axis to a tensor of the
parameter's shape; every proxy of that parameter (:mod:`dmuon.testing._proxies`, the matrices the
reference orthogonalises) must then see, in each of its rows, the one value
:func:`second_moment_rows` gives for that matrix's row. The owner's batched normalisation of the
parameter's matrices, mapped back to storage, must equal the reference's ``normuon_normalize`` of
each proxy on its own (fp32, 1e-6), and its new ``v`` the reference's rows.
"""

from __future__ import annotations

import types

import pytest
import torch

import dmuon.testing as T
import dmuon.testing._normuon_reference as R
from dmuon._update import normuon_normalize
from dmuon.exec._optim import normuon_update as nm
from dmuon.exec._optim.expert_update import matrices_to_stack, stack_to_matrices
from dmuon.plan._records.params import ExpertStack, MatrixView


def _info(matrix_shape, experts=None, view=None):
    return types.SimpleNamespace(matrix_shape=matrix_shape, experts=experts, view=view, fqn="w")


def _expand(v: torch.Tensor, shape, view) -> torch.Tensor:
    """``v`` broadcast over the collapsed ``in`` axis to the parameter's ``shape``."""
    if view is not None and view.dim == 1:
        return torch.cat([v[:, i : i + 1].expand(-1, s) for i, s in enumerate(view.sizes)], dim=1)
    return v.expand(shape)


# (name, parameter shape, info, proxies)
LAYOUTS = [
    ("linear", (6, 4), _info((6, 4)), T.matrix((6, 4))),
    ("conv", (5, 2, 3, 3), _info((5, 18)), T.conv((5, 2, 3, 3))),
    (
        "stack linear",
        (3, 6, 4),
        _info((6, 4), ExpertStack(num_experts=3, layout="torchtitan")),
        T.expert_stack((3, 6, 4), "linear"),
    ),
    ("stack generic (no record)", (3, 6, 4), _info((6, 4)), T.expert_stack((3, 6, 4), "linear")),
    (
        "hf gate/up split",
        (3, 8, 5),
        _info((4, 5), ExpertStack(num_experts=3, gate_up="concat", layout="hf")),
        T.expert_stack((3, 8, 5), "hf_gate_up"),
    ),
    (
        "hf gate/up fused",
        (3, 8, 5),
        _info((8, 5), ExpertStack(num_experts=3, gate_up="concat", split=False)),
        T.expert_stack((3, 8, 5), "hf_gate_up", fused=True),
    ),
    (
        "gpt-oss down (in, out)",
        (3, 5, 7),
        _info((7, 5), ExpertStack(num_experts=3, transposed=True)),
        T.expert_stack((3, 5, 7), "in_out"),
    ),
    (
        "gpt-oss gate/up interleaved",
        (3, 5, 8),
        _info((4, 5), ExpertStack(num_experts=3, transposed=True, gate_up="interleave")),
        T.expert_stack((3, 5, 8), "gpt_oss_gate_up"),
    ),
    (
        "gpt-oss gate/up fused",
        (3, 5, 8),
        _info((8, 5), ExpertStack(num_experts=3, transposed=True, gate_up="interleave", split=False)),
        T.expert_stack((3, 5, 8), "gpt_oss_gate_up", fused=True),
    ),
    (
        "row blocks (q/k/v heads)",
        (10, 6),
        _info((10, 6), view=MatrixView(dim=0, sizes=(4, 4, 2))),
        T.matrix_view((10, 6), 0, (4, 4, 2)),
    ),
    (
        "column blocks (o_proj heads)",
        (6, 9),
        _info((6, 9), view=MatrixView(dim=1, sizes=(3, 3, 3))),
        T.matrix_view((6, 9), 1, (3, 3, 3)),
    ),
]


def _matrices(x: torch.Tensor, info):
    """The owner's ``(k, m, n)`` Muon matrices of ``x`` and the (v block index) of each call:
    the whole parameter at once, or one call per view block (as ``muon_step`` hands them over)."""
    m, n = info.matrix_shape
    if info.view is not None:
        out = []
        for i, (off, size) in enumerate(zip(info.view.offsets(), info.view.sizes)):
            out.append((x.narrow(info.view.dim, off, size).contiguous().unsqueeze(0), i))
        return out
    if info.experts is not None:
        return [(stack_to_matrices(x, info.experts), None)]
    return [(x.reshape(-1, m, n), None)]


@pytest.mark.parametrize("name, shape, info, proxies", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_second_moment_layout_matches_the_proxies_rows(name, shape, info, proxies):
    g = torch.Generator().manual_seed(0)
    vshape = nm.second_moment_shape(shape, matrix_shape=info.matrix_shape, experts=info.experts, view=info.view)
    assert vshape[0] == shape[0] and len(vshape) == len(shape)  # dim 0 is the parameter's (checkpoint chunks)
    v = torch.rand(vshape, generator=g)
    full = _expand(v, shape, info.view)
    # 1. every proxy row is constant over `in` and equals the row the owner reads for that matrix
    owner_rows = []
    for x, block in _matrices(full, info):
        rows = nm.second_moment_rows(v, info, block, x.shape[1])
        assert rows.shape == x.shape[:2]
        assert torch.equal(x, rows.unsqueeze(-1).expand_as(x))
        owner_rows.extend(rows.unbind(0))
    proxy_rows = [pr.of(full)[:, 0] for pr in proxies]
    assert all(torch.equal(pr.of(full), r.unsqueeze(-1).expand_as(pr.of(full))) for pr, r in zip(proxies, proxy_rows))
    assert len(owner_rows) == len(proxy_rows) and all(torch.equal(a, b) for a, b in zip(owner_rows, proxy_rows))
    # 2. write_second_moment_rows is the inverse
    w = torch.zeros(vshape)
    for x, block in _matrices(full, info):
        nm.write_second_moment_rows(w, nm.second_moment_rows(v, info, block, x.shape[1]), info, block)
    assert torch.equal(w, v)


@pytest.mark.parametrize("name, shape, info, proxies", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_owner_normalisation_equals_the_reference_per_matrix(name, shape, info, proxies):
    g = torch.Generator().manual_seed(1)
    ortho = torch.randn(shape, generator=g)
    vshape = nm.second_moment_shape(shape, matrix_shape=info.matrix_shape, experts=info.experts, view=info.view)
    v = torch.rand(vshape, generator=g) * 0.1
    v_ref = [pr.of(_expand(v, shape, info.view))[:, 0].clone() for pr in proxies]
    # the owner: its batched calls, mapped back to the storage layout
    update = torch.empty(shape)
    for x, block in _matrices(ortho, info):
        rows = nm.second_moment_rows(v, info, block, x.shape[1])
        u, rows_new = normuon_normalize(x, rows, beta2=0.9, eps=1e-10)
        nm.write_second_moment_rows(v, rows_new, info, block)
        if info.view is not None:
            off, size = info.view.offsets()[block], info.view.sizes[block]
            update.narrow(info.view.dim, off, size).copy_(u[0])
        elif info.experts is not None:
            update.copy_(matrices_to_stack(u, info.experts, shape))
        else:
            update.copy_(u.reshape(shape))
    # the reference: each proxy its own matrix
    full_v = _expand(v, shape, info.view)
    for pr, vr in zip(proxies, v_ref):
        want_u, want_v = R.normuon_normalize(pr.of(ortho), vr, beta2=0.9, eps=1e-10)
        torch.testing.assert_close(pr.of(update), want_u, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(pr.of(full_v)[:, 0], want_v, rtol=1e-6, atol=0)


def test_refusals_name_the_parameter_and_the_fix():
    nm.check_supported(types.SimpleNamespace(fqn="a", tp=None, group=None, experts=None))  # one owner
    nm.check_supported(types.SimpleNamespace(fqn="a", tp=None, group=object(), experts=ExpertStack(num_experts=2)))
    with pytest.raises(ValueError, match=r"'layers.0.fc1.weight' is owned by an owner group.*owner_groups='off'"):
        nm.check_supported(types.SimpleNamespace(fqn="layers.0.fc1.weight", tp=None, group=object(), experts=None))
    with pytest.raises(ValueError, match=r"'q.weight' is tensor-parallel.*variant='muon'"):
        nm.check_supported(
            types.SimpleNamespace(fqn="q.weight", tp=types.SimpleNamespace(size=2), group=None, experts=None)
        )
