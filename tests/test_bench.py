"""bench.py's figures: the FLOPs of a training step, on which its TFLOP/s and MFU rest."""
from argparse import Namespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import bench


@pytest.mark.parametrize("stage", [1, 2])
def test_a_steps_flops_count_the_attention_on_the_cpu_too(stage):
    torch.manual_seed(0)
    model, batch = bench.stage_model(Namespace(preset="small", stage=stage, batch=2))
    with sdpa_kernel(SDPBackend.MATH):  # attention as plain matrix products, which torch's counter always sees
        products = bench.step_flops(model.train(), batch)
    # The CPU's fused kernel, counted as torch counts the GPU's: its backward also recomputes the scores
    assert products < bench.step_flops(model, batch) < 1.05 * products
