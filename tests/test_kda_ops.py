"""KDA ops: chunked vs recurrent vs decode step, against fla-core's naive torch reference, and the
short causal conv against a numpy loop."""

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3text.ops.kda import (
    causal_conv1d,
    causal_conv1d_step,
    kda_chunked,
    kda_recurrent,
    kda_step,
    l2_normalize,
)

# Each compiled shape runs once or twice on tiny inputs, so compile time dominates: skip the
# backend's optimisation passes (about a third off every compile; results are unaffected).
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
chunked = _jit(kda_chunked, static_argnames="chunk_size")
recurrent = _jit(kda_recurrent)
step = _jit(kda_step)
conv = _jit(causal_conv1d)
conv_step = _jit(causal_conv1d_step)

RTOL, ATOL = 1e-5, 1e-5
# One set of sizes throughout (K != V), so each sequence length compiles once per function.
B, H, DK, DV = 2, 3, 16, 12


def np_l2_normalize(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def make_inputs(seed, t, max_decay=1.0, with_state=True):
    """Normalised q/k (as the KDA layer feeds them), sigmoid beta and decays in [-max_decay, 0].

    Plain numpy float32, so that building inputs compiles nothing.
    """
    rng = np.random.default_rng(seed)
    q = np_l2_normalize(rng.standard_normal((B, t, H, DK)))
    k = np_l2_normalize(rng.standard_normal((B, t, H, DK)))
    v = rng.standard_normal((B, t, H, DV))
    g = -rng.uniform(0.0, max_decay, (B, t, H, DK))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, t, H))))
    state = rng.standard_normal((B, H, DK, DV)).astype(np.float32) if with_state else None
    return *(a.astype(np.float32) for a in (q, k, v, g, beta)), state


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def load_fla_naive():
    """fla's torch reference, loaded by path: `import fla` would pull in triton."""
    pytest.importorskip("torch")
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fla_naive():
    return load_fla_naive()


# --- l2_normalize -----------------------------------------------------------------------------


def test_l2_normalize_puts_eps_inside_the_sqrt():
    x = jnp.array([[3.0, 4.0], [0.0, 0.0]], jnp.bfloat16)
    y = l2_normalize(x, eps=1e-6)
    assert y.dtype == jnp.bfloat16
    assert_close(y.astype(jnp.float32), [[0.6, 0.8], [0.0, 0.0]], rtol=1e-2, atol=0)
    assert_close(l2_normalize(jnp.array([1e-3]), eps=1e-6), [1e-3 / np.sqrt(1e-6 + 1e-6)])


# --- chunked vs recurrent ---------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("max_decay", [1.0, 5.0])
def test_chunked_matches_recurrent(t, with_state, max_decay):
    # At max_decay = 5, exp(G_i - G_j) above a 64-token chunk's diagonal is far outside float32.
    q, k, v, g, beta, s0 = make_inputs(t, t, max_decay, with_state)
    o_ref, s_ref = recurrent(q, k, v, g, beta, s0)
    o, s = chunked(q, k, v, g, beta, s0)
    assert o.shape == (B, t, H, DV) and s.shape == (B, H, DK, DV)
    assert o.dtype == s.dtype == jnp.float32
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert_close(o, o_ref)
    assert_close(s, s_ref)


def test_chunked_is_independent_of_chunk_size():
    q, k, v, g, beta, s0 = make_inputs(7, 200, max_decay=2.0)
    o_64, s_64 = chunked(q, k, v, g, beta, s0)  # the default, 64
    o_16, s_16 = chunked(q, k, v, g, beta, s0, chunk_size=16)
    assert_close(o_16, o_64)
    assert_close(s_16, s_64)


def test_chunked_accepts_bf16_inputs_and_computes_in_fp32():
    q, k, v, g, beta, s0 = make_inputs(8, 65)
    low = [a.astype(jnp.bfloat16) for a in (q, k, v, g, beta)]
    o, s = chunked(*low, s0)
    o_ref, s_ref = recurrent(*(a.astype(np.float32) for a in low), s0)
    assert o.dtype == s.dtype == jnp.float32
    assert_close(o, o_ref)
    assert_close(s, s_ref)


# --- decode step ------------------------------------------------------------------------------


def test_step_by_step_matches_recurrent():
    q, k, v, g, beta, state = make_inputs(3, 63, max_decay=3.0)
    o_ref, s_ref = recurrent(q, k, v, g, beta, state)
    outs = []
    for i in range(q.shape[1]):
        o_i, state = step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], state)
        outs.append(o_i)
    assert_close(jnp.stack(outs, axis=1), o_ref)
    assert_close(state, s_ref)


# --- no-op tokens -----------------------------------------------------------------------------


def test_zero_beta_zero_decay_token_leaves_state_unchanged():
    q, k, v, _, _, state = make_inputs(4, 1)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    _, new_state = step(q, k, v, np.zeros_like(k), np.zeros((B, H), np.float32), state)
    np.testing.assert_array_equal(np.asarray(new_state), state)


@pytest.mark.parametrize("fn", [chunked, recurrent], ids=["chunked", "recurrent"])
def test_interleaved_noop_tokens_do_not_change_results(fn):
    # Real tokens keep their q, k, v; the inserted ones have random q, k, v but beta = g = 0.
    q, k, v, g, beta, s0 = make_inputs(5, 200, max_decay=2.0)
    real = np.sort(np.random.default_rng(0).choice(200, size=65, replace=False))
    noop = np.setdiff1d(np.arange(200), real)
    g[:, noop] = 0.0
    beta[:, noop] = 0.0
    o_all, s_all = fn(q, k, v, g, beta, s0)
    o_real, s_real = fn(*(a[:, real] for a in (q, k, v, g, beta)), s0)
    assert_close(np.asarray(o_all)[:, real], o_real)
    assert_close(s_all, s_real)


def test_chunked_internal_padding_equals_explicit_padding():
    q, k, v, g, beta, s0 = make_inputs(6, 65)
    pad = [(0, 0), (0, 128 - 65)]
    padded = [np.pad(a, pad + [(0, 0)] * (a.ndim - 2)) for a in (q, k, v, g, beta)]
    o, s = chunked(q, k, v, g, beta, s0)
    o_pad, s_pad = chunked(*padded, s0)
    assert_close(o, np.asarray(o_pad)[:, :65], rtol=0, atol=0)
    assert_close(s, s_pad, rtol=0, atol=0)


# --- fla-core reference -----------------------------------------------------------------------


def to_torch(*arrays):
    import torch

    return [None if a is None else torch.from_numpy(np.asarray(a, np.float64)) for a in arrays]


@pytest.mark.parametrize(("t", "with_state"), [(64, False), (128, True)])
@pytest.mark.parametrize("max_decay", [1.0, 5.0])
def test_matches_fla_naive(fla_naive, t, with_state, max_decay):
    # fla computes in float32 (it upcasts to torch.float), so agreement is at float32 level.
    q, k, v, g, beta, s0 = make_inputs(200 + t, t, max_decay, with_state)
    tq, tk, tv, tg, tbeta, ts0 = to_torch(q, k, v, g, beta, s0)
    kwargs = dict(scale=1.0, initial_state=ts0, output_final_state=True)
    o_rec, s_rec = fla_naive.naive_recurrent_kda(tq, tk, tv, tg, tbeta, **kwargs)
    o_chk, s_chk = fla_naive.naive_chunk_kda(tq, tk, tv, tg, tbeta, chunk_size=64, **kwargs)

    o, s = recurrent(q, k, v, g, beta, s0)
    o_c, s_c = chunked(q, k, v, g, beta, s0)
    for ours in (o, o_c):
        for theirs in (o_rec, o_chk):
            assert_close(ours, theirs.numpy(), atol=2e-5)
    for ours in (s, s_c):
        for theirs in (s_rec, s_chk):
            assert_close(ours, theirs.numpy(), atol=2e-5)


# --- causal conv ------------------------------------------------------------------------------


def naive_conv(x, weight, conv_state):
    """y[t] = sum_j weight[j] * x[t - (W - 1) + j], history from conv_state."""
    width = weight.shape[0]
    full = np.concatenate([conv_state, x], axis=1).astype(np.float64)
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[1]):
        for j in range(width):
            y[:, t] += weight[j] * full[:, t + j]
    return y, full[:, -(width - 1) :]


def conv_inputs(seed, b=2, t=9, c=6, width=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    weight = rng.standard_normal((width, c)).astype(np.float32)
    state = rng.standard_normal((b, width - 1, c)).astype(np.float32)
    return x, weight, state


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("t", [1, 2, 9])
def test_conv_matches_naive_loop(t, with_state):
    x, weight, state = conv_inputs(t, t=t)
    if not with_state:
        state = np.zeros_like(state)
    y, new_state = conv(x, weight, state if with_state else None)
    y_ref, state_ref = naive_conv(x, weight, state)
    assert y.shape == x.shape and new_state.shape == state.shape
    assert_close(y, y_ref)
    assert_close(new_state, state_ref, rtol=0, atol=0)


def test_conv_split_in_two_calls_matches_one_call():
    x, weight, state = conv_inputs(1, t=11)
    y, s = conv(x, weight, state)
    y1, s1 = conv(x[:, :4], weight, state)
    y2, s2 = conv(x[:, 4:], weight, s1)
    assert_close(jnp.concatenate([y1, y2], axis=1), y, rtol=0, atol=0)
    assert_close(s2, s, rtol=0, atol=0)


def test_conv_lengths_keep_padding_out_of_the_state():
    x, weight, state = conv_inputs(2, b=4, t=8)
    lengths = np.array([8, 5, 1, 0])
    y, new_state = conv(x, weight, state, lengths)
    y_full, _ = naive_conv(x, weight, state)
    for row, n in enumerate(lengths):
        _, state_ref = naive_conv(x[row : row + 1, :n], weight, state[row : row + 1])
        assert_close(new_state[row : row + 1], state_ref, rtol=0, atol=0)
        assert_close(y[row, :n], y_full[row, :n])


def test_conv_step_matches_conv():
    x, weight, state = conv_inputs(3, t=7)
    y_ref, s_ref = conv(x, weight, state)
    outs = []
    for t in range(x.shape[1]):
        y_t, state = conv_step(x[:, t], weight, state)
        outs.append(y_t)
    assert_close(jnp.stack(outs, axis=1), y_ref)
    assert_close(state, s_ref, rtol=0, atol=0)


def test_conv_keeps_low_precision_dtype():
    x, weight, state = conv_inputs(4)
    x = x.astype(jnp.bfloat16)
    y, s = conv(x, weight, state)
    assert y.dtype == s.dtype == jnp.bfloat16
    y_ref, _ = naive_conv(x.astype(np.float32), weight, state)
    assert_close(np.asarray(y, np.float32), y_ref, rtol=1e-2, atol=1e-2)


def test_conv_over_fused_qkv_channels_is_channelwise():
    """The KDA layer convolves q, k, v as one [.., 3, C] channel block: the same as each part
    (or the flattened channels) alone, for the sequence and the step form."""
    x, weight, state = conv_inputs(5, t=6, c=12)
    fused = (x.reshape(2, 6, 3, 4), weight.reshape(4, 3, 4), state.reshape(2, 3, 3, 4))
    y_ref, s_ref = naive_conv(x, weight, state)
    y, s = conv(*fused)
    assert_close(np.asarray(y).reshape(x.shape), y_ref)
    assert_close(np.asarray(s).reshape(state.shape), s_ref, rtol=0, atol=0)
    y_t, s_t = conv_step(fused[0][:, 0], fused[1], fused[2])
    assert_close(np.asarray(y_t).reshape(2, 12), y_ref[:, 0])
    assert_close(np.asarray(s_t).reshape(state.shape),
                 np.concatenate([state[:, 1:], x[:, :1]], axis=1), rtol=0, atol=0)
