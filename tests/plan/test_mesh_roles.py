"""The one rule that reads a mesh's dims: :func:`dmuon.plan.mesh_dim_roles`.

Pure (no process group): names as torchtitan and users write them, overrides, positional 2-D,
and the errors a user can cause (each names the dims it found and the names it expected).
"""

from __future__ import annotations

import types

import pytest

from dmuon.plan import MeshDimRoles, compile as compile_plan, mesh_dim_roles, normalize_mesh


@pytest.mark.parametrize(
    "shape, names, kw, want",
    [
        ((4,), None, {}, (None, 0, None)),
        ((2, 2), None, {}, (0, 1, None)),  # unnamed 2-D: (replicate, shard) by position
        ((2, 2), ("replicate", "shard"), {}, (0, 1, None)),
        ((2, 2), ("shard", "replicate"), {}, (1, 0, None)),
        ((2, 2), ("dp", "tp"), {}, (None, 0, 1)),
        ((2, 2), ("tp", "dp_shard"), {}, (None, 1, 0)),
        ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"), {}, (0, 1, 2)),  # torchtitan
        ((2, 2, 2), ("replicate", "shard", "tp"), {}, (0, 1, 2)),
        ((2, 2, 2), ("tp", "shard", "replicate"), {}, (2, 1, 0)),
        ((2, 2, 2), ("pp", "fs", "mp"), dict(replicate_dim="pp", shard_dim="fs", tp_dim="mp"), (0, 1, 2)),
        ((2, 2), ("a", "b"), dict(replicate_dim="b", shard_dim="a"), (1, 0, None)),
        ((2, 2), ("data", "model"), dict(shard_dim="data", tp_dim="model"), (None, 0, 1)),
    ],
)
def test_roles(shape, names, kw, want):
    assert mesh_dim_roles(shape, names, **kw) == MeshDimRoles(replicate=want[0], shard=want[1], tp=want[2])


@pytest.mark.parametrize(
    "shape, names, kw, match",
    [
        ((2, 2, 2), None, {}, r"cannot find the replicate and shard and tp dim .*\(unnamed\).*'dp_replicate'"),
        ((2, 2, 2), ("a", "b", "tp"), {}, r"replicate and shard dim of the 3-D mesh with dims \('a', 'b', 'tp'\)"),
        ((2, 2), ("dp", "x"), {}, r"replicate or tp dim .*\('dp', 'x'\).*or pass shard_dim="),
        (
            (2, 2),
            ("dp", "tp"),
            dict(tp_dim="model"),
            r"tp_dim='model' names no dim of the mesh, whose dims are \('dp', 'tp'\)",
        ),
        ((2, 2, 2), ("shard", "tp", "x"), dict(replicate_dim="shard"), r"overlap"),
        ((2, 2, 2, 2), ("a", "b", "c", "d"), {}, r"1, 2 or 3 dims"),
    ],
)
def test_errors(shape, names, kw, match):
    with pytest.raises(ValueError, match=match):
        mesh_dim_roles(shape, names, **kw)


def test_normalize_mesh_and_compile_read_the_data_parallel_dims():
    """A named 3-D mesh plans on its data-parallel dims; unnamed 3-D still raises."""
    from oracle import TinyLM

    mesh = types.SimpleNamespace(shape=(2, 3, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    assert normalize_mesh(mesh) == (2, 3)
    assert normalize_mesh(types.SimpleNamespace(shape=(3, 2), mesh_dim_names=("dp", "tp"))) == (1, 3)
    assert compile_plan(TinyLM(), mesh).mesh_shape == (2, 3)
    with pytest.raises(ValueError, match="1-D"):
        normalize_mesh((2, 2, 2))
