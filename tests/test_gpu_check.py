"""`make gpu-check` on a machine without CUDA says so and succeeds (CI and this box)."""

import pytest
import torch

from labkit.gpu_check import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run the check")
def test_without_cuda_it_says_so_and_exits_0(capsys):
    assert main() == 0
    assert "no CUDA GPU" in capsys.readouterr().out
