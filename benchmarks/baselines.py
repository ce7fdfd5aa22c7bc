"""Side-by-side baselines, each pair in one process on the same weights and inputs.

    python benchmarks/baselines.py [--quick] [--only SECTION ...] [--out DIR] [--force]
                                    [--torch-threads N]

Sections (all by default):

- transformers: k3text decode (`Engine.decode_batch`, on-device loop) vs transformers'
  `KimiLinearForCausalLM.generate` (torch CPU, greedy) on a small Kimi Linear (hidden 512,
  4 layers, 16 experts) whose k3text twin holds the same weights (tests/hf_reference.py), at
  batch 1 and 8, and at batch 8 once more with the grouped ragged_dot MoE kernel forced.
  Decode tokens/s = batch x (new tokens - 1) / decode time: k3text's `decode_seconds`; for
  transformers the time from the first to the last new token, clocked by a stopping criterion
  inside `generate`. Both fp32; compile and warm-up excluded; medians.
  The share of greedy tokens both produce is printed as a same-model check. k3text runs with
  the CPU decode settings of configs/inference/cpu.yml: layers unrolled over per-layer weights,
  and moe_dense_threshold at 8 x the experts (XLA:CPU's ragged_dot loses to the hit-experts
  kernel up to there: at 128 routed slots over 16 experts the hit-experts kernel still decodes
  twice as fast).
  Each row also gives the rate each side reads weights at (the parameter bytes a step must
  read: hit experts only, one embedding row per token, times steps per second) next to the
  rate a large float32 matrix-vector product reaches on this machine.
- kda: KDA prefill forms on the same inputs, each against the per-token recurrence
  (`kda.prefill` ``recurrent``): k3text's matmul-form ``chunked`` with K3's gate bound declared
  (product diagonals) and without (pairwise diagonals, Kimi Linear's path), fla-core's
  `naive_chunk_kda` (torch), tokamax's `kimi_delta_attention` `xla` (its token-by-token
  recurrence) and `xla_chunked` (jit; K3's gate fused in, the only gate `xla_chunked` takes);
  B=1 at T = 256 ... 16384 and B=8 at T = 4096 (H=4, K=V=128), nine rounds. Each timed call
  of an XLA form follows untimed calls of the same form (KDA_SETTLE_S). Compile excluded;
  medians, and in brackets the ratio of the fastest runs (XLA:CPU runs the chunked form's
  threaded products in fast and slow phases that last seconds: benchmarks/README.md); the max
  |difference| from the recurrence is printed as a check. A second table gives the achieved
  FLOP rate of the forms whose work is counted (`kda_flops`) beside the rate of a 2048^3 float32
  matmul measured in the same process.
- loop: the tiny K3 (configs/models/k3-tiny.yml) at batch 1: the whole decode loop jitted
  (`Engine.decode_batch`) vs a Python loop over the jitted `Engine.step`, once reading each step's
  tokens back to the host (as a server checking EOS must) and once dispatching asynchronously.
- mxfp4: the tiny K3 decode step at batch 1 (on-device loop, ms/step) against the number of
  experts at fixed top-k (64 vs 512), MXFP4-packed vs unpacked experts
  (`expert_weight_format=bf16`, stored in the model's weight_dtype: float32, XLA:CPU's native
  type; bfloat16 storage on CPU would add XLA:CPU's whole-tensor bf16->f32 conversions); plus
  the grouped (`ragged_dot`) kernel forced with moe_dense_threshold=1, which touches every
  held expert.
- paged: the decode loop of the shipped model (configs/inference/cpu.yml, the 20 built-in
  prompts at batch 20, 64 tokens each, eos ignored) over fixed slot rows (`Engine.decode_batch`,
  each slot a contiguous `max_target_length` cache) vs over the paged pool
  (`Engine.paged_generate` after the executor's prefill, the same prompts; the pool holds as
  many positions as the slots do), at two page sizes; ms per decode step, the same tokens
  checked.

- ttft: time to first token at a 2,048-token prompt for the shipped model (configs/inference/
  cpu.yml) and the tiny Kimi Linear, per KDA prefill form on the same weights: the chunked
  form as it was before `k3text.ops.kda` (`old`), the first matmul form (`previous`) and the
  halving form whose loop still read reordered copies of the sequence (`halving`), all read
  from git (EARLIER_KDA), this tree's chunked form and the per-token recurrence.

Pairs are measured interleaved (one call of each per round, in a new order each round, after
one warm-up call each), so load from other processes hits both sides of a ratio alike. torch
runs with one thread unless --torch-threads says otherwise: on a loaded 2-core machine torch's
OpenMP pool stalls whenever one of its threads is preempted (the same fla call took 0.37-7.7 s
with 2 threads, a steady 0.20 s with 1), and one thread was torch's fastest setting here, so
this favours the torch side.

Each section writes SECTION.jsonl (line 1: the machine; then one object per row), SECTION.csv
and SECTION.png into --out (default benchmarks/results/baselines/), and prints its table with
the ratios. Runs on one CPU device (no fake devices).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import benchlib

sys.path.insert(0, str(benchlib.ROOT / "tests"))  # hf_reference: the Kimi Linear twin

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from transformers import StoppingCriteriaList

from k3text import decode, files, sharding
from k3text.config import CONFIG_DIR, Config, ConfigError, load_config
from k3text.inference import sampling
from k3text.inference.engine import Engine, build_engine, place_model
from k3text.layers import moe
from k3text.ops import kda
from k3text.ops.kda.chunked import PAIRWISE_LEAF, PRODUCT_LEAF
from k3text.ops.kda.tokamax import tokamax_kda
from k3text.serving.executor import PagedExecutor
from k3text.tokenizer import load_tokenizer, tokenizer_file
from k3text.tools.tables import table

import hf_reference

K3_TINY = CONFIG_DIR / "models" / "k3-tiny.yml"
# In every table's title: CPU figures move with the jaxlib wheel (benchmarks/README.md).
STACK = benchlib.stack()
Row = dict[str, Any]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def interleaved(runs: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Call each run once to warm up (compile), then `repeats` rounds that call every run once,
    so a burst of load from other processes on a shared machine hits all of them alike and
    their ratios stay fair. Each round calls them in a new order (seeded), so no run always
    follows the same one: a multi-threaded program timed right after a long single-threaded
    one starts with the other core idle, and ran a few percent slower there (the chunked KDA
    prefill after the recurrence, benchmarks/README.md). Returns each run's outputs, by name."""
    for fn in runs.values():
        fn()
    outputs: dict[str, list[Any]] = {name: [] for name in runs}
    order, shuffle = list(runs), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for name in order:
            outputs[name].append(runs[name]())
    return outputs


# --------------------------------------------------------------------------------------------
# transformers generate vs k3text.
# --------------------------------------------------------------------------------------------

SMALL_KIMI_LINEAR = dict(
    vocab_size=2048, hidden_size=512, num_hidden_layers=4, intermediate_size=1024,
    moe_intermediate_size=256, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=16,
    num_experts_per_token=2, linear_attn_config={
        "kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 8, "head_dim": 64,
        "short_conv_kernel_size": 4},
)


def twin_engine(hf_model: Any, prompt_len: int, steps: int, **overrides: Any) -> Engine:
    """A k3text engine on one device holding `hf_model`'s weights, with the CPU decode settings
    of configs/inference/cpu.yml (layers unrolled over per-layer weights)."""
    overrides.setdefault("scan_layers", False)
    overrides.setdefault("moe_dense_threshold", 8 * hf_model.config.num_experts)
    cfg, twin = hf_reference.k3text_twin(
        hf_model, matmul_precision="default", max_decode_steps=steps, ignore_eos=True,
        max_prefill_predict_length=prompt_len, max_target_length=prompt_len + steps,
        **overrides)
    ctx = sharding.MeshContext(sharding.make_mesh(cfg), cfg.logical_axis_rules)
    return Engine(cfg, place_model(twin, ctx), ctx)


def expert_kernel(cfg: Config, tokens: int) -> str:
    """The routed-expert kernel one device runs for `tokens` tokens (unsharded experts)."""
    return moe.expert_implementation(cfg, None, tokens)


def bandwidth_bytes_per_s() -> float:
    """This machine's memory bandwidth as XLA:CPU streams weights: the best of 10 float32
    matrix-vector products over a 64 MiB matrix."""
    w = jnp.asarray(np.random.default_rng(0).random((16384, 1024), np.float32))
    x = jnp.ones((1, 16384), jnp.float32)
    matvec = jax.jit(lambda w, x: x @ w)
    matvec(w, x).block_until_ready()
    best = min(timed(lambda: matvec(w, x).block_until_ready())[0] for _ in range(10))
    return w.nbytes / best


def weight_bytes_per_step(engine: Engine, batch: int) -> float:
    """Parameter bytes a decode step of `batch` tokens must read: every parameter, except that
    the embedding table gives one row per token and routed experts count only as many as the
    tokens are expected to hit (`batch` tokens choosing top-k of E experts uniformly)."""
    cfg = engine.cfg
    e, k = cfg.num_experts, cfg.num_experts_per_token
    hit = e * (1 - (1 - k / e) ** batch) / e
    total = 0.0
    for path, var in nnx.to_flat_state(engine.params):
        nbytes = sum(a.nbytes for a in jax.tree.leaves(var.get_value()))
        if path[0] == "embed":
            nbytes *= batch / cfg.vocab_size
        elif "experts" in path:
            nbytes *= hit
        total += nbytes
    return total


class _TokenClock:
    """A transformers stopping criterion that never stops: it only records when each new
    token has been appended (the first one right after prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def hf_generate(model: Any, prompts: torch.Tensor, new_tokens: int
                ) -> tuple[float, float, list[list[int]]]:
    """Greedy `generate`: (time to first token, decode seconds for the remaining
    new_tokens - 1 tokens, the new tokens)."""
    clock = _TokenClock()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(prompts, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([clock]))
    return clock.times[0] - t0, clock.times[-1] - clock.times[0], \
        out[:, prompts.shape[1]:].tolist()


def agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> str:
    """Leading tokens both produced, summed over the batch (random tiny models have near-ties,
    so a late divergence is no error)."""
    same = total = 0
    for a, b in zip(ours, theirs, strict=True):
        total += len(b)
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     min(len(a), len(b)))
    return f"{same}/{total}"


def transformers_section(quick: bool) -> list[Row]:
    prompt_len, steps, repeats = (64, 16, 2) if quick else (64, 64, 5)
    model = hf_reference.tiny_hf_model(seed=0, **SMALL_KIMI_LINEAR)
    model.generation_config.eos_token_id = None
    # The CPU kernel choice (hit experts up to 8 x 16 slots), and the grouped kernel forced.
    default = twin_engine(model, prompt_len, steps)
    grouped = twin_engine(model, prompt_len, steps, moe_dense_threshold=1)
    bandwidth = bandwidth_bytes_per_s()
    rng = np.random.default_rng(0)
    rows = []
    for batch, engine, how in ((1, default, "auto"), (8, default, "auto"),
                               (8, grouped, "forced")):
        prompts = rng.integers(3, engine.cfg.vocab_size, (batch, prompt_len))
        listed, tensor = prompts.tolist(), torch.as_tensor(prompts)
        out = interleaved({"k3text": lambda e=engine, p=listed: e.decode_batch(p),
                           "transformers": lambda t=tensor: hf_generate(model, t, steps)},
                          repeats)
        gens, runs = out["k3text"], out["transformers"]
        ours = benchlib.median(benchlib.loop_tokens_per_s(batch, g.decode_steps,
                                                          g.decode_seconds) for g in gens)
        theirs = benchlib.median(batch * (steps - 1) / decode_s for _, decode_s, _ in runs)
        # Decode at small batch streams weights: the rate each side reads them at, against
        # what a large matrix-vector product reaches here.
        step_bytes = weight_bytes_per_step(engine, batch)
        rows.append({"section": "transformers", "batch": batch, "prompt_length": prompt_len,
                     "new_tokens": steps,
                     "k3text_moe_kernel": f"{expert_kernel(engine.cfg, batch)} ({how})",
                     "k3text_tokens_per_s": ours, "transformers_tokens_per_s": theirs,
                     "speedup": ours / theirs,
                     "weight_mb_per_step": step_bytes / 1e6,
                     "k3text_weight_gb_s": ours / batch * step_bytes / 1e9,
                     "transformers_weight_gb_s": theirs / batch * step_bytes / 1e9,
                     "matvec_gb_s": bandwidth / 1e9,
                     "k3text_ttft_ms": benchlib.median(g.prefill_seconds for g in gens) * 1e3,
                     "transformers_ttft_ms": benchlib.median(r[0] for r in runs) * 1e3,
                     "tokens_agree": agreement(gens[0].output_ids, runs[0][2]),
                     "torch_threads": torch.get_num_threads()})
    print(table(["batch", "k3text MoE kernel", "k3text tok/s", "transformers tok/s",
                 "k3text / transformers", "weights read GB/s (k3text / hf)",
                 "TTFT ms (k3text / hf)", "tokens agree"],
                [[str(r["batch"]), r["k3text_moe_kernel"], f"{r['k3text_tokens_per_s']:.1f}",
                  f"{r['transformers_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                  f"{r['k3text_weight_gb_s']:.1f} / {r['transformers_weight_gb_s']:.1f}",
                  f"{r['k3text_ttft_ms']:.0f} / {r['transformers_ttft_ms']:.0f}",
                  r["tokens_agree"]] for r in rows],
                title=f"[{STACK}] "
                      f"(a) decode, small Kimi Linear (hidden 512, 4 layers, 16 experts), "
                      f"prompt {prompt_len}, {steps} new tokens, fp32, median of {repeats} "
                      f"interleaved runs; warm-up/compile excluded; forced = "
                      f"moe_dense_threshold=1, so the grouped kernel runs; weights read = "
                      f"parameter bytes a step must read ({rows[0]['weight_mb_per_step']:.1f} MB "
                      f"at batch 1) x steps/s; a 64 MiB float32 matrix-vector product reads "
                      f"{bandwidth / 1e9:.1f} GB/s here"))
    return rows


# --------------------------------------------------------------------------------------------
# KDA prefill forms.
# --------------------------------------------------------------------------------------------

KDA_HEADS, KDA_HEAD_DIM = 4, 128
# (batch, T): B=1 up to 16K tokens, and a batch of 8.
KDA_CASES_QUICK = ((1, 256), (1, 1024))
KDA_CASES = ((1, 256), (1, 1024), (1, 4096), (1, 16384), (8, 4096))


def load_fla_naive() -> Any:
    """fla-core's torch reference, loaded by path (`import fla` needs triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the kda section needs fla-core, which is not installed "
                          "(pip install -e '.[test]')")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


KDA_LOWER_BOUND = -5.0  # K3's gate; tokamax's xla_chunked implements only this gate form
KDA_SETTLE_S = 0.1  # seconds of untimed calls of an XLA form before each timed one (at least one)


def kda_inputs(b: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
    """q, k (L2-normalised, as the layer feeds them), v, beta in (0, 1), and K3's lower-bounded
    decay gate twice: raw (f, a_log, dt_bias, for tokamax's fused gate) and activated
    (g = lb * sigmoid(exp(a_log) * (f + dt_bias)), mostly in (-2, 0), for the other forms)."""
    h, d = KDA_HEADS, KDA_HEAD_DIM
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = (unit(rng.standard_normal((b, t, h, d))) for _ in range(2))
    v = rng.standard_normal((b, t, h, d))
    f = rng.standard_normal((b, t, h, d))
    a_log, dt_bias = np.zeros(h), np.full(h * d, -2.0)
    x = f + dt_bias.reshape(h, d)
    g = KDA_LOWER_BOUND / (1.0 + np.exp(-np.exp(a_log)[:, None] * x))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, f=f, a_log=a_log, dt_bias=dt_bias)
    return {name: a.astype(np.float32) for name, a in arrays.items()}


LOG_GATE = ("q", "k", "v", "g", "beta")
RAW_GATE = ("q", "k", "v", "f", "beta", "a_log", "dt_bias")
KDA_FORMS = {  # name -> the arrays it takes, in order; the recurrence is the baseline
    "recurrent": LOG_GATE,
    "chunked": LOG_GATE,  # K3's bound declared: product diagonals
    "chunked_unbounded": LOG_GATE,  # no bound declared: pairwise diagonals (Kimi Linear's path)
    "fla_naive_chunk": LOG_GATE,
    "tokamax_xla": RAW_GATE,
    "tokamax_xla_chunked": RAW_GATE,
}


def tokamax_form(implementation: str) -> Callable[..., jax.Array]:
    """tokamax's KDA on the raw gate (activated in the kernel), k3text layouts in and out."""
    def run(q, k, v, f, beta, a_log, dt_bias):
        return tokamax_kda(q, k, v, f, beta, implementation=implementation, a_log=a_log,
                           dt_bias=dt_bias, lower_bound=KDA_LOWER_BOUND)[0]
    return jax.jit(run)


def kda_prefill_form(implementation: str, **options: Any) -> Callable[..., jax.Array]:
    return jax.jit(lambda *a: kda.prefill(*a, implementation=implementation, **options)[0])


def matmul_rate() -> float:
    """FLOP/s of a 2048^3 float32 matmul on this machine, in this process (median of 5)."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048)), jnp.float32)
    product = jax.jit(jnp.matmul)
    product(a, a).block_until_ready()
    seconds = benchlib.median(timed(lambda: product(a, a).block_until_ready())[0]
                              for _ in range(5))
    return 2 * 2048**3 / seconds


def kda_flops(form: str, b: int, t: int, chunk: int | None = None) -> float | None:
    """Floating-point operations a KDA form needs, counted from its algorithm (XLA's cost analysis
    does not count loop bodies, so it reports nearly nothing for a scan): the per-token
    recurrences about 7 K V per token and head (decay, k . S, the rank-1 write, q . S); k3text's
    chunked form its products per chunk and head (`ops/kda/chunked.py`: the diagonal leaves, the
    splits below them, the leaves' and splits' inverse, U and W from the inverse, the hand-off
    and the output). None for forms whose algorithm is not ours to count."""
    k = v = KDA_HEAD_DIM
    heads = b * KDA_HEADS
    chunk = chunk or inspect.signature(kda.prefill).parameters["chunk_size"].default
    if form in ("recurrent", "tokamax_xla"):
        return 7.0 * k * v * t * heads
    if not form.startswith("chunked"):
        return None
    leaf = PAIRWISE_LEAF if form == "chunked_unbounded" else PRODUCT_LEAF
    leaves = chunk // leaf
    macs = 2 * chunk * leaf * k  # diagonal leaves, q and k rows (pairwise or products alike)
    macs += leaves * 2 * leaf**3 * max(0, leaf.bit_length() - 2)  # leaves' inverse, by powers
    width, blocks = leaf, leaves // 2
    while blocks:  # each split: q and k rows against keys, and T2 L21 T1
        macs += blocks * (2 * width * width * k + 2 * width**3)
        width, blocks = 2 * width, blocks // 2
    macs += 2 * chunk * chunk * (k + v)  # [W | U] from the inverse, A_qk [W | U]
    macs += 3 * chunk * k * v  # the hand-off: [W; q Gamma - A_qk W] S, k^T u
    return 2.0 * macs * -(-t // chunk) * heads


def kda_section(quick: bool) -> list[Row]:
    cases, repeats = (KDA_CASES_QUICK, 3) if quick else (KDA_CASES, 9)
    naive = load_fla_naive()
    jitted = {
        "recurrent": kda_prefill_form("recurrent"),
        "chunked": kda_prefill_form("chunked", gate_lower_bound=KDA_LOWER_BOUND),
        "chunked_unbounded": kda_prefill_form("chunked"),
        "tokamax_xla": tokamax_form("xla"),
        "tokamax_xla_chunked": tokamax_form("xla_chunked"),
    }
    peak = matmul_rate()
    # One output per form and case (the warm-up's) is kept for the comparison; the timed runs'
    # are freed at once, as a model's layers free theirs: outputs all kept alive would make
    # every call write its output into freshly mapped pages.
    first: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> float:
        # Each timed call of an XLA form follows untimed calls of the same form (for
        # KDA_SETTLE_S, or one call where a call takes longer), as a model's layers follow one
        # another: right after another form's long call (fla's single-threaded torch call, the
        # recurrence) XLA:CPU's worker threads had sat idle, and the chunked form's next calls
        # ran slower (benchmarks/README.md). fla's torch form uses none of those threads.
        start = time.perf_counter()
        while name in jitted and time.perf_counter() - start < KDA_SETTLE_S:
            fn()
        seconds, out = timed(fn)
        first.setdefault(name, out)
        return seconds

    rows = []
    for b, t in cases:
        inputs = kda_inputs(b, t)
        forms, flops = {}, {}
        for name, fn in jitted.items():
            device = [jax.device_put(inputs[a]) for a in KDA_FORMS[name]]
            forms[name] = lambda fn=fn, d=device: fn(*d).block_until_ready()
            flops[name] = kda_flops(name, b, t)
        tensors = [torch.from_numpy(inputs[a]) for a in KDA_FORMS["fla_naive_chunk"]]
        forms["fla_naive_chunk"] = lambda x=tensors: naive.naive_chunk_kda(
            *x, scale=1.0, chunk_size=64)[0]
        first.clear()
        results = interleaved({"core_round_trip": benchlib.core_round_trip_ns,
                               **{name: lambda n=name, fn=fn: run(n, fn)
                                  for name, fn in forms.items()}},
                              repeats)
        trips = [ns for ns in results["core_round_trip"] if ns is not None]
        round_trip = benchlib.median(trips) if trips else None
        reference = np.asarray(first["recurrent"])
        for name in KDA_FORMS:
            runs = results[name]
            seconds = benchlib.median(runs)
            rate = flops.get(name) and flops[name] / seconds
            rows.append({"section": "kda", "form": name, "batch": b, "T": t,
                         "heads": KDA_HEADS, "head_dim": KDA_HEAD_DIM, "ms": seconds * 1e3,
                         "fastest_ms": min(runs) * 1e3,
                         "runs_ms": [run_s * 1e3 for run_s in runs],
                         "core_round_trip_ns": round_trip,
                         "core_round_trips_ns": results["core_round_trip"],
                         "tokens_per_s": b * t / seconds,
                         "gflop": flops.get(name) and flops[name] / 1e9,
                         "gflop_per_s": rate and rate / 1e9,
                         "share_of_matmul_rate": rate and rate / peak,
                         "matmul_gflop_per_s": peak / 1e9,
                         "max_abs_diff_vs_recurrent": float(np.max(np.abs(
                             np.asarray(first[name]) - reference)))})
    by = {(r["form"], r["batch"], r["T"]): r for r in rows}
    others = [f for f in KDA_FORMS if f != "recurrent"]
    print(table(["B", "T", *(f"{f} ms" for f in KDA_FORMS),
                 *(f"recurrent / {f}" for f in others), "max |diff|", "core round trip"],
                [[str(b), str(t), *(f"{by[f, b, t]['ms']:.2f}" for f in KDA_FORMS),
                  *(f"{ratio(by['recurrent', b, t]['ms'], by[f, b, t]['ms'])} ("
                    f"{ratio(by['recurrent', b, t]['fastest_ms'], by[f, b, t]['fastest_ms'])})"
                    for f in others),
                  f"{max(by[f, b, t]['max_abs_diff_vs_recurrent'] for f in KDA_FORMS):.1e}",
                  benchlib.round_trip_text(by["recurrent", b, t]["core_round_trip_ns"])]
                 for b, t in cases],
                title=f"[{STACK}] "
                      f"(b) KDA prefill, H={KDA_HEADS} K=V={KDA_HEAD_DIM}, fp32, K3's gate "
                      f"(lower bound {KDA_LOWER_BOUND}); speed-ups over the per-token recurrence, "
                      f"of the median run (of the fastest run); jit compile excluded; the "
                      f"cores' round trip (benchlib.core_round_trip_ns) is the median of the "
                      f"rounds'"))
    xla_forms = [f for f in KDA_FORMS if f != "fla_naive_chunk"]
    print(table(["B", "T", *(f"{f} GFLOP/s" for f in xla_forms)],
                [[str(b), str(t), *(
                    f"{by[f, b, t]['gflop_per_s']:.1f} ({by[f, b, t]['share_of_matmul_rate']:.0%})"
                    if by[f, b, t]["gflop_per_s"] else "-" for f in xla_forms)]
                 for b, t in cases],
                title=f"[{STACK}] "
                      f"    achieved rate (each form's FLOPs counted from its algorithm, see "
                      f"kda_flops, / time) and its share of a 2048^3 fp32 matmul measured here: "
                      f"{peak / 1e9:.1f} GFLOP/s"))
    return rows


# --------------------------------------------------------------------------------------------
# Whole-loop jit vs jit-per-step.
# --------------------------------------------------------------------------------------------


def step_loop(engine: Engine, prompt: list[int], sync: bool) -> tuple[float, list[int]]:
    """Decode with a Python loop over `Engine.step`: seconds for the steps after prefill (as
    `Generation.decode_seconds` counts them) and the tokens. `sync` reads each step's tokens
    back to the host before the next step, as a server checking EOS must."""
    cfg = engine.cfg
    key = jax.random.key(cfg.seed)
    logits, state = engine.prefill([prompt])
    tokens = sampling.sample(cfg, logits, key)[0]
    out = [tokens]
    t0 = time.perf_counter()
    for _ in range(cfg.max_decode_steps - 1):
        tokens, _, _, state = engine.step(tokens, state, key)
        if sync:
            np.asarray(tokens)
        out.append(tokens)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    return seconds, [int(np.asarray(t)[0]) for t in out]


def loop_section(quick: bool) -> list[Row]:
    steps, repeats = (16, 3) if quick else (64, 5)
    cfg = load_config(K3_TINY, [], max_decode_steps=steps, ignore_eos=True)
    engine, _ = build_engine(cfg)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, 16).tolist()
    # One warm-up call of a step loop compiles both Engine.step variants (the first step takes
    # the sampled prefill tokens, later ones the step's own outputs).
    out = interleaved({"loop": lambda: engine.decode_batch([prompt]),
                       "sync": lambda: step_loop(engine, prompt, sync=True),
                       "async": lambda: step_loop(engine, prompt, sync=False)}, repeats)
    loop_tps = benchlib.median(benchlib.loop_tokens_per_s(1, g.decode_steps, g.decode_seconds)
                               for g in out["loop"])
    tokens = out["loop"][0].output_ids[0]
    rows = [{"section": "loop", "form": "whole loop jitted (Engine.decode_batch)",
             "tokens_per_s": loop_tps, "ms_per_token": 1e3 / loop_tps, "vs_whole_loop": 1.0,
             "same_tokens": True}]
    for name, form in (("sync", "jit-per-step, host sync each step"),
                       ("async", "jit-per-step, async dispatch")):
        tps = (steps - 1) / benchlib.median(seconds for seconds, _ in out[name])
        rows.append({"section": "loop", "form": form, "tokens_per_s": tps,
                     "ms_per_token": 1e3 / tps, "vs_whole_loop": tps / loop_tps,
                     "same_tokens": out[name][0][1] == tokens})
    print(table(["form", "tokens/s", "ms/token", "whole loop speedup", "same tokens"],
                [[r["form"], f"{r['tokens_per_s']:.1f}", f"{r['ms_per_token']:.3f}",
                  ratio(loop_tps, r["tokens_per_s"]), str(r["same_tokens"])] for r in rows],
                title=f"[{STACK}] "
                      f"(c) decode loop shape, k3-tiny, batch 1, {steps} tokens, median of "
                      f"{repeats} interleaved runs; compile excluded"))
    return rows


# --------------------------------------------------------------------------------------------
# Time to first token at long prompts, per KDA prefill implementation.
# --------------------------------------------------------------------------------------------

# Earlier chunked KDA forms, read from git so they run in this process without living in the
# tree: `old`, the form the model ran before `k3text.ops.kda` became a package of
# implementations (a [C, C, K] pairwise-decay tensor per chunk and a 64-step triangular solve);
# `previous`, the first matmul form (16-token sub-chunks, every chunk's own work computed for the
# whole sequence before the hand-off scan).
EARLIER_KDA = {"old": ("665a2be", "src/k3text/ops/kda.py"),
               "previous": ("c3c0685", "src/k3text/ops/kda/chunked.py"),
               "halving": ("0d0b2b2", "src/k3text/ops/kda/chunked.py")}
TTFT_FORMS = ("old", "previous", "halving", "chunked", "recurrent")
TTFT_PROMPT = 2048


def earlier_kda_chunked(name: str) -> Callable[..., Any]:
    import types

    commit, path = EARLIER_KDA[name]
    shown = subprocess.run(["git", "-C", str(benchlib.ROOT), "show", f"{commit}:{path}"],
                           capture_output=True, text=True)
    if shown.returncode:
        raise ValueError(f"the ttft section reads the {name!r} KDA form from git history "
                         f"({commit}:{path}), which this checkout lacks (a shallow clone or an "
                         f"archive?): {shown.stderr.strip()}")
    source = shown.stdout
    module = types.ModuleType(f"k3text_{name}_kda")
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)

    def chunked(q, k, v, g, beta, initial_state=None, chunk_size=64, gate_lower_bound=None,
                precision=None):
        bound = {} if name == "old" else {"gate_lower_bound": gate_lower_bound}  # old: no bound
        return module.kda_chunked(q, k, v, g, beta, initial_state, chunk_size=chunk_size,
                                  precision=precision, **bound)
    return chunked


def ttft_engines(model: str) -> dict[str, Any]:
    """One engine per KDA prefill form (`TTFT_FORMS`), on the same weights: the earlier chunked
    forms (`EARLIER_KDA`, swapped in while their engine traces), `chunked` (this tree's) and
    `recurrent` (the per-token scan). Prompts up to TTFT_PROMPT tokens in 64-token prefill
    chunks."""
    lengths = dict(max_prefill_predict_length=TTFT_PROMPT,
                   max_target_length=TTFT_PROMPT + 64, per_device_batch_size=1)
    if model == "shipped":
        base = [str(CONFIG_DIR / "inference" / "cpu.yml")]
    else:
        base = [str(CONFIG_DIR / "models" / "kimi-linear-tiny.yml")]
    engines = {}
    for name in TTFT_FORMS:
        implementation = "recurrent" if name == "recurrent" else "chunked"
        cfg = load_config(base[0], base[1:] + [f"kda_implementation={implementation}"],
                          **lengths)
        engines[name] = build_engine(cfg)[0]
    return engines


def ttft_section(quick: bool) -> list[Row]:
    prompt_len, repeats = (512, 2) if quick else (TTFT_PROMPT, 3)
    earlier = {name: earlier_kda_chunked(name) for name in EARLIER_KDA}
    rows = []
    for model in ("shipped", "kimi-linear-tiny"):
        engines = ttft_engines(model)
        prompt = np.random.default_rng(0).integers(
            3, engines["old"].cfg.vocab_size, prompt_len).tolist()

        def first_token(engine, swap=None, prompt=prompt):
            # An earlier op is swapped in for the trace only; compiled programs keep it.
            saved = kda.kda_chunked
            if swap is not None:
                kda.kda_chunked = swap
            try:
                start = time.perf_counter()
                prefix = engine.prefill([prompt])
                jax.block_until_ready(prefix)
                return time.perf_counter() - start
            finally:
                kda.kda_chunked = saved

        runs = interleaved({name: (lambda e=e, n=name: first_token(e, earlier.get(n)))
                            for name, e in engines.items()}, repeats)
        base = benchlib.median(runs["old"])
        for name, seconds in runs.items():
            ms = benchlib.median(seconds) * 1e3
            rows.append({"section": "ttft", "model": model, "kda_prefill": name,
                         "prompt_tokens": prompt_len, "ttft_ms": ms,
                         "speedup_vs_old": base * 1e3 / ms})
    by = {(r["model"], r["kda_prefill"]): r for r in rows}
    print(table(["model", "prompt", *(f"{n} ms" for n in TTFT_FORMS),
                 *(f"old / {n}" for n in TTFT_FORMS[1:]), "halving / chunked"],
                [[m, str(prompt_len), *(f"{by[m, n]['ttft_ms']:.0f}" for n in TTFT_FORMS),
                  *(f"{by[m, n]['speedup_vs_old']:.2f}x" for n in TTFT_FORMS[1:]),
                  ratio(by[m, "halving"]["ttft_ms"], by[m, "chunked"]["ttft_ms"])]
                 for m in ("shipped", "kimi-linear-tiny")],
                title=f"[{STACK}] "
                      f"(e) time to first token (prefill of one {prompt_len}-token prompt in "
                      f"64-token chunks, batch 1) per KDA prefill form, median of "
                      f"{repeats} interleaved runs; compile excluded"))
    return rows


def plot_ttft(rows: Sequence[Row], ax: Any) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    bars(ax, models, {name: [r["ttft_ms"] for r in rows if r["kda_prefill"] == name]
                      for name in TTFT_FORMS}, "time to first token (ms)")


# --------------------------------------------------------------------------------------------
# MXFP4 decode step vs expert count.
# --------------------------------------------------------------------------------------------


def expert_bytes_per_layer(cfg: Config) -> int:
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
               for shape, dtype, _ in moe.expert_param_shapes(cfg).values())


def mxfp4_section(quick: bool) -> list[Row]:
    steps, repeats = (16, 3) if quick else (32, 5)
    cases = [(e, fmt, 0) for fmt in ("mxfp4", "bf16") for e in (64, 512)]
    if not quick:
        cases += [(e, "mxfp4", 1) for e in (64, 512)]
    engines = {}
    for case in cases:
        experts, fmt, threshold = case
        cfg = load_config(K3_TINY, [], num_experts=experts, expert_weight_format=fmt,
                          moe_dense_threshold=threshold, max_decode_steps=steps,
                          ignore_eos=True)
        engines[case] = build_engine(cfg)[0]
    prompt = [np.random.default_rng(0).integers(3, engines[cases[0]].cfg.vocab_size,
                                                8).tolist()]
    out = interleaved({case: lambda e=engine: e.decode_batch(prompt)
                       for case, engine in engines.items()}, repeats)
    rows = []
    for (experts, fmt, threshold), gens in out.items():
        cfg = engines[experts, fmt, threshold].cfg
        rows.append({"section": "mxfp4", "experts": experts,
                     "top_k": cfg.num_experts_per_token, "format": fmt,
                     "moe_dense_threshold": threshold, "path": expert_kernel(cfg, 1),
                     "step_ms": benchlib.median(g.decode_seconds / (g.decode_steps - 1)
                                                for g in gens) * 1e3,
                     "expert_mib_per_layer": expert_bytes_per_layer(cfg) / benchlib.MiB})
    by = {(r["experts"], r["format"], r["moe_dense_threshold"]): r["step_ms"] for r in rows}
    print(table(["experts", "format", "path", "step ms", "expert MiB/layer", "vs 64 experts",
                 "mxfp4 / bf16"],
                [[str(r["experts"]), r["format"], r["path"], f"{r['step_ms']:.3f}",
                  f"{r['expert_mib_per_layer']:.2f}",
                  ratio(r["step_ms"], by[64, r["format"], r["moe_dense_threshold"]]),
                  ratio(r["step_ms"], by[r["experts"], "bf16", 0])
                  if r["moe_dense_threshold"] == 0 else "-"] for r in rows],
                title=f"[{STACK}] "
                      f"(d) k3-tiny decode step, batch 1, top-{rows[0]['top_k']}, on-device "
                      f"loop of {steps} steps, median of {repeats} interleaved runs; compile "
                      f"excluded. bf16 = unpacked experts in weight_dtype (float32 here)"))
    return rows


# --------------------------------------------------------------------------------------------
# Decode over fixed slot rows vs over the paged pool.
# --------------------------------------------------------------------------------------------

PAGE_SIZES = (16, 64)


def paged_loop(engine: Engine, prompts: Sequence[list[int]], page: int, steps: int
               ) -> tuple[float, list[list[int]]]:
    """The prompts prefilled through the executor (one call, each sampling its first token),
    then `steps` - 1 decode steps of every sequence in one `Engine.paged_generate` call over
    pages reserved for them: (seconds per step, each prompt's tokens after the first)."""
    cfg, n = engine.cfg, len(prompts)
    executor = PagedExecutor(engine, n, n * cfg.max_target_length // page + 1, page, steps=1,
                             prefill_rows=n, prefill_budget=n * cfg.prefill_chunk_size)
    for i, prompt in enumerate(prompts):
        executor.submit(prompt, steps, engine.stop_ids(),
                        sampling.config_sampling(cfg, 1, [cfg.seed + i]))
    executor.step()  # every prompt admitted, its first token sampled
    for rid, prompt in enumerate(prompts):
        executor.pages.reserve(rid, len(prompt) + steps - 1)
    table = executor.pages.table(executor.occupant, executor.width)
    seconds, (executor.pool, rest) = timed(
        lambda: engine.paged_generate(executor.pool, table, steps - 1))
    return seconds / rest.steps, [rest.ids[i, :rest.count[i]].tolist() for i in range(n)]


def paged_section(quick: bool) -> list[Row]:
    steps, repeats = (16, 3) if quick else (64, 5)
    cfg = load_config(CONFIG_DIR / "inference" / "cpu.yml", [], max_decode_steps=steps,
                      ignore_eos=True)
    engine, _ = build_engine(cfg)
    prompts = [list(r.prompt_ids) for r in decode.collect_requests(cfg, load_tokenizer(
        cfg.tokenizer_type, tokenizer_file(cfg)))]

    def slots() -> tuple[float, list[list[int]]]:
        g = engine.decode_batch(prompts)
        return g.decode_seconds / (g.decode_steps - 1), [ids[1:] for ids in g.output_ids]

    runs = {"slots": slots} | {f"paged {page}": lambda page=page: paged_loop(
        engine, prompts, page, steps) for page in PAGE_SIZES}
    out = interleaved(runs, repeats)
    slot_s = benchlib.median(seconds for seconds, _ in out["slots"])
    rows = []
    for name, results in out.items():
        step_s = benchlib.median(seconds for seconds, _ in results)
        rows.append({"section": "paged", "cache": name, "batch": len(prompts),
                     "step_ms": step_s * 1e3, "tokens_per_s": len(prompts) / step_s,
                     "vs_slots": slot_s / step_s,
                     "same_tokens": results[0][1] == out["slots"][0][1]})
    print(table(["cache", "ms/step", "tokens/s", "speed vs slots", "same tokens"],
                [[r["cache"] if r["cache"] == "slots" else f"{r['cache']}-token pages",
                  f"{r['step_ms']:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['vs_slots']:.2f}x",
                  str(r["same_tokens"])] for r in rows],
                title=f"[{STACK}] (f) decode loop over slot rows vs the paged pool, shipped "
                      f"model, batch {len(prompts)}, {steps} tokens, median of {repeats} "
                      f"interleaved runs; compile excluded"))
    return rows


def plot_paged(rows: Sequence[Row], ax: Any) -> None:
    bars(ax, [r["cache"] for r in rows], {"ms/step": [r["step_ms"] for r in rows]},
         "decode step (ms)")


# --------------------------------------------------------------------------------------------
# Outputs.
# --------------------------------------------------------------------------------------------


def bars(ax: Any, labels: Sequence[str], series: Mapping[str, Sequence[float]], ylabel: str
         ) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(labels))], values, width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot_transformers(rows: Sequence[Row], ax: Any) -> None:
    bars(ax, [f"batch {r['batch']}\n{r['k3text_moe_kernel']}" for r in rows],
         {"k3text": [r["k3text_tokens_per_s"] for r in rows],
          "transformers": [r["transformers_tokens_per_s"] for r in rows]}, "decode tokens/s")


def plot_kda(rows: Sequence[Row], ax: Any) -> None:
    for form in dict.fromkeys(r["form"] for r in rows):
        mine = [r for r in rows if r["form"] == form and r["batch"] == 1]
        ax.plot([r["T"] for r in mine], [r["ms"] for r in mine], marker="o", label=form)
    ax.set(xscale="log", yscale="log", xlabel="T (tokens), batch 1", ylabel="ms per call")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def plot_loop(rows: Sequence[Row], ax: Any) -> None:
    bars(ax, [r["form"].replace(", ", "\n").replace(" (", "\n(") for r in rows],
         {"tokens/s": [r["tokens_per_s"] for r in rows]}, "decode tokens/s")


def plot_mxfp4(rows: Sequence[Row], ax: Any) -> None:
    series: dict[str, list[float]] = {}
    for r in rows:
        name = r["format"] + (" (ragged_dot forced)" if r["moe_dense_threshold"] else "")
        series.setdefault(name, []).append(r["step_ms"])
    bars(ax, [f"{e} experts" for e in dict.fromkeys(r["experts"] for r in rows)], series,
         "decode step (ms)")


def write(section: str, rows: list[Row], out: Path, machine: Mapping[str, Any]) -> None:
    header = {"machine": machine, "section": section}
    benchlib.write_jsonl(out / f"{section}.jsonl", header, rows)
    benchlib.write_csv(out / f"{section}.csv", machine, list(rows[0]), rows)
    plt = benchlib.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    SECTIONS[section][1](rows, ax)
    ax.set_title(f"baselines: {section}", fontsize=10)
    benchlib.save_figure(fig, out / f"{section}.png", machine)
    plt.close(fig)


# name -> (measure(quick) -> rows, plot(rows, axes))
SECTIONS: dict[str, tuple[Callable[[bool], list[Row]], Callable[[Sequence[Row], Any], None]]] = {
    "transformers": (transformers_section, plot_transformers),
    "kda": (kda_section, plot_kda),
    "loop": (loop_section, plot_loop),
    "mxfp4": (mxfp4_section, plot_mxfp4),
    "ttft": (ttft_section, plot_ttft),
    "paged": (paged_section, plot_paged),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "baselines")
    parser.add_argument("--force", action="store_true",
                        help="replace the results files of an earlier run in --out")
    parser.add_argument("--torch-threads", type=_positive_int, default=1,
                        help="torch intra-op threads (default 1: see the module docstring)")
    args = parser.parse_args(argv)
    try:  # before any section runs: where each one's results go, and the history `ttft` reads
        benchlib.check_outputs([args.out / f"{section}.{ext}" for section in args.only
                                for ext in ("jsonl", "csv", "png")], args.force)
        if "ttft" in args.only:
            for name in EARLIER_KDA:
                earlier_kda_chunked(name)
        if "kda" in args.only:
            load_fla_naive()
    except (ValueError, OSError) as e:  # OutputError included
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    torch.set_num_threads(args.torch_threads)
    machine = benchlib.machine(torch=torch.__version__, torch_threads=torch.get_num_threads())
    print(benchlib.machine_line(machine))
    written = []
    try:
        for section in args.only:
            seconds, rows = timed(lambda s=section: SECTIONS[s][0](args.quick))
            print(f"[{section}: {seconds:.0f} s]\n")
            write(section, rows, args.out, machine)
            written.append(section)
    except KeyboardInterrupt:  # each finished section's files are already whole on disk
        print(f"interrupted; sections written: {', '.join(written) or 'none'}", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # a results file not written (a full disk, or one
        # that appeared meanwhile: OutputError)
        print(f"error: {e}; sections written: {', '.join(written) or 'none'}", file=sys.stderr)
        return files.exit_status(e)
    print(f"wrote {', '.join(f'{s}.jsonl/.csv/.png' for s in args.only)} in {args.out}")
    return 0


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
