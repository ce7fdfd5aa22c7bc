"""Full-size validation without memory: build the model and decode state as abstract shapes on a
fake CPU mesh of the config's size, lower and compile one decode step and one prefill chunk, and
print per-device bytes from the compiler (`compiled.memory_analysis()`) and each program's
collectives read from its compiled HLO (`k3text.tools.collectives`): how many run per call,
bytes per device, the ten largest, and a `!!` line for any that moves a parameter.

    python -m k3text.tools.compile_check configs/inference/v7x16.yml [key=value ...] [--tpu]
                                         [--serving]

`--serving` adds the server's programs at the configured slot count (a prefill chunk into a
`serve_prefill_batch`-row prefix, its insert into the pool, one `generate` call of
`serve_steps_per_call` steps, and the call the scheduler runs while a group is being prefilled:
those steps with that chunk riding the first and its rows inserted after it). With
`prefill_context_parallelism` > 1 it also compiles one context-parallel prefill call (that many
chunks of one sequence, one per row). `--tpu` also lowers every program for TPU (`jax.export`,
platforms=["tpu"]) from this machine, so nothing CPU-only hides in the production path: under
an abstract mesh of TPU v7x devices, so `auto` implementations pick what a TPU runs (tokamax's
Mosaic KDA kernels, and its grouped matmul for routed experts above the dense threshold), and it
prints how many Mosaic kernel calls each program holds, by kernel. Weight and
state bytes are also computed from the real shardings (shard shape x itemsize), which is what
`argument` should match.
"""

from __future__ import annotations

import collections
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from k3text import files
from k3text.config import Config, load_config, request_host_devices
from k3text.tools import collectives

GIB = 1024**3


def abstract_inputs(cfg: Config, ctx: Any) -> dict[str, Any]:
    """Abstract (sharded ShapeDtypeStruct) parameters, decode state and token inputs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k3text import sharding
    from k3text.layers.initializers import Init
    from k3text.models.decoder import Decoder
    from k3text.models.state import STATE_AXES, state_shapes

    graphdef, params = nnx.split(Decoder(cfg, Init(abstract=True)))
    shardings = sharding.state_shardings(params, ctx)
    params = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        params, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    batch = cfg.global_batch_size
    shapes = state_shapes(cfg, batch)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         shapes, sharding.tree_shardings(STATE_AXES, shapes, ctx))
    rows = ctx.sharding(("batch", None))
    chunk = cfg.prefill_chunk_size
    inputs = dict(
        graphdef=graphdef, params=params, state=state,
        token=jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=ctx.sharding(("batch",))),
        chunk=jax.ShapeDtypeStruct((batch, chunk), jnp.int32, sharding=rows),
        valid=jax.ShapeDtypeStruct((batch, chunk), jnp.bool_, sharding=rows),
        start=jax.ShapeDtypeStruct((), jnp.int32),
    )
    slices = cfg.prefill_context_parallelism
    if slices > 1:  # a context-parallel prefill call: one sequence's chunks as its rows
        shapes = state_shapes(cfg, slices)
        inputs |= dict(
            slices_state=jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                shapes, sharding.tree_shardings(STATE_AXES, shapes, ctx)),
            slices_chunk=jax.ShapeDtypeStruct((slices, chunk), jnp.int32, sharding=rows),
            slices_valid=jax.ShapeDtypeStruct((slices, chunk), jnp.bool_, sharding=rows))
    return inputs


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its shard of each)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
    return total


def programs(inputs: dict[str, Any]) -> dict[str, tuple[Any, tuple]]:
    """{name: (jitted function, abstract args)} for one decode step and one prefill chunk, and
    one context-parallel prefill call when the config has `prefill_context_parallelism` > 1."""
    import functools

    import jax
    from flax import nnx

    graphdef = inputs["graphdef"]

    def decode_step(params, tokens, state):
        return nnx.merge(graphdef, params).decode(tokens, state)

    def prefill_chunk(params, tokens, valid, state, start, slices=False):
        return nnx.merge(graphdef, params).prefill(tokens, valid, state, start, slices=slices)

    found = {
        "decode step": (jax.jit(decode_step, donate_argnums=2),
                        (inputs["params"], inputs["token"], inputs["state"])),
        "prefill chunk": (jax.jit(prefill_chunk, donate_argnums=3),
                          (inputs["params"], inputs["chunk"], inputs["valid"], inputs["state"],
                           inputs["start"])),
    }
    if "slices_state" in inputs:
        found["context-parallel prefill"] = (
            jax.jit(functools.partial(prefill_chunk, slices=True), donate_argnums=3),
            (inputs["params"], inputs["slices_chunk"], inputs["slices_valid"],
             inputs["slices_state"], inputs["start"]))
    return found


def serving_programs(cfg: Config, inputs: dict[str, Any], ctx: Any,
                     ) -> dict[str, tuple[Any, tuple]]:
    """{name: (jitted function, abstract args)} for the server's programs at the configured
    slot count: a prefill chunk into a `serve_prefill_batch`-row prefix (and the scored one
    of a request for `prompt_logprobs`, every position through the LM head), inserting that prefix
    into the pool, one `generate` call of `serve_steps_per_call` steps over every slot, and
    `decode_and_prefill` (those steps with a whole chunk of the prefix riding the first, its
    rows inserted after it): the call the scheduler makes while a group is being prefilled."""
    import functools

    import jax
    import jax.numpy as jnp

    from k3text import sharding
    from k3text.inference import engine
    from k3text.inference.sampling import sampling_shapes
    from k3text.models.state import STATE_AXES, state_shapes

    def abstract(shapes: Any, axes: Any) -> Any:
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, sharding.tree_shardings(axes, shapes, ctx))

    slots = cfg.global_batch_size
    rows = min(cfg.serve_prefill_batch, slots)
    pool = abstract(engine.pool_shapes(cfg, slots), engine.pool_axes(cfg))
    prefix = engine.Prefix(
        abstract(jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.float32),
                 ("batch", "vocab")),
        abstract(state_shapes(cfg, rows), STATE_AXES))
    row = lambda dtype, *shape: jax.ShapeDtypeStruct(  # noqa: E731
        (rows, *shape), dtype, sharding=ctx.sharding(("batch",) + (None,) * len(shape)))
    chunk = cfg.prefill_chunk_size
    params = inputs["params"]
    graphdef = inputs["graphdef"]
    steps, top_n = cfg.serve_steps_per_call, cfg.serve_max_logprobs
    params_shapes = sampling_shapes(rows, cfg.vocab_size)
    # The engine sends a call's per-row arguments as one packed buffer (`engine.pack_rows`).
    insert_rows = (row(jnp.int32), row(jnp.int32), row(jnp.int32, engine.MAX_STOP_IDS),
                   *(row(s.dtype, *s.shape[1:]) for s in params_shapes))
    insert_layout = engine.RowLayout.of(insert_rows)
    riding_layout = engine.RowLayout.of((row(jnp.int32, chunk), row(jnp.bool_, chunk),
                                         *insert_rows))
    return {
        "serve prefill": (jax.jit(functools.partial(engine.prefill_chunk_program, graphdef),
                                  donate_argnums=3),
                          (params, row(jnp.int32, chunk), row(jnp.bool_, chunk), prefix,
                           inputs["start"])),
        "serve scored prefill": (
            jax.jit(functools.partial(engine.scored_prefill_chunk_program, graphdef,
                                      top_n=top_n), donate_argnums=3),
            (params, row(jnp.int32, chunk), row(jnp.bool_, chunk), prefix, inputs["start"],
             row(jnp.int32, chunk))),
        "serve insert": (jax.jit(functools.partial(engine.packed_insert_program,
                                                   layout=insert_layout, top_n=top_n),
                                 donate_argnums=0),
                         (pool, prefix, row(jnp.int32, insert_layout.words))),
        "serve generate": (jax.jit(functools.partial(engine.generate_program, cfg, graphdef,
                                                     max_steps=steps, top_n=top_n),
                                   donate_argnums=1),
                           (params, pool)),
        "serve decode + prefill": (
            jax.jit(functools.partial(engine.packed_decode_and_prefill_program, cfg, graphdef,
                                      layout=riding_layout, top_n=top_n, n_steps=steps),
                    donate_argnums=(1, 2)),
            (params, pool, prefix, row(jnp.int32, riding_layout.words), inputs["start"])),
    }


def paged_serving_programs(cfg: Config, inputs: dict[str, Any], ctx: Any,
                           ) -> dict[str, tuple[Any, tuple]]:
    """{name: (jitted function, abstract args)} for a paged server's two programs
    (`serve_engine: paged`) over its pool (`inference.pages.pool_size`): the step, every
    slot's decode token beside `serve_prefill_batch` prefill slices of one chunk, then the
    rest of `serve_steps_per_call` decode steps (a mixed plan); and the decode-only loop of
    those steps (a decode-only plan)."""
    import functools

    import jax
    import jax.numpy as jnp

    from k3text import sharding
    from k3text.inference import engine
    from k3text.inference.pages import pool_size
    from k3text.inference.sampling import sampling_shapes
    from k3text.models.state import cache_length
    from k3text.serving.scheduler import prefill_rows

    def abstract(shapes: Any, axes: Any) -> Any:
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, sharding.tree_shardings(axes, shapes, ctx))

    slots, rows = cfg.global_batch_size, prefill_rows(cfg)
    num_pages, page = pool_size(cfg)
    width = -(-cache_length(cfg) // page)
    pool = abstract(engine.paged_pool_shapes(cfg, slots, num_pages, page),
                    engine.paged_pool_axes(cfg))
    table = jax.ShapeDtypeStruct((slots, width), jnp.int32, sharding=ctx.sharding(("batch", None)))
    row = lambda dtype, *shape: jax.ShapeDtypeStruct(  # noqa: E731
        (rows, *shape), dtype, sharding=ctx.sharding(("batch",) + (None,) * len(shape)))
    chunk, steps, top_n = cfg.prefill_chunk_size, cfg.serve_steps_per_call, cfg.serve_max_logprobs
    # The long rows (tokens, slot, start, count, table), ends, prompt length, resumed, then
    # `insert`'s per-row arguments less the slots, packed as `Engine.paged_step` sends them.
    layout = engine.RowLayout.of((
        row(jnp.int32, chunk), row(jnp.int32), row(jnp.int32), row(jnp.int32),
        row(jnp.int32, width), row(jnp.bool_), row(jnp.int32), row(jnp.int32), row(jnp.int32),
        row(jnp.int32, engine.MAX_STOP_IDS),
        *(row(s.dtype, *s.shape[1:]) for s in sampling_shapes(rows, cfg.vocab_size))))
    graphdef, params = inputs["graphdef"], inputs["params"]
    return {
        "paged step (mixed)": (
            jax.jit(functools.partial(engine.packed_paged_step_program, cfg, graphdef,
                                      layout=layout, top_n=top_n, n_steps=steps),
                    donate_argnums=1),
            (params, pool, table, row(jnp.int32, layout.words))),
        "paged decode": (
            jax.jit(functools.partial(engine.paged_generate_program, cfg, graphdef,
                                      max_steps=steps, top_n=top_n), donate_argnums=1),
            (params, pool, table)),
    }


def decode_step_collectives(cfg: Config) -> collectives.Report:
    """The communication report of one compiled decode step of `cfg` on fake CPU devices (the
    process must expose `cfg.num_devices` of them: `request_host_devices`, or
    `jax.config.update("jax_num_cpu_devices", n)` before the backend starts)."""
    import jax

    from k3text import sharding

    mesh = sharding.make_mesh(cfg, jax.devices()[: cfg.num_devices])
    ctx = sharding.MeshContext(mesh, cfg.logical_axis_rules)
    with sharding.use_mesh(mesh, ctx.rules):
        fn, args = programs(abstract_inputs(cfg, ctx))["decode step"]
        compiled, partitioned = collectives.partitioned_hlo(fn.lower(*args))
    return collectives.read(compiled.as_text(), partitioned_module=partitioned)


def export_for_tpu(fn: Any, args: tuple, mesh: Any, device_kind: str = "TPU7x") -> str:
    """`fn(*args)` exported for TPU from this host, as StableHLO text.

    Traced under an abstract mesh of `device_kind` devices shaped like `mesh`: `auto`
    implementations then resolve for TPU (`sharding.target_platform`), and tokamax's kernels
    size themselves for that generation; `cross_compile` lets tokamax lower them without one.
    """
    import jax
    from jax.sharding import AbstractDevice, AbstractMesh
    from tokamax.config import cross_compile

    device = AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    target = AbstractMesh(tuple(mesh.shape.values()), tuple(mesh.axis_names),
                          tuple(mesh.axis_types), abstract_device=device)
    checks = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    with cross_compile(True), jax.sharding.use_abstract_mesh(target):
        return jax.export.export(fn, platforms=["tpu"], disabled_checks=checks)(*args) \
            .mlir_module()


def check(cfg: Config, tpu: bool = False, serving: bool = False,
          out: TextIO = sys.stdout) -> dict[str, dict[str, Any]]:
    """Compile the decode step and prefill chunk (and with `serving` the server's programs);
    print and return per-device GiB figures."""
    import jax

    from k3text import sharding

    mesh = sharding.make_mesh(cfg, jax.devices()[: cfg.num_devices])
    ctx = sharding.MeshContext(mesh, cfg.logical_axis_rules)
    print(f"{cfg.model_name}: mesh {dict(mesh.shape)} on {jax.devices()[0].platform} "
          f"(fake devices: shapes only, nothing allocated); batch {cfg.global_batch_size}, "
          f"prefill chunk {cfg.prefill_chunk_size}, cache {cfg.mla_cache_dtype}, "
          f"moe_ep_mode {cfg.moe_ep_mode}", file=out)
    with sharding.use_mesh(mesh, ctx.rules):
        inputs = abstract_inputs(cfg, ctx)
        weights = per_device_bytes(inputs["params"])
        state = per_device_bytes(inputs["state"])
        print(f"weights {weights / GIB:.2f} GiB/device, decode state {state / GIB:.2f} "
              f"GiB/device (from the shardings)", file=out)
        results = {}
        compiled_programs = programs(inputs)
        if serving:
            compiled_programs |= (paged_serving_programs if cfg.serve_engine == "paged"
                                  else serving_programs)(cfg, inputs, ctx)
        for name, (fn, args) in compiled_programs.items():
            start = time.perf_counter()
            compiled, partitioned = collectives.partitioned_hlo(fn.lower(*args))
            seconds = time.perf_counter() - start
            ma = compiled.memory_analysis()
            report = collectives.read(compiled.as_text(), partitioned_module=partitioned)
            figures = {"argument": ma.argument_size_in_bytes / GIB,
                       "output": ma.output_size_in_bytes / GIB,
                       "alias": ma.alias_size_in_bytes / GIB,
                       "temp": ma.temp_size_in_bytes / GIB,
                       "compile_seconds": seconds,
                       "collectives": report.count,
                       "collective_mb": report.bytes / 1e6,
                       "partitioned_collective_mb": report.partitioned_bytes / 1e6,
                       "largest_collective_bytes": max((c.bytes for c in report.collectives),
                                                       default=0),
                       "parameter_collectives": sum(c.per_call
                                                    for c in report.moving_parameters())}
            results[name] = figures
            print(f"{name:22s} argument {figures['argument']:8.2f}  temp "
                  f"{figures['temp']:8.2f}  output {figures['output']:8.2f}  aliased "
                  f"{figures['alias']:8.2f} GiB/device  (lower+compile {seconds:.1f} s)",
                  file=out)
            results[name]["report"] = report
            for line in collectives.describe(report, indent=" " * 23,
                                             layers=cfg.num_hidden_layers):
                print(line, file=out)
            if tpu:
                module = export_for_tpu(fn, args, mesh)
                kernels = collections.Counter(re.findall(r'kernel_name = "([^"]+)"', module))
                results[name]["tpu_kernels"] = module.count("tpu_custom_call")
                print(f"{'':22s} lowers for TPU: {len(module) / 1e6:.1f} MB of StableHLO, "
                      f"{results[name]['tpu_kernels']} Mosaic kernel calls ("
                      + ", ".join(f"{n} x {k}" for k, n in sorted(kernels.items())) + ")",
                      file=out)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    tpu, serving = "--tpu" in argv, "--serving" in argv
    args = [a for a in argv if a not in ("--tpu", "--serving")]
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if not args:
        print("usage: python -m k3text.tools.compile_check CONFIG [key=value ...] [--tpu] "
              "[--serving]\n"
              "error: no CONFIG file given (-h for help)", file=sys.stderr)
        return 2
    try:
        request_host_devices(args)
        check(load_config(args[0], args[1:]), tpu=tpu, serving=serving)
    except (ValueError, OSError) as e:  # ConfigError included
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    except KeyboardInterrupt:
        print("k3text.tools.compile_check: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
