import os
import sys

import pytest

# Ranks start with `spawn` and import test workers by module name.
sys.path.insert(0, os.path.dirname(__file__))


def gpu_available() -> bool:
    """A GPU torch can use, and the CUDA backend linked into hyperparallel."""
    import torch

    from hyperparallel import _C

    return torch.cuda.is_available() and "cuda" in _C.device_backends()


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU and hyperparallel built against a CUDA torch")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
