"""Tiny transformers Kimi Linear models (fan-in scaled random weights) and their k3text twins.

transformers binds `kimi_linear`'s KDA and short-conv functions when its modeling module is
imported: to fla-core's Triton kernels whenever `import fla` succeeds, which it does as soon as
`triton` is importable (the Python 3.12 torch wheel brings it), and those kernels need a GPU.
The reference here is transformers' own PyTorch code, so `torch_reference_kimi_linear` rebinds
those functions to the plain PyTorch functions they decorate, whatever is installed.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import torch

from k3text.checkpoint import hf, hf_config
from k3text.config import Config, config_from_dict

_KERNEL_BOUND = ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention",
                 "causal_conv1d_fn", "causal_conv1d_update")


def torch_reference_kimi_linear():
    """transformers' `kimi_linear` modeling module with its KDA and conv functions bound to their
    PyTorch bodies (the undecorated functions), never to an external kernel package."""
    from transformers.models.kimi_linear import modeling_kimi_linear as module

    for name in _KERNEL_BOUND:
        setattr(module, name, inspect.unwrap(getattr(module, name)))
        assert getattr(module, name).__module__ == module.__name__, name
    return module


def tiny_hf_config(**overrides):
    from transformers import KimiLinearConfig

    layers = overrides.pop("num_hidden_layers", 4)
    full = overrides.pop("full_attn_layers", [4])
    kwargs = dict(
        vocab_size=96, hidden_size=48, num_hidden_layers=layers, intermediate_size=80,
        moe_intermediate_size=24, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        num_experts=8, num_experts_per_token=2, n_shared_experts=1, routed_scaling_factor=2.446,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
        linear_attn_config={
            "kda_layers": [i for i in range(1, layers + 1) if i not in full],
            "full_attn_layers": full, "num_heads": 3, "head_dim": 8,
            "short_conv_kernel_size": 4},
    )
    kwargs.update(overrides)
    return KimiLinearConfig(**kwargs)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Fan-in scaled normal weights everywhere (norm gains near 1, small router biases), keeping
    the KDA A_log / dt_bias initialisation."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def tiny_hf_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model_class = torch_reference_kimi_linear().KimiLinearForCausalLM
    model = model_class(tiny_hf_config(**overrides)).float().eval()
    randomize_(model, seed)
    return model


def k3text_config(hf_model, **overrides) -> Config:
    keys = hf_config.model_keys(hf_model.config.to_dict())
    base = dict(weight_dtype="float32", dtype="float32", matmul_precision="highest")
    base.update(overrides)
    return config_from_dict(keys, **base)


def k3text_twin(hf_model, **overrides):
    """The k3text Decoder holding the HF model's weights (transformers' in-memory names)."""
    cfg = k3text_config(hf_model, **overrides)
    tensors = [(n, t.detach().numpy()) for n, t in hf_model.state_dict().items()]
    return cfg, hf.model_from_params(cfg, hf.params_from_tensors(cfg, tensors, "transformers"))


def hf_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.as_tensor(tokens)).logits.float().numpy()
