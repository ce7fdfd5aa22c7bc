"""The parameters as the engine's programs take them: a flat list of the large arrays, with the
small replicated ones bound into the programs as constants.

A call's host-side cost grows with its argument count. jax flattens an `nnx.State` of Variables
in Python on every call, and the runtime then prepares every argument buffer on its own. An
unrolled model (`scan_layers: false`, split per layer and per expert) has hundreds of arrays,
most of them tiny (norm scales, biases, gate corrections, MXFP4 block scales), so a decode call
of a small model spent more time being dispatched than running a step. Passed as a plain list,
every large or sharded weight stays its own buffer, read in place; the tiny ones are part of the
compiled program, where a call neither passes nor copies them. (Packed into one buffer per
dtype instead, they had to be sliced back out on every call: several hundred copies, hoisted
out of the decode loop, which cost a small model as much as a decode step.) Their values are
replicated, so every process binds the same constants and compiles the same programs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

CONSTANT_BYTES = 16 * 1024  # replicated arrays up to this size are bound in as constants


class WeightLayout(NamedTuple):
    """How a flat argument list maps back onto the model's parameters (bound into the programs,
    never traced)."""

    graphdef: Any
    treedef: Any
    leaves: tuple[int | np.ndarray, ...]  # per parameter: its buffer's index, or its value


def _constant(a: jax.Array) -> bool:
    return a.nbytes <= CONSTANT_BYTES and a.sharding.is_fully_replicated


def flatten(graphdef: Any, params: Any) -> tuple[list[jax.Array], WeightLayout]:
    """`params` (an nnx.State) as the argument list the programs take, and its layout."""
    leaves, treedef = jax.tree.flatten(params)
    buffers: list[jax.Array] = []
    where: list[int | np.ndarray] = []
    for a in leaves:
        if _constant(a):  # every process holds it whole
            where.append(np.asarray(a.addressable_data(0)))
        else:
            where.append(len(buffers))
            buffers.append(a)
    return buffers, WeightLayout(graphdef, treedef, tuple(where))


def unflatten(layout: WeightLayout, buffers: list[jax.Array]) -> Any:
    """The nnx.State `flatten` was given, inside a program, from its argument list."""
    # jnp.asarray: a constant the program indexes like any other parameter (even by a traced
    # index, which a numpy array would refuse).
    leaves = [jnp.asarray(w) if isinstance(w, np.ndarray) else buffers[w]
              for w in layout.leaves]
    return jax.tree.unflatten(layout.treedef, leaves)
