"""The parameter inventory behind the operator tools: every parameter of the model the stack
actually builds, with its shape, stored dtype, logical axes and the component it belongs to.

It comes from `Decoder(cfg, Init(abstract=True))` (shapes only: the 2.8 T-parameter K3 builds in
~0.1 s and allocates nothing), never from a formula, so a change to a layer shows up here.

Parameters are counted as logical weights: an MXFP4 `*_packed` uint8 byte holds two FP4 codes
(two parameters) and its `*_scale` bytes hold none; bytes are always counted as stored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from flax import nnx

from k3text import sharding
from k3text.config import Config
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder

# Component key -> label, in the order the tools print them.
COMPONENTS: dict[str, str] = {
    "embedding": "embedding",
    "lm_head": "lm_head",
    "kda": "KDA mixer",
    "mla": "MLA mixer",
    "dense_mlp": "dense MLP",
    "router": "router",
    "latent_proj": "latent projections",
    "shared_experts": "shared experts",
    "routed_experts": "routed experts",
    "norms": "norms / AttnRes",
}

# Children of one MoE block, and of one decoder layer outside its mixer and MLP.
_MOE_PARTS = {
    "experts": "routed_experts",
    "shared_experts": "shared_experts",
    "gate": "router",
    "e_score_correction_bias": "router",
    "routed_expert_down_proj": "latent_proj",
    "routed_expert_up_proj": "latent_proj",
    "routed_expert_norm": "norms",
}
_LAYER_NORMS = {"input_layernorm", "post_attention_layernorm", "self_attention_res_proj",
                "self_attention_res_norm", "mlp_res_proj", "mlp_res_norm"}
_TOP_LEVEL = {"embed": "embedding", "lm_head": "lm_head", "norm": "norms",
              "output_attn_res_proj": "norms", "output_attn_res_norm": "norms"}


FP4_PER_BYTE = 2  # an MXFP4 packed byte holds two E2M1 codes
MOE_PER_LAYER = ("router", "latent_proj", "shared_experts", "routed_experts")

# Where the name inside a decoder layer starts in a parameter path; the element before it is
# the layer's index in its list: ("lead", i, ...), ("trail", i, ...), and ("groups", "layers",
# j, ...) for position j of every scanned group.
_LAYER_PREFIX = {"lead": 2, "trail": 2, "groups": 3}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter array of the model (a scanned one holds every layer of its group)."""

    path: tuple  # nnx state path, e.g. ("groups", "layers", 0, "mixer", "q_proj")
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]  # logical axis names
    component: str  # a COMPONENTS key
    params: int  # logical parameters it holds

    @property
    def name(self) -> str:
        return ".".join(str(p) for p in self.path)

    @property
    def local_name(self) -> str:
        """The name inside its decoder layer ("mixer.kv_a_proj"), or the full name."""
        return ".".join(str(p) for p in self.path[_LAYER_PREFIX.get(self.path[0], 0):])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def abstract_state(cfg: Config) -> nnx.State:
    """The model's parameter state with ShapeDtypeStruct leaves (no memory allocated)."""
    return nnx.state(Decoder(cfg, Init(abstract=True)))


def _decoder_layer(cfg: Config, path: tuple) -> tuple[int, tuple] | None:
    """(layer index, path inside the layer) for a decoder-layer parameter, else None."""
    plan = cfg.structure.scan
    first = {"lead": 0, "groups": plan.lead, "trail": plan.lead + plan.period * plan.num_groups}
    if path[0] not in first:
        return None
    start = _LAYER_PREFIX[path[0]]
    return first[path[0]] + path[start - 1], path[start:]


def component_of(cfg: Config, path: tuple) -> str:
    """The COMPONENTS key of the parameter at `path`. An unknown parameter is an error, so a new
    one cannot silently land in the wrong row."""
    located = _decoder_layer(cfg, path)
    if located is None:
        component = _TOP_LEVEL.get(path[0])
    else:
        layer, inner = located
        spec = cfg.structure.layers[layer]
        if inner[0] == "mixer":
            component = spec.mixer
        elif inner[0] == "mlp":
            component = "dense_mlp" if spec.mlp == "dense" else _MOE_PARTS.get(inner[1])
        else:
            component = "norms" if inner[0] in _LAYER_NORMS else None
    if component is None:
        raise ValueError(f"parameter {'.'.join(map(str, path))} belongs to no known component")
    return component


def logical_params(component: str, path: tuple, shape: tuple[int, ...]) -> int:
    """Parameters an array holds: the routed experts' MXFP4 `*_packed` bytes hold two each, their
    `*_scale` bytes none (names from `moe.expert_param_shapes`)."""
    leaf = str(path[-1])
    if component == "routed_experts" and leaf.endswith("_packed"):
        return math.prod(shape) * FP4_PER_BYTE
    if component == "routed_experts" and leaf.endswith("_scale"):
        return 0
    return math.prod(shape)


def inventory(cfg: Config, state: nnx.State | None = None) -> list[Tensor]:
    """Every parameter of the model `cfg` describes (or of `state`, its abstract state)."""
    state = abstract_state(cfg) if state is None else state
    tensors = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        shape, component = tuple(value.shape), component_of(cfg, path)
        tensors.append(Tensor(path, shape, np.dtype(value.dtype), sharding.variable_axes(var),
                              component, logical_params(component, path, shape)))
    return tensors


def moe_layers(cfg: Config) -> int:
    return sum(spec.mlp == "moe" for spec in cfg.structure.layers)


def layer_counts(cfg: Config) -> dict[str, int]:
    """How many decoder layers hold each per-layer component (absent: not per layer)."""
    st = cfg.structure
    moe = moe_layers(cfg)
    counts = {"kda": st.num_kda, "mla": st.num_mla, "dense_mlp": len(st.layers) - moe}
    counts.update({part: moe for part in MOE_PER_LAYER})
    return counts


def sum_by[T, V: (int, float)](items: Iterable[T], key: Callable[[T], str], value: Callable[[T], V],
           ) -> dict[str, V]:
    """{key(item): sum of value(item)} over `items`, keys in first-seen order."""
    out: dict[str, V] = {}
    for item in items:
        k = key(item)
        out[k] = out[k] + value(item) if k in out else value(item)
    return out


def ordered[V: (int, float)](totals: Mapping[str, V]) -> list[tuple[str, V]]:
    """(component, total) in COMPONENTS order, components the model lacks left out."""
    return [(c, totals[c]) for c in COMPONENTS if c in totals]
