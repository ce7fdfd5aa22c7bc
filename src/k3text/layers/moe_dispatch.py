"""Expert parallelism by all-to-all dispatch (the DP-attention + EP layout of the report, §6.2).

Each device of the expert group takes its slice of the tokens, routes them, sends every
(token, expert) row to the device holding that expert, runs its local experts on what it
received, sends the results back, and combines them with the routing weights; the token slices
are then gathered back. One dispatch/combine design, two transports:

- `ragged`: `jax.lax.ragged_all_to_all`, exact-size exchanges (TPU; XLA:CPU cannot execute it);
- `padded`: a capacity-padded `jax.lax.all_to_all` with the same semantics: each device sends
  a fixed [devices, capacity] buffer with invalid rows marked, capacity = every local row, so no
  row is ever dropped. Runs everywhere, including XLA:CPU.

Both transports carry the same rows to the same places; the tests run `padded` numerically and
lower `ragged` for TPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from k3text import sharding
from k3text.config import Config
from k3text.ops import experts as expert_ops
from k3text.ops.experts import ExpertFFN, LayerExperts


def transport(cfg: Config) -> str:
    """The transport that runs: `ragged` on TPU (or when asked), `padded` elsewhere."""
    if cfg.moe_a2a_transport != "auto":
        return cfg.moe_a2a_transport
    return "ragged" if sharding.target_platform() == "tpu" else "padded"


def received_rows(tokens: int, k: int, devices: int) -> int:
    """Rows each device of a `devices`-wide expert group receives and runs its experts on, for
    `tokens` tokens (its batch shard) with `k` routed slots each: one capacity-padded block of
    every group device's token slice (both transports allocate the padded size)."""
    return devices * -(-tokens // devices) * k


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _exchange_padded(rows: jax.Array, ids: jax.Array, dest: jax.Array, axes: tuple,
                     n: int) -> tuple[jax.Array, jax.Array, Any]:
    """Send rows [A, D] (sorted by destination `dest`) to their devices; returns the received
    rows [n * A, D] grouped by source, their expert ids (-1 = empty slot), and what `back`
    needs to return results to the senders."""
    count = rows.shape[0]
    offsets = _exclusive_cumsum(jnp.bincount(dest, length=n))
    slot = jnp.arange(count) - offsets[dest]  # position inside the destination's block
    send = jnp.zeros((n, count, rows.shape[1]), rows.dtype).at[dest, slot].set(rows)
    send_ids = jnp.full((n, count), -1, jnp.int32).at[dest, slot].set(ids)
    recv = jax.lax.all_to_all(send, axes, 0, 0, tiled=True)
    recv_ids = jax.lax.all_to_all(send_ids, axes, 0, 0, tiled=True)
    return recv.reshape(n * count, -1), recv_ids.reshape(-1), (dest, slot)


def _return_padded(results: jax.Array, how: Any, axes: tuple, n: int) -> jax.Array:
    dest, slot = how
    back = jax.lax.all_to_all(results.reshape(n, -1, results.shape[-1]), axes, 0, 0, tiled=True)
    return back[dest, slot]


def _exchange_ragged(rows: jax.Array, ids: jax.Array, dest: jax.Array, axes: tuple,
                     n: int) -> tuple[jax.Array, jax.Array, Any]:
    """The same exchange with exact sizes (`ragged_all_to_all`)."""
    count = rows.shape[0]
    send_sizes = jnp.bincount(dest, length=n).astype(jnp.int32)
    input_offsets = _exclusive_cumsum(send_sizes)
    # sizes[s, d]: rows device s sends to device d, known to everyone.
    sizes = jax.lax.all_gather(send_sizes, axes, tiled=False)
    me = _flat_index(axes)
    recv_sizes = sizes[:, me]
    # Where my rows land in each receiver's buffer: after the rows of lower-numbered senders.
    output_offsets = (jnp.cumsum(sizes, axis=0) - sizes)[me]
    buffer = jnp.zeros((n * count, rows.shape[1]), rows.dtype)
    recv = jax.lax.ragged_all_to_all(rows, buffer, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axes)
    recv_ids = jax.lax.ragged_all_to_all(ids, jnp.full((n * count,), -1, jnp.int32),
                                         input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axes)
    # Return trip: my received blocks go back to the offsets their senders sent them from.
    back = (_exclusive_cumsum(recv_sizes), recv_sizes,
            (jnp.cumsum(sizes, axis=1) - sizes)[:, me], send_sizes, count)
    return recv, recv_ids, back


def _return_ragged(results: jax.Array, how: Any, axes: tuple, n: int) -> jax.Array:
    offsets, sizes, their_offsets, my_sizes, count = how
    out = jnp.zeros((count, results.shape[-1]), results.dtype)
    return jax.lax.ragged_all_to_all(results, out, offsets, sizes, their_offsets, my_sizes,
                                     axis_name=axes)


def _flat_index(axes: tuple) -> jax.Array:
    index = 0
    for axis in axes:
        index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
    return index


def experts_all_to_all(cfg: Config, ctx: sharding.MeshContext, x: jax.Array,
                       weights: jax.Array, ids: jax.Array, experts: LayerExperts,
                       specs: LayerExperts, ffn: ExpertFFN, implementation: str) -> jax.Array:
    """Σ_k weights · expert_ids(x) for x [N, D] replicated over the expert axes.

    `specs`: the shard_map in_specs of `experts`; each device runs the `implementation` kernel
    of `k3text.ops.experts` on the `received_rows` it receives."""
    axes = ctx.axes("exp")
    n = ctx.size("exp")
    held = cfg.num_experts // n
    exchange, give_back = ((_exchange_ragged, _return_ragged) if transport(cfg) == "ragged"
                           else (_exchange_padded, _return_padded))
    token_spec = ctx.spec(("batch", None))

    def body(x, weights, ids, experts):
        tokens, k = ids.shape
        local = -(-tokens // n)
        pad = local * n - tokens
        me = ctx.axis_index("exp")
        take = lambda a: jax.lax.dynamic_slice_in_dim(  # noqa: E731
            jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)), me * local, local)
        x_mine, w_mine, ids_mine = take(x), take(weights), take(ids)
        if pad:  # padding tokens route nowhere
            real = me * local + jnp.arange(local) < tokens
            ids_mine = jnp.where(real[:, None], ids_mine, -1)
        flat = ids_mine.reshape(-1)
        dest = jnp.where(flat >= 0, flat // held, 0)
        order = jnp.argsort(dest, stable=True)
        rows = x_mine[order // k]
        expert = jnp.where(flat[order] >= 0, flat[order] % held, -1)
        recv, recv_ids, how = exchange(rows, expert, dest[order], axes, n)
        results = expert_ops.routed_experts(recv, jnp.ones((recv.shape[0], 1), jnp.float32),
                                            recv_ids[:, None], experts, ffn, implementation)
        returned = give_back(results, how, axes, n)
        w = w_mine.reshape(-1)[order]
        mine = jnp.zeros((local, x.shape[1]), jnp.float32).at[order // k].add(
            returned * w[:, None])
        return jax.lax.all_gather(mine, axes, tiled=True)[:tokens]

    return jax.shard_map(body, mesh=ctx.shard_map_mesh(),
                         in_specs=(token_spec, token_spec, token_spec, specs),
                         out_specs=token_spec, check_vma=False)(x, weights, ids, experts)
