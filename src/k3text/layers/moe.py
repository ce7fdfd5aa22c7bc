"""Mixture of experts: sigmoid router with grouped top-k, routed experts (BF16 or packed MXFP4),
shared experts, and K3's LatentMoE (experts act in a smaller latent between a down and an up
projection).

Expert computation never gathers expert weights per token across the mesh (GSPMD would
materialise full-size temporaries on every device). Instead each device works on the experts it
holds, inside `shard_map`:
- `experts_grouped`: assignments sorted by expert and two grouped matmuls
  (`jax.lax.ragged_dot_general`) over the local experts; for prefill and large batches;
- `experts_gathered`: a loop over the few routed (token, expert) slots that touches and
  dequantises only the experts actually hit; for decode, where cost must follow experts hit,
  not experts held.
Expert parallelism (`moe_ep_mode`):
- `local`: tokens replicated over the expert axes, each device computes its local experts, one
  `psum` combines;
- `all_to_all`: each device routes its slice of the tokens, dispatches (token, expert) rows to
  the devices owning the experts and combines them back (`k3text.layers.moe_dispatch`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3text import sharding
from k3text.config import Config
from k3text.layers import linears, mxfp4
from k3text.layers.activations import glu
from k3text.layers.initializers import FP32, Init, compute_dtype, precision, weight_dtype
from k3text.layers.linears import matmul
from k3text.layers.mlp import MLP
from k3text.layers.normalizations import rms_norm

log = logging.getLogger(__name__)


class LayerExperts(NamedTuple):
    """The routed-expert weights of one MoE layer, addressed inside the stack they live in.

    Stacked form: `arrays` keep a leading [layers] axis (the scanned group's stack; [1] for a
    layer outside any scan) and `layer` picks one entry. Kernels index (layer, expert) in one
    gather, so a decode step reads the experts it hits straight out of the stack. Slicing a
    layer's experts out first, which is what a scan over stacked parameters does, copies every
    expert the layer holds on every step: cost would follow experts held, not experts hit.

    Split form (unrolled layers on one expert shard; see `decoder.split_for_unrolled`): each
    name holds a tuple of per-expert arrays and `layer` is unused. The hit-experts kernel then
    switches to the expert's own branch and multiplies its arrays in place: XLA:CPU copies any
    slice that feeds a dot, so even a one-expert slice costs a write and a reread.
    """

    arrays: dict[str, jax.Array | tuple[jax.Array, ...]]  # [layers, experts, out, in] or split
    layer: jax.Array  # int32 scalar

    @property
    def split(self) -> bool:
        return isinstance(next(iter(self.arrays.values())), tuple)

    @property
    def held(self) -> int:
        first = next(iter(self.arrays.values()))
        return len(first) if self.split else first.shape[1]

    @staticmethod
    def of(arrays: dict[str, Any], stack_index: Any = None) -> LayerExperts:
        """The experts of one layer from its parameter values: a whole stack and this layer's
        `stack_index` in it, a split layer, or one layer's [experts, ...] arrays."""
        if stack_index is not None:
            return LayerExperts(arrays, jnp.asarray(stack_index, jnp.int32))
        if isinstance(next(iter(arrays.values())), tuple):
            return LayerExperts(arrays, jnp.int32(0))
        return LayerExperts({name: a[None] for name, a in arrays.items()}, jnp.int32(0))


# x [M, in] . w [G, out, in] -> [M, out], rows of x grouped by expert.
_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


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
# Expert weights.
# --------------------------------------------------------------------------------------------


def expert_matrices(cfg: Config, experts: LayerExperts, index: jax.Array | None = None,
                    ) -> tuple[jax.Array, jax.Array]:
    """(gate_up [n, 2I, D], down [n, D, I]) in the compute dtype, for the experts at `index`
    (all held experts when None). Packed MXFP4 experts are narrowed first, then dequantised,
    so only the selected experts are ever expanded."""
    def pick(name: str) -> jax.Array:
        a = experts.arrays[name]
        if experts.split:  # the grouped kernel over split experts restacks them (a copy)
            a = jnp.stack(a)
            return a if index is None else a[index]
        if index is None:
            return jax.lax.dynamic_index_in_dim(a, experts.layer, 0, keepdims=False)
        return a[experts.layer, index]

    return _dequantized(cfg, pick)


def _dequantized(cfg: Config, pick: Any) -> tuple[jax.Array, jax.Array]:
    """(gate_up, down) in the compute dtype from `pick(name)`, the stored arrays by name."""
    dtype = compute_dtype(cfg)
    if cfg.expert_weight_format == "mxfp4":
        gate_up = mxfp4.dequantize_mxfp4(pick("gate_up_packed"), pick("gate_up_scale"), dtype)
        down = mxfp4.dequantize_mxfp4(pick("down_packed"), pick("down_scale"), dtype)
        return gate_up, down
    return pick("gate_up").astype(dtype), pick("down").astype(dtype)


def _expert_glu(cfg: Config, h: jax.Array) -> jax.Array:
    width = cfg.moe_intermediate_size
    return glu(cfg, h[..., :width], h[..., width:])


def experts_grouped(cfg: Config, x: jax.Array, weights: jax.Array, local_ids: jax.Array,
                    experts: LayerExperts) -> jax.Array:
    """Weighted sum over each token's routed experts that live in `experts`.

    x [N, D]; weights, local_ids [N, k] with ids relative to the first held expert (ids outside
    [0, held) belong to other devices and contribute nothing). Rows are sorted by expert and
    pushed through two grouped matmuls over the held experts.
    """
    held = experts.held
    k = local_ids.shape[-1]
    flat_ids = local_ids.reshape(-1)
    here = (flat_ids >= 0) & (flat_ids < held)
    order = jnp.argsort(jnp.where(here, flat_ids, held), stable=True)
    token = order // k
    group_sizes = jnp.bincount(jnp.where(here, flat_ids, held), length=held + 1)[:held]
    gate_up, down = expert_matrices(cfg, experts)
    dtype, prec = compute_dtype(cfg), precision(cfg)
    rows = jnp.take(x, token, axis=0).astype(dtype)
    h = jax.lax.ragged_dot_general(rows, gate_up, group_sizes.astype(jnp.int32), _RAGGED_DIMS,
                                   precision=prec, preferred_element_type=FP32)
    y = jax.lax.ragged_dot_general(_expert_glu(cfg, h).astype(dtype), down,
                                   group_sizes.astype(jnp.int32), _RAGGED_DIMS, precision=prec,
                                   preferred_element_type=FP32)
    w = jnp.where(here, weights.reshape(-1), 0.0)[order]
    return jnp.zeros(x.shape, FP32).at[token].add(y * w[:, None])


def experts_gathered(cfg: Config, x: jax.Array, weights: jax.Array, local_ids: jax.Array,
                     experts: LayerExperts) -> jax.Array:
    """Same result as `experts_grouped`, touching only the experts tokens were routed to.

    A scan over the N*k routed slots: each held slot narrows the expert weights to one expert,
    dequantises it and applies it to one token; slots owned by other devices are skipped. Cost
    and temporaries follow the number of slots, not the number of experts held.
    """
    held = experts.held
    dtype, prec = compute_dtype(cfg), precision(cfg)
    k = local_ids.shape[-1]

    # Expert matrices are [out, in], the layout `linears.matvec` wants. A packed MXFP4 matrix
    # would be re-decoded inside that fused loop, which loses to decoding it once.
    def expert_matvec(w: jax.Array, v: jax.Array) -> jax.Array:
        if cfg.expert_weight_format == "mxfp4":
            return jnp.dot(w, v, precision=prec, preferred_element_type=FP32)
        return linears.matvec(v, w, prec, preferred_element_type=FP32)

    def ffn(gate_up: jax.Array, down: jax.Array, row: jax.Array) -> jax.Array:
        return expert_matvec(down, _expert_glu(cfg, expert_matvec(gate_up, row)).astype(dtype))

    def expert_branch(e: int):
        return lambda row: ffn(*_dequantized(cfg, lambda name: experts.arrays[name][e]), row)

    def one_slot(out, slot):
        token, expert, weight = slot // k, local_ids.reshape(-1)[slot], weights.reshape(-1)[slot]
        here = (expert >= 0) & (expert < held)
        expert = jnp.clip(expert, 0, held - 1)

        def apply(out):
            row = x[token].astype(dtype)
            if experts.split:
                y = jax.lax.switch(expert, [expert_branch(e) for e in range(held)], row)
            else:
                gate_up, down = expert_matrices(cfg, experts, expert[None])
                y = ffn(gate_up[0], down[0], row)
            return out.at[token].add(weight * y)

        if held == cfg.num_experts:  # every expert is here: nothing to skip
            return apply(out), None
        return jax.lax.cond(here, apply, lambda out: out, out), None

    out, _ = jax.lax.scan(one_slot, jnp.zeros(x.shape, FP32), jnp.arange(local_ids.size))
    return out


def use_gathered(cfg: Config, slots: int, held: int) -> bool:
    """Pick the hit-experts loop when there are fewer routed slots than held experts."""
    threshold = cfg.moe_dense_threshold or held - 1
    return slots <= threshold


def experts_local(cfg: Config, x: jax.Array, weights: jax.Array, local_ids: jax.Array,
                  experts: LayerExperts) -> jax.Array:
    fn = experts_gathered if use_gathered(cfg, local_ids.size, experts.held) else \
        experts_grouped
    return fn(cfg, x, weights, local_ids, experts)


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
    slots = ids.size
    if ctx is None or ctx.size("exp") == 1:
        path = "gathered" if use_gathered(cfg, slots, cfg.num_experts) else "ragged_dot"
        _logged(cfg, f"unsharded, {path}")
        return experts_local(cfg, x, weights, ids, experts)
    if cfg.moe_ep_mode == "all_to_all":
        from k3text.layers import moe_dispatch

        _logged(cfg, f"all_to_all over {ctx.axes('exp')}, transport "
                     f"{moe_dispatch.transport(cfg)}")
        return moe_dispatch.experts_all_to_all(cfg, ctx, x, weights, ids, experts, param_axes)
    held = cfg.num_experts // ctx.size("exp")
    path = "gathered" if use_gathered(cfg, slots // max(1, ctx.size("batch")), held) else \
        "ragged_dot"
    _logged(cfg, f"local expert parallelism over {ctx.axes('exp')}, {path}, psum combine")
    return _experts_local_ep(cfg, ctx, x, weights, ids, experts, param_axes)


def expert_specs(ctx: sharding.MeshContext, param_axes: dict[str, tuple]) -> LayerExperts:
    """shard_map in_specs of a `LayerExperts` whose arrays have `param_axes` after the stack."""
    return LayerExperts({name: ctx.spec(("layers", *axes)) for name, axes in param_axes.items()},
                        ctx.spec(()))


def _experts_local_ep(cfg: Config, ctx: sharding.MeshContext, x: jax.Array, weights: jax.Array,
                      ids: jax.Array, experts: LayerExperts,
                      param_axes: dict[str, tuple]) -> jax.Array:
    held = cfg.num_experts // ctx.size("exp")
    token_spec = ctx.spec(("batch", None))
    exp_axes = ctx.axes("exp")

    def body(x, weights, ids, experts):
        first = ctx.axis_index("exp") * held
        partial = experts_local(cfg, x, weights, ids - first, experts)
        return jax.lax.psum(partial, exp_axes)

    return jax.shard_map(body, mesh=ctx.mesh,
                         in_specs=(token_spec, token_spec, token_spec,
                                   expert_specs(ctx, param_axes)),
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
