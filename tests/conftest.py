import pytest
import torch

# Tiny models are dominated by per-op overhead; a second thread only adds synchronisation cost
# (and on a busy machine a lot of it). Tests that time nothing lose nothing by using one thread.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
