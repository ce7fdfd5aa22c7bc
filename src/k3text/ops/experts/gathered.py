"""Hit-experts kernel: a loop over the routed (token, expert) slots that touches and dequantises
only the experts actually hit; for decode, where cost must follow experts hit, not experts
held."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3text.ops.experts.base import FP32, ExpertFFN, LayerExperts


def gathered(x: jax.Array, weights: jax.Array, local_ids: jax.Array, experts: LayerExperts,
             ffn: ExpertFFN, all_ids_held: bool) -> jax.Array:
    """Σ over each token's routed slots held here of weight · expert(x); see `routed_experts`.

    A scan over the N*k routed slots, grouped by expert (`slot_order`): each held slot narrows
    the expert weights to one expert (split experts: switches to that expert's branch),
    dequantises it and applies it to one token; slots owned by other devices are skipped
    (untested when `all_ids_held`). Cost and temporaries follow the number of slots, not the
    number of experts held.
    """
    held = experts.held
    k = local_ids.shape[-1]

    # Expert matrices are [out, in]; one row is one token.
    def matvec(w: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.dot(w, v, precision=ffn.precision, preferred_element_type=FP32)

    def apply_expert(gate_up: jax.Array, down: jax.Array, row: jax.Array) -> jax.Array:
        return matvec(down, ffn.glu(matvec(gate_up, row)).astype(ffn.dtype))

    def expert_branch(e: int) -> Callable[[jax.Array], jax.Array]:
        return lambda row: apply_expert(*experts.expert(e, ffn.dtype), row)

    def one_slot(out: jax.Array, slot: jax.Array) -> tuple[jax.Array, None]:
        token, expert, weight = slot // k, local_ids.reshape(-1)[slot], weights.reshape(-1)[slot]
        here = (expert >= 0) & (expert < held)
        expert = jnp.clip(expert, 0, held - 1)

        def apply(out: jax.Array) -> jax.Array:
            row = x[token].astype(ffn.dtype)
            if experts.split:
                y = jax.lax.switch(expert, [expert_branch(e) for e in range(held)], row)
            else:
                gate_up, down = experts.matrices(ffn.dtype, expert[None])
                y = apply_expert(gate_up[0], down[0], row)
            return out.at[token].add(weight * y)

        if all_ids_held:
            return apply(out), None
        return jax.lax.cond(here, apply, lambda out: out, out), None

    out, _ = jax.lax.scan(one_slot, jnp.zeros(x.shape, FP32), slot_order(local_ids))
    return out


def slot_order(local_ids: jax.Array) -> jax.Array:
    """The order `gathered` visits the routed slots [N, k] in: grouped by expert, so slots
    that share an expert run back to back and its second read comes from the cache (decode
    at batch 8 of the baselines' model: benchmarks/README.md). Each token's contributions are
    then summed in expert order, so a token decoded alone or beside others gets the same sum."""
    return jnp.argsort(local_ids.reshape(-1), stable=True)
