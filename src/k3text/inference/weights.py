"""The parameters as the engine's programs take them: a flat list of arrays, with the small
replicated ones packed into one buffer per dtype.

A call's host-side cost grows with its argument count. jax flattens an `nnx.State` of Variables
in Python on every call, and the runtime then prepares every argument buffer on its own. An
unrolled model (`scan_layers: false`, split per layer and per expert) has hundreds of arrays,
most of them tiny (norm scales, biases, gate corrections, MXFP4 block scales), so a decode call
of a small model spent more time being dispatched than running a step. Passed as a plain list
with the tiny arrays packed, the same call takes a few dozen buffers; the programs slice the
packed arrays back out (copies of a few hundred KiB at most), and every large weight stays its
own buffer, read in place.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

PACK_BYTES = 16 * 1024  # replicated arrays up to this size travel in a packed buffer


class Packed(NamedTuple):
    """Where one parameter lies in a packed buffer."""

    buffer: int  # index into the flat argument list
    offset: int  # elements
    shape: tuple[int, ...]


class WeightLayout(NamedTuple):
    """How a flat argument list maps back onto the model's parameters (static: bound into the
    programs, never traced)."""

    graphdef: Any
    treedef: Any
    leaves: tuple[int | Packed, ...]  # per parameter: its own buffer's index, or its place


def _packable(a: jax.Array) -> bool:
    return a.nbytes <= PACK_BYTES and a.sharding.is_fully_replicated


def flatten(graphdef: Any, params: Any) -> tuple[list[jax.Array], WeightLayout]:
    """`params` (an nnx.State) as the argument list the programs take, and its layout."""
    leaves, treedef = jax.tree.flatten(params)
    buffers: list[jax.Array] = []
    groups: dict[Any, list[int]] = {}  # dtype -> parameters packed together
    where: list[int | Packed] = []
    for i, a in enumerate(leaves):
        if _packable(a):
            groups.setdefault(a.dtype, []).append(i)
            where.append(-1)  # filled below
        else:
            where.append(len(buffers))
            buffers.append(a)
    for members in groups.values():
        offsets = np.cumsum([0] + [leaves[i].size for i in members])
        for i, offset in zip(members, offsets[:-1], strict=True):
            where[i] = Packed(len(buffers), int(offset), tuple(leaves[i].shape))
        sharding = leaves[members[0]].sharding
        if isinstance(sharding, jax.sharding.NamedSharding):  # replicated, as a 1-D array
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        # Packed on the host (every process holds each replicated array whole): no program to
        # compile per engine.
        host = np.concatenate([np.asarray(leaves[i].addressable_data(0)).reshape(-1)
                               for i in members])
        buffers.append(jax.make_array_from_callback(host.shape, sharding,
                                                    lambda index, h=host: h[index]))
    return buffers, WeightLayout(graphdef, treedef, tuple(where))


def unflatten(layout: WeightLayout, buffers: list[jax.Array]) -> Any:
    """The nnx.State `flatten` was given, inside a program, from its argument list."""
    leaves = []
    for w in layout.leaves:
        if isinstance(w, Packed):
            size = int(np.prod(w.shape, dtype=np.int64))
            leaves.append(buffers[w.buffer][w.offset: w.offset + size].reshape(w.shape))
        else:
            leaves.append(buffers[w])
    return jax.tree.unflatten(layout.treedef, leaves)
