"""Mixture of experts: sigmoid router with grouped top-k, routed experts (BF16 or packed MXFP4),
shared experts, and K3's LatentMoE (experts act in a smaller latent between a down and an up
projection).

Expert computation never gathers expert weights per token across the mesh (GSPMD would
materialise full-size temporaries on every device). Instead each device works on the experts it
holds, inside `shard_map`, with one of the kernels of `k3text.ops.experts` (`grouped` ragged_dot
matmuls over held experts for prefill and large batches, `gathered` over the experts hit for
decode, or `reference`), chosen by `moe_expert_implementation` (`expert_implementation`).
Expert parallelism (`moe_ep_mode`):
- `local`: tokens replicated over the expert axes, each device computes its local experts, one
  `psum` combines;
- `all_to_all`: each device routes its slice of the tokens, dispatches (token, expert) rows to
  the devices owning the experts and combines them back (`k3text.layers.moe_dispatch`).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from k3text import sharding
from k3text.config import Config
from k3text.layers import moe_dispatch
from k3text.layers.activations import glu
from k3text.layers.initializers import FP32, Init, compute_dtype, precision, weight_dtype
from k3text.layers.linears import matmul
from k3text.layers.mlp import MLP
from k3text.layers.normalizations import rms_norm
from k3text.ops import experts as expert_ops
from k3text.ops import mxfp4
from k3text.ops.experts import ExpertFFN, LayerExperts

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Router.
# --------------------------------------------------------------------------------------------


def router_scores(x: jax.Array, gate: jax.Array, bias: jax.Array) -> jax.Array:
    """[N, 2, E] fp32: sigmoid(x @ gate) and the same plus e_score_correction_bias, computed
    where the gate and bias columns live (split over experts)."""
    logits = jnp.dot(x.astype(FP32), gate.astype(FP32), precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    return jnp.stack([scores, scores + bias.astype(FP32)], axis=-2)


def route(cfg: Config, scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token: (weights [N, k] fp32, expert ids [N, k] int32) from
    `router_scores`, whole on every device.

    Experts are chosen by score + e_score_correction_bias (noaux_tc), inside the `topk_group`
    best groups (a group scores the sum of its top-2 biased scores); weights are the unbiased
    scores of the chosen experts, renormalised when `moe_renormalize`, times
    `routed_scaling_factor`.
    """
    scores, choice = scores[..., 0, :], scores[..., 1, :]
    groups = cfg.num_expert_group
    if cfg.use_grouped_topk and groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], groups, -1)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        kept = jnp.any(jax.nn.one_hot(keep, groups, dtype=bool), axis=-2)
        choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_token)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.moe_renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids.astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# Expert kernels.
# --------------------------------------------------------------------------------------------


def expert_ffn(cfg: Config) -> ExpertFFN:
    """The routed experts' numerics: the config's GLU, compute dtype and precision."""
    return ExpertFFN(functools.partial(glu, cfg), compute_dtype(cfg), precision(cfg))


def expert_implementation(cfg: Config, ctx: sharding.MeshContext | None, tokens: int) -> str:
    """The `k3text.ops.experts` kernel each device runs for `tokens` routed tokens (global)
    under `ctx`: `moe_expert_implementation`, or for `auto` the `moe_dense_threshold` rule
    asked with the slots and experts one device sees."""
    k = cfg.num_experts_per_token
    ep = 1 if ctx is None else ctx.size("exp")
    if ep == 1:
        slots, held = tokens * k, cfg.num_experts
    elif cfg.moe_ep_mode == "all_to_all":
        slots = moe_dispatch.received_rows(tokens // ctx.size("batch"), k, ep)
        held = cfg.num_experts // ep
    else:
        slots, held = tokens * k // ctx.size("batch"), cfg.num_experts // ep
    return expert_ops.resolve_implementation(
        cfg.moe_expert_implementation, slots, held, cfg.moe_dense_threshold,
        dims=(cfg.moe_hidden_size, cfg.moe_intermediate_size))


# --------------------------------------------------------------------------------------------
# Expert parallelism.
# --------------------------------------------------------------------------------------------


# Paths already reported: tracing happens once per shape, but one line per distinct path per
# process is what an operator wants to read.
_reported_paths: set[str] = set()


def _logged(cfg: Config, what: str) -> None:
    line = f"moe: {what} (experts {cfg.num_experts}, format {cfg.expert_weight_format})"
    if line not in _reported_paths:
        _reported_paths.add(line)
        log.info("%s", line)


def routed_experts(cfg: Config, x: jax.Array, weights: jax.Array, ids: jax.Array,
                   experts: LayerExperts, param_axes: dict[str, tuple]) -> jax.Array:
    """Σ_k weights · expert_ids(x) for x [N, D], on whatever mesh is active."""
    ctx = sharding.active()
    implementation = expert_implementation(cfg, ctx, ids.shape[0])
    ffn = expert_ffn(cfg)
    if ctx is None or ctx.size("exp") == 1:
        _logged(cfg, f"unsharded, implementation {implementation}")
        return expert_ops.routed_experts(x, weights, ids, experts, ffn, implementation,
                                         all_ids_held=experts.held == cfg.num_experts)
    specs = expert_specs(ctx, param_axes)
    if cfg.moe_ep_mode == "all_to_all":
        _logged(cfg, f"all_to_all over {ctx.axes('exp')}, transport "
                     f"{moe_dispatch.transport(cfg)}, implementation {implementation}")
        return moe_dispatch.experts_all_to_all(cfg, ctx, x, weights, ids, experts, specs, ffn,
                                               implementation)
    _logged(cfg, f"local expert parallelism over {ctx.axes('exp')}, implementation "
                 f"{implementation}, psum combine")
    return _experts_local_ep(cfg, ctx, x, weights, ids, experts, specs, ffn, implementation)


def expert_specs(ctx: sharding.MeshContext, param_axes: dict[str, tuple]) -> LayerExperts:
    """shard_map in_specs of a `LayerExperts` whose arrays have `param_axes` after the stack."""
    return LayerExperts({name: ctx.spec(("layers", *axes)) for name, axes in param_axes.items()},
                        ctx.spec(()))


def _experts_local_ep(cfg: Config, ctx: sharding.MeshContext, x: jax.Array, weights: jax.Array,
                      ids: jax.Array, experts: LayerExperts, specs: LayerExperts,
                      ffn: ExpertFFN, implementation: str) -> jax.Array:
    held = cfg.num_experts // ctx.size("exp")
    token_spec = ctx.spec(("batch", None))
    exp_axes = ctx.axes("exp")

    def body(x, weights, ids, experts):
        first = ctx.axis_index("exp") * held
        partial = expert_ops.routed_experts(x, weights, ids - first, experts, ffn,
                                            implementation)
        return jax.lax.psum(partial, exp_axes)

    return jax.shard_map(body, mesh=ctx.shard_map_mesh(),
                         in_specs=(token_spec, token_spec, token_spec, specs),
                         out_specs=token_spec, check_vma=False)(x, weights, ids, experts)


# --------------------------------------------------------------------------------------------
# The layer.
# --------------------------------------------------------------------------------------------


def expert_param_shapes(cfg: Config) -> dict[str, tuple[tuple[int, ...], Any, tuple]]:
    """{name: (shape, dtype, logical axes)} of the routed-expert parameters of one layer.

    Layout is the checkpoints' [expert, out, in]; gate and up are fused along `out`
    (gate rows first). MXFP4 keeps the packed bytes and E8M0 scales (4.25 bits/element).
    """
    e, d, f = cfg.num_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
    axes = ("exp", "exp_out", "exp_in")
    if cfg.expert_weight_format == "mxfp4":
        u8 = jnp.uint8
        block = mxfp4.MXFP4_BLOCK
        return {
            "gate_up_packed": ((e, 2 * f, d // 2), u8, axes),
            "gate_up_scale": ((e, 2 * f, d // block), u8, axes),
            "down_packed": ((e, d, f // 2), u8, axes),
            "down_scale": ((e, d, f // block), u8, axes),
        }
    wdt = weight_dtype(cfg)
    return {"gate_up": ((e, 2 * f, d), wdt, axes), "down": ((e, d, f), wdt, axes)}


def _random_experts(cfg: Config, init: Init) -> dict[str, nnx.Param]:
    """Fan-in scaled random experts. MXFP4 ones are drawn directly in the packed format
    (uniform random E2M1 codes, one power-of-two scale), so no quantiser runs at init."""
    shapes = expert_param_shapes(cfg)
    fan_in = {"gate_up": cfg.moe_hidden_size, "down": cfg.moe_intermediate_size}
    values = {}
    for name, (shape, dtype, axes) in shapes.items():
        if cfg.expert_weight_format == "bf16":
            values[name] = init.fan_in(shape, axes, dtype, fan_in=fan_in[name])
        elif name.endswith("_packed"):
            values[name] = init.integers(shape, axes, dtype, 0, 256)
        else:
            # Uniform E2M1 codes have RMS ~2.93: pick 2^e closest to 1 / (2.93 sqrt(fan_in)).
            exponent = round(-math.log2(2.93 * math.sqrt(fan_in[name.removesuffix("_scale")])))
            values[name] = init.constant(shape, axes, dtype, 127 + exponent)
    return values


class MoE(nnx.Module):
    def __init__(self, cfg: Config, init: Init):
        self.cfg = cfg
        hidden, wdt = cfg.hidden_size, weight_dtype(cfg)
        self.gate = init.fan_in((hidden, cfg.num_experts), ("embed", "exp"), wdt)
        self.e_score_correction_bias = init.constant((cfg.num_experts,), ("exp",), FP32, 0.0)
        if cfg.routed_expert_hidden_size:
            latent = cfg.routed_expert_hidden_size
            self.routed_expert_down_proj = init.fan_in((hidden, latent),
                                                        ("embed", "latent"), wdt)
            self.routed_expert_up_proj = init.fan_in((latent, hidden),
                                                      ("latent", "embed"), wdt)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = init.constant((latent,), (None,), wdt)
        self.experts = nnx.Dict(_random_experts(cfg, init))
        if cfg.num_shared_experts:
            self.shared_experts = MLP(cfg, hidden, cfg.moe_intermediate_size
                                      * cfg.num_shared_experts, init)

    def __call__(self, x: jax.Array, stack_index: Any = None) -> jax.Array:
        """x [..., hidden] -> [..., hidden].

        `stack_index`: set when this layer's routed experts were handed over as the whole stack
        of a scanned layer group (leading [layers] axis); the index of this layer in it.
        """
        cfg = self.cfg
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        # The router scores and the latent are computed where their weights' columns live and
        # gathered (in one collective where both split over the same devices): every device
        # needs every expert's score and the whole latent. Left alone, the partitioner may
        # gather the weight instead: a weight-sized transfer each step for an activation-sized
        # one.
        scores = router_scores(tokens, self.gate[...], self.e_score_correction_bias[...])
        if cfg.routed_expert_hidden_size:
            z = matmul(cfg, tokens, self.routed_expert_down_proj[...])
            scores, z = sharding.gather_features((scores, z), ("exp", "latent"))
        else:
            z, (scores,) = tokens, sharding.gather_features((scores,), ("exp",))
        weights, ids = route(cfg, scores)
        experts = LayerExperts.of({name: p.get_value() for name, p in self.experts.items()},
                                  stack_index)
        axes = {name: spec[2] for name, spec in expert_param_shapes(cfg).items()}
        y = routed_experts(cfg, z, weights, ids, experts, axes).astype(compute_dtype(cfg))
        if cfg.routed_expert_hidden_size:
            if cfg.latent_moe_use_norm:
                # Normalised whole on every device (split, its sum would be one more
                # collective), then each device keeps its slice of the latent: the up projection
                # reduces partial outputs, where left alone the partitioner gathers the weight.
                y = sharding.constrain_features(
                    rms_norm(y, self.routed_expert_norm[...], cfg.rms_norm_eps), None)
            y = matmul(cfg, sharding.constrain_features(y, "latent"),
                       self.routed_expert_up_proj[...])
        if cfg.num_shared_experts:
            y = y + self.shared_experts(tokens)
        return y.reshape(shape)
