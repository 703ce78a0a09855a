"""What verify records of a rank's parameters: tied weights under every name (a pipeline stage holds its own copy
of a weight one process holds under two names), and fused q/k/v parameters held as DTensors in a permuted row
order (GPT-2's ``c_attn``, litgpt's ``qkv`` under tensor parallelism) read back whole in the model's order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from launch import REPO_ROOT
from torch import nn

from lightning_dist.verification.compare import compare_tensors
from lightning_dist.verification.tensors import full_gradients, full_parameters


def test_a_tied_weight_is_recorded_under_both_of_its_names():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    model[1](model[0](torch.arange(3))).sum().backward()
    params, grads = full_parameters(model), full_gradients(model)
    assert set(params) == set(grads) == {"0.weight", "1.weight"}
    assert torch.equal(params["0.weight"], params["1.weight"]) and torch.equal(grads["0.weight"], grads["1.weight"])


FUSED = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from lightning_dist.parallel.tensor_parallel import checkpoint_layout
    from lightning_dist.verification.tensors import full_gradients, full_parameters

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    layer = nn.Linear(2, 6, bias=False)
    original = torch.arange(12.0).reshape(6, 2)
    order = torch.tensor([0, 2, 4, 1, 3, 5])  # q/k/v rows interleaved per rank, as the plan holds them
    layer.weight = nn.Parameter(distribute_tensor(original[order], mesh, [Shard(0)]))
    setattr(layer, checkpoint_layout._ROW_ORDERS, {"weight": (0, order)})
    layer.weight.grad = distribute_tensor(original[order] * 2, mesh, [Shard(0)])
    assert torch.equal(full_parameters(layer)["weight"], original)
    assert torch.equal(full_gradients(layer)["weight"], original * 2)
    dist.destroy_process_group()
    print("ok")
    """
)


def test_a_permuted_dtensor_parameter_is_read_whole_in_the_models_order(tmp_path):
    """Before the fix this raised "`distribute_tensor` should be used to distribute leaf tensors": the parameter was
    reordered as a DTensor that requires grad."""
    script = tmp_path / "fused.py"
    script.write_text(FUSED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout + done.stderr)[-3000:]


def test_a_tensor_at_rounding_level_is_not_judged_against_its_own_noise():
    """BERT's attention key biases have a zero gradient in exact arithmetic (softmax cancels them): both runs hold
    rounding noise there (1e-21 against gradients of 0.2 in fp64), which differed by 230% of itself. Judged against
    1e-3 of the step's largest gradient it is equal; a real error in a small gradient still shows."""
    ref = {"w": torch.tensor([0.2, -0.1], dtype=torch.float64), "key.bias": torch.tensor([2.2e-21, -1e-21])}
    ours = {"w": ref["w"].clone(), "key.bias": torch.tensor([5.6e-21, 1e-21])}
    assert compare_tensors("gradients", "step 1", ours, ref, 1e-10).ok
    wrong = {"w": ref["w"].clone(), "key.bias": torch.tensor([2e-5, 0.0])}  # 1e-4 of the largest gradient
    row = compare_tensors("gradients", "step 1", wrong, ref, 1e-4)
    assert not row.ok and row.worst[0][0] == "key.bias"
    # optimizer states are judged per state: exp_avg_sq's scale is not the step count's
    state = {"p exp_avg_sq": torch.tensor([1e-6, 2e-6]), "p step": torch.tensor(3.0)}
    off = {"p exp_avg_sq": torch.tensor([1e-6, 2.2e-6]), "p step": torch.tensor(3.0)}
    assert not compare_tensors("optimizer state", "end", off, state, 1e-4).ok


def test_two_identical_modules_built_apart_share_a_cached_reference():
    """verify's reference cache is keyed on the pickled module; a tensor's own pickle names its memory address, so
    before the fix two identical modules (one per check, as a script builds them) never shared a reference."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_dist.verification import _reference_key

    torch.manual_seed(0)
    first = _reference_key(BoringModel(), None, {"accelerator": "cpu"})
    torch.manual_seed(0)
    assert _reference_key(BoringModel(), None, {"accelerator": "cpu", "devices": 2}) == first
    torch.manual_seed(1)
    assert _reference_key(BoringModel(), None, {"accelerator": "cpu"}) != first  # other weights
    torch.manual_seed(0)
    assert _reference_key(BoringModel(), None, {"accelerator": "cpu", "max_steps": 5}) != first
