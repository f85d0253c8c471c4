import pytest
import torch


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
