"""ParallelDims: validation, rank coordinates, and the 1-rank DeviceMesh the trainer builds."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError
from meshtrain.mesh import AXES, ParallelDims
from meshtrain.runtime.distributed import init_distributed


@pytest.mark.parametrize("pp,dp,sp,tp", [(1, 8, 1, 1), (2, 2, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2), (3, 1, 1, 2)])
def test_coordinates_follow_the_device_mesh_rank_layout(pp, dp, sp, tp):
    """init_device_mesh lays ranks out as arange(world).view(pp, dp, sp, tp); coordinates must agree."""
    dims = ParallelDims(pp=pp, dp=dp, sp=sp, tp=tp, world_size=pp * dp * sp * tp)
    layout = torch.arange(dims.world_size).view(pp, dp, sp, tp)
    for rank in range(dims.world_size):
        where = [int(i) for i in (layout == rank).nonzero()[0]]
        assert [dims.coordinates(rank)[str(a)] for a in AXES] == where


def test_tp_is_innermost_so_tp_groups_are_neighbouring_ranks():
    dims = ParallelDims(pp=2, dp=2, sp=1, tp=4, world_size=16)
    for rank, nxt in itertools.pairwise(range(4)):
        a, b = dims.coordinates(rank), dims.coordinates(nxt)
        assert (a["pp"], a["dp"], a["sp"]) == (b["pp"], b["dp"], b["sp"]) and b["tp"] == a["tp"] + 1


@pytest.mark.parametrize("kwargs,needle", [
    ({"pp": 1, "dp": 3, "sp": 1, "tp": 1, "world_size": 4}, "must equal world_size = 4"),
    ({"pp": 1, "dp": 0, "sp": 1, "tp": 1, "world_size": 0}, "parallel.dp = 0"),
    ({"pp": 1, "dp": 1, "sp": 1, "tp": -2, "world_size": -2}, "parallel.tp = -2"),
])
def test_bad_degrees_are_rejected(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        ParallelDims(**kwargs)


def test_one_rank_mesh_has_all_axes():
    init_distributed("gloo")
    try:
        dims = ParallelDims(pp=1, dp=1, sp=1, tp=1, world_size=1)
        with pytest.raises(RuntimeError):
            dims.get_mesh("dp")
        dims.build_mesh("cpu")
        assert dims.mesh.mesh_dim_names == tuple(str(a) for a in AXES)
        assert all(dims.get_mesh(a).size() == 1 and dims.rank_of(a) == 0 for a in AXES)
        with pytest.raises(KeyError, match="unknown mesh axis"):
            dims.get_mesh("ep")
    finally:
        dist.destroy_process_group()
