"""KDA (Kimi Delta Attention) layer: projections, short conv, decay/beta gates, delta rule,
gated output norm. The delta rule and the conv are ops (`k3text.ops.kda`); which
implementation runs the prefill form is the config's `kda_implementation`.

Two entry points share every projection and gate:
- `__call__`: a whole sequence or a prefill chunk, chunked delta rule, optionally continuing
  from and returning a `KDAState` (recurrent state + conv state);
- `step`: one token per sequence for decode, single-step update and conv ring update.

Right-padded tokens (`valid == False`) are made no-ops on the state (beta = 0, g = 0, and the
conv state is taken from each row's last valid inputs), so padding never leaks into a sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3text import sharding
from k3text.config import Config
from k3text.layers.initializers import FP32, Init, compute_dtype, precision, weight_dtype
from k3text.layers.linears import matmul
from k3text.layers.normalizations import gated_rms_norm
from k3text.ops import kda as kda_ops


class KDAState(NamedTuple):
    """Per-sequence KDA decode state of one layer."""

    recurrent: jax.Array  # [B, H, K, V] float32
    conv: jax.Array  # [B, W-1, 3, H*K]: the last W-1 inputs of the q, k and v convolutions


def decay_gate(cfg: Config, f: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """Log-space per-channel decay g <= 0 from the low-rank projection output f [..., H, K], in
    the config's gate form (`k3text.ops.kda.decay_gate`)."""
    return kda_ops.decay_gate(f, a_log, dt_bias, _lower_bound(cfg))


def _lower_bound(cfg: Config) -> float | None:
    """K3's gate_lower_bound, None for Kimi Linear's unbounded gate."""
    return cfg.linear_attn_config.gate_lower_bound or None


def _inverse_softplus_dt(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
    return dt + np.log(-np.expm1(-dt))


class KDAAttention(nnx.Module):
    def __init__(self, cfg: Config, init: Init):
        self.cfg = cfg
        lin = cfg.linear_attn_config
        hidden, heads, dim = cfg.hidden_size, lin.num_heads, lin.head_dim
        width = heads * dim
        wdt = weight_dtype(cfg)
        # q, k and v share their input: one kernel [hidden, 3, H*K] makes one matmul of the
        # three (at decode, one large matrix-vector product streams weights faster than three
        # small ones), and the (q, k, v) axis keeps each tensor-parallel shard's three parts on
        # the same device, as MLP.wi does for gate and up.
        self.qkv_proj = init.fan_in((hidden, 3, width), ("embed", None, "heads"), wdt,
                                    fan_in=hidden)
        # Depthwise causal conv kernels [W, 3, H*K] over (q, k, v), stored fp32 as the
        # checkpoints do; laid out like the conv state.
        kernel = lin.short_conv_kernel_size
        self.qkv_conv = init.fan_in((kernel, 3, width), (None, None, "heads"), FP32,
                                    fan_in=kernel)
        # Low-rank decay projection hidden -> head_dim -> H*K, then the gate function.
        self.f_a_proj = init.fan_in((hidden, dim), ("lora_in", "kda_rank"), wdt)
        self.f_b_proj = init.fan_in((dim, width), ("kda_rank", "heads"), wdt)
        # A_log ~ log U(1, 16) and dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1), as FLA inits.
        self.A_log = init.values((heads,), ("heads",), FP32,
                                 lambda rng, s: np.log(rng.uniform(1.0, 16.0, s)))
        self.dt_bias = init.values((width,), ("heads",), FP32, _inverse_softplus_dt)
        self.b_proj = init.fan_in((hidden, heads), ("embed", "heads"), wdt)
        if lin.use_full_rank_gate:
            self.g_proj = init.fan_in((hidden, width), ("embed", "heads"), wdt)
        else:
            self.g_a_proj = init.fan_in((hidden, dim), ("lora_in", "kda_rank"), wdt)
            self.g_b_proj = init.fan_in((dim, width), ("kda_rank", "heads"), wdt)
        self.o_norm = init.constant((dim,), (None,), FP32)
        self.o_proj = init.fan_in((width, hidden), ("heads", "embed"), wdt)

    # ---- pieces shared by the sequence and step paths --------------------------------------

    def _split_heads(self, x: jax.Array) -> jax.Array:
        lin = self.cfg.linear_attn_config
        return x.reshape(*x.shape[:-1], lin.num_heads, lin.head_dim)

    def _gate_inputs(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The raw decay projection f [..., H, K] and beta logits [..., H] of the layer input."""
        cfg = self.cfg
        f = matmul(cfg, matmul(cfg, x, self.f_a_proj[...]), self.f_b_proj[...])
        return self._split_heads(f), matmul(cfg, x, self.b_proj[...])

    def _output(self, x: jax.Array, o: jax.Array) -> jax.Array:
        cfg = self.cfg
        if cfg.linear_attn_config.use_full_rank_gate:
            gate = matmul(cfg, x, self.g_proj[...])
        else:
            gate = matmul(cfg, matmul(cfg, x, self.g_a_proj[...]), self.g_b_proj[...])
        o = gated_rms_norm(o, self._split_heads(gate), self.o_norm[...], cfg.rms_norm_eps)
        o = o.reshape(*o.shape[:-2], -1).astype(compute_dtype(cfg))
        return matmul(cfg, o, self.o_proj[...])

    def _qkv(self, x: jax.Array) -> jax.Array:
        """x [..., hidden] -> the q, k, v projections [..., 3, H*K]."""
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        return jnp.einsum("...d,dpf->...pf", x.astype(dtype), self.qkv_proj[...].astype(dtype),
                          precision=precision(cfg))

    # ---- entry points ---------------------------------------------------------------------

    def __call__(self, x: jax.Array, state: KDAState | None = None,
                 valid: jax.Array | None = None, slices: bool = False,
                 ) -> tuple[jax.Array, KDAState]:
        """x [B, T, hidden] -> (y [B, T, hidden], final state).

        `valid` [B, T] marks real tokens; padding must come after each row's real tokens.
        `slices`: the rows are consecutive slices of one sequence (a context-parallel prefill,
        `k3text.ops.kda.context_parallel`; `state` is given, the same in every row); the final
        state is the sequence's, in every row.
        """
        cfg, prec = self.cfg, precision(self.cfg)
        lengths = None if valid is None else jnp.sum(valid, axis=1, dtype=jnp.int32)
        qkv = self._qkv(x)
        conv_in = None if state is None else state.conv
        if slices:
            conv_in = kda_ops.slice_halos(qkv, conv_in)
        y, conv = kda_ops.causal_conv1d(qkv, self.qkv_conv[...], conv_in, lengths=lengths)
        if slices:
            conv = kda_ops.last_filled_row(conv, lengths)
        q, k, v = kda_ops.mix_qkv(y, cfg.linear_attn_config.num_heads)
        q, k, v = (sharding.constrain(t, ("batch", None, "heads", None)) for t in (q, k, v))
        f, beta_logits = self._gate_inputs(x)
        g = decay_gate(cfg, f, self.A_log[...], self.dt_bias[...])
        beta = jax.nn.sigmoid(beta_logits.astype(FP32))
        if valid is not None:  # padding tokens: no decay, no write
            g = jnp.where(valid[:, :, None, None], g, 0.0)
            beta = jnp.where(valid[:, :, None], beta, 0.0)
        initial = None if state is None else state.recurrent

        def delta_rule(q, k, v, g, beta, initial):
            return kda_ops.prefill(
                q, k, v, g, beta, implementation=cfg.kda_implementation, initial_state=initial,
                chunk_size=cfg.kda_chunk_size, gate_lower_bound=_lower_bound(cfg),
                precision=prec)

        if slices:
            o, recurrent = kda_ops.prefill_across_rows(delta_rule, q, k, v, g, beta, initial,
                                                       precision=prec)
        else:
            o, recurrent = delta_rule(q, k, v, g, beta, initial)
        return self._output(x, o), KDAState(recurrent, conv)

    def step(self, x: jax.Array, state: KDAState, valid: jax.Array | None = None,
             ) -> tuple[jax.Array, KDAState]:
        """One decode token per sequence: x [B, hidden] -> (y [B, hidden], new state); rows
        where `valid` [B] is false keep their state exactly."""
        cfg = self.cfg
        f, beta_logits = self._gate_inputs(x)
        o, conv, recurrent = kda_ops.decode_step(
            self._qkv(x), self.qkv_conv[...], state.conv, f, self.A_log[...], self.dt_bias[...],
            beta_logits, state.recurrent, implementation=cfg.kda_decode_implementation,
            gate_lower_bound=_lower_bound(cfg), precision=precision(cfg), valid=valid)
        return self._output(x, o), KDAState(recurrent, conv)
