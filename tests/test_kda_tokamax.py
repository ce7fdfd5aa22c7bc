"""tokamax's KDA (0.0.17) against k3text's reference recurrence: `xla` and `xla_chunked` run on the
CPU for K3's lower-bounded gate and Kimi Linear's gates, with the gate each implementation
refuses recorded; `mosaic` lowered for TPU v7x from this CPU at v7x16's per-device shapes
inside `shard_map`, and run on the CPU by Pallas's TPU interpreter. The contracts compared here
are tabulated in `k3text/ops/kda/tokamax.py`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tokamax.config import cross_compile

from k3text.config import load_config
from k3text.layers.attention_kda import decay_gate
from k3text.ops.kda import l2_normalize
from k3text.ops.kda.reference import kda_recurrent
from k3text.ops.kda.tokamax import tokamax_kda

from helpers import ROOT, tiny_config

B, H, K, V = 2, 3, 16, 8
K3 = tiny_config("k3-tiny")  # gate_lower_bound -5: K3's bounded sigmoid gate
KIMI_LINEAR = tiny_config("kimi-linear-tiny")  # no bound: -exp(A_log) * softplus(f + dt_bias)

reference = jax.jit(kda_recurrent)
gate_of = jax.jit(decay_gate, static_argnums=0)


@functools.partial(jax.jit, static_argnames=("implementation", "lower_bound", "fused"))
def through_tokamax(q, k, v, f, beta, s0, a_log, dt_bias, valid=None, *, implementation,
                    lower_bound, fused):
    """tokamax given raw q/k (normalised and scaled in its kernel) and either the raw decay
    projection (fused gate) or the log-space gate k3text's layer would compute."""
    if fused:
        return tokamax_kda(q, k, v, f, beta, implementation=implementation, initial_state=s0,
                           a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound,
                           l2_normalize_qk=True, scale=K ** -0.5, valid=valid)
    g = decay_gate(K3 if lower_bound else KIMI_LINEAR, f, a_log, dt_bias)
    return tokamax_kda(q, k, v, g, beta, implementation=implementation, initial_state=s0,
                       l2_normalize_qk=True, scale=K ** -0.5, valid=valid)


def make_inputs(seed, t):
    """Raw (unnormalised) q/k, the raw decay projection f, A_log ~ log U(1, 16) and a dt_bias
    around softplus^-1(0.01), as the layers initialise them."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, t, H, K)) for _ in range(2))
    v = rng.standard_normal((B, t, H, V))
    f = rng.standard_normal((B, t, H, K))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, t, H))))
    s0 = rng.standard_normal((B, H, K, V))
    a_log = np.log(rng.uniform(1.0, 16.0, H))
    dt_bias = -4.6 + 0.5 * rng.standard_normal(H * K)
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, f, beta, s0, a_log, dt_bias)]


def k3text_reference(cfg, q, k, v, f, beta, s0, a_log, dt_bias):
    """k3text's own path: the layer's gate and q/k normalisation, then the reference scan."""
    g = gate_of(cfg, f, a_log, dt_bias)
    return reference(l2_normalize(q) * K ** -0.5, l2_normalize(k), v, g, beta, s0)


def assert_close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_k3_lower_bounded_gate_fused_in_the_kernel(implementation):
    inputs = make_inputs(0, 128)  # two 64-token chunks, an initial state
    o_ref, s_ref = k3text_reference(K3, *inputs)
    o, s = through_tokamax(*inputs, implementation=implementation, lower_bound=-5.0, fused=True)
    assert o.shape == (B, 128, H, V) and s.shape == (B, H, K, V)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3", "kimi_linear"])
def test_xla_takes_every_gate_form(lower_bound):
    """Pre-activated log gates for both models, and Kimi Linear's softplus gate fused; odd T."""
    cfg = K3 if lower_bound else KIMI_LINEAR
    inputs = make_inputs(1, 37)
    o_ref, s_ref = k3text_reference(cfg, *inputs)
    for fused in (True, False):
        o, s = through_tokamax(*inputs, implementation="xla", lower_bound=lower_bound,
                               fused=fused)
        assert_close(o, o_ref)
        assert_close(s, s_ref)


@pytest.mark.parametrize("fused,lower_bound", [(False, -5.0), (False, None), (True, None)],
                         ids=["k3_log_gate", "kimi_linear_log_gate", "kimi_linear_fused"])
def test_xla_chunked_refuses_all_but_the_fused_bounded_gate(fused, lower_bound):
    with pytest.raises(NotImplementedError):
        through_tokamax(*make_inputs(2, 64), implementation="xla_chunked",
                        lower_bound=lower_bound, fused=fused)


def test_xla_chunked_needs_whole_chunks_without_segment_ids():
    with pytest.raises(NotImplementedError, match="divisible"):
        through_tokamax(*make_inputs(3, 65), implementation="xla_chunked", lower_bound=-5.0,
                        fused=True)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_segment_ids_replace_no_op_padding(implementation):
    """Rows of different lengths: tokamax's segment 0 on the padding, k3text's reference with
    beta = 0 and g = 0 there (exact no-ops); outputs on real tokens and final states agree."""
    q, k, v, f, beta, s0, a_log, dt_bias = make_inputs(4, 100)
    valid = jnp.arange(100)[None, :] < jnp.array([[100], [71]])
    o, s = through_tokamax(q, k, v, f, beta, s0, a_log, dt_bias, valid,
                           implementation=implementation, lower_bound=-5.0, fused=True)
    g = jnp.where(valid[..., None, None], gate_of(K3, f, a_log, dt_bias), 0.0)
    o_ref, s_ref = reference(l2_normalize(q) * K ** -0.5, l2_normalize(k), v, g,
                             jnp.where(valid[..., None], beta, 0.0), s0)
    assert_close(jnp.where(valid[..., None, None], o, 0.0),
                 jnp.where(valid[..., None, None], o_ref, 0.0))
    assert_close(s, s_ref)


# --- mosaic: lowered for TPU v7x from the CPU at v7x16's per-device shapes --------------------


V7X16 = load_config(ROOT / "configs/inference/v7x16.yml")


def v7x16_abstract_mesh() -> AbstractMesh:
    """v7x16's tensor-parallel mesh as an abstract mesh of TPU7x devices: tokamax's kernel reads
    the TPU generation (VMEM size) from it when no TPU is attached."""
    device = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    return AbstractMesh((V7X16.ici_tensor_parallelism,), ("tensor",), (AxisType.Explicit,),
                        abstract_device=device)


def export_mosaic_step(gate_form: str):
    """The KDA part of one device's prefill chunk on v7x16 (3 heads, 4096 tokens, K = V = 128,
    bf16 inputs, fp32 state), as `mosaic` inside `shard_map`, exported for TPU from this CPU.
    gate_form: `bounded` (K3's gate fused), `softplus` (Kimi Linear's gate fused) or `log`
    (a pre-activated log-space gate)."""
    lin, mesh = V7X16.linear_attn_config, v7x16_abstract_mesh()
    tp = V7X16.ici_tensor_parallelism
    heads, t, d = lin.num_heads, V7X16.prefill_chunk_size, lin.head_dim
    assert (heads // tp, t, d) == (3, 4096, 128)
    fused = gate_form != "log"

    def local(q, k, v, gate, beta, s0, a_log, dt_bias):
        return tokamax_kda(q, k, v, gate, beta, implementation="mosaic", initial_state=s0,
                           a_log=a_log if fused else None, dt_bias=dt_bias if fused else None,
                           lower_bound=lin.gate_lower_bound if gate_form == "bounded" else None,
                           l2_normalize_qk=True, scale=d ** -0.5)

    # Heads split over the devices: axis 2 of [B, T, H, D], axis 1 of the [B, H, K, V] state.
    heads_axis, state_axis = P(None, None, "tensor"), P(None, "tensor")
    step = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(heads_axis,) * 5 + (state_axis, P("tensor"), P("tensor")),
        out_specs=(heads_axis, state_axis), check_vma=False))

    def spec(shape, dtype, axes):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, axes))

    bf16, f32 = jnp.bfloat16, jnp.float32
    args = ([spec((1, t, heads, d), bf16, heads_axis)] * 4
            + [spec((1, t, heads), bf16, heads_axis), spec((1, heads, d, d), f32, state_axis),
               spec((heads,), f32, P("tensor")), spec((heads * d,), f32, P("tensor"))])
    with cross_compile(True), jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(step, platforms=["tpu"])(*args)


@pytest.mark.parametrize("gate_form", ["bounded", "log"])
def test_mosaic_lowers_for_tpu_inside_shard_map_at_v7x16_shapes(gate_form):
    exported = export_mosaic_step(gate_form)
    heads, t, d = (V7X16.linear_attn_config.num_heads, V7X16.prefill_chunk_size,
                   V7X16.linear_attn_config.head_dim)
    assert exported.platforms == ("tpu",) and exported.nr_devices == V7X16.ici_tensor_parallelism
    assert exported.mlir_module().count("tpu_custom_call") >= 1
    assert [a.shape for a in exported.out_avals] == [(1, t, heads, d), (1, heads, d, d)]


def test_mosaic_in_pallas_interpret_mode_matches_reference(monkeypatch):
    """The Mosaic kernels themselves, run on the CPU by Pallas's TPU interpreter (tokamax reads
    PALLAS_INTERPRET when it traces): K3's fused gate and a log-space gate, K = V = 128, two
    chunks, an initial state. The abstract TPU7x mesh only answers the kernel's VMEM query; its
    axis is Auto so the interpreter's buffer updates carry no sharding."""
    monkeypatch.setenv("PALLAS_INTERPRET", "1")
    rng = np.random.default_rng(5)
    b, t, h, d = 1, 128, 2, 128
    q, k, v, f = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(4))
    beta = jnp.asarray(1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h)))), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, d, d)), jnp.float32)
    a_log, dt_bias = jnp.zeros(h), jnp.full(h * d, -2.0)
    g = gate_of(K3, f, a_log, dt_bias)
    o_ref, s_ref = reference(l2_normalize(q) * d ** -0.5, l2_normalize(k), v, g, beta, s0)

    def both(q, k, v, f, g, beta, s0, a_log, dt_bias):
        common = dict(implementation="mosaic", initial_state=s0, l2_normalize_qk=True,
                      scale=d ** -0.5)
        return (tokamax_kda(q, k, v, f, beta, a_log=a_log, dt_bias=dt_bias,
                            lower_bound=K3.linear_attn_config.gate_lower_bound, **common),
                tokamax_kda(q, k, v, g, beta, **common))

    args = (q, k, v, f, g, beta, s0, a_log, dt_bias)
    device = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
    with cross_compile(True), jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(both).trace(*args)
    for o, s in traced.lower(lowering_platforms=("cpu",)).compile()(*args):
        assert_close(o, o_ref)
        assert_close(s, s_ref)


def test_mosaic_refuses_kimi_linear_fused_softplus_gate():
    with pytest.raises(NotImplementedError, match="lower_bound"):
        export_mosaic_step("softplus")
