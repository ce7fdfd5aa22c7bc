"""Hugging Face tensor names -> k3text parameters: one name table per checkpoint layout.

Layouts:
- `moonshot`: Moonshot's original Kimi Linear layout, also what transformers 5.24
  `save_pretrained` writes (separate q/k/v_conv1d, per-expert `w1|w2|w3`, the dense layer's
  MLP under `block_sparse_moe.`);
- `transformers`: transformers' in-memory names (fused `conv1d`, `forget_gate.` prefix, `mlp.`
  prefix, stacked `experts.gate_up_proj` / `experts.down_proj`);
- `k3`: the released Kimi K3 (`language_model.` prefix, q-LoRA gated MLA, full-rank KDA gate,
  LatentMoE, AttnRes, MXFP4 experts as `weight_packed` + `weight_scale`, dense MLP under
  `mlp.`); vision tensors are dropped.

Each rule maps a name to a `Slot`: which k3text parameter (a path inside one decoder layer, or a
global one), where inside it the tensor goes (expert index, gate/up half, fused-conv part) and
how the HF array is reshaped into the k3text layout (k3text kernels are [in, out], except the
MLP and expert matrices, which keep the checkpoint's [out, in]).

The reverse direction (`layer_tensor_names`, `global_tensor_names`, `from_k3text`) names the HF
tensors of a k3text parameter and shapes a parameter block back into its HF tensor; it writes
test checkpoints and gives the inventory a model config expects.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from k3text.checkpoint.safetensors_io import CheckpointError
from k3text.config import Config

# Parameters the k3text model stores as [in, out] (HF Linear weights are [out, in]).
_LINEAR = "linear"


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one HF tensor lands in the k3text parameter tree.

    path:   parameter path relative to a decoder layer (`layer` set) or to the model.
    layer:  0-based decoder layer, or None for global parameters.
    index:  numpy index into the destination parameter (after any layer stacking), e.g.
            (expert,) or (slice(None), 1, slice(None)) for the up half of a fused MLP kernel.
    kind:   how the HF array becomes the destination block (see `to_k3text`).
    source: index into the HF array taken first (one part of a fused tensor).
    """

    path: tuple[str, ...]
    layer: int | None
    index: tuple = ()
    kind: str = "copy"
    source: tuple = ()


DROPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


def to_k3text(cfg: Config, slot: Slot, array: np.ndarray) -> np.ndarray:
    """Reshape one HF tensor into the block of its k3text parameter that `slot.index` names."""
    kind = slot.kind
    array = array[slot.source]
    if kind == "copy":
        return array
    if kind == _LINEAR:
        return array.T
    if kind == "row":  # [1, D] AttnRes pseudo-queries
        return array.reshape(-1)
    if kind == "conv":  # [C, 1, W] depthwise conv -> [W, C]
        return array.reshape(array.shape[0], -1).T
    if kind == "a_log":  # [1, 1, H, 1] or [K] padded: the first H entries are meaningful
        return array.reshape(-1)[: cfg.linear_attn_config.num_heads]
    if kind in _KV_B:  # [H * (nope + v), kv_lora] -> [H, kv_lora, nope] or [H, kv_lora, v]
        per_head = array.reshape(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
        return per_head[:, _kv_b_rows(cfg, kind)].transpose(0, 2, 1)
    if kind == "experts_fused":  # in-memory [E, out, in] already in k3text's expert layout
        return array
    raise ValueError(f"unknown slot kind {kind}")


def from_k3text(cfg: Config, slot: Slot, block: np.ndarray, layout: str) -> np.ndarray:
    """The inverse of `to_k3text`: one k3text parameter block back into its HF tensor (or, for
    a fused tensor, into the part `slot.source` selects). Only views where the HF layout allows,
    so a zero-stride stand-in block gives the HF shape without allocating it."""
    kind = slot.kind
    if kind in ("copy", "experts_fused"):
        return block
    if kind == _LINEAR:
        return block.T
    if kind == "row":
        return block.reshape(1, -1)
    if kind == "conv":
        return block.T.reshape(block.shape[1], 1, block.shape[0])
    if kind == "a_log":
        if layout == "k3":  # the released checkpoint pads A_log to head_dim
            return np.pad(block, (0, cfg.linear_attn_config.head_dim - block.shape[0]))
        return block.reshape(1, 1, -1, 1)
    if kind in _KV_B:  # this half's rows of every head, [H * (nope or v), kv_lora]
        return block.transpose(0, 2, 1).reshape(-1, cfg.kv_lora_rank)
    raise ValueError(f"unknown slot kind {kind}")


def join_parts(cfg: Config, slots: list[Slot], parts: list[np.ndarray]) -> np.ndarray:
    """One HF tensor from the `from_k3text` parts of its slots (their rows add up to the
    tensor's): kv_b_proj interleaves its k and v rows head by head; the parts of other fused
    tensors (transformers' conv1d) follow one another."""
    if len(parts) == 1:
        return parts[0]
    if slots[0].kind in _KV_B:
        heads = cfg.num_attention_heads
        per_head = [p.reshape(heads, -1, cfg.kv_lora_rank) for p in parts]
        return np.concatenate(per_head, axis=1).reshape(-1, cfg.kv_lora_rank)
    return np.concatenate(parts)


def is_part(slot: Slot) -> bool:
    """Whether the slot takes only part of its HF tensor."""
    return bool(slot.source) or slot.kind in _KV_B


# kv_b_proj's halves: per head, its first qk_nope_head_dim rows map the latent to k_nope, the
# remaining v_head_dim rows to v.
_KV_B = ("kv_b_k", "kv_b_v")


def _kv_b_rows(cfg: Config, kind: str) -> slice:
    nope = cfg.qk_nope_head_dim
    return slice(0, nope) if kind == "kv_b_k" else slice(nope, None)


# --------------------------------------------------------------------------------------------
# Rules: (regex over the name after the layer prefix, builder) per layout.
# --------------------------------------------------------------------------------------------

# (config, the name's match, its decoder layer or None) -> where the tensor goes.
Builder = Callable[[Config, re.Match, int | None], Slot | list[Slot]]


def _linear(*path: str) -> Builder:
    return lambda cfg, m, layer: Slot(path, None, (), _LINEAR)


def _copy(*path: str, kind: str = "copy") -> Builder:
    return lambda cfg, m, layer: Slot(path, None, (), kind)


def _pair(path: tuple[str, ...], part: int) -> Builder:
    """Gate (0) or up (1) half of a fused [2, width, hidden] MLP kernel (stored [out, in])."""
    return lambda cfg, m, layer: Slot(path, None, (part,))


def _expert(name: str, part: int | None) -> Builder:
    """One expert's matrix into the stacked [E, out, in] tensors (`part` picks the gate/up rows
    of the fused gate_up; MXFP4 packed bytes and scales follow the same rows)."""

    def build(cfg: Config, m: re.Match, layer: int | None) -> Slot:
        e = int(m["expert"])
        suffix = m.groupdict().get("q") or ""
        leaf = {"": "", "weight_packed": "_packed", "weight_scale": "_scale"}[suffix]
        if part is None:
            return Slot(("mlp", "experts", f"{name}{leaf}"), None, (e,))
        f = cfg.moe_intermediate_size
        rows = slice(part * f, (part + 1) * f)
        return Slot(("mlp", "experts", f"gate_up{leaf}"), None, (e, rows))

    return build


_QKV = "qkv"


def _qkv_part(path: tuple[str, ...], kind: str) -> Builder:
    """The q, k or v part (named by the `p` group) of a fused KDA [in, 3, H*K] kernel; an MLA
    layer's `q_proj` (same HF name) is its own kernel."""

    def build(cfg: Config, m: re.Match, layer: int | None) -> Slot:
        if layer is not None and cfg.structure.layers[layer].mixer == "mla":
            return Slot(("mixer", f"{m['p']}_proj"), None, (), kind)
        return Slot(path, None, (slice(None), _QKV.index(m["p"]), slice(None)), kind)

    return build


def _fused_conv(cfg: Config, m: re.Match, layer: int | None) -> list[Slot]:
    """transformers' fused conv1d [3C, 1, W] over concat(q, k, v) -> the [W, 3, C] kernel."""
    width = cfg.linear_attn_config.num_heads * cfg.linear_attn_config.head_dim
    return [Slot(("mixer", "qkv_conv"), None, (slice(None), i, slice(None)), "conv",
                 (slice(i * width, (i + 1) * width),)) for i in range(len(_QKV))]


_KDA_COMMON = [
    (r"self_attn\.(?P<p>[qkv])_proj\.weight", _qkv_part(("mixer", "qkv_proj"), _LINEAR)),
    (r"self_attn\.b_proj\.weight", _linear("mixer", "b_proj")),
    (r"self_attn\.g_a_proj\.weight", _linear("mixer", "g_a_proj")),
    (r"self_attn\.g_b_proj\.weight", _linear("mixer", "g_b_proj")),
    (r"self_attn\.o_norm\.weight", _copy("mixer", "o_norm")),
    (r"self_attn\.o_proj\.weight", _linear("mixer", "o_proj")),
]
_KDA_SEPARATE = [
    (r"self_attn\.(?P<p>[qkv])_conv1d\.weight", _qkv_part(("mixer", "qkv_conv"), "conv")),
    (r"self_attn\.f_a_proj\.weight", _linear("mixer", "f_a_proj")),
    (r"self_attn\.f_b_proj\.weight", _linear("mixer", "f_b_proj")),
    (r"self_attn\.A_log", _copy("mixer", "A_log", kind="a_log")),
    (r"self_attn\.dt_bias", _copy("mixer", "dt_bias")),
]
_MLA = [
    (r"self_attn\.q_a_proj\.weight", _linear("mixer", "q_a_proj")),
    (r"self_attn\.q_a_layernorm\.weight", _copy("mixer", "q_a_layernorm")),
    (r"self_attn\.q_b_proj\.weight", _linear("mixer", "q_b_proj")),
    (r"self_attn\.kv_a_proj_with_mqa\.weight", _linear("mixer", "kv_a_proj")),
    (r"self_attn\.kv_a_layernorm\.weight", _copy("mixer", "kv_a_layernorm")),
    (r"self_attn\.kv_b_proj\.weight",
     lambda cfg, m, layer: [Slot(("mixer", "k_b_proj"), None, (), "kv_b_k"),
                            Slot(("mixer", "v_b_proj"), None, (), "kv_b_v")]),
]
_NORMS = [
    (r"input_layernorm\.weight", _copy("input_layernorm", "weight")),
    (r"post_attention_layernorm\.weight", _copy("post_attention_layernorm", "weight")),
]


def _mlp_rules(prefix: str) -> list:
    return [
        (rf"{prefix}\.gate_proj\.weight", _pair(("mlp", "wi"), 0)),
        (rf"{prefix}\.up_proj\.weight", _pair(("mlp", "wi"), 1)),
        (rf"{prefix}\.down_proj\.weight", _copy("mlp", "wo")),
    ]


def _moe_rules(prefix: str) -> list:
    return [
        (rf"{prefix}\.gate\.weight", _linear("mlp", "gate")),
        (rf"{prefix}\.gate\.e_score_correction_bias", _copy("mlp", "e_score_correction_bias")),
        (rf"{prefix}\.shared_experts\.gate_proj\.weight",
         _pair(("mlp", "shared_experts", "wi"), 0)),
        (rf"{prefix}\.shared_experts\.up_proj\.weight",
         _pair(("mlp", "shared_experts", "wi"), 1)),
        (rf"{prefix}\.shared_experts\.down_proj\.weight",
         _copy("mlp", "shared_experts", "wo")),
    ]


def _moe_expert_rules(prefix: str, quantized: bool) -> list:
    q = r"\.(?P<q>weight_packed|weight_scale)" if quantized else r"\.weight"
    return [
        (rf"{prefix}\.experts\.(?P<expert>\d+)\.w1{q}", _expert("gate_up", 0)),
        (rf"{prefix}\.experts\.(?P<expert>\d+)\.w3{q}", _expert("gate_up", 1)),
        (rf"{prefix}\.experts\.(?P<expert>\d+)\.w2{q}", _expert("down", None)),
    ]


LAYER_RULES: dict[str, list] = {
    "moonshot": (_NORMS + _KDA_COMMON + _KDA_SEPARATE + _MLA
                 + _mlp_rules(r"block_sparse_moe") + _mlp_rules(r"mlp")
                 + _moe_rules("block_sparse_moe")
                 + _moe_expert_rules("block_sparse_moe", quantized=False)),
    "transformers": (_NORMS + _KDA_COMMON + _MLA + [
        (r"self_attn\.conv1d\.weight", _fused_conv),
        (r"self_attn\.forget_gate\.f_a_proj\.weight", _linear("mixer", "f_a_proj")),
        (r"self_attn\.forget_gate\.f_b_proj\.weight", _linear("mixer", "f_b_proj")),
        (r"self_attn\.forget_gate\.A_log", _copy("mixer", "A_log", kind="a_log")),
        (r"self_attn\.forget_gate\.dt_bias", _copy("mixer", "dt_bias")),
        (r"mlp\.experts\.gate_up_proj", _copy("mlp", "experts", "gate_up", kind="experts_fused")),
        (r"mlp\.experts\.down_proj", _copy("mlp", "experts", "down", kind="experts_fused")),
    ] + _mlp_rules("mlp") + _moe_rules("mlp")),
    "k3": (_NORMS + _KDA_COMMON + _KDA_SEPARATE + _MLA + _mlp_rules("mlp") + [
        (r"self_attn\.g_proj\.weight", _linear("mixer", "g_proj")),
        (r"(?P<n>self_attention_res|mlp_res)_proj\.weight",
         lambda cfg, m, layer: Slot((f"{m['n']}_proj",), None, (), "row")),
        (r"(?P<n>self_attention_res|mlp_res)_norm\.weight",
         lambda cfg, m, layer: Slot((f"{m['n']}_norm",), None, ())),
        (r"block_sparse_moe\.routed_expert_down_proj\.weight",
         _linear("mlp", "routed_expert_down_proj")),
        (r"block_sparse_moe\.routed_expert_up_proj\.weight",
         _linear("mlp", "routed_expert_up_proj")),
        (r"block_sparse_moe\.routed_expert_norm\.weight", _copy("mlp", "routed_expert_norm")),
    ] + _moe_rules("block_sparse_moe") + _moe_expert_rules("block_sparse_moe", quantized=True)),
}

GLOBAL_RULES = [
    (r"model\.embed_tokens\.weight", _copy("embed", "table")),
    (r"model\.norm\.weight", _copy("norm", "weight")),
    (r"lm_head\.weight", _linear("lm_head", "kernel")),
    (r"model\.output_attn_res_proj\.weight", _copy("output_attn_res_proj", kind="row")),
    (r"model\.output_attn_res_norm\.weight", _copy("output_attn_res_norm")),
]

_LAYER = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)")


class UnknownTensorError(CheckpointError):
    """A checkpoint tensor no rule of the layout knows."""


def strip_prefix(name: str, layout: str) -> str | None:
    """The text-model name, or None for tensors the text stack drops (vision tower)."""
    if layout == "k3":
        if name.startswith(DROPPED_PREFIXES):
            return None
        if not name.startswith("language_model."):
            raise UnknownTensorError(f"'{name}' is not under 'language_model.' nor a vision "
                                     f"tensor")
        return name.removeprefix("language_model.")
    return name


def slots_for(cfg: Config, name: str, layout: str) -> list[Slot] | None:
    """The k3text slots an HF tensor fills, or None when it is dropped (vision tensors)."""
    text = strip_prefix(name, layout)
    if text is None:
        return None
    m = _LAYER.fullmatch(text)
    if m is None:
        rules, rest, layer = GLOBAL_RULES, text, None
    else:
        rules, rest, layer = LAYER_RULES[layout], m["rest"], int(m["layer"])
        if layer >= cfg.num_hidden_layers:
            raise UnknownTensorError(f"'{name}': layer {layer} but the model has "
                                     f"{cfg.num_hidden_layers}")
    found = _match_rule(layout if layer is not None else "global", rules, rest)
    if found is None:
        raise UnknownTensorError(f"no {layout} name rule for tensor '{name}'")
    match, build = found
    built = build(cfg, match, layer)
    slots = built if isinstance(built, list) else [built]
    return [dataclasses.replace(s, layer=layer) for s in slots]


# Rules never depend on the numbers inside a name (layer, expert), they only capture them, so
# all names with the same non-numeric skeleton match the same rule: remember which. A K3
# checkpoint has ~500 K names over ~100 skeletons.
_NUMBER = re.compile(r"\.\d+(?=\.|$)")
_RULE_OF_SKELETON: dict[tuple[str, str], int] = {}


def _match_rule(table: str, rules: list, rest: str) -> tuple[re.Match, Builder] | None:
    key = (table, _NUMBER.sub(".#", rest))
    known = _RULE_OF_SKELETON.get(key)
    if known is not None:
        match = re.fullmatch(rules[known][0], rest)
        if match:
            return match, rules[known][1]
    for i, (pattern, build) in enumerate(rules):
        match = re.fullmatch(pattern, rest)
        if match:
            _RULE_OF_SKELETON[key] = i
            return match, build
    return None


def detect_layout(config_json: dict, names: list[str]) -> str:
    """Which name table a checkpoint uses, from its config.json and tensor names."""
    if config_json.get("model_type") == "kimi_k3" or "text_config" in config_json:
        return "k3"
    if any(n.endswith("self_attn.conv1d.weight") or ".mlp.experts.gate_up_proj" in n
           for n in names):
        return "transformers"
    return "moonshot"


# --------------------------------------------------------------------------------------------
# The reverse direction: k3text parameter -> the HF tensor names that fill it, per layout.
# `hf.tensor_groups` walks the parameter tree through these; `slots_for` (the forward rules)
# then says where each name lands, and tests hold the two directions to each other.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spelling:
    """How a layout spells the parts the forward rules accept in several forms."""

    prefix: str  # before `model.` / `lm_head.`
    dense: str  # the dense MLP's module
    moe: str  # the MoE block's module
    decay: str  # the KDA decay projections' module
    fused_conv: bool  # one conv1d over concat(q, k, v)
    experts: str  # "per_expert" (w1/w2/w3), "stacked" ([E, ...] tensors) or "mxfp4"


_SPELLINGS = {
    # transformers' save_pretrained renames every `mlp.` back to `block_sparse_moe.`.
    "moonshot": _Spelling("", "block_sparse_moe", "block_sparse_moe", "self_attn", False,
                          "per_expert"),
    "transformers": _Spelling("", "mlp", "mlp", "self_attn.forget_gate", True, "stacked"),
    "k3": _Spelling("language_model.", "mlp", "block_sparse_moe", "self_attn", False, "mxfp4"),
}
LAYOUTS = tuple(_SPELLINGS)

_MLA_NAMES = {"kv_a_proj": "kv_a_proj_with_mqa"}
_GLOBAL_NAMES = {
    ("embed", "table"): "model.embed_tokens.weight",
    ("norm", "weight"): "model.norm.weight",
    ("lm_head", "kernel"): "lm_head.weight",
    ("output_attn_res_proj",): "model.output_attn_res_proj.weight",
    ("output_attn_res_norm",): "model.output_attn_res_norm.weight",
}


def global_tensor_names(layout: str, path: tuple[str, ...]) -> list[str]:
    """The HF names of a global (not per-layer) k3text parameter."""
    return [_SPELLINGS[layout].prefix + _GLOBAL_NAMES[path]]


def layer_tensor_names(cfg: Config, layout: str, path: tuple[str, ...], layer: int) -> list[str]:
    """The HF names that fill parameter `path` (relative to a decoder layer) of layer `layer`."""
    prefix = f"{_SPELLINGS[layout].prefix}model.layers.{layer}."
    return [prefix + name for name in _layer_names(cfg, layout, path)]


def _layer_names(cfg: Config, layout: str, path: tuple[str, ...]) -> list[str]:
    sp = _SPELLINGS[layout]
    match path:
        case (norm, "weight"):
            return [f"{norm}.weight"]
        case (attn_res,):
            return [f"{attn_res}.weight"]
        case ("mixer", "k_b_proj" | "v_b_proj"):
            return ["self_attn.kv_b_proj.weight"]
        case ("mixer", "qkv_proj"):
            return [f"self_attn.{p}_proj.weight" for p in _QKV]
        case ("mixer", "qkv_conv") if sp.fused_conv:
            return ["self_attn.conv1d.weight"]
        case ("mixer", "qkv_conv"):
            return [f"self_attn.{p}_conv1d.weight" for p in _QKV]
        case ("mixer", "f_a_proj" | "f_b_proj"):
            return [f"{sp.decay}.{path[1]}.weight"]
        case ("mixer", "A_log" | "dt_bias"):
            return [f"{sp.decay}.{path[1]}"]
        case ("mixer", name):
            return [f"self_attn.{_MLA_NAMES.get(name, name)}.weight"]
        case ("mlp", "wi"):
            return [f"{sp.dense}.gate_proj.weight", f"{sp.dense}.up_proj.weight"]
        case ("mlp", "wo"):
            return [f"{sp.dense}.down_proj.weight"]
        case ("mlp", "gate"):
            return [f"{sp.moe}.gate.weight"]
        case ("mlp", "e_score_correction_bias"):
            return [f"{sp.moe}.gate.e_score_correction_bias"]
        case ("mlp", "shared_experts", "wi"):
            return [f"{sp.moe}.shared_experts.gate_proj.weight",
                    f"{sp.moe}.shared_experts.up_proj.weight"]
        case ("mlp", "shared_experts", "wo"):
            return [f"{sp.moe}.shared_experts.down_proj.weight"]
        case ("mlp", "experts", name):
            return _expert_names(cfg, layout, name)
        case ("mlp", name):
            return [f"{sp.moe}.{name}.weight"]
    raise UnknownTensorError(f"no {layout} name for k3text parameter {'.'.join(path)}")


def _expert_names(cfg: Config, layout: str, name: str) -> list[str]:
    """Routed experts: gate_up is filled by w1 (gate) and w3 (up), down by w2."""
    sp = _SPELLINGS[layout]
    matrix = name.removesuffix("_packed").removesuffix("_scale")
    if (matrix != name) != (sp.experts == "mxfp4"):
        raise UnknownTensorError(f"the {layout} layout has no name for k3text expert "
                                 f"parameter '{name}'")
    if sp.experts == "stacked":
        return [f"{sp.moe}.experts.{matrix}_proj"]
    suffix = ".weight" if matrix == name else f".weight_{name.removeprefix(matrix + '_')}"
    ws = ("w1", "w3") if matrix == "gate_up" else ("w2",)
    return [f"{sp.moe}.experts.{e}.{w}{suffix}" for e in range(cfg.num_experts) for w in ws]


def default_layout(cfg: Config) -> str:
    """The layout a model's released checkpoints use: K3's for MXFP4 experts, else Moonshot's."""
    return "k3" if cfg.expert_weight_format == "mxfp4" else "moonshot"
