"""Every routed-expert kernel of `k3text.ops.experts` (grouped, gathered, reference; experts
stacked inside a layer stack or split per expert) against the routed weighted sum computed
independently in float64 numpy, on the same small cases: BF16 and MXFP4 experts, k = 1 and
k > 1, slots routed to experts held elsewhere; tokamax's TPU grouped matmul on the same kind
of cases at its smallest tiles, in Pallas's TPU interpreter. Then the `auto` rule and the config
key that picks a kernel for the MoE layer."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from tokamax.config import cross_compile

from k3text.config import ConfigError
from k3text.layers import moe as moe_module
from k3text.layers.initializers import Init
from k3text.layers.moe import MoE
from k3text.ops import experts
from k3text.ops.experts import ExpertFFN, LayerExperts

from helpers import tiny_config

TOKENS, HIDDEN, WIDTH, HELD = 5, 64, 32, 4  # MXFP4 packs 32-element blocks along `in`
FFN = ExpertFFN(lambda gate, up: jax.nn.silu(gate) * up, jnp.float32,
                jax.lax.Precision.HIGHEST)


def np_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MXFP4 by its definition: low nibble first, E2M1 code = sign bit + magnitude index, one
    power-of-two scale 2^(byte - 127) per 32 inputs."""
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)[codes & 7]
    values = np.where(codes & 8, -magnitude, magnitude)
    return values * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=-1)


def random_experts(fmt: str, rng: np.random.Generator, hidden: int = HIDDEN, width: int = WIDTH,
                   ) -> tuple[dict, np.ndarray, np.ndarray]:
    """One layer's experts in storage form and as float64 (gate_up [E, 2I, D], down [E, D, I])."""
    shapes = {"gate_up": (HELD, 2 * width, hidden), "down": (HELD, hidden, width)}
    arrays, dense = {}, {}
    for name, shape in shapes.items():
        if fmt == "bf16":
            w = jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-1]), jnp.bfloat16)
            arrays[name], dense[name] = w, np.asarray(w, np.float64)
        else:
            packed = rng.integers(0, 256, (*shape[:-1], shape[-1] // 2), dtype=np.uint8)
            # 2^-3 .. 2^-5 keeps activations O(1) with E2M1 magnitudes up to 6.
            scale = rng.integers(122, 125, (*shape[:-1], shape[-1] // 32), dtype=np.uint8)
            arrays[f"{name}_packed"], arrays[f"{name}_scale"] = (jnp.asarray(packed),
                                                                 jnp.asarray(scale))
            dense[name] = np_mxfp4(packed, scale)
    return arrays, dense["gate_up"], dense["down"]


def np_routed(x: np.ndarray, weights: np.ndarray, ids: np.ndarray, gate_up: np.ndarray,
              down: np.ndarray) -> np.ndarray:
    """Σ_k weight · down[e] @ (silu(gate) * up) of gate_up[e] @ x, over the slots held here."""
    width = down.shape[-1]
    out = np.zeros_like(x)
    for n, (row, token_weights, token_ids) in enumerate(zip(x, weights, ids, strict=True)):
        for w, e in zip(token_weights, token_ids, strict=True):
            if 0 <= e < len(gate_up):
                h = gate_up[e] @ row
                gate, up = h[:width], h[width:]
                out[n] += w * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def layouts(arrays: dict, rng: np.random.Generator) -> dict[str, LayerExperts]:
    """The same experts as the kernels meet them: layer 1 of a two-layer stack (layer 0 other
    values), and split into per-expert arrays."""
    def stack(a):
        other = jnp.asarray(rng.permutation(np.asarray(a).reshape(-1)).reshape(a.shape))
        return jnp.stack([other, a])

    return {
        "stacked": LayerExperts.of({name: stack(a) for name, a in arrays.items()}, 1),
        "split": LayerExperts.of({name: tuple(a) for name, a in arrays.items()}),
    }


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def case(request):
    rng = np.random.default_rng(0 if request.param == "bf16" else 1)
    arrays, gate_up, down = random_experts(request.param, rng)
    x = rng.normal(size=(TOKENS, HIDDEN))
    return layouts(arrays, rng), gate_up, down, x, rng


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("layout", ["stacked", "split"])
@pytest.mark.parametrize("implementation", experts.XLA_IMPLEMENTATIONS)
def test_kernel_matches_float64_sum(case, implementation, layout, k):
    held, gate_up, down, x, rng = case
    # Ids in [-2, HELD + 2): some slots belong to experts held by other devices.
    ids = rng.integers(-2, HELD + 2, (TOKENS, k)).astype(np.int32)
    ids[0, 0], ids[-1, -1] = -1, HELD
    ids[1, 0] = 2
    weights = rng.uniform(0.1, 1.0, (TOKENS, k))
    fn = jax.jit(functools.partial(experts.routed_experts, ffn=FFN,
                                   implementation=implementation))
    got = fn(jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(ids),
             held[layout])
    expected = np_routed(x, weights, ids, gate_up, down)
    assert got.dtype == jnp.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("layout", ["stacked", "split"])
def test_gathered_gives_a_token_the_same_bits_alone_and_in_a_batch(case, layout):
    """The hit-experts loop visits the slots grouped by expert (`slot_order`), across tokens: a
    token's sum must still not depend on the other tokens' routing, bit for bit, as solo and
    batched decoding compare (k = 3, so the order of a token's own terms shows)."""
    held, _, _, x, rng = case
    ids = np.stack([rng.permutation(HELD)[:3] for _ in range(TOKENS)]).astype(np.int32)
    x32 = jnp.asarray(x, jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (TOKENS, 3)), jnp.float32)
    fn = jax.jit(functools.partial(experts.routed_experts, ffn=FFN, implementation="gathered"))
    batched = np.asarray(fn(x32, weights, jnp.asarray(ids), held[layout]))
    for n in range(TOKENS):
        alone = fn(x32[n:n + 1], weights[n:n + 1], jnp.asarray(ids[n:n + 1]), held[layout])
        np.testing.assert_array_equal(np.asarray(alone)[0], batched[n])


@pytest.mark.parametrize("implementation", ["reference", "gathered"])
def test_an_expert_no_token_routes_to_adds_nothing_even_when_not_finite(implementation):
    """Expert 3's weights are NaN and no slot routes to it: the reference, which computes every
    held expert, gives the float64 sum of the others as the hit-experts kernel does (a zero
    weight times NaN must not get through). `grouped` is left out: XLA:CPU's ragged_dot
    computes every group for every row and masks by multiplying."""
    rng = np.random.default_rng(4)
    arrays, gate_up, down = random_experts("bf16", rng)
    arrays = {name: a.at[3].set(jnp.nan) for name, a in arrays.items()}
    x = rng.normal(size=(TOKENS, HIDDEN))
    ids = rng.integers(0, 3, (TOKENS, 2)).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (TOKENS, 2))
    got = experts.routed_experts(jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32),
                                 jnp.asarray(ids), LayerExperts.of(arrays), ffn=FFN,
                                 implementation=implementation)
    expected = np_routed(x, weights, ids, gate_up, down)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("layout", ["stacked", "split"])
def test_gathered_with_every_expert_held_skips_nothing(case, layout):
    """`all_ids_held` drops the gathered kernel's per-slot test: with ids all in range the sum
    is the same."""
    held, gate_up, down, x, rng = case
    ids = rng.integers(0, HELD, (TOKENS, 2)).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (TOKENS, 2))
    fn = jax.jit(functools.partial(experts.routed_experts, ffn=FFN, implementation="gathered",
                                   all_ids_held=True))
    got = fn(jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(ids),
             held[layout])
    expected = np_routed(x, weights, ids, gate_up, down)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("fmt,layout", [("mxfp4", "stacked"), ("mxfp4", "split"),
                                        ("bf16", "stacked")])
def test_tokamax_mosaic_in_pallas_interpret_mode_matches_float64_sum(fmt, layout, monkeypatch):
    """tokamax's Pallas TPU grouped matmul, run by Pallas's TPU interpreter on this CPU, at its
    smallest tiles (128): MXFP4 experts dequantised per tile by the kernel, BF16 experts as
    stored; 70 tokens x 3 slots (210 rows, padded to 256), some held elsewhere."""
    monkeypatch.setenv("PALLAS_INTERPRET", "1")
    rng = np.random.default_rng(7)
    arrays, gate_up, down = random_experts(fmt, rng, hidden=128, width=128)
    tokens = 70
    x = rng.normal(size=(tokens, 128))
    ids = rng.integers(-2, HELD + 2, (tokens, 3)).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, 3))
    fn = functools.partial(experts.routed_experts, ffn=FFN, implementation="tokamax_mosaic")
    args = (jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(ids),
            layouts(arrays, rng)[layout])
    tpu = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    with cross_compile(True), jax.sharding.use_abstract_mesh(
            AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=tpu)):
        traced = jax.jit(fn).trace(*args)
    lowered = traced.lower(lowering_platforms=("cpu",))
    assert "tpu_custom_call" not in lowered.as_text()  # interpreted, not handed to Mosaic
    got = lowered.compile()(*args)
    expected = np_routed(x, weights, ids, gate_up, down)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_mxfp4_scales_become_exact_bfloat16():
    """Every E8M0 byte is the bfloat16 power of two it means (byte 0: 2^-127, a subnormal;
    255: NaN)."""
    got = np.asarray(experts.tokamax.e8m0_as_bfloat16(jnp.arange(256, dtype=jnp.uint8)),
                     np.float64)
    np.testing.assert_array_equal(got[:255], 2.0 ** (np.arange(255) - 127))
    assert np.isnan(got[255])


def test_auto_rule_and_unknown_implementation():
    resolve = functools.partial(experts.resolve_implementation, backend="cpu")
    # Threshold 0: the hit-experts loop up to held - 1 slots.
    assert [resolve("auto", slots, 8, 0) for slots in (7, 8)] == ["gathered", "grouped"]
    assert [resolve("auto", slots, 8, 64) for slots in (64, 65)] == ["gathered", "grouped"]
    xla = experts.XLA_IMPLEMENTATIONS
    assert {resolve(name, 1000, 8, 0) for name in xla} == set(xla)
    # On a TPU above the threshold: tokamax's kernel where its 128-wide tiles fit the experts.
    tpu = functools.partial(experts.resolve_implementation, backend="tpu")
    assert [tpu("auto", 7, 8, 0, (128, 128)), tpu("auto", 8, 8, 0, (128, 128)),
            tpu("auto", 8, 8, 0, (3584, 64)), tpu("auto", 8, 8, 0)] == \
        ["gathered", "tokamax_mosaic", "grouped", "grouped"]
    with pytest.raises(ValueError, match="tokamax_mosaic runs on TPU, not cpu"):
        resolve("tokamax_mosaic", 1000, 8, 0)
    with pytest.raises(ValueError, match="unknown expert implementation 'dense'"):
        experts.routed_experts(jnp.ones((1, HIDDEN)), jnp.ones((1, 1)),
                               jnp.zeros((1, 1), jnp.int32), None, FFN, "dense")


def test_config_accepts_each_implementation_and_nothing_else():
    for name in ("auto", *experts.IMPLEMENTATIONS):
        assert tiny_config("k3-tiny", f"moe_expert_implementation={name}") \
            .moe_expert_implementation == name
    with pytest.raises(ConfigError, match="moe_expert_implementation"):
        tiny_config("k3-tiny", "moe_expert_implementation=ragged_dot")


def test_moe_layer_runs_the_configured_kernel(caplog, monkeypatch):
    """Each implementation named by the config runs in the MoE layer (its log line names it)
    and gives the layer's `auto` output."""
    cfg = tiny_config("kimi-linear-tiny", "expert_weight_format=mxfp4")
    x = jnp.asarray(np.random.default_rng(3).normal(size=(6, cfg.hidden_size)), jnp.float32)
    expected = nnx.jit(lambda m, x: m(x))(MoE(cfg, Init(5)), x)
    for name in experts.XLA_IMPLEMENTATIONS:
        # Each distinct path is logged once per process: forget what was reported before.
        monkeypatch.setattr(moe_module, "_reported_paths", set())
        caplog.clear()
        layer = MoE(cfg.replace(moe_expert_implementation=name), Init(5))
        with caplog.at_level(logging.INFO, logger="k3text.layers.moe"):
            got = nnx.jit(lambda m, x: m(x))(layer, x)
        assert f"moe: unsharded, implementation {name} " in caplog.text
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
