"""The KDA recurrent state stored in bfloat16 (`kda_state_dtype`) against float32, both held
against a float64 truth, in one process.

    python benchmarks/state_dtype.py [--quick] [--out DIR] [--force]

Storing the state in bfloat16 halves its bytes per sequence (K3: 434 -> 217 MB); the delta rule
still runs in float32 inside a step, so what it costs is one rounding of the state each time it
is stored: after every decode token, the worst case, which both parts below take.

- `op`: the decode step's delta rule (`ops.kda.reference.kda_step`, K3's head width 128 and its
  bounded gate, 4 heads, the layer's init distribution for the gate and beta) over 1K, 8K and
  32K tokens, the state kept in float32 or rounded to bfloat16 after every token, against the
  same recurrence in float64 (numpy). Reported: the outputs' relative RMS error over the last
  tenth of the tokens and the worst single token's, and the final state's relative error.
- `model`: the shipped model (configs/inference/cpu.yml) decoding one sequence token by token,
  every step fed the same tokens (the float32 engine's greedy continuation of a built-in
  prompt), with each state dtype: how far the bfloat16 state's log-probability of the fed token
  moves from float32's (largest and mean), how often the two pick a different next token and
  how far apart float32's two likeliest tokens were there, over the first 1K and all of 8K
  tokens (the model was trained on short facts; past them its
  text is not meaningful, its arithmetic is).

Outputs in --out (default benchmarks/results/state_dtype/): state_dtype.jsonl (line 1 the
machine), state_dtype.csv.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib
import jax
import jax.numpy as jnp
import numpy as np

from k3text import sharding
from k3text.checkpoint.store import load_model
from k3text.config import CONFIG_DIR, load_config
from k3text.inference.engine import Engine
from k3text.ops.kda import decay_gate, l2_normalize
from k3text.ops.kda.reference import kda_step

FIELDS = ("part", "tokens", "state_dtype", "output_rel_rms", "worst_token_rel",
          "final_state_rel", "max_logprob_shift", "mean_logprob_shift", "argmax_differs",
          "widest_gap_differing")
HEADS, HEAD_DIM, GATE_LOWER_BOUND = 4, 128, -5.0


def op_inputs(rng: np.random.Generator, tokens: int) -> tuple[np.ndarray, ...]:
    """q, k [T, H, K] (normalised, q scaled), v [T, H, V], g [T, H, K], beta [T, H]: the decay
    and beta from the layer's own init (A_log ~ log U(1, 16), dt ~ log U(1e-3, 1e-1))."""
    shape = (tokens, HEADS, HEAD_DIM)
    q = np.asarray(l2_normalize(jnp.asarray(rng.normal(size=shape), jnp.float32)))
    k = np.asarray(l2_normalize(jnp.asarray(rng.normal(size=shape), jnp.float32)))
    q = q * HEAD_DIM**-0.5
    v = rng.normal(size=shape).astype(np.float32)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), HEADS * HEAD_DIM))
    g = decay_gate(jnp.asarray(rng.normal(size=shape), jnp.float32),
                   jnp.asarray(np.log(rng.uniform(1.0, 16.0, HEADS)), jnp.float32),
                   jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32), GATE_LOWER_BOUND)
    beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(tokens, HEADS))))
    return q, k, v, np.asarray(g), beta.astype(np.float32)


def recurrence_float64(q, k, v, g, beta) -> tuple[np.ndarray, np.ndarray]:
    """The delta rule token by token in float64 (`ops.kda.reference`'s update as stated)."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    state = np.zeros((HEADS, HEAD_DIM, HEAD_DIM))
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        state *= np.exp(g[t])[:, :, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], state))
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], state)
    return out, state


def decode_with_state(q, k, v, g, beta, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The decode step over every token, the state stored in `dtype` between tokens."""
    stored = jnp.dtype(dtype)

    def step(state, xs):
        o, new = kda_step(*(x[None] for x in xs), state.astype(jnp.float32)[None],
                          precision=jax.lax.Precision.HIGHEST)
        return new[0].astype(stored), o[0]

    run = jax.jit(lambda xs: jax.lax.scan(step, jnp.zeros((HEADS, HEAD_DIM, HEAD_DIM), stored),
                                          xs))
    state, out = run(tuple(jnp.asarray(a) for a in (q, k, v, g, beta)))
    return np.asarray(out, np.float64), np.asarray(state.astype(jnp.float32), np.float64)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def op_rows(lengths: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    inputs = op_inputs(np.random.default_rng(0), max(lengths))
    for tokens in lengths:
        part = tuple(a[:tokens] for a in inputs)
        truth, truth_state = recurrence_float64(*part)
        tail = slice(tokens - tokens // 10, tokens)
        scale = np.sqrt(np.mean(truth**2, axis=(1, 2)))
        for dtype in ("float32", "bfloat16"):
            out, state = decode_with_state(*part, dtype)
            per_token = np.sqrt(np.mean((out - truth) ** 2, axis=(1, 2))) / scale
            rows.append({"part": "op", "tokens": tokens, "state_dtype": dtype,
                         "output_rel_rms": relative(out[tail], truth[tail]),
                         "worst_token_rel": float(per_token.max()),
                         "final_state_rel": relative(state, truth_state)})
    return rows


def model_rows(lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Teacher-forced decode of the shipped model with each state dtype (module docstring)."""
    tokens = max(lengths)
    base = load_config(CONFIG_DIR / "inference" / "cpu.yml",
                       [f"max_target_length={tokens + 64}", "per_device_batch_size=1"])
    ctx = sharding.MeshContext(sharding.make_mesh(base, jax.devices()[:1]),
                               base.logical_axis_rules)
    model = load_model(base, ctx, base.load_parameters_path)
    engines = {dtype: Engine(base.replace(kda_state_dtype=dtype), model, ctx)
               for dtype in ("float32", "bfloat16")}
    key = jax.random.key(0)
    fed = [base.bos_token_id if base.bos_token_id >= 0 else 1]
    logprobs: dict[str, list[np.ndarray]] = {dtype: [] for dtype in engines}
    states = {dtype: engine.new_state(1) for dtype, engine in engines.items()}
    for t in range(tokens):
        for dtype, engine in engines.items():
            _, _, logits, states[dtype] = engine.step(jnp.asarray([fed[t]], jnp.int32),
                                                      states[dtype], key)
            logprobs[dtype].append(np.asarray(jax.nn.log_softmax(logits[0]), np.float64))
        fed.append(int(np.argmax(logprobs["float32"][-1])))  # float32's greedy text, for both
    full = {dtype: np.stack(lps) for dtype, lps in logprobs.items()}
    rows = []
    for n in lengths:
        ids = np.asarray(fed[1:n + 1])
        chosen = {d: lp[np.arange(n), ids] for d, lp in ((d, full[d][:n]) for d in full)}
        shift = np.abs(chosen["bfloat16"] - chosen["float32"])
        differs = np.argmax(full["bfloat16"][:n], -1) != np.argmax(full["float32"][:n], -1)
        top2 = -np.sort(-full["float32"][:n], axis=-1)[:, :2]
        gaps = (top2[:, 0] - top2[:, 1])[differs]
        rows.append({"part": "model", "tokens": n, "state_dtype": "bfloat16",
                     "max_logprob_shift": float(shift.max()),
                     "mean_logprob_shift": float(shift.mean()),
                     "argmax_differs": int(differs.sum()),
                     "widest_gap_differing": float(gaps.max()) if gaps.size else 0.0})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1K and 2K tokens only")
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "state_dtype")
    parser.add_argument("--force", action="store_true",
                        help="replace the results files of an earlier run in --out")
    args = parser.parse_args(argv)
    return benchlib.run_checked(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    from k3text.tools.tables import table

    benchlib.check_outputs([args.out / "state_dtype.jsonl", args.out / "state_dtype.csv"],
                           args.force)
    machine = benchlib.machine()
    print(benchlib.machine_line(machine))
    op_lengths = (1024, 2048) if args.quick else (1024, 8192, 32768)
    model_lengths = (1024, 2048) if args.quick else (1024, 8192)
    t0 = time.perf_counter()
    ops = op_rows(op_lengths)
    print(table(["tokens", "state dtype", "output rel. RMS (last tenth)", "worst token",
                 "final state"],
                [[f"{r['tokens']:,}", r["state_dtype"], f"{r['output_rel_rms']:.2e}",
                  f"{r['worst_token_rel']:.2e}", f"{r['final_state_rel']:.2e}"] for r in ops],
                title=f"[{benchlib.stack()}] KDA decode recurrence ({HEADS} heads x {HEAD_DIM}, "
                      f"gate lower bound {GATE_LOWER_BOUND}) against float64, the state stored "
                      f"after every token"))
    print(f"[op: {time.perf_counter() - t0:.0f} s]\n")
    t0 = time.perf_counter()
    models = model_rows(model_lengths)
    print(table(["tokens", "largest |logprob shift|", "mean |logprob shift|",
                 "next-token argmax differs", "widest float32 top-2 gap there"],
                [[f"{r['tokens']:,}", f"{r['max_logprob_shift']:.2e}",
                  f"{r['mean_logprob_shift']:.2e}", f"{r['argmax_differs']} of {r['tokens']:,}",
                  f"{r['widest_gap_differing']:.2e}"]
                 for r in models],
                title=f"[{benchlib.stack()}] shipped model, one sequence fed the same tokens, "
                      f"bfloat16 KDA state against float32"))
    print(f"[model: {time.perf_counter() - t0:.0f} s]\n")
    rows = ops + models
    benchlib.write_jsonl(args.out / "state_dtype.jsonl", machine, rows)
    benchlib.write_csv(args.out / "state_dtype.csv", machine, FIELDS, rows)
    print(f"wrote state_dtype.jsonl/.csv in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
