"""Drop-in fused modules for HuggingFace Qwen3 and Qwen3-MoE.

``patch(model)`` swaps a model's RMSNorms, attention, MLPs, linear layers and MoE
router/experts for C++ kernels (torch custom ops ``torch.ops.hyperparallel.*``
with C++ autograd) without changing its parameters or state_dict, and
returns a ``PatchReport`` of what it swapped and what it left as HF's;
``load_pretrained(model, directory)`` loads HF safetensors weights into it.

Example::

    import torch
    import hyperparallel.nn as hpnn
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained("../shared/bench/qwen3-moe-small.config.json")
    model = AutoModelForCausalLM.from_config(config)
    hpnn.patch(model)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
"""

from hyperparallel.nn import modules
from hyperparallel.nn.load import LoadResult, load_pretrained
from hyperparallel.nn.patch import PatchReport, patch

__all__ = ["LoadResult", "PatchReport", "load_pretrained", "modules", "patch"]
