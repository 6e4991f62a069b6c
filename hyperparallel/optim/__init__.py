"""Optimizers whose math and scheduling run in C++.

:class:`Muon` is torch.optim.Muon, distributed so that each matrix's
Newton–Schulz runs once in the whole job; :func:`muon_param_split` and
:func:`muon_with_adamw` give the usual split of a model between Muon and
AdamW.

Example::

    import hyperparallel.optim
    muon, adamw = hyperparallel.optim.muon_with_adamw(model, lr=2e-3)
    loss.backward()
    muon.step(); adamw.step()
    muon.zero_grad(); adamw.zero_grad()
"""

from hyperparallel.optim.muon import Muon, reset_stats, stats
from hyperparallel.optim.split import muon_param_split, muon_with_adamw

__all__ = ["Muon", "muon_param_split", "muon_with_adamw", "reset_stats", "stats"]
