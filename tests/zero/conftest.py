import pytest

from .common import train_in_memory


@pytest.fixture(scope="module")
def reference():
    """20 steps of the in-memory reference training (losses)."""
    return train_in_memory(20)
