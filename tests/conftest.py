"""Suite-wide settings: tiny models on 2 shared cores run ~6x faster with one intra-op thread than
contending for two (measured in tests/test_model_parity.py)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
