"""Place Hugging Face tensors into the k3text parameter tree, and back.

`names.slots_for` says which parameter block each HF tensor fills; this module knows where each
decoder layer lives in the (possibly scanned) tree: `lead.{i}`, `groups.layers.{j}` at stack
index g, or `trail.{i}`. It is shared by the in-memory loader (tests, small models) and the
streaming converter. The reverse direction (`tensor_groups`, `hf_tensors`) walks the parameter
tree through the reverse name tables: it writes test checkpoints and counts what a checkpoint of
a model config must hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import jax
import numpy as np
from flax import nnx

from k3text.checkpoint import names
from k3text.config import Config
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder

Path = tuple


def layer_location(cfg: Config, layer: int) -> tuple[Path, tuple]:
    """(path prefix of decoder layer `layer` in the parameter tree, leading stack index)."""
    plan = cfg.structure.scan
    if layer < plan.lead:
        return ("lead", layer), ()
    if layer in plan.scanned_layers:
        g, j = divmod(layer - plan.lead, plan.period)
        return ("groups", "layers", j), (g,)
    return ("trail", layer - plan.lead - plan.period * plan.num_groups), ()


def destination(cfg: Config, slot: names.Slot) -> tuple[Path, tuple]:
    """(full parameter path, index inside it) for a slot."""
    if slot.layer is None:
        return slot.path, slot.index
    prefix, stack = layer_location(cfg, slot.layer)
    return (*prefix, *slot.path), (*stack, *slot.index)


def abstract_params(cfg: Config) -> dict[Path, jax.ShapeDtypeStruct]:
    """Flat {path: ShapeDtypeStruct} of the model's parameters (no memory allocated)."""
    state = nnx.state(Decoder(cfg, Init(abstract=True)))
    return {path: var.get_value() for path, var in nnx.to_flat_state(state)}


def _key(path: Path) -> Path:
    return tuple(str(p) for p in path)


def params_from_tensors(cfg: Config, tensors: Iterable[tuple[str, np.ndarray]],
                        layout: str) -> dict[Path, np.ndarray]:
    """Assemble every model parameter from (HF name, array) pairs; each element exactly once."""
    shapes = {_key(p): s for p, s in abstract_params(cfg).items()}
    values: dict[Path, np.ndarray] = {}
    filled: dict[Path, np.ndarray] = {}
    for name, array in tensors:
        slots = names.slots_for(cfg, name, layout)
        for slot in slots or ():
            path, index = destination(cfg, slot)
            key = _key(path)
            if key not in shapes:
                raise names.UnknownTensorError(f"'{name}' maps to {'.'.join(key)}, which this "
                                               f"model config does not have")
            shape = shapes[key]
            if key not in values:
                values[key] = np.zeros(shape.shape, shape.dtype)
                filled[key] = np.zeros(shape.shape, bool)
            block = names.to_k3text(cfg, slot, np.asarray(array))
            target = values[key][index]
            if block.shape != target.shape:
                raise ValueError(f"'{name}' {tuple(np.shape(array))} -> {'.'.join(key)}"
                                 f"[{index}] needs {target.shape}, got {block.shape}")
            if filled[key][index].any():
                raise ValueError(f"'{name}' overlaps another tensor in {'.'.join(key)}")
            values[key][index] = block.astype(shape.dtype)
            filled[key][index] = True
    missing = [".".join(k) for k in shapes if k not in filled or not filled[k].all()]
    if missing:
        raise ValueError(f"checkpoint does not provide {len(missing)} parameters, e.g. "
                         f"{missing[:5]}")
    return values


def model_from_params(cfg: Config, values: Mapping[Path, np.ndarray]) -> Decoder:
    """A Decoder whose parameters are `values` (flat, keyed by string paths)."""
    graphdef, state = nnx.split(Decoder(cfg, Init(abstract=True)))
    flat = []
    for path, var in nnx.to_flat_state(state):
        flat.append((path, var.replace(jax.numpy.asarray(values[_key(path)]))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# --------------------------------------------------------------------------------------------
# The reverse direction: k3text parameters -> HF tensors.
# --------------------------------------------------------------------------------------------


def param_name(path: Path) -> str:
    """The '.'-joined name of a parameter path (how checkpoints and messages spell it)."""
    return ".".join(str(p) for p in path)


def layers_of(cfg: Config, path: Path) -> tuple[Path, tuple[int, ...]] | None:
    """(path relative to its decoder layer, the layers it holds), or None for a global
    parameter. The inverse of `layer_location`: a scanned parameter holds one layer per group."""
    plan = cfg.structure.scan
    match path:
        case ("lead", i, *rest):
            return tuple(rest), (int(i),)
        case ("groups", "layers", j, *rest):
            return tuple(rest), tuple(plan.lead + g * plan.period + int(j)
                                      for g in range(plan.num_groups))
        case ("trail", i, *rest):
            return tuple(rest), (plan.lead + plan.period * plan.num_groups + int(i),)
    return None


def tensor_groups(cfg: Config, layout: str) -> Iterator[tuple[Path, int | None, list[str]]]:
    """(parameter path, decoder layer or None, the HF names filling it there) for every
    parameter of the model, in parameter order."""
    for path in abstract_params(cfg):
        path = _key(path)
        held = layers_of(cfg, path)
        if held is None:
            yield path, None, names.global_tensor_names(layout, path)
            continue
        rel, layers = held
        for layer in layers:
            yield path, layer, names.layer_tensor_names(cfg, layout, rel, layer)


def tensor_names(cfg: Config, layout: str) -> list[str]:
    """Every HF tensor name a `layout` checkpoint of this model has (fused tensors once)."""
    return list(dict.fromkeys(n for _, _, group in tensor_groups(cfg, layout) for n in group))


def hf_tensors(cfg: Config, values: Mapping[Path, np.ndarray], layout: str,
               ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) for every tensor of a `layout` checkpoint holding `values` (flat
    parameters keyed like `params_from_tensors` returns them); its inverse."""
    for name in tensor_names(cfg, layout):
        slots = names.slots_for(cfg, name, layout)
        parts = []
        for slot in slots:
            path, index = destination(cfg, slot)
            block = np.asarray(values[_key(path)])[index]
            parts.append(names.from_k3text(cfg, slot, block, layout))
        yield name, names.join_parts(cfg, slots, parts)
