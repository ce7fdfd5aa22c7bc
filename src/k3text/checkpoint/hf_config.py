"""Hugging Face `config.json` <-> k3text model keys.

Kimi Linear's config is flat; K3 wraps the text model's keys in `text_config` next to a
`vision_config`. Keys keep their checkpoint names; HF's aliases (`num_experts_per_tok`,
`n_group`, ...) are accepted. An absent feature key means Kimi Linear behaviour; a key the
model cannot do without is an error naming it. `config_json` writes the reverse (test
checkpoints).
"""

from __future__ import annotations

from typing import Any

from k3text.config import Config, ConfigError

# HF attribute aliases -> the checkpoint key names k3text uses.
_ALIASES = {
    "num_experts_per_tok": "num_experts_per_token",
    "n_group": "num_expert_group",
    "n_shared_experts": "num_shared_experts",
    "num_local_experts": "num_experts",
    "norm_topk_prob": "moe_renormalize",
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_COPIED = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
           "moe_layer_freq", "num_attention_heads", "num_key_value_heads", "kv_lora_rank",
           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope",
           "mla_use_output_gate", "num_experts", "num_experts_per_token", "num_shared_experts",
           "moe_intermediate_size", "latent_moe_use_norm", "moe_renormalize",
           "routed_scaling_factor", "use_grouped_topk", "num_expert_group", "topk_group",
           "topk_method", "moe_router_activation_func", "hidden_act", "rms_norm_eps",
           "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
# Optional numbers where HF's null means "off" (k3text spells off as 0).
_ZERO_IF_NULL = ("q_lora_rank", "routed_expert_hidden_size", "activation_situ_beta",
                 "activation_situ_linear_beta", "attn_res_block_size")
_LINEAR_KEYS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim",
                "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate")


def text_config(config_json: dict[str, Any]) -> dict[str, Any]:
    """The text model's config (K3's `text_config`, or the whole Kimi Linear config)."""
    return config_json.get("text_config", config_json)


def expert_format(text: dict[str, Any]) -> str:
    """'mxfp4' for compressed-tensors MXFP4 experts, else 'bf16'."""
    quant = text.get("quantization_config") or {}
    if not quant:
        return "bf16"
    fmt = quant.get("format", "")
    groups = quant.get("config_groups", {})
    weights = [g.get("weights", {}) for g in groups.values()]
    if fmt == "mxfp4-pack-quantized" and all(
            w.get("num_bits") == 4 and w.get("group_size") == 32 for w in weights):
        return "mxfp4"
    raise ConfigError(f"unsupported quantization_config: format {fmt!r}, weights {weights}")


def model_keys(config_json: dict[str, Any]) -> dict[str, Any]:
    """The k3text model keys (flat, dotted) a checkpoint's config.json describes."""
    text = dict(text_config(config_json))
    for alias, key in _ALIASES.items():
        if alias in text and key not in text:
            text[key] = text[alias]
    missing = [k for k in _REQUIRED if text.get(k) is None]
    if missing:
        raise ConfigError(f"config.json lacks required model keys {missing}")
    keys: dict[str, Any] = {k: text[k] for k in _COPIED if text.get(k) is not None}
    for k in _ZERO_IF_NULL:
        if text.get(k) is not None:
            keys[k] = text[k]
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(keys.get(k), list):
            keys[k] = keys[k][0]
    if "first_k_dense_replace" in text:
        keys["first_k_dense_replace"] = text["first_k_dense_replace"]
    elif text.get("mlp_layer_types"):
        types = text["mlp_layer_types"]
        keys["first_k_dense_replace"] = next(
            (i for i, t in enumerate(types) if t != "dense"), len(types))
    lin = text.get("linear_attn_config") or {}
    for k in _LINEAR_KEYS:
        if lin.get(k) is not None:
            keys[f"linear_attn_config.{k}"] = lin[k]
    if "linear_attn_config.full_attn_layers" not in keys and text.get("layer_types"):
        keys["linear_attn_config.full_attn_layers"] = [
            i + 1 for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    if not lin.get("num_heads") and text.get("linear_num_heads"):
        keys["linear_attn_config.num_heads"] = text["linear_num_heads"]
    if not lin.get("head_dim") and text.get("linear_head_dim"):
        keys["linear_attn_config.head_dim"] = text["linear_head_dim"]
    keys["expert_weight_format"] = expert_format(text)
    name = config_json.get("_name_or_path") or config_json.get("model_type", "")
    keys["model_name"] = str(name)
    return keys


# The compressed-tensors description of K3's MXFP4 routed experts (everything else unquantised).
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized",
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": True, "scale_dtype": "torch.uint8"},
        "input_activations": None,
    }},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def config_json(cfg: Config, layout: str) -> dict[str, Any]:
    """The `config.json` of a `layout` checkpoint of the model `cfg` describes; `model_keys`
    reads it back to the same model keys."""
    text: dict[str, Any] = {"model_type": "kimi_linear", "_name_or_path": cfg.model_name}
    for k in (*_COPIED, "first_k_dense_replace"):
        text[k] = cfg[k]
    for k in _ZERO_IF_NULL:
        text[k] = cfg[k] or None
    text["linear_attn_config"] = {
        k: list(v) if isinstance(v := cfg[f"linear_attn_config.{k}"], tuple) else v
        for k in _LINEAR_KEYS}
    if cfg.expert_weight_format == "mxfp4":
        text["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    if layout == "k3":
        return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                "_name_or_path": cfg.model_name, "text_config": text,
                "vision_config": {"model_type": "moonvit"}}
    return {"architectures": ["KimiLinearForCausalLM"], **text}
