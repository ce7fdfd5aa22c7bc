"""K3 features against plain references: AttnRes over a Python list of blocks, LatentMoE and the
router as a per-token loop over experts, SiTU and the gates by their formulas, and scanned vs
unrolled execution of the same stacked parameters."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3text.config import config_from_dict, load_config
from k3text.layers.activations import situ_glu
from k3text.layers.attention_kda import decay_gate
from k3text.layers.initializers import Init
from k3text.layers.linears import matmul_out_in
from k3text.layers.moe import MoE
from k3text.models.decoder import Decoder
from k3text.ops import mxfp4
from k3text.ops.experts import XLA_IMPLEMENTATIONS

from helpers import tiny_config


def np_rms(x, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


# ---- [out, in] projections ------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(), (1,), (1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("out_in", [(48, 64), (256, 128)])
def test_matmul_out_in_matches_numpy(lead, out_in):
    """x @ kernel.T against numpy, for one token and several, any leading shape."""
    cfg = tiny_config("k3-tiny")
    rng = np.random.default_rng(0)
    x, kernel = rng.normal(size=(*lead, out_in[1])), rng.normal(size=out_in)
    got = jax.jit(lambda x, k: matmul_out_in(cfg, x, k))(jnp.asarray(x, jnp.float32),
                                                        jnp.asarray(kernel, jnp.float32))
    assert got.shape == (*lead, out_in[0])
    np.testing.assert_allclose(got, x @ kernel.T, rtol=1e-5, atol=1e-4)


# ---- SiTU and gates -------------------------------------------------------------------------


def test_situ_formula():
    rng = np.random.default_rng(0)
    gate, up = rng.normal(0, 30, (2, 1000))
    sig = 1 / (1 + np.exp(-gate))
    expected = (4.0 * np.tanh(gate / 4.0) * sig) * (25.0 * np.tanh(up / 25.0))
    np.testing.assert_allclose(situ_glu(jnp.asarray(gate), jnp.asarray(up), 4.0, 25.0),
                               expected, rtol=1e-5, atol=1e-5)
    # Without a linear beta the up branch passes through.
    np.testing.assert_allclose(situ_glu(jnp.asarray(gate), jnp.asarray(up), 4.0, 0.0),
                               4.0 * np.tanh(gate / 4.0) * sig * up, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lower_bound", [0.0, -5.0])
def test_decay_gate_formulas(lower_bound):
    cfg = tiny_config("k3-tiny", f"linear_attn_config.gate_lower_bound={lower_bound}")
    rng = np.random.default_rng(1)
    f = rng.normal(0, 3, (5, 4, 16))
    a_log, dt_bias = rng.normal(0, 1, 4), rng.normal(0, 1, 64)
    x = f + dt_bias.reshape(4, 16)
    rate = np.exp(a_log)[:, None]
    if lower_bound:
        expected = lower_bound / (1 + np.exp(-rate * x))
    else:
        expected = -rate * np.log1p(np.exp(x))
    got = decay_gate(cfg, jnp.asarray(f), jnp.asarray(a_log), jnp.asarray(dt_bias))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    if lower_bound:
        assert np.all((np.asarray(got) > lower_bound) & (np.asarray(got) < 0))


# ---- Router and LatentMoE -------------------------------------------------------------------


def reference_moe(cfg, moe, x):
    """Per-token loop over the chosen experts, in float64, from the module's own weights."""
    x = np.asarray(x, np.float64)
    gate = np.asarray(moe.gate[...], np.float64)
    bias = np.asarray(moe.e_score_correction_bias[...], np.float64)
    if cfg.expert_weight_format == "mxfp4":
        e = moe.experts
        gate_up = np.asarray(mxfp4.dequantize_mxfp4(e["gate_up_packed"][...],
                                                    e["gate_up_scale"][...]), np.float64)
        down = np.asarray(mxfp4.dequantize_mxfp4(e["down_packed"][...], e["down_scale"][...]),
                          np.float64)
    else:
        gate_up = np.asarray(moe.experts["gate_up"][...], np.float64)
        down = np.asarray(moe.experts["down"][...], np.float64)
    f = cfg.moe_intermediate_size
    beta, lin = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    out = []
    for token in x:
        scores = 1 / (1 + np.exp(-(token @ gate)))
        biased = scores + bias
        groups = biased.reshape(cfg.num_expert_group, -1)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
        kept = np.argsort(-group_score, kind="stable")[: cfg.topk_group]
        allowed = np.full_like(biased, -np.inf).reshape(groups.shape)
        allowed[kept] = groups[kept]
        chosen = np.argsort(-allowed.reshape(-1), kind="stable")[: cfg.num_experts_per_token]
        weights = scores[chosen] / (scores[chosen].sum() + 1e-20) * cfg.routed_scaling_factor
        z = token @ np.asarray(moe.routed_expert_down_proj[...], np.float64)
        y = np.zeros_like(z)
        for w, e in zip(weights, chosen, strict=True):
            h = gate_up[e] @ z
            g, u = h[:f], h[f:]
            act = beta * np.tanh(g / beta) / (1 + np.exp(-g)) * lin * np.tanh(u / lin)
            y += w * (down[e] @ act)
        y = np_rms(y, cfg.rms_norm_eps) * np.asarray(moe.routed_expert_norm[...])
        y = y @ np.asarray(moe.routed_expert_up_proj[...], np.float64)
        wi = np.asarray(moe.shared_experts.wi[...], np.float64)  # [2, width, hidden]
        g, u = wi[0] @ token, wi[1] @ token
        shared = beta * np.tanh(g / beta) / (1 + np.exp(-g)) * lin * np.tanh(u / lin)
        out.append(y + np.asarray(moe.shared_experts.wo[...], np.float64) @ shared)
    return np.stack(out)


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
@pytest.mark.parametrize("path", XLA_IMPLEMENTATIONS)  # tokamax's: test_ops_experts.py
def test_latent_moe_matches_per_token_loop(experts, path):
    cfg = tiny_config("k3-tiny", f"expert_weight_format={experts}",
                      f"moe_expert_implementation={path}")
    moe = MoE(cfg, Init(5))
    moe.e_score_correction_bias[...] = jnp.asarray(
        np.random.default_rng(2).normal(0, 0.05, cfg.num_experts), jnp.float32)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(48, cfg.hidden_size)), jnp.float32)
    got = nnx.jit(lambda m, x: m(x))(moe, x)
    np.testing.assert_allclose(got, reference_moe(cfg, moe, x), rtol=1e-4, atol=1e-4)


# ---- Block Attention Residuals --------------------------------------------------------------


def reference_forward(model, tokens):
    """K3_MODEL.md §2.5 as written: a Python list of blocks, layer by layer, in float64 for
    the residual mixing; the sublayers are the model's own modules."""
    cfg = model.cfg
    plan = cfg.structure.scan
    layers = list(model.lead)
    if plan.num_groups:
        graphdef, params = nnx.split(model.groups)
        for g in range(plan.num_groups):
            group = nnx.merge(graphdef, jax.tree.map(lambda p, g=g: p[g], params))
            layers += list(group.layers)
    layers += list(model.trail)
    eps = cfg.rms_norm_eps

    def mix(prefix, blocks, proj, norm):
        values = np.stack([*blocks, prefix]).astype(np.float64)
        scores = (np_rms(values, eps) * np.asarray(norm) * np.asarray(proj)).sum(-1)
        weights = np.exp(scores - scores.max(0))
        weights /= weights.sum(0)
        return jnp.asarray((weights[..., None] * values).sum(0), jnp.float32)

    x = model.embed(tokens)
    blocks = []
    for i, layer in enumerate(layers):
        prefix = x
        h = (mix(prefix, blocks, layer.self_attention_res_proj[...],
                 layer.self_attention_res_norm[...]) if blocks else prefix)
        if i % cfg.attn_res_block_size == 0:
            blocks.append(prefix)
            prefix = None
        a = layer.mixer(layer.input_layernorm(h))[0]
        prefix = a if prefix is None else prefix + a
        h = mix(prefix, blocks, layer.mlp_res_proj[...], layer.mlp_res_norm[...])
        x = prefix + layer.mlp(layer.post_attention_layernorm(h))
    x = mix(x, blocks, model.output_attn_res_proj[...], model.output_attn_res_norm[...])
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize("block_size", [2, 3, 12])
def test_attn_res_matches_list_reference(block_size):
    cfg = tiny_config("k3-tiny", f"attn_res_block_size={block_size}")
    model = Decoder(cfg, Init(6))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 11)))
    expected = reference_forward(model, tokens)
    got = nnx.jit(lambda m, t: m.forward(t))(model, tokens)
    np.testing.assert_allclose(got, expected, atol=1e-4 * float(jnp.abs(expected).max()))


# ---- Scan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["k3-tiny", "kimi-linear-tiny"])
def test_scanned_equals_unrolled(name):
    scanned = tiny_config(name)
    unrolled = scanned.replace(scan_layers=False)
    assert scanned.structure.scan.num_groups >= 2
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, scanned.vocab_size, (2, 20)))
    a = nnx.jit(lambda m, t: m.forward(t))(Decoder(scanned, Init(8)), tokens)
    b = nnx.jit(lambda m, t: m.forward(t))(Decoder(unrolled, Init(8)), tokens)
    np.testing.assert_allclose(a, b, atol=1e-5)


def k3_shaped(layers: int):
    full = [i for i in range(4, layers + 1, 4)] + ([layers] if layers % 4 else [])
    base = load_config("configs/models/kimi-k3.yml").model_dict()
    base.update(num_hidden_layers=layers, hidden_size=64, intermediate_size=64, vocab_size=128,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
                num_experts_per_token=2, moe_intermediate_size=32,
                routed_expert_hidden_size=32, expert_weight_format="mxfp4",
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    base["linear_attn_config"] = dict(base["linear_attn_config"], num_heads=2, head_dim=16,
                                      full_attn_layers=full,
                                      kda_layers=[i for i in range(1, layers + 1)
                                                  if i not in full])
    return config_from_dict(base)


def test_full_depth_compiles_like_a_shallow_model():
    # The program's size, not a wall-clock time (which a loaded machine makes flaky): the 84
    # extra layers are 21 more trips of the same scan, not 84 more layers of program.
    sizes = {}
    for layers in (9, 93):
        cfg = k3_shaped(layers)
        graphdef, state = nnx.split(Decoder(cfg, Init(abstract=True)))
        tokens = jax.ShapeDtypeStruct((1, 64), jnp.int32)
        fn = jax.jit(lambda s, t, g=graphdef: nnx.merge(g, s).forward(t))
        sizes[layers] = len(fn.lower(state, tokens).as_text())
    assert k3_shaped(93).structure.scan.num_groups == 22
    assert sizes[93] < 1.5 * sizes[9], sizes
