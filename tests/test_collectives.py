"""The collectives report read from compiled HLO: per-call counts through loop trip counts, bytes,
and the flag on a collective that moves a parameter, on a program whose collectives are known."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3text.tools import collectives


def test_counts_loop_trips_bytes_and_flags_the_gathered_weight():
    mesh = jax.make_mesh((8,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
    split, whole = NamedSharding(mesh, P(None, "tensor")), NamedSharding(mesh, P())

    def program(params, x):
        # A weight gathered whole (the failure the report exists to catch), once per call...
        w = jax.lax.with_sharding_constraint(params["w"], whole)

        def step(_, h):  # ...and an activation gathered on each of 5 loop trips.
            y = jnp.tanh(h @ params["v"])  # [4, 64] split over tensor
            return jax.lax.with_sharding_constraint(y, whole) @ w

        return jax.lax.fori_loop(0, 5, step, x)

    params = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=split),
              "v": jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=split)}
    x = jax.ShapeDtypeStruct((4, 32), jnp.float32, sharding=whole)
    hlo = jax.jit(program).lower(params, x).compile().as_text()
    report = collectives.read(hlo)

    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    weight = [c for c in gathers if c.moves_parameter]
    assert len(weight) == 1 and weight[0].per_call == 1
    assert weight[0].result == "f32[64,32]" and weight[0].bytes == 64 * 32 * 4
    assert weight[0].op_name.startswith("params['w']")
    looped = [c for c in gathers if not c.moves_parameter]
    assert looped and all(c.per_call == 5 for c in looped)
    assert sum(c.per_call for c in looped) == 5 * len(looped)
    assert report.count == sum(c.per_call for c in report.collectives)
    assert report.bytes == sum(c.bytes * c.per_call for c in report.collectives)
    assert report.unknown_trip_counts == 0
    lines = list(collectives.describe(report))
    assert lines[0].startswith(f"collectives per call: {report.count}")
    assert lines[1].startswith("!! 1 collectives move parameters")


def test_result_bytes_of_arrays_and_tuples():
    assert collectives.result_bytes("f32[7168,3584]{0,1}") == 7168 * 3584 * 4
    assert collectives.result_bytes("(bf16[2,3]{1,0}, s32[4]{0})") == 2 * 3 * 2 + 4 * 4
    assert collectives.result_bytes("f32[]") == 4
    assert np.isclose(collectives.result_bytes("pred[8]"), 8)
