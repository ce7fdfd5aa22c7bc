"""Configuration: YAML files with `base_config` inheritance, `key=value` overrides, one frozen,
validated `Config`.

Every key is declared once, with its default and comment, in `configs/base.yml`; its type is the
type of that default. Loading order (later wins):

    base.yml  ->  model file named by `model_config:`  ->  the config file chain (base_config)
    ->  the model config stored with `load_parameters_path` (model keys only)  ->  command line

A checkpoint's own model config replaces the model keys a config file named by default; a model
key given explicitly on the command line that disagrees with the checkpoint is an error.

Structure derived from the model keys (layer types, dense layers, the scanned layer groups,
AttnRes block count) is computed once here, in `ModelStructure`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
BASE_CONFIG = CONFIG_DIR / "base.yml"
CHECKPOINT_MODEL_FILE = "model.yml"

# Keys describing the network itself (what a checkpoint fixes). Everything else is how to run it.
MODEL_KEYS = frozenset(
    """model_name vocab_size hidden_size num_hidden_layers intermediate_size first_k_dense_replace
    moe_layer_freq num_attention_heads num_key_value_heads q_lora_rank kv_lora_rank
    qk_nope_head_dim qk_rope_head_dim v_head_dim mla_use_nope mla_use_output_gate
    linear_attn_config.kda_layers linear_attn_config.full_attn_layers linear_attn_config.num_heads
    linear_attn_config.head_dim linear_attn_config.short_conv_kernel_size
    linear_attn_config.gate_lower_bound linear_attn_config.use_full_rank_gate num_experts
    num_experts_per_token num_shared_experts moe_intermediate_size routed_expert_hidden_size
    latent_moe_use_norm moe_renormalize routed_scaling_factor use_grouped_topk num_expert_group
    topk_group topk_method moe_router_activation_func hidden_act activation_situ_beta
    activation_situ_linear_beta attn_res_block_size rms_norm_eps tie_word_embeddings bos_token_id
    eos_token_id pad_token_id expert_weight_format""".split()
)

MESH_AXES = ("data", "expert", "tensor")

_CHOICES = {
    "hidden_act": ("silu", "situ"),
    "topk_method": ("noaux_tc",),
    "moe_router_activation_func": ("sigmoid",),
    "weight_dtype": ("bfloat16", "float32"),
    "dtype": ("bfloat16", "float32"),
    "expert_weight_format": ("bf16", "mxfp4"),
    "matmul_precision": ("default", "high", "highest"),
    "moe_ep_mode": ("local", "all_to_all"),
    "kda_implementation": ("auto", "recurrent", "chunked", "tokamax_mosaic"),
    "kda_decode_implementation": ("auto", "xla", "tokamax_mosaic"),
    "moe_a2a_transport": ("auto", "ragged", "padded"),
    "moe_expert_implementation": ("auto", "grouped", "gathered", "reference", "tokamax_mosaic"),
    "mla_cache_dtype": ("float32", "bfloat16", "float8_e4m3fn"),
    "kda_state_dtype": ("float32", "bfloat16"),
    "serve_engine": ("slots", "paged"),
    "decode_sampling_strategy": ("greedy", "weighted", "topk", "nucleus", "composite"),
    "tokenizer_type": ("none", "byte", "tiktoken"),
    "jax_cpu_collectives": ("gloo", "mpi", "none"),
}


class ConfigError(ValueError):
    """A configuration problem, reported in one line naming the key and the values."""


# --------------------------------------------------------------------------------------------
# Flat dotted-key dictionaries.
# --------------------------------------------------------------------------------------------


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        # logical_axis_rules is a mapping value, not a section of keys.
        if isinstance(value, Mapping) and name != "logical_axis_rules":
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give a YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


@functools.cache
def base_defaults() -> dict[str, Any]:
    """The flat {dotted key: default} table of configs/base.yml."""
    return _flatten(_read_yaml(BASE_CONFIG))


def _file_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """[(file, flat keys)] from the root of the base_config chain down to `path`."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    flat = _flatten(_read_yaml(path))
    parent = flat.pop("base_config", None)
    for key, value in (("base_config", parent), ("model_config", flat.get("model_config"))):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{path}: {key} must be a file path, got {value!r}")
    chain = []
    if parent:
        parent_path = Path(parent)
        if not parent_path.is_absolute():
            parent_path = path.parent / parent_path
        if parent_path.resolve() != BASE_CONFIG:
            chain = _file_chain(parent_path, (*seen, path))
    return [*chain, (path, flat)]


# --------------------------------------------------------------------------------------------
# Type checking against the defaults.
# --------------------------------------------------------------------------------------------


def _unknown_key_message(key: str, where: str) -> str:
    close = difflib.get_close_matches(key, base_defaults().keys(), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown config key '{key}' in {where}{hint}"


def _type_name(value: Any) -> str:
    return type(value).__name__


def _coerce(key: str, value: Any, where: str) -> Any:
    """Check `value` against the default's type; convert lossless cases (int -> float)."""
    default = base_defaults()[key]
    bad = ConfigError(
        f"config key '{key}' in {where} must be {_type_name(default)}, got {value!r} "
        f"({_type_name(value)})"
    )
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot, no exponent sign) as text
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        try:
            number = float(value)
        except OverflowError:  # an int beyond float range
            number = math.inf
        if not math.isfinite(number):  # YAML's .nan and .inf: no key has a use for them
            raise ConfigError(f"config key '{key}' in {where} must be a finite number, got "
                              f"{value!r}")
        return number
    if isinstance(default, str):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. prompt_ids=7 from the command line
        if not isinstance(value, str):
            raise bad
        return value
    if isinstance(default, list):
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(
                f"config key '{key}' in {where} must be a list of int, got {value!r}"
            )
        return tuple(value)
    if key == "logical_axis_rules":
        if not isinstance(value, Mapping):
            raise bad
        rules = {}
        for name, axes in value.items():
            axes = [] if axes is None else axes
            axes = [axes] if isinstance(axes, str) else axes
            if not isinstance(axes, list) or any(a not in MESH_AXES for a in axes):
                raise ConfigError(
                    f"logical_axis_rules.{name} in {where} must list mesh axes from "
                    f"{list(MESH_AXES)}, got {value[name]!r}"
                )
            rules[name] = tuple(axes)
        return rules
    raise AssertionError(f"base.yml default of {key} has unsupported type")  # pragma: no cover


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"command-line override '{item}' is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if key not in base_defaults():
        raise ConfigError(_unknown_key_message(key, "the command line"))
    if isinstance(base_defaults()[key], str):
        return key, raw  # strings verbatim: prompt=123 stays "123"
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(f"command-line value for '{key}' is not valid: {raw!r}") from None


# --------------------------------------------------------------------------------------------
# The frozen config object.
# --------------------------------------------------------------------------------------------


class _Section:
    """Read-only attribute view of the keys under one dotted prefix."""

    def __init__(self, values: Mapping[str, Any], prefix: str):
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str) -> Any:
        key = self._prefix + name
        if key in self._values:
            return self._values[key]
        if any(k.startswith(key + ".") for k in self._values):
            return _Section(self._values, key + ".")
        raise AttributeError(f"config has no key '{key}'")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is frozen; use Config.replace(...)")


class Config(_Section):
    """One validated configuration. Attribute access (`cfg.linear_attn_config.num_heads`),
    `cfg[key]` for dotted keys, `cfg.replace(key=value)` for a modified copy."""

    def __init__(self, values: Mapping[str, Any], explicit: Iterable[str] = ()):
        super().__init__(dict(values), "")
        object.__setattr__(self, "explicit_keys", frozenset(explicit))
        _validate(self)
        object.__setattr__(self, "structure", ModelStructure.from_config(self))

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def model_dict(self) -> dict[str, Any]:
        """The model keys as a nested YAML-ready mapping (what a checkpoint stores)."""
        nested: dict[str, Any] = {}
        for key in sorted(MODEL_KEYS):
            *parents, leaf = key.split(".")
            node = nested
            for p in parents:
                node = node.setdefault(p, {})
            value = self._values[key]
            node[leaf] = list(value) if isinstance(value, tuple) else value
        return nested

    def replace(self, **updates: Any) -> Config:
        """A new validated Config with `updates` (dotted keys via `**{'a.b': v}`)."""
        values = dict(self._values)
        for key, value in updates.items():
            if key not in values:
                raise ConfigError(_unknown_key_message(key, "replace()"))
            values[key] = _coerce(key, value, "replace()")
        return Config(values, self.explicit_keys | set(updates))

    # Convenience views used across the stack.
    @property
    def mesh_shape(self) -> dict[str, int]:
        """Global size of each mesh axis (ici x dcn)."""
        return {
            axis: self[f"ici_{axis}_parallelism"] * self[f"dcn_{axis}_parallelism"]
            for axis in MESH_AXES
        }

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    def axis_size(self, logical: str) -> int:
        """How many ways the logical axis `logical` is split on the configured mesh."""
        axes = self.logical_axis_rules.get(logical, ())
        return math.prod(self.mesh_shape[a] for a in axes)

    @property
    def mla_latent_dim(self) -> int:
        """Width of one cached MLA token: c_kv || k_r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_hidden_size(self) -> int:
        """Width the routed experts act on: the LatentMoE latent, or the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def global_batch_size(self) -> int:
        return int(self.per_device_batch_size * self.mesh_shape["data"])  # whole: validated


# --------------------------------------------------------------------------------------------
# Derived structure.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is: its mixer and its MLP kind."""

    mixer: str  # "kda" | "mla"
    mlp: str  # "dense" | "moe"


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    """Layers [0, lead) and [lead + period * num_groups, L) run unrolled; the `num_groups`
    repeats of the `period`-layer group in between run as one scan over stacked parameters."""

    lead: int
    period: int
    num_groups: int
    trail: int

    @property
    def scanned_layers(self) -> range:
        return range(self.lead, self.lead + self.period * self.num_groups)


def find_scan_plan(layers: Sequence[LayerSpec], min_groups: int = 2) -> ScanPlan:
    """The repeating group covering the most layers.

    Ties go to the shorter period, then to groups aligned with layer 0 (start % period == 0),
    then to the earlier start. K3 ([KDA(dense) KDA KDA MLA] + 22 x [KDA KDA KDA MLA] + [MLA])
    gives lead 4, period 4, 22 groups, trail 1. Fewer than `min_groups` repeats: no scan.
    """
    n = len(layers)
    best, best_key = ScanPlan(lead=n, period=0, num_groups=0, trail=0), None
    for period in range(1, n // min_groups + 1):
        for start in range(0, n - period * min_groups + 1):
            unit = layers[start : start + period]
            count = 1
            while layers[start + count * period : start + (count + 1) * period] == unit:
                count += 1
            if count < min_groups:
                continue
            key = (count * period, -period, start % period == 0, -start)
            if best_key is None or key > best_key:
                best_key = key
                best = ScanPlan(start, period, count, n - start - count * period)
    return best


@dataclasses.dataclass(frozen=True)
class ModelStructure:
    """Per-layer structure derived once from the model keys."""

    layers: tuple[LayerSpec, ...]
    scan: ScanPlan
    kda_index: tuple[int, ...]  # layer -> ordinal among KDA layers (-1 for MLA)
    mla_index: tuple[int, ...]  # layer -> ordinal among MLA layers (-1 for KDA)
    attn_res_blocks: int  # AttnRes buffer size (blocks opened over the whole depth); 0 = off

    @property
    def num_kda(self) -> int:
        return sum(spec.mixer == "kda" for spec in self.layers)

    @property
    def num_mla(self) -> int:
        return sum(spec.mixer == "mla" for spec in self.layers)

    @staticmethod
    def from_config(cfg: Config) -> ModelStructure:
        n = cfg.num_hidden_layers
        mla = {i - 1 for i in cfg.linear_attn_config.full_attn_layers}
        layers = []
        for i in range(n):
            is_moe = (
                cfg.num_experts > 0
                and i >= cfg.first_k_dense_replace
                and i % cfg.moe_layer_freq == 0
            )
            layers.append(LayerSpec("mla" if i in mla else "kda", "moe" if is_moe else "dense"))
        layers = tuple(layers)
        plan = find_scan_plan(layers)
        kda_index, mla_index, counts = [], [], {"kda": 0, "mla": 0}
        for spec in layers:
            kda_index.append(counts["kda"] if spec.mixer == "kda" else -1)
            mla_index.append(counts["mla"] if spec.mixer == "mla" else -1)
            counts[spec.mixer] += 1
        block = cfg.attn_res_block_size
        blocks = -(-n // block) if block else 0
        return ModelStructure(layers, plan, tuple(kda_index), tuple(mla_index), blocks)


# --------------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate(cfg: Config) -> None:
    for key, allowed in _CHOICES.items():
        _require(
            cfg[key] in allowed,
            f"config key '{key}' must be one of {list(allowed)}, got {cfg[key]!r}",
        )
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "kv_lora_rank",
                "qk_nope_head_dim", "v_head_dim", "num_attention_heads",
                "linear_attn_config.num_heads", "linear_attn_config.head_dim",
                "linear_attn_config.short_conv_kernel_size", "kda_chunk_size",
                "prefill_chunk_size", "max_target_length", "max_prefill_predict_length",
                "max_decode_steps", "per_device_batch_size", "train_batch_size",
                "train_seq_len", "checkpoint_every", "log_every", "learning_rate"):
        _require(cfg[key] > 0, f"config key '{key}' must be positive, got {cfg[key]}")
    for key in ("train_steps", "warmup_steps", "first_k_dense_replace", "num_experts",
                "num_shared_experts", "init_seed", "seed", "corpus_seed", "q_lora_rank",
                "routed_expert_hidden_size", "attn_res_block_size", "moe_dense_threshold",
                "activation_situ_linear_beta", "weight_decay", "num_processes",
                "intermediate_size", "moe_intermediate_size"):
        _require(cfg[key] >= 0, f"config key '{key}' must be >= 0, got {cfg[key]}")
    for key in ("qk_rope_head_dim", "mla_key_block", "rms_norm_eps", "grad_clip",
                "routed_scaling_factor", "moe_layer_freq", "num_expert_group", "topk_group"):
        _require(cfg[key] > 0, f"config key '{key}' must be positive, got {cfg[key]}")
    _require(cfg.process_id >= -1, f"config key 'process_id' must be >= 0, or -1 (from the "
                                   f"environment), got {cfg.process_id}")
    _require(not cfg.num_processes or cfg.process_id < cfg.num_processes,
             f"config key 'process_id' ({cfg.process_id}) must be below num_processes "
             f"({cfg.num_processes})")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        _require(0 <= cfg[key] < cfg.vocab_size,
                 f"config key '{key}' must be a token id in [0, vocab_size={cfg.vocab_size}), "
                 f"got {cfg[key]}")
    if cfg.first_k_dense_replace or not cfg.num_experts or cfg.moe_layer_freq > 1:
        _require(cfg.intermediate_size > 0, f"config key 'intermediate_size' must be positive "
                                            f"(the model has dense layers), got "
                                            f"{cfg.intermediate_size}")
    for axis in MESH_AXES:
        for kind in ("ici", "dcn"):
            key = f"{kind}_{axis}_parallelism"
            _require(cfg[key] >= 1, f"config key '{key}' must be >= 1, got {cfg[key]}")
    # A fractional share per device is fine (MaxText's convention) while the global batch, the
    # sequences decoded together, comes out whole.
    rows = cfg.per_device_batch_size * cfg.mesh_shape["data"]
    _require(rows >= 1 and rows == int(rows),
             f"per_device_batch_size ({cfg.per_device_batch_size}) x data shards "
             f"({cfg.mesh_shape['data']}) must be a whole number of sequences, got {rows:g}")

    _require(not (cfg.serve_prefill_apart and cfg.jax_distributed_initialize),
             "serve_prefill_apart runs in one process only; set it false for a multi-process "
             "server (jax_distributed_initialize)")

    n = cfg.num_hidden_layers
    # Kimi models have under 100 layers; the search for a repeating layer pattern (ScanPlan)
    # takes seconds at a thousand and runs for hours on a mistyped count.
    _require(n <= 1000, f"config key 'num_hidden_layers' must be at most 1000, got {n}")
    lin = cfg.linear_attn_config
    full = list(lin.full_attn_layers)
    for name, ids in (("full_attn_layers", full), ("kda_layers", list(lin.kda_layers))):
        bad = [i for i in ids if not 1 <= i <= n]
        _require(
            not bad,
            f"linear_attn_config.{name} {bad} out of range: layers are 1-indexed, "
            f"num_hidden_layers is {n}",
        )
        _require(len(set(ids)) == len(ids), f"linear_attn_config.{name} repeats a layer: {ids}")
    if lin.kda_layers:
        both = sorted(set(full) & set(lin.kda_layers))
        _require(not both, f"layers {both} are in both kda_layers and full_attn_layers")
        # The first few missing, looking at no more than len(listed) + 10 layers: a set of
        # range(1, n + 1) would exhaust memory for a mistyped num_hidden_layers.
        listed = set(full) | set(lin.kda_layers)
        missing = list(itertools.islice((i for i in range(1, n + 1) if i not in listed), 10))
        more = f" and {n - len(listed) - 10:,} more" if n - len(listed) > 10 else ""
        _require(
            not missing,
            f"layers {missing}{more} are in neither linear_attn_config.kda_layers nor "
            f"full_attn_layers",
        )

    _require(
        cfg.num_key_value_heads == cfg.num_attention_heads,
        f"num_key_value_heads ({cfg.num_key_value_heads}) must equal num_attention_heads "
        f"({cfg.num_attention_heads}): MLA shares one latent across heads",
    )
    _require(cfg.mla_use_nope, "mla_use_nope=false (rotary MLA) is not supported by Kimi models")
    if cfg.hidden_act == "situ":
        _require(
            cfg.activation_situ_beta > 0,
            "hidden_act is situ but activation_situ_beta is not set (K3 uses 4.0)",
        )
    if lin.gate_lower_bound:
        _require(lin.gate_lower_bound < 0,
                 f"linear_attn_config.gate_lower_bound must be negative, got "
                 f"{lin.gate_lower_bound}")
    if cfg.num_experts:
        _require(
            0 < cfg.num_experts_per_token <= cfg.num_experts,
            f"num_experts_per_token ({cfg.num_experts_per_token}) must be in "
            f"[1, num_experts={cfg.num_experts}]",
        )
        _require(
            cfg.num_experts % cfg.num_expert_group == 0,
            f"num_experts ({cfg.num_experts}) must divide into num_expert_group "
            f"({cfg.num_expert_group}) groups",
        )
        _require(
            1 <= cfg.topk_group <= cfg.num_expert_group,
            f"topk_group ({cfg.topk_group}) must be in [1, num_expert_group="
            f"{cfg.num_expert_group}]",
        )
        per_group = cfg.num_experts // cfg.num_expert_group
        _require(
            cfg.num_expert_group == 1 or per_group >= 2,
            f"grouped top-k scores groups by their top-2 experts: num_experts/num_expert_group "
            f"= {per_group} is too small",
        )
        _require(
            cfg.topk_group * per_group >= cfg.num_experts_per_token,
            f"topk_group ({cfg.topk_group}) groups of {per_group} experts cannot supply "
            f"num_experts_per_token={cfg.num_experts_per_token}",
        )
        _require(cfg.moe_intermediate_size > 0,
                 "moe_intermediate_size must be positive when num_experts > 0")
    if cfg.expert_weight_format == "mxfp4":
        for key, value in (("moe_intermediate_size", cfg.moe_intermediate_size),
                           ("routed_expert_hidden_size / hidden_size", cfg.moe_hidden_size)):
            _require(value % 32 == 0,
                     f"expert_weight_format mxfp4 packs 32-element blocks: {key} = {value} "
                     f"is not a multiple of 32")
    _require(cfg.kda_chunk_size > 0 and cfg.kda_chunk_size & (cfg.kda_chunk_size - 1) == 0,
             f"kda_chunk_size must be a power of two (the chunked KDA form halves a chunk down "
             f"to its leaves), got {cfg.kda_chunk_size}")
    _require(
        cfg.prefill_chunk_size % cfg.kda_chunk_size == 0,
        f"prefill_chunk_size ({cfg.prefill_chunk_size}) must be a multiple of kda_chunk_size "
        f"({cfg.kda_chunk_size})",
    )
    buckets = list(cfg.prefill_buckets)
    _require(all(b > 0 for b in buckets) and buckets == sorted(set(buckets)),
             f"prefill_buckets must be increasing positive token widths, got {buckets}")
    _require(
        cfg.max_prefill_predict_length <= cfg.max_target_length,
        f"max_prefill_predict_length ({cfg.max_prefill_predict_length}) exceeds "
        f"max_target_length ({cfg.max_target_length})",
    )
    _require(cfg.decode_sampling_temperature > 0,
             f"decode_sampling_temperature must be > 0, got {cfg.decode_sampling_temperature}")
    _require(0 < cfg.decode_sampling_nucleus_p <= 1,
             f"decode_sampling_nucleus_p must be in (0, 1], got {cfg.decode_sampling_nucleus_p}")
    _require(0 <= cfg.decode_sampling_top_k <= cfg.vocab_size,
             f"decode_sampling_top_k must be in [0, vocab_size={cfg.vocab_size}], got "
             f"{cfg.decode_sampling_top_k}")
    if cfg.decode_sampling_strategy in ("topk", "composite"):
        _require(cfg.decode_sampling_top_k > 0,
                 f"decode_sampling_strategy={cfg.decode_sampling_strategy} needs "
                 f"decode_sampling_top_k > 0")
    _require(0 <= cfg.server_port <= 65535, f"server_port must be in [0, 65535], got "
             f"{cfg.server_port}")
    for key in ("max_queued_requests", "serve_steps_per_call", "serve_prefill_token_budget",
                "serve_prefill_batch", "serve_default_max_tokens"):
        _require(getattr(cfg, key) >= 1, f"{key} must be >= 1, got {getattr(cfg, key)}")
    _check_page_pool(cfg)
    _require(0 <= cfg.serve_decode_prompt_tokens < cfg.prefill_chunk_size,
             f"serve_decode_prompt_tokens must be in [0, prefill_chunk_size="
             f"{cfg.prefill_chunk_size}), got {cfg.serve_decode_prompt_tokens}")
    _require(re.fullmatch(r"auto|all|\d+(,\d+)*", str(cfg.serve_xla_cpus)) is not None,
             f"serve_xla_cpus must be auto, all or CPU ids separated by commas (e.g. 1 or 2,3), "
             f"got {cfg.serve_xla_cpus!r}")
    for key in ("serve_max_logprobs", "return_top_logprobs"):
        _require(0 <= cfg[key] <= min(cfg.vocab_size, 20),
                 f"{key} must be in [0, {min(cfg.vocab_size, 20)}], got {cfg[key]}")
    _require(cfg.prefix_cache_block >= 0 and
             cfg.prefix_cache_block % cfg.prefill_chunk_size == 0,
             f"prefix_cache_block ({cfg.prefix_cache_block}) must be 0 (one prefill chunk) or a "
             f"multiple of prefill_chunk_size ({cfg.prefill_chunk_size}): a block's KDA "
             f"checkpoint is taken where a prefill chunk ends")
    _require(cfg.prefix_cache_bytes >= 0, f"prefix_cache_bytes must be >= 0, got "
             f"{cfg.prefix_cache_bytes}")
    cp = cfg.prefill_context_parallelism
    _require(cp >= 1, f"prefill_context_parallelism must be >= 1, got {cp}")
    if cp > 1:
        _require(cp % cfg.axis_size("batch") == 0,
                 f"prefill_context_parallelism ({cp}) must be a multiple of the batch mesh axes' "
                 f"size ({cfg.axis_size('batch')}): its rows split over them")
        _require(cfg.prefill_chunk_size >= cfg.linear_attn_config.short_conv_kernel_size - 1,
                 f"prefill_context_parallelism needs prefill_chunk_size "
                 f"({cfg.prefill_chunk_size}) >= short_conv_kernel_size - 1: a slice's conv "
                 f"inputs come from the slice before it only")
        _require(not cfg.enable_prefix_caching,
                 "prefill_context_parallelism > 1 and enable_prefix_caching cannot be combined: "
                 "a cached block's KDA checkpoint is taken where a prefill chunk ends, and a "
                 "context-parallel call ends only every prefill_context_parallelism chunks")
    _require(cfg.serve_shutdown_timeout >= 0, f"serve_shutdown_timeout must be >= 0, got "
             f"{cfg.serve_shutdown_timeout}")
    _require(cfg.serve_iteration_timeout >= 0, f"serve_iteration_timeout must be >= 0 (0: no "
             f"limit), got {cfg.serve_iteration_timeout}")
    _validate_divisibility(cfg)
    _validate_logits_layout(cfg)


def _validate_logits_layout(cfg: Config) -> None:
    """Logits are [batch, ..., vocab], and a mesh axis named by both rules goes to batch alone
    (the first to claim it): the vocabulary's reductions, gathers and per-shard top N would then
    run over an axis the logits are not split on, and give wrong numbers without an error."""
    def split(logical: str) -> set[str]:
        return {a for a in cfg.logical_axis_rules.get(logical, ()) if cfg.mesh_shape[a] > 1}

    shared = sorted(split("batch") & split("vocab"))
    _require(not shared, f"logical_axis_rules.batch and logical_axis_rules.vocab both split "
             f"over {', '.join(shared)}: an axis the logits' rows take cannot split their "
             f"vocabulary too; name it in one of them")


def _check_page_pool(cfg: Config) -> None:
    """The paged pool's keys (`serve_engine: paged`), in one line each."""
    if cfg.serve_engine == "paged":
        page, seq = cfg.pagedattn_tokens_per_page, cfg.axis_size("cache_seq")
        _require(page >= 1 and page % seq == 0,
                 f"pagedattn_tokens_per_page must be a positive multiple of the cache_seq mesh "
                 f"axes' size ({seq}: each device holds its share of every page), got {page}")
        pages = cfg.pagedattn_num_pages
        _require(pages == 0 or pages >= 2,
                 f"pagedattn_num_pages must be 0 (enough for every slot at max_target_length) "
                 f"or at least 2 (one is the null page), got {pages}")
        taken = [key for key, on in (
            ("enable_prefix_caching", cfg.enable_prefix_caching),
            ("prefill_context_parallelism > 1", cfg.prefill_context_parallelism > 1),
            ("serve_prefill_apart", cfg.serve_prefill_apart)) if on]
        _require(not taken, f"serve_engine=paged does not serve with {', '.join(taken)} yet; "
                            f"use serve_engine=slots for it")


def divisibility_table(cfg: Config) -> list[tuple[str, str, int]]:
    """(logical axis, config key, size) for every model dimension that a mesh axis splits."""
    lin = cfg.linear_attn_config
    rows = [
        ("vocab", "vocab_size", cfg.vocab_size),
        ("heads", "linear_attn_config.num_heads", lin.num_heads),
        ("heads", "num_attention_heads", cfg.num_attention_heads),
        ("mlp", "intermediate_size", cfg.intermediate_size),
        ("batch", "per_device_batch_size x data", cfg.global_batch_size),
        ("cache_seq", "max_target_length in whole prefill chunks (the MLA cache positions)",
         -(-cfg.max_target_length // cfg.prefill_chunk_size) * cfg.prefill_chunk_size),
    ]
    if cfg.q_lora_rank:
        rows.append(("q_lora", "q_lora_rank", cfg.q_lora_rank))
    if cfg.num_experts:
        rows += [
            ("exp", "num_experts", cfg.num_experts),
            ("mlp", "moe_intermediate_size x num_shared_experts",
             cfg.moe_intermediate_size * cfg.num_shared_experts),
        ]
        if cfg.routed_expert_hidden_size:
            rows.append(("latent", "routed_expert_hidden_size", cfg.routed_expert_hidden_size))
    return rows


def _validate_divisibility(cfg: Config) -> None:
    for logical, key, size in divisibility_table(cfg):
        ways = cfg.axis_size(logical)
        if size and size % ways:
            axes = " x ".join(
                f"{a}={cfg.mesh_shape[a]}" for a in cfg.logical_axis_rules.get(logical, ())
            )
            raise ConfigError(
                f"{key} = {size} does not divide over the '{logical}' mesh axes ({axes} -> "
                f"{ways} shards); change the mesh or logical_axis_rules.{logical}"
            )


# --------------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------------


def _apply(values: dict[str, Any], flat: Mapping[str, Any], where: str,
           allowed: frozenset[str] | None = None) -> None:
    for key, value in flat.items():
        if key in ("base_config", "model_config"):
            continue
        if key not in values:
            raise ConfigError(_unknown_key_message(key, where))
        if allowed is not None and key not in allowed:
            raise ConfigError(f"'{key}' in {where} is not a model key")
        value = _coerce(key, value, where)
        if key == "logical_axis_rules":  # a file names only the rules it changes
            value = {**values[key], **value}
        values[key] = value


def checkpoint_model_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The flat model keys stored with a converted checkpoint, or None when it has none. A
    checkpoint stores every model key: one that lacks some is damaged, not a smaller model."""
    file = Path(path) / CHECKPOINT_MODEL_FILE
    if not file.exists():
        return None
    stored = _flatten(_read_yaml(file))
    missing = sorted(MODEL_KEYS - stored.keys())
    if missing:
        raise ConfigError(f"{file} lacks {len(missing)} of the model keys a checkpoint stores "
                          f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
                          f"the checkpoint is damaged or not k3text's")
    return stored


# Keys naming files or directories. A relative path written in a config file is relative to that
# file (like base_config and model_config), so a config works from any working directory; one
# given on the command line is relative to the working directory. `~` is the home directory in
# both (the shell expands it only on the command line, and only at a word's start).
PATH_KEYS = frozenset({"load_parameters_path", "tokenizer_path", "prompts_file", "output_file",
                       "compilation_cache_dir", "checkpoint_dir", "export_path"})


def _file_relative(flat: Mapping[str, Any], file: Path) -> dict[str, Any]:
    def resolve(value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return value
        value = os.path.expanduser(value)
        return value if Path(value).is_absolute() else str((file.parent / value).resolve())

    return {k: resolve(v) if k in PATH_KEYS else v for k, v in flat.items()}


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                **kwargs: Any) -> Config:
    """Load `path` (or only base.yml), apply `key=value` overrides and keyword overrides."""
    values = dict(base_defaults())
    for key, value in values.items():
        values[key] = _coerce(key, value, "base.yml")

    chain = _file_chain(Path(path)) if path else []
    model_file = None
    for file, flat in chain:
        if "model_config" in flat:
            model_file = (file.parent / flat["model_config"]).resolve()
    cli = dict(_parse_override(item) for item in overrides)
    cli.update(kwargs)
    cli = {k: os.path.expanduser(v) if k in PATH_KEYS and isinstance(v, str) else v
           for k, v in cli.items()}
    if model_file is not None:
        for file, flat in _file_chain(model_file):
            _apply(values, flat, str(file))
    for file, flat in chain:
        _apply(values, _file_relative(flat, file), str(file))

    ckpt_path = cli.get("load_parameters_path", values["load_parameters_path"])
    if ckpt_path:
        stored = checkpoint_model_config(ckpt_path)
        if stored is not None:
            where = f"{Path(ckpt_path) / CHECKPOINT_MODEL_FILE}"
            _apply(values, stored, where, allowed=MODEL_KEYS)
            for key in MODEL_KEYS & cli.keys():
                given = _coerce(key, cli[key], "the command line")
                if given != values[key]:
                    raise ConfigError(
                        f"'{key}={cli[key]}' on the command line disagrees with the checkpoint "
                        f"at {ckpt_path} ({key} = {values[key]!r})"
                    )
    _apply(values, cli, "the command line")
    return Config(values, explicit=cli.keys())


def config_from_dict(model: Mapping[str, Any], **overrides: Any) -> Config:
    """A Config from base.yml plus a nested or flat mapping (tests and the converter use it)."""
    values = {k: _coerce(k, v, "base.yml") for k, v in base_defaults().items()}
    _apply(values, _flatten(model), "the given mapping")
    _apply(values, overrides, "keyword overrides")
    return Config(values, explicit=overrides.keys())


def request_host_devices(argv: Sequence[str]) -> None:
    """Before jax starts: let XLA:CPU expose as many (fake) devices as the mesh of the config in
    `argv` (CONFIG [key=value ...]) needs (its share, with `num_processes` processes), so
    multi-device CPU configs run as they are. Has no effect on accelerator backends, or once
    jax is imported; a bad config is left for the caller to report."""
    import sys

    if "jax" in sys.modules or not argv:
        return
    try:
        cfg = load_config(argv[0], argv[1:])
    except (ConfigError, OSError):
        return
    # Each of several processes (jax.distributed) brings exactly its share of the mesh; one
    # process may hold more devices than the mesh needs.
    processes = cfg.num_processes if cfg.jax_distributed_initialize else 0
    count = cfg.num_devices // max(1, processes)
    if cfg.serve_prefill_apart:  # a second mesh of the same shape prefills
        count *= 2
    flags = os.environ.get("XLA_FLAGS", "").split()
    name = "--xla_force_host_platform_device_count="
    asked = [int(f[len(name):]) for f in flags if f.startswith(name)]
    if count > max(asked, default=1) or (processes > 1 and asked != [count]):
        kept = [f for f in flags if not f.startswith(name)]
        os.environ["XLA_FLAGS"] = " ".join([*kept, f"{name}{count}"])

