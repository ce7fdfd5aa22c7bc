"""Packed MXFP4 experts in the MoE forward: equal to the same layer holding the dequantised
experts, unsharded and on 8 devices in both expert-parallel modes; stored at 4.25 bits."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3text import sharding
from k3text.config import load_config
from k3text.inference.engine import place_model
from k3text.layers.initializers import Init
from k3text.layers.moe import MoE, expert_param_shapes
from k3text.models.decoder import Decoder
from k3text.ops import mxfp4

from helpers import mesh_context, tiny_config


def dequantised_twin(packed: MoE, cfg) -> MoE:
    """The same MoE with experts stored as fp32 values of the packed ones."""
    twin = MoE(cfg, Init(abstract=True))
    graphdef, state = nnx.split(twin)
    values = dict(nnx.to_flat_state(nnx.state(packed)))
    flat = []
    for path, var in nnx.to_flat_state(state):
        if path[-1] in ("gate_up", "down"):
            base = path[:-1]
            value = mxfp4.dequantize_mxfp4(values[(*base, f"{path[-1]}_packed")].get_value(),
                                           values[(*base, f"{path[-1]}_scale")].get_value())
        else:
            value = values[path].get_value()
        flat.append((path, var.replace(jnp.asarray(value))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.mark.parametrize("mesh", [None, ("local", 2, 4), ("all_to_all", 2, 4),
                                  ("local", 1, 8)])
def test_packed_experts_equal_dequantised_experts(mesh):
    cfg = tiny_config("k3-tiny")
    if mesh:
        mode, tensor, expert = mesh
        cfg = cfg.replace(moe_ep_mode=mode, ici_tensor_parallelism=tensor,
                          ici_expert_parallelism=expert)
    packed = MoE(cfg, Init(2))
    twin = dequantised_twin(packed, cfg.replace(expert_weight_format="bf16"))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(24, cfg.hidden_size)), jnp.float32)
    ctx = mesh_context(cfg)
    packed, twin = place_model(packed, ctx), place_model(twin, ctx)
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        a = nnx.jit(lambda m, x: m(x))(packed, x)
        b = nnx.jit(lambda m, x: m(x))(twin, x)
    # The experts' packed bytes stay packed on device: uint8, sharded over the expert axes.
    stored = packed.experts["gate_up_packed"][...]
    assert stored.dtype == jnp.uint8
    assert stored.sharding.is_equivalent_to(ctx.sharding(("exp", "exp_out", "exp_in")), 3)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_k3_routed_experts_are_stored_at_4_25_bits():
    cfg = load_config("configs/models/kimi-k3.yml")
    state = nnx.state(Decoder(cfg, Init(abstract=True)))
    elements = bits = 0
    for path, var in nnx.to_flat_state(state):
        if "experts" not in path or "shared_experts" in path:
            continue
        value = var.get_value()
        bits += value.size * jnp.dtype(value.dtype).itemsize * 8
        if str(path[-1]).endswith("_packed"):
            elements += value.size * 2
    assert elements == 92 * 896 * 3 * 3584 * 3072
    assert bits / elements == 4.25
    shapes = expert_param_shapes(cfg)
    assert shapes["gate_up_packed"][0] == (896, 6144, 1792)
    assert shapes["down_scale"][0] == (896, 3584, 96)

