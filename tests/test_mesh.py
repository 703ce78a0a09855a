"""ParallelDims: resolving sizes and the errors a wrong mesh gives (no processes needed)."""

import pytest

from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims


def test_auto_axis_takes_what_is_left():
    dims = ParallelDims.resolve(8, dp_replicate=2, dp_shard="auto", tp=2)
    assert dims.as_dict() == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert (dims.batch, dims.fsdp, dims.world_size) == (4, 2, 8)
    assert str(dims) == "dp_replicate=2 × dp_shard=2 × tp=2"


def test_fsdp_group_includes_context_parallel_ranks():
    dims = ParallelDims.resolve(8, dp_shard=2, cp=2, tp=2)
    assert dims.fsdp == 4 and dims.batch == 2


def test_product_must_equal_world_size():
    with pytest.raises(
        MeshConfigError,
        match=r"mesh axis dp_shard=3, mesh axis tp=2 make a mesh of 6 ranks, but 4 processes are running",
    ):
        ParallelDims.resolve(4, dp_shard=3, tp=2)


def test_auto_must_divide():
    with pytest.raises(MeshConfigError, match=r"4 is not divisible by 3"):
        ParallelDims.resolve(4, dp_shard="auto", tp=3)


@pytest.mark.parametrize("sizes", [{"tp": 0}, {"tp": -2}, {"tp": 1.5}, {"tp": True}])
def test_sizes_must_be_positive_integers(sizes):
    with pytest.raises(MeshConfigError, match=r"mesh axis tp=.* is not a valid size\. Pass a positive int"):
        ParallelDims.resolve(4, dp_shard="auto", **sizes)


def test_messages_name_the_option_that_set_the_axis():
    with pytest.raises(MeshConfigError, match=r"tensor_parallel_size='2' is not a valid size \(a str: write 2, not"):
        ParallelDims.resolve(4, options={"tp": "tensor_parallel_size"}, dp_shard="auto", tp="2")


def test_one_auto_axis_only():
    with pytest.raises(MeshConfigError, match="Only one size can be 'auto'"):
        ParallelDims.resolve(4, dp_shard="auto", tp="auto")


def test_unknown_axis():
    with pytest.raises(MeshConfigError, match="Unknown mesh axes"):
        ParallelDims.resolve(4, dp=4)


def test_batch_rank_matches_the_device_mesh_layout():
    dims = ParallelDims.resolve(16, pp=2, dp_shard=2, cp=2, tp=2)
    # rank = ((pp·dp_shard + s)·cp + c)·tp + t: the batch index is s, whatever pp, cp and tp are.
    assert [dims.batch_rank(r) for r in range(16)] == [0, 0, 0, 0, 1, 1, 1, 1] * 2
