"""KDA ops: every implementation (prefill forms and the decode step) against one float64
recurrence, the chunked form against fla-core's naive torch reference, and the short causal conv
against a numpy loop."""

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.ops import kda
from k3text.ops.kda import causal_conv1d, causal_conv1d_step, l2_normalize
from k3text.ops.kda.chunked import kda_chunked
from k3text.ops.kda.reference import kda_recurrent, kda_step

from helpers import tiny_config

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


# --- the harness: every implementation against a float64 recurrence ---------------------------
#
# Each case batches four rows that cover the gates and write strengths KDA meets: K3's lower
# bound on every channel of every token (g = -5), strong unbounded Kimi Linear decays (down to
# -33 per token), beta = 0 (no write; the state only decays) and beta = 1 (a full overwrite).
# The reference is the token update of the module docstring in numpy float64, written here
# independently of k3text's ops. Implementations compute in float32, so tolerances are float32
# rounding of O(1) outputs accumulated over the sequence.

HARNESS_T = [1, 15, 16, 17, 63, 64, 65, 1000, 4096]
HARNESS_TOL = 5e-5  # inputs are rounded to their dtype before the reference sees them
K3_BOUND = -5.0


def harness_inputs(t, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = np_l2_normalize(rng.standard_normal((4, t, H, DK))) * DK ** -0.5
    k = np_l2_normalize(rng.standard_normal((4, t, H, DK)))
    v = rng.standard_normal((4, t, H, DV))
    g = np.stack([np.full((t, H, DK), K3_BOUND),
                  -np.exp(rng.uniform(0.0, 3.5, (t, H, DK))),
                  -rng.uniform(0.0, 1.0, (t, H, DK)),
                  -rng.uniform(0.0, -K3_BOUND, (t, H, DK))])
    beta = np.stack([1.0 / (1.0 + np.exp(-rng.standard_normal((t, H)))), rng.uniform(0, 1, (t, H)),
                     np.zeros((t, H)), np.ones((t, H))])
    s0 = rng.standard_normal((4, H, DK, DV))
    # Round to the input dtype first: the reference then sees exactly what the op sees.
    rounded = [np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (q, k, v, g, beta)]
    return rounded, s0.astype(np.float32)


def reference_f64(q, k, v, g, beta, s0):
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    state = np.zeros((q.shape[0], H, DK, DV)) if s0 is None else np.asarray(s0, np.float64)
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[..., None]
        predicted = np.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + np.einsum("bhk,bhv->bhkv", k[:, t],
                                  beta[:, t, :, None] * (v[:, t] - predicted))
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], state)
    return o, state


def decode_by_steps(q, k, v, g, beta, s0):
    """The decode step's delta rule (`reference.kda_step`, the ``xla`` decode step's core) applied
    token by token; the whole decode step, conv and activations included, has its own harness
    below."""
    state = jnp.zeros((q.shape[0], H, DK, DV), jnp.float32) if s0 is None else s0

    def one(state, xs):
        o, state = kda_step(*xs, state, precision=jax.lax.Precision.HIGHEST)
        return state, o

    state, o = jax.lax.scan(one, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(o, 0, 1), state


HIGHEST = jax.lax.Precision.HIGHEST
IMPLEMENTATIONS = {
    "recurrent": _jit(functools.partial(kda.prefill, implementation="recurrent",
                                        precision=HIGHEST)),
    "chunked": _jit(functools.partial(kda.prefill, implementation="chunked", precision=HIGHEST)),
    # K3's bound declared: the diagonal sub-chunks run as products (the row with unbounded
    # decays is left out of this one's comparison).
    "chunked_bounded": _jit(functools.partial(kda.prefill, implementation="chunked",
                                              gate_lower_bound=K3_BOUND, precision=HIGHEST)),
    "decode_step": _jit(decode_by_steps),
}


# bfloat16 inputs at three lengths: the arithmetic is float32 either way.
HARNESS_CASES = [pytest.param(t, with_state, dtype, id=f"T{t}-{'state' if with_state else 'zero'}"
                              f"-{jnp.dtype(dtype).name}")
                 for dtype, lengths in ((jnp.float32, HARNESS_T), (jnp.bfloat16, (17, 65, 1000)))
                 for t in lengths for with_state in (True, False)]


@pytest.mark.parametrize(("t", "with_state", "dtype"), HARNESS_CASES)
def test_every_implementation_matches_the_float64_recurrence(t, with_state, dtype):
    (q, k, v, g, beta), s0 = harness_inputs(t, dtype, seed=t)
    s0 = s0 if with_state else None
    o_ref, s_ref = reference_f64(q, k, v, g, beta, s0)
    low = [jnp.asarray(a, dtype) for a in (q, k, v, g, beta)]
    tol = HARNESS_TOL
    for name, fn in IMPLEMENTATIONS.items():
        o, s = fn(*low, initial_state=s0) if name != "decode_step" else fn(*low, s0)
        assert o.shape == (4, t, H, DV) and s.shape == (4, H, DK, DV), name
        assert o.dtype == s.dtype == jnp.float32, name
        rows = [0, 2, 3] if name == "chunked_bounded" else [0, 1, 2, 3]
        o, s = np.asarray(o)[rows], np.asarray(s)[rows]
        assert np.isfinite(o).all() and np.isfinite(s).all(), name
        np.testing.assert_allclose(o, o_ref[rows], rtol=tol, atol=tol, err_msg=name)
        np.testing.assert_allclose(s, s_ref[rows], rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("t", [17, 65])
def test_tokamax_mosaic_in_pallas_interpret_mode_matches_the_float64_recurrence(
        t, monkeypatch):
    """tokamax's Mosaic TPU kernel through `kda.prefill`, run on the CPU by Pallas's TPU
    interpreter (tokamax reads PALLAS_INTERPRET while tracing; the abstract TPU7x mesh answers
    its VMEM query); T = 17 and 65 exercise the padding to its 64-token chunks.

    It matches on the bounded rows. On the row with strong unbounded decays (down to -33 per
    token) its outputs are not finite, which is why ``auto`` never gives it an unbounded gate;
    should a tokamax release fix that, this test says so and `kda.resolve_prefill` can change."""
    monkeypatch.setenv("PALLAS_INTERPRET", "1")
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType
    from tokamax.config import cross_compile

    (q, k, v, g, beta), s0 = harness_inputs(t, jnp.float32, seed=t)
    o_ref, s_ref = reference_f64(q, k, v, g, beta, s0)
    device = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
    mosaic = functools.partial(kda.prefill, implementation="tokamax_mosaic")
    args = (q, k, v, g, beta, s0)
    with cross_compile(True), jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(lambda *a: mosaic(*a[:5], initial_state=a[5])).trace(*args)
    o, s = (np.asarray(a) for a in traced.lower(lowering_platforms=("cpu",)).compile()(*args))
    bounded = [0, 2, 3]
    np.testing.assert_allclose(o[bounded], o_ref[bounded], rtol=5e-5, atol=5e-5)
    np.testing.assert_allclose(s[bounded], s_ref[bounded], rtol=5e-5, atol=5e-5)
    assert not np.isfinite(o[1]).all(), "tokamax's kernel now handles strong unbounded decays"


def test_chunked_with_one_sub_chunk_per_chunk_matches_the_float64_recurrence():
    """Chunks that are a single sub-chunk (no below-diagonal blocks, the whole chunk pairwise or
    as products, down to one and two tokens) against the float64 recurrence, as the harness
    checks four sub-chunks of 16."""
    (q, k, v, g, beta), s0 = harness_inputs(200, jnp.float32, seed=3)
    o_ref, s_ref = reference_f64(q, k, v, g, beta, s0)
    form = _jit(kda_chunked, static_argnames=("chunk_size", "sub_chunk_size", "gate_lower_bound",
                                              "precision"))
    for chunk, bound, rows in ((64, None, [0, 1, 2, 3]), (16, K3_BOUND, [0, 2, 3]),
                               (1, K3_BOUND, [0, 2, 3]), (2, K3_BOUND, [0, 2, 3])):
        o, s = form(q, k, v, g, beta, s0, chunk_size=chunk, sub_chunk_size=chunk,
                    gate_lower_bound=bound, precision=HIGHEST)
        np.testing.assert_allclose(np.asarray(o)[rows], o_ref[rows], rtol=5e-5, atol=5e-5)
        np.testing.assert_allclose(np.asarray(s)[rows], s_ref[rows], rtol=5e-5, atol=5e-5)


def test_chunked_pads_a_last_partial_step_of_chunks_with_no_ops():
    """300 tokens are 5 chunks of 64, walked 4 per step: the second step holds one real chunk
    (partly filled) and three of padding, which must leave the state and outputs untouched."""
    (q, k, v, g, beta), s0 = harness_inputs(300, jnp.float32, seed=5)
    o_ref, s_ref = reference_f64(q, k, v, g, beta, s0)
    form = _jit(kda_chunked, static_argnames=("chunk_size", "gate_lower_bound",
                                              "chunks_per_step", "precision"))
    for bound, rows in ((None, [0, 1, 2, 3]), (K3_BOUND, [0, 2, 3])):
        o, s = form(q, k, v, g, beta, s0, chunk_size=64, gate_lower_bound=bound,
                    chunks_per_step=4, precision=HIGHEST)
        np.testing.assert_allclose(np.asarray(o)[rows], o_ref[rows], rtol=5e-5, atol=5e-5)
        np.testing.assert_allclose(np.asarray(s)[rows], s_ref[rows], rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("t", [96, 133])
def test_chunked_walks_the_steps_its_loop_leaves_over(t):
    """The loop takes two steps an iteration and leaves one to three steps (the last partial)
    after it. Here, a step a chunk of 32: 96 tokens leave one whole step after one iteration, 133
    two whole steps and a partial one; the harness's lengths cover the other arrangements (1000:
    a whole step and a partial one after the loop, 4096: two whole steps, 65: three steps and no
    loop)."""
    (q, k, v, g, beta), s0 = harness_inputs(t, jnp.float32, seed=7)
    o_ref, s_ref = reference_f64(q, k, v, g, beta, s0)
    o, s = _jit(kda_chunked, static_argnames=("chunks_per_step", "precision"))(
        q, k, v, g, beta, s0, chunks_per_step=1, precision=HIGHEST)
    np.testing.assert_allclose(np.asarray(o), o_ref, rtol=5e-5, atol=5e-5)
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=5e-5, atol=5e-5)


def test_chunked_refuses_a_chunk_that_is_not_whole_sub_chunks():
    (q, k, v, g, beta), s0 = harness_inputs(8, jnp.float32)
    with pytest.raises(ValueError, match="multiple of sub_chunk_size"):
        kda_chunked(q, k, v, g, beta, s0, chunk_size=40, sub_chunk_size=16)


def test_chunked_is_differentiable_and_its_gradients_match_the_recurrence():
    (q, k, v, g, beta), s0 = harness_inputs(40, jnp.float32, seed=4)  # 3 chunks of 16

    def loss(fn, q, k, v, g, beta):
        o, s = fn(q, k, v, g, beta, s0)
        return jnp.sum(o ** 2) + jnp.sum(s ** 2)

    grads = [_jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
             for fn in (functools.partial(kda_recurrent, precision=HIGHEST),
                        functools.partial(kda_chunked, chunk_size=16, precision=HIGHEST))]
    for ref, ours in zip(*grads, strict=True):
        assert np.isfinite(np.asarray(ours)).all()
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=2e-4, atol=2e-4)


def test_auto_picks_per_backend_and_unknown_names_are_refused():
    assert kda.resolve_prefill("auto", "cpu") == "recurrent"
    assert kda.resolve_prefill("auto", "cpu", head_dim=16) == "recurrent"
    assert kda.resolve_prefill("auto", "cpu", head_dim=128) == "chunked"
    assert kda.resolve_prefill("auto", "cpu", gate_lower_bound=-5.0, head_dim=128) == "chunked"
    assert kda.resolve_prefill("auto", "tpu", gate_lower_bound=-5.0) == "tokamax_mosaic"
    assert kda.resolve_prefill("auto", "tpu") == "chunked"  # unbounded gate
    assert kda.resolve_prefill("auto", "gpu") == "chunked"
    assert kda.resolve_prefill("chunked", "tpu") == "chunked"
    with pytest.raises(ValueError, match="unknown KDA prefill implementation 'fast'"):
        kda.resolve_prefill("fast")


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


@pytest.mark.parametrize("name", ["k3-tiny", "kimi-linear-tiny"])
def test_the_model_reads_the_same_through_every_cpu_implementation(name):
    """Whole-model logits of a tiny K3 (bounded gate: the chunked form's product diagonals) and a
    tiny Kimi Linear (unbounded: pairwise diagonals) with each prefill implementation the CPU
    runs, right-padded rows included; 100 tokens span two 64-token chunks."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 100)), jnp.int32)
    valid = jnp.arange(100)[None, :] < jnp.array([[100], [77]])
    logits = {}
    for implementation in ("recurrent", "chunked"):
        model = Decoder(tiny_config(name, f"kda_implementation={implementation}"), Init(0))
        graph, state = nnx.split(model)
        forward = jax.jit(lambda state, t, m, g=graph: nnx.merge(g, state).forward(t, m))
        logits[implementation] = np.asarray(forward(state, tokens, valid))
    real = np.asarray(valid)
    np.testing.assert_allclose(logits["chunked"][real], logits["recurrent"][real],
                               rtol=1e-4, atol=1e-4)


# --- the decode step from raw projections: every implementation against float64 --------------

DECODE_HEADS, DECODE_DIM, DECODE_WIDTH, DECODE_SLOTS = 2, 16, 4, 3


def decode_inputs(seed, steps):
    """Raw projections for `steps` tokens of 3 slots, as the layer hands them over: q, k, v
    before the conv, the decay projection f, beta logits; conv weights, A_log, dt_bias, and a
    slot pool state (recurrent and conv). f is scaled up so that the unbounded gate reaches
    strong decays."""
    rng = np.random.default_rng(seed)
    h, d, w = DECODE_HEADS, DECODE_DIM, DECODE_WIDTH
    return dict(
        qkv=rng.standard_normal((steps, DECODE_SLOTS, 3, h * d)),
        f=4 * rng.standard_normal((steps, DECODE_SLOTS, h, d)),
        beta_logits=2 * rng.standard_normal((steps, DECODE_SLOTS, h)),
        conv_weight=rng.standard_normal((w, 3, h * d)) / 2,
        a_log=np.log(rng.uniform(1.0, 16.0, h)),
        dt_bias=rng.standard_normal(h * d),
        conv_state=rng.standard_normal((DECODE_SLOTS, w - 1, 3, h * d)),
        state=rng.standard_normal((DECODE_SLOTS, h, d, d)))


def decode_reference_f64(x, lower_bound):
    """The KDA layer's decode step in numpy float64: conv over the window, SiLU, per-head L2 norm
    (eps inside the sqrt) and the query scale, the gate, the sigmoid beta, the delta rule."""
    h, d = DECODE_HEADS, DECODE_DIM
    conv, state = x["conv_state"].astype(np.float64), x["state"].astype(np.float64)
    outs = []
    for t in range(x["qkv"].shape[0]):
        window = np.concatenate([conv, x["qkv"][t][:, None]], axis=1)
        conv = window[:, 1:]
        y = np.einsum("bwcf,wcf->bcf", window, x["conv_weight"])
        y = y / (1 + np.exp(-y))
        q, k, v = (y[:, i].reshape(-1, h, d) for i in range(3))
        q = np_l2_normalize(q) * d ** -0.5
        k = np_l2_normalize(k)
        z = x["f"][t] + x["dt_bias"].reshape(h, d)
        rate = np.exp(x["a_log"])[:, None]
        g = lower_bound / (1 + np.exp(-rate * z)) if lower_bound else -rate * np.logaddexp(0, z)
        beta = 1 / (1 + np.exp(-x["beta_logits"][t]))
        state = state * np.exp(g)[..., None]
        delta = beta[..., None] * (v - np.einsum("bhk,bhkv->bhv", k, state))
        state = state + k[..., None] * delta[..., None, :]
        outs.append(np.einsum("bhk,bhkv->bhv", q, state))
    return np.stack(outs), conv, state


def run_decode(implementation, x, lower_bound):
    def steps(qkv, f, beta_logits, conv_weight, a_log, dt_bias, conv_state, state):
        def one(carry, xs):
            conv_state, state = carry
            o, conv_state, state = kda.decode_step(
                xs[0], conv_weight, conv_state, xs[1], a_log, dt_bias, xs[2], state,
                implementation=implementation, gate_lower_bound=lower_bound, precision=HIGHEST)
            return (conv_state, state), o
        (conv_state, state), o = jax.lax.scan(one, (conv_state, state), (qkv, f, beta_logits))
        return o, conv_state, state

    args = [jnp.asarray(x[n], jnp.float32) for n in ("qkv", "f", "beta_logits", "conv_weight",
                                                       "a_log", "dt_bias", "conv_state",
                                                       "state")]
    if implementation == "xla":
        return jax.jit(steps)(*args)
    # tokamax's kernel on the CPU: Pallas's TPU interpreter, the abstract TPU7x mesh for its
    # VMEM query.
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType
    from tokamax.config import cross_compile

    device = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
    with cross_compile(True), jax.sharding.use_abstract_mesh(mesh), \
            pltpu.force_tpu_interpret_mode():
        traced = jax.jit(steps).trace(*args)
    return traced.lower(lowering_platforms=("cpu",)).compile()(*args)


@pytest.mark.parametrize("lower_bound", [K3_BOUND, None], ids=["k3", "kimi_linear"])
@pytest.mark.parametrize("implementation", kda.DECODE_IMPLEMENTATIONS)
def test_every_decode_step_matches_the_float64_layer_step(implementation, lower_bound):
    """Five tokens over a pool of three slots, K3's bounded and Kimi Linear's unbounded gate;
    tokamax's fused kernel runs in Pallas's TPU interpreter."""
    x = decode_inputs(11, steps=5)
    o_ref, conv_ref, state_ref = decode_reference_f64(x, lower_bound)
    o, conv_state, state = (np.asarray(a) for a in run_decode(implementation, x, lower_bound))
    for got, want in ((o, o_ref), (conv_state, conv_ref), (state, state_ref)):
        np.testing.assert_allclose(got, want, rtol=5e-5, atol=5e-5)


def test_auto_decode_step_is_tokamax_on_tpu_only():
    assert kda.resolve_decode("auto", "tpu") == "tokamax_mosaic"
    assert kda.resolve_decode("auto", "cpu") == "xla"
    with pytest.raises(ValueError, match="unknown KDA decode implementation"):
        kda.resolve_decode("pallas")


def test_chunked_temporaries_do_not_grow_with_the_sequence():
    """The loop reads each step's tokens out of the inputs and writes its outputs in place: a
    4x longer sequence needs no more temporary memory (XLA:CPU allocates temporaries on every
    call, and the kernel zero-fills them page by page; a reordered copy of the sequence once
    cost as much system time as the arithmetic). The compiler's own figures, 1 x T x 4 x 128."""
    def temp_bytes(t):
        shape = jax.ShapeDtypeStruct((1, t, 4, 128), jnp.float32)
        args = (shape,) * 4 + (jax.ShapeDtypeStruct((1, t, 4), jnp.float32),)
        compiled = jax.jit(functools.partial(kda_chunked, gate_lower_bound=K3_BOUND)).lower(
            *args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(1024), temp_bytes(4096)
    sequence = 4096 * 4 * 128 * 4  # one [1, 4096, 4, 128] float32 array: 8 MiB
    assert long <= short + 1024 * 1024, (short, long)
    assert long < sequence, long
