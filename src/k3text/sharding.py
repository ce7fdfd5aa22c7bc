"""The device mesh and the logical-axis rules: the only module that spells mesh axis names.

Parameters carry logical axis names in their `axes` metadata (`("embed", "heads")`), decode state
and activations name logical axes too; `logical_axis_rules` in the config maps each logical name
to mesh axes. Everything else in the stack asks this module for PartitionSpecs, shardings and the
mesh axes behind a logical name (e.g. the expert axes a MoE `psum` runs over).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3text.config import MESH_AXES, Config, ConfigError

log = logging.getLogger(__name__)

Logical = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class MeshContext:
    """A mesh plus the rules that map logical axis names onto it."""

    mesh: Mesh
    rules: Mapping[str, tuple[str, ...]]

    def spec(self, logical: Sequence[str | None]) -> PartitionSpec:
        return logical_to_spec(logical, self.rules, self.mesh)

    def sharding(self, logical: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical))

    def shard_map_mesh(self) -> Mesh | jax.sharding.AbstractMesh:
        """The mesh `shard_map` should run over: this one, or the ambient abstract mesh of the
        same shape when one is set. Lowering TPU kernels from another machine sets an abstract
        mesh of TPU devices (their generation sizes the kernels), and shard_map must then run
        over that mesh."""
        ambient = jax.sharding.get_abstract_mesh()
        return self.mesh if ambient.empty or ambient.shape != self.mesh.shape else ambient

    def axes(self, logical: str) -> tuple[str, ...]:
        """Mesh axes (of size > 1) that the logical axis is split over."""
        return tuple(a for a in self.rules.get(logical, ()) if self.mesh.shape[a] > 1)

    def size(self, logical: str) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes(logical))

    def axis_index(self, logical: str) -> jax.Array:
        """This shard's index along the (flattened) mesh axes of `logical`; inside shard_map."""
        index = 0
        for axis in self.axes(logical):
            index = index * self.mesh.shape[axis] + jax.lax.axis_index(axis)
        return index


def target_platform() -> str:
    """The platform programs are being built for: the ambient abstract mesh's device platform
    when one is set (lowering for TPU from another machine sets a mesh of TPU devices), else
    JAX's default backend. Backend-dependent choices (`auto` implementations) read this, so a
    TPU export from a CPU host picks what a TPU would run."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None and device.platform else jax.default_backend()


_ACTIVE: list[MeshContext] = []


def logical_to_spec(logical: Sequence[str | None], rules: Mapping[str, tuple[str, ...]],
                    mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `logical` names.

    A mesh axis is used at most once per array (first dimension wins); axes of size 1 are
    dropped so specs stay readable.
    """
    used: set[str] = set()
    parts: list[Any] = []
    for name in logical:
        axes = []
        for axis in rules.get(name, ()) if name else ():
            if axis in used or (mesh is not None and mesh.shape[axis] == 1):
                continue
            used.add(axis)
            axes.append(axis)
        parts.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*parts)


# --------------------------------------------------------------------------------------------
# Mesh construction.
# --------------------------------------------------------------------------------------------


def maybe_initialize_distributed(cfg: Config) -> None:
    """`jax.distributed.initialize` when the config asks for it (multi-host)."""
    if not cfg.jax_distributed_initialize:
        return
    if cfg.jax_cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", cfg.jax_cpu_collectives)
    kwargs: dict[str, Any] = {}
    if cfg.coordinator_address:  # what is left unset (0 / -1), jax reads from the environment
        kwargs = dict(coordinator_address=cfg.coordinator_address,
                      num_processes=cfg.num_processes or None,
                      process_id=None if cfg.process_id < 0 else cfg.process_id)
    jax.distributed.initialize(**kwargs)
    # On jaxlib 0.12.1 the processes' collectives meet only when every process runs a program
    # compiled from the same module, its locations included: a difference in locations alone
    # leaves the processes waiting on each other for ever. Two things would make them differ:
    # - full tracebacks: a location would carry the call stack that traced the op, and process 0
    #   of a server runs its engine from a scheduler thread, the others from their main thread;
    #   the tracing frame alone is the same in every process;
    # - the persistent compilation cache, whose key leaves locations out: process 0 could load a
    #   program compiled from other locations (another version of the code, a one-process run)
    #   while the others compile theirs.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
    # On the CPU the persistent cache serves process 0 alone: its key hashes the devices'
    # topology as each process sees it, and only process 0 writes. So the others compile every
    # program while process 0 loads its own, and on jaxlib 0.12.1 a loaded program never meets
    # a freshly compiled one in their collectives, even from the same module. Every process
    # compiles, then, as the others have to anyway.
    if jax.default_backend() == "cpu":
        jax.config.update("jax_enable_compilation_cache", False)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The [data, expert, tensor] mesh the config describes, over `devices` (default: all).

    A single process with more devices than the mesh needs uses the first ones (and says so);
    several processes must fill the mesh exactly.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.mesh_shape
    needed = math.prod(shape.values())
    if needed < len(devices) and jax.process_count() == 1:
        log.info("mesh uses %d of %d devices", needed, len(devices))
        devices = devices[:needed]
    if needed != len(devices):
        sizes = ", ".join(
            f"{a}={cfg[f'ici_{a}_parallelism']}x{cfg[f'dcn_{a}_parallelism']}" for a in MESH_AXES
        )
        raise ConfigError(f"mesh ({sizes}) needs {needed} devices, but {len(devices)} are "
                          f"available")
    dims = [shape[a] for a in MESH_AXES]
    if jax.process_count() > 1 or any(cfg[f"dcn_{a}_parallelism"] > 1 for a in MESH_AXES):
        # Let JAX order devices by physical topology; data placement never depends on this
        # order (loading asks each sharding which slice a device holds).
        return jax.make_mesh(dims, MESH_AXES, devices=devices,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
    return Mesh(np.asarray(devices).reshape(dims), MESH_AXES)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Mapping[str, tuple[str, ...]]) -> Iterator[MeshContext]:
    """Activate `mesh` and `rules` for activation constraints and the MoE shard_map."""
    ctx = MeshContext(mesh, dict(rules))
    _ACTIVE.append(ctx)
    try:
        with jax.set_mesh(mesh):
            yield ctx
    finally:
        _ACTIVE.pop()


def active() -> MeshContext | None:
    """The mesh context set by `use_mesh`, or None (single device, no constraints)."""
    return _ACTIVE[-1] if _ACTIVE else None


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names; a no-op without an active mesh."""
    ctx = active()
    if ctx is None or ctx.mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, ctx.sharding(logical))


def constrain_features(x: jax.Array, features: str | None) -> jax.Array:
    """Pin an activation [batch, ..., features]: batch over the data axes, the last axis by the
    logical name `features` (None or a replicated name: whole on every device), the axes
    between unsplit."""
    if not _PINNING[-1]:
        return x
    return constrain(x, ("batch",) + (None,) * (x.ndim - 2) + (features,))


def gather_features(pieces: Sequence[jax.Array], features: Sequence[str]) -> list[jax.Array]:
    """Activations [batch, ..., F_i], each split over its last axis by the logical name
    `features[i]` (as a projection by a column-split weight leaves it), made whole on every
    device. Pieces split over the same mesh axes travel in one all-gather: two small gathers
    cost two collective latencies where one would do, and the partitioner does not merge them.
    Without an active mesh the pieces come back as they are."""
    ctx = active()
    if ctx is None or ctx.mesh.size == 1 or not _PINNING[-1]:
        return [constrain_features(x, None) for x in pieces]
    specs = [ctx.spec(("batch",) + (None,) * (x.ndim - 2) + (name,))
             for x, name in zip(pieces, features, strict=True)]
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, name in enumerate(features):
        groups.setdefault(ctx.axes(name), []).append(i)

    def body(*local):
        out = list(local)
        for axes, members in groups.items():
            if not axes:
                continue
            rows = local[members[0]].shape[0]
            # Pieces of different dtypes travel as their bytes, each in its own dtype (a
            # concatenation would widen the narrower ones).
            mixed = len({local[i].dtype for i in members}) > 1
            flat = [local[i].reshape(rows, -1) for i in members]
            if mixed:
                flat = [jax.lax.bitcast_convert_type(f, jnp.uint8).reshape(rows, -1)
                        if f.dtype.itemsize > 1 else f.view(jnp.uint8) for f in flat]
            widths = [f.shape[1] for f in flat]
            whole = jax.lax.all_gather(jnp.concatenate(flat, axis=-1), axes)
            offset = 0  # whole: [shards, rows, sum of widths]
            for i, width in zip(members, widths, strict=True):
                part = whole[:, :, offset:offset + width]
                if mixed and local[i].dtype.itemsize > 1:
                    part = jax.lax.bitcast_convert_type(
                        part.reshape(*part.shape[:2], -1, local[i].dtype.itemsize),
                        local[i].dtype)
                elif mixed:
                    part = part.view(local[i].dtype)
                part = part.reshape(-1, *local[i].shape)
                out[i] = jnp.moveaxis(part, 0, -2).reshape(*local[i].shape[:-1], -1)
                offset += width
        return tuple(out)

    replicated = tuple(ctx.spec(("batch",) + (None,) * (x.ndim - 1)) for x in pieces)
    return list(jax.shard_map(body, mesh=ctx.shard_map_mesh(), in_specs=tuple(specs),
                              out_specs=replicated, check_vma=False)(*pieces))


def top_k_features(x: jax.Array, k: int, features: str) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis of x [batch, ..., F], split over its last axis by the
    logical name `features` (as the vocab-split LM head leaves its logits): each shard's own top
    k first, then the best k of those, so k values per shard travel instead of the whole axis.
    Returns (values, indices into the whole axis), whole on every device."""
    ctx = active()
    if (k == 0 or ctx is None or ctx.mesh.size == 1 or not _PINNING[-1]
            or not ctx.axes(features)):  # k = 0: nothing to gather (a zero-width gather fails)
        return jax.lax.top_k(x, k)
    axes = ctx.axes(features)

    def body(local: jax.Array) -> tuple[jax.Array, jax.Array]:
        # A shard narrower than k gives all it has; the shards together still hold k.
        values, index = jax.lax.top_k(local, min(k, local.shape[-1]))
        index = index + ctx.axis_index(features) * local.shape[-1]
        values = jax.lax.all_gather(values, axes, axis=x.ndim - 1, tiled=True)
        index = jax.lax.all_gather(index, axes, axis=x.ndim - 1, tiled=True)
        best, pick = jax.lax.top_k(values, k)
        return best, jnp.take_along_axis(index, pick, axis=-1)

    whole = ctx.spec(("batch",) + (None,) * (x.ndim - 1))
    return jax.shard_map(body, mesh=ctx.shard_map_mesh(),
                         in_specs=(ctx.spec(("batch",) + (None,) * (x.ndim - 2) + (features,)),),
                         out_specs=(whole, whole), check_vma=False)(x)


@contextlib.contextmanager
def unpinned_activations() -> Iterator[None]:
    """Leave activation layouts to the partitioner (`constrain_features` and `gather_features`
    do nothing): the layout before they existed, kept to measure what they save."""
    _PINNING.append(False)
    try:
        yield
    finally:
        _PINNING.pop()


_PINNING: list[bool] = [True]


# --------------------------------------------------------------------------------------------
# Parameters and state.
# --------------------------------------------------------------------------------------------


def shard_bytes(s: NamedSharding, shape: Sequence[int], dtype: Any) -> int:
    """Bytes of the shard one device holds of a [shape] array placed with `s`."""
    return math.prod(s.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


def variable_axes(variable: nnx.Variable) -> Logical:
    axes = variable.get_metadata().get("axes")
    value = variable.get_value()
    if axes is None:
        return (None,) * np.ndim(value)
    if len(axes) != np.ndim(value):
        raise ValueError(f"parameter with axes {axes} has shape {np.shape(value)}")
    return tuple(axes)


def tree_shardings(logical_tree: Any, shapes: Any, ctx: MeshContext) -> Any:
    """NamedShardings for a tree of logical-axis tuples, checking every split divides."""

    def one(path, logical, shape):
        spec = ctx.spec(logical)
        for dim, part in zip(np.shape(shape) if not hasattr(shape, "shape") else shape.shape,
                             spec, strict=False):
            if part is None:
                continue
            ways = math.prod(ctx.mesh.shape[a] for a in ((part,) if isinstance(part, str)
                                                         else part))
            if dim % ways:
                raise ConfigError(
                    f"{jax.tree_util.keystr(path)}: dimension {dim} ({logical}) does not divide "
                    f"over mesh axes {part} ({ways} shards)"
                )
        return NamedSharding(ctx.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, logical_tree, shapes, is_leaf=is_logical)


def is_logical(x: Any) -> bool:
    """A logical-axes tuple (names or None per dimension) is a leaf of a logical tree."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def state_shardings(state: Any, ctx: MeshContext) -> Any:
    """NamedSharding tree for an nnx State (Variables replaced by shardings)."""
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    logical = jax.tree.map(variable_axes, state, is_leaf=is_var)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v.get_value()),
                                                         v.get_value().dtype),
                          state, is_leaf=is_var)
    return tree_shardings(logical, shapes, ctx)
