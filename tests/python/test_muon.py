"""hp.optim's building blocks against torch.optim.Muon (torch 2.13)."""

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from hyperparallel import _C

NS = (3.4445, -4.775, 2.0315)


@pytest.mark.parametrize("shape", [(3, 24, 40), (2, 40, 24), (2, 260, 300), (2, 300, 260), (2, 1, 7)])
def test_batched_newton_schulz_is_torch_bit_for_bit(shape):
    # The symmetric products are computed a row panel at a time: each
    # element is the same dot product, in the same order, as in torch's GEMM.
    generator = torch.Generator().manual_seed(4)
    batch = torch.randn(shape, generator=generator)
    ours = batch.bfloat16()
    _C.newton_schulz_(ours, _C.NsOptions(a=NS[0], b=NS[1], c=NS[2], steps=5, eps=1e-7))
    for matrix, result in zip(batch, ours):
        assert torch.equal(result, _zeropower_via_newtonschulz(matrix, NS, 5, 1e-7))
