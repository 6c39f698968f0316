"""Suite-wide settings: tiny models on 2 shared cores run ~6x faster with one intra-op thread than
contending for two (measured in tests/test_model_parity.py)."""

import os

import pytest
import torch

# Without a GPU, Triton kernels (specialists/ops/fused.py) run on CPU tensors through Triton's
# interpreter; it is read when a kernel is defined, so before anything imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, scope="session")
def _exact_fp32_on_cuda():
    """On a GPU run (CANTATA_TEST_DEVICE=cuda) fp32 must mean fp32: no TF32 in matmuls or convolutions."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    yield
