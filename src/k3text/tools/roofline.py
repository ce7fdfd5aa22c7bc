"""Roofline floors: `python -m k3text.tools.roofline CONFIG [key=value ...] [context=N]
[--hardware v7x|v6e] [--chips N] [--latent-proj-format bf16|mxfp4] [--mfu F,F] [--collectives]`
(default v7x, and the config's device count).

Decode is bound by the bytes read per step; prefill by FLOPs. Bytes are the abstract model's
stored bytes (its real dtypes: BF16 weights, fp32 gates, MXFP4 experts at 4.25 bits), FLOPs
2 x active parameters per token, both from `k3text.tools.inventory`. Assumptions, printed with
the results:

- weights are split evenly over all chips and every chip streams its share once per step (no
  replication, no cache reuse across steps): time = bytes / (chips x HBM bandwidth);
- routing is uniform and independent: a step of B tokens touches E(1 - (1 - k/E)^B) distinct
  experts per MoE layer (exact for uniformly random top-k sets; real routers are skewed and
  touch fewer);
- the embedding table is read one row per token; every other weight is read whole;
- the decode state each sequence reads and writes per step (KDA recurrent + conv state, the MLA
  cache up to `context`) is listed beside the weights, not folded into them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any

from k3text.config import Config, ConfigError
from k3text.models.state import bytes_per_sequence
from k3text.ops import mxfp4
from k3text.tools import cli, inventory
from k3text.tools.hardware import (
    HARDWARE,
    HARDWARE_HEADERS,
    V7X16_CALL_LATENCY,
    Hardware,
    hardware_rows,
)
from k3text.tools.inventory import COMPONENTS, Tensor
from k3text.tools.params import active_params, param_report
from k3text.tools.tables import flops, gb, table, tokens

# Batch-1 traffic is reported in three groups: the mixers, the routed experts a step hits,
# and everything else a step reads.
TRAFFIC_GROUPS = {
    "attention": ("kda", "mla"),
    "routed experts hit": ("routed_experts",),
    "rest": ("lm_head", "dense_mlp", "shared_experts", "router", "latent_proj", "norms",
             "embedding"),
}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTEXTS = (4096, 32768, 131072, 262144, 1048576)


# --------------------------------------------------------------------------------------------
# Decode bytes.
# --------------------------------------------------------------------------------------------


def expected_experts_hit(num_experts: int, top_k: int, batch: float) -> float:
    """Expected distinct experts one MoE layer touches for `batch` tokens under uniform,
    independent routing: each token misses a given expert with probability 1 - k/E."""
    if math.isinf(batch):
        return float(num_experts)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes(t: Tensor, latent_proj_format: str | None) -> int:
    """Bytes of a tensor as read: as stored, or the latent projections re-encoded as
    `latent_proj_format` (bf16, or mxfp4 packed + scales along the input dimension)."""
    if t.component != "latent_proj" or latent_proj_format is None:
        return t.nbytes
    if latent_proj_format == "bf16":
        return t.params * 2
    *lead, n_in, n_out = t.shape  # kernels are stored [in, out]; MXFP4 blocks run along `in`
    return mxfp4.mxfp4_bytes((*lead, n_out, n_in))


def decode_weight_bytes(cfg: Config, tensors: Sequence[Tensor], batch: float,
                        latent_proj_format: str | None = None) -> dict[str, float]:
    """{component: weight bytes one decode step of `batch` tokens reads}; batch = inf reads
    the whole model."""
    hit = (expected_experts_hit(cfg.num_experts, cfg.num_experts_per_token, batch)
           / cfg.num_experts if cfg.num_experts else 0.0)
    out: dict[str, float] = {}
    for t in tensors:
        b: float = weight_bytes(t, latent_proj_format)
        if t.component == "embedding" and not cfg.tie_word_embeddings:
            b *= min(batch, cfg.vocab_size) / cfg.vocab_size
        elif t.component == "routed_experts":
            b *= hit
        out[t.component] = out.get(t.component, 0.0) + b
    return out


def grouped(by_component: dict[str, float]) -> dict[str, float]:
    """{TRAFFIC_GROUPS group: bytes} from {component: bytes}."""
    return {g: sum(by_component.get(c, 0.0) for c in comps) for g, comps in TRAFFIC_GROUPS.items()}


def decode_state_traffic(cfg: Config, context: int) -> float:
    """Decode-state bytes one sequence moves per step: the KDA recurrent and conv state read and
    written back, the MLA latent cache read over `context` positions plus one written."""
    b = bytes_per_sequence(cfg)
    return 2 * (b["kda_recurrent"] + b["kda_conv"]) + (context + 1) * b["mla_cache_per_token"]


# --------------------------------------------------------------------------------------------
# FLOPs.
# --------------------------------------------------------------------------------------------


def weight_flops_per_token(cfg: Config, tensors: Sequence[Tensor]) -> int:
    """2 x active parameters: one multiply-add per weight a token uses (attention over the
    context and the KDA recurrence excluded)."""
    return 2 * active_params(cfg, param_report(cfg, tensors))


def mla_decode_attention_flops(cfg: Config, context: int) -> dict[str, float]:
    """FLOPs one decoded token spends attending over `context` cached positions in the absorbed
    MLA form, per part: scores against the latent c_kv, scores against the shared k_r tail,
    and the value sum over the latent. The absorption matmuls are weights (k_b_proj,
    v_b_proj) and already in 2 x active."""
    per = 2 * cfg.structure.num_mla * cfg.num_attention_heads * context
    return {"scores_latent": per * cfg.kv_lora_rank,
            "scores_rope_tail": per * cfg.qk_rope_head_dim,
            "values": per * cfg.kv_lora_rank}


def mla_prefill_attention_flops(cfg: Config, context: int) -> float:
    """Mean FLOPs per prompt token of materialised causal MLA attention over a `context`-token
    prompt: scores over qk_nope + qk_rope, values over v_head_dim, (context + 1) / 2 keys."""
    width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    return 2 * cfg.structure.num_mla * cfg.num_attention_heads * width * (context + 1) / 2


def kda_recurrence_flops(cfg: Config) -> int:
    """FLOPs of the single-step KDA update per token, constant in context. Per head: the decay
    S * exp(g) (K*V), k^T S (2*K*V), the rank-1 delta update (2*K*V) and q^T S (2*K*V)."""
    lin = cfg.linear_attn_config
    return cfg.structure.num_kda * lin.num_heads * 7 * lin.head_dim * lin.head_dim


def attention_crossover(cfg: Config, weight_flops: float,
                        parts: Sequence[str] | None = None) -> float:
    """Context at which absorbed MLA attention (the given parts, default all) costs as many
    FLOPs per decoded token as the weights do (`weight_flops`, 2 x active)."""
    per_position = mla_decode_attention_flops(cfg, 1)
    coefficient = sum(v for k, v in per_position.items() if parts is None or k in parts)
    return weight_flops / coefficient if coefficient else math.inf


# --------------------------------------------------------------------------------------------
# Floors.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Machine:
    hardware: Hardware
    chips: int

    @property
    def bandwidth(self) -> float:
        return self.hardware.hbm_bandwidth * self.chips

    def peak_flops(self, fp8: bool = False) -> float:
        return (self.hardware.fp8_flops if fp8 else self.hardware.bf16_flops) * self.chips

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / self.bandwidth

    def compute_seconds(self, n_flops: float, fp8: bool = False) -> float:
        return n_flops / self.peak_flops(fp8)


def prefill_tokens_per_second(machine: Machine, weight_flops: float, mfu: float,
                              fp8: bool = False) -> float:
    """Prefill throughput at a model-FLOPs utilisation, attention over the prompt excluded."""
    return machine.peak_flops(fp8) * mfu / weight_flops


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f}"


def _batch1_table(cfg: Config, tensors: Sequence[Tensor], machine: Machine,
                  latent: str | None) -> str:
    one = decode_weight_bytes(cfg, tensors, 1, latent)
    rows = []
    for group, components in TRAFFIC_GROUPS.items():
        present = [c for c in components if c in one]
        rows.append([group, gb(sum(one[c] for c in present))])
        if len(present) > 1:
            rows += [[f"  {COMPONENTS[c]}", gb(one[c])] for c in present]
    total = sum(one.values())
    rows += [("-",), ["weights", gb(total)],
             ["HBM floor", f"{_ms(machine.memory_seconds(total))} ms"]]
    return table(("decode step, batch 1", "bytes read"), rows,
                 title="Decode weight traffic at batch 1 (GB = 1e9 B; embedding: one row)")


def _ladder_table(cfg: Config, tensors: Sequence[Tensor], machine: Machine,
                  latent: str | None, context: int, weight_flops: float) -> str:
    flops_token = (weight_flops + sum(mla_decode_attention_flops(cfg, context).values())
                   + kda_recurrence_flops(cfg))
    state = decode_state_traffic(cfg, context)
    rows = []
    for batch in (*BATCHES, math.inf):
        weights = sum(decode_weight_bytes(cfg, tensors, batch, latent).values())
        hit = f"{expected_experts_hit(cfg.num_experts, cfg.num_experts_per_token, batch):.1f}"
        if math.isinf(batch):
            rows.append(["whole model", hit, gb(weights), "-",
                         _ms(machine.memory_seconds(weights)), "-", "-", "-"])
            continue
        memory = machine.memory_seconds(weights + batch * state)
        compute = machine.compute_seconds(batch * flops_token)
        step = max(memory, compute)
        rows.append([str(batch), hit, gb(weights), gb(batch * state), _ms(memory),
                     _ms(compute), _ms(step), tokens(batch / step)])
    return table(("batch", "experts/layer", "weights", "state", "HBM ms", "bf16 ms", "step ms",
                  "tok/s"), rows,
                 title=f"Decode step floors; state = KDA recurrent + conv read and written, MLA "
                       f"cache read at context={context:,}")


def _prefill_table(machine: Machine, weight_flops: float, mfus: Sequence[float]) -> str:
    rows = [[name, *(tokens(prefill_tokens_per_second(machine, weight_flops, m, fp8))
                     for m in mfus)] for name, fp8 in (("bf16", False), ("fp8", True))]
    return table(("prefill tok/s", *(f"MFU {m:.0%}" for m in mfus)), rows,
                 title=f"Prefill: {flops(weight_flops)} per token = 2 x active parameters "
                       f"(attention over the prompt excluded)")


def _attention_table(cfg: Config, weights: float) -> str:
    rows = []
    for context in CONTEXTS:
        mla = mla_decode_attention_flops(cfg, context)
        total = sum(mla.values())
        rows.append([tokens(context), flops(total), flops(mla["scores_rope_tail"]),
                     flops(mla_prefill_attention_flops(cfg, context)),
                     flops(kda_recurrence_flops(cfg)), f"{total / weights:.2f}x"])
    out = table(("context", "MLA decode", "of it k_r tail", "MLA prefill (mean)",
                 "KDA recurrence", "decode / weights"), rows,
                title="Attention FLOPs per token vs context (absorbed MLA decode; materialised "
                      "causal prefill; KDA constant)")
    full = attention_crossover(cfg, weights)
    latent_only = attention_crossover(cfg, weights, ("scores_latent", "values"))
    return (f"{out}\nMLA decode attention overtakes the weight FLOPs ({flops(weights)}) at "
            f"{tokens(full)} tokens of context ({tokens(latent_only)} without the "
            f"{cfg.qk_rope_head_dim}-wide k_r tail)")


def _long_context_table(cfg: Config, machine: Machine, context: int) -> str:
    """Per decode step, the MLA cache read at `context` for one sequence with the cache split
    over the `cache_seq` devices (each reads its share) and replicated (every device reads all
    of it), and the split cache's merge: per MLA layer a query all-gather, a max all-reduce and
    one all-reduce of the merged sums, priced with the v7x-16 per-call latency bands."""
    shards = cfg.axis_size("cache_seq")
    devices = machine.chips * machine.hardware.devices_per_chip
    per_device_bw = machine.bandwidth / devices
    cache = context * bytes_per_sequence(cfg)["mla_cache_per_token"]
    n_mla = cfg.structure.num_mla
    calls = {"all-gather": n_mla, "all-reduce": 2 * n_mla}
    low = sum(n * V7X16_CALL_LATENCY[k].low for k, n in calls.items())
    high = sum(n * V7X16_CALL_LATENCY[k].high for k, n in calls.items())
    merge = cfg.num_attention_heads * (cfg.mla_latent_dim + 1) * 4  # fp32 sums per sequence
    rows = [
        [f"split over {shards} devices (cache_seq)", gb(cache / shards),
         _ms(cache / shards / per_device_bw), f"{3 * n_mla} per step, {merge:,} B each "
         f"per sequence", f"{_ms(low)}-{_ms(high)}"],
        [f"replicated on {devices} devices", gb(cache), _ms(cache / per_device_bw), "none",
         "-"],
    ]
    return table(("MLA cache", "read per device per sequence", "HBM ms", "merge collectives",
                  "merge ms"), rows,
                 title=f"MLA decode attention at context={context:,}, one sequence per step "
                       f"(latency bands: K3 report §12.1)")


def render(cfg: Config, machine: Machine, latent: str | None, context: int,
           mfus: Sequence[float]) -> str:
    tensors = inventory.inventory(cfg)
    stored = {t.dtype.name for t in tensors if t.component == "latent_proj"}
    latent_note = (f"latent projections as stored ({', '.join(sorted(stored))})"
                   if latent is None else f"latent projections counted as {latent}")
    h = machine.hardware
    header = (f"{cfg.model_name or 'model'} on {machine.chips} x {h.name}: "
              f"{machine.bandwidth / 1e12:,.1f} TB/s HBM, {machine.peak_flops() / 1e15:,.1f} "
              f"PFLOPS bf16, {machine.peak_flops(True) / 1e15:,.1f} PFLOPS fp8\n"
              f"assumptions: weights split evenly over the chips; uniform independent routing "
              f"(E(1-(1-k/E)^B) experts per MoE layer); {latent_note}")
    weight_flops = weight_flops_per_token(cfg, tensors)
    return "\n\n".join([
        header,
        table(HARDWARE_HEADERS, hardware_rows(), title="Hardware (per chip)"),
        _batch1_table(cfg, tensors, machine, latent),
        _ladder_table(cfg, tensors, machine, latent, context, weight_flops),
        _prefill_table(machine, weight_flops, mfus),
        _attention_table(cfg, weight_flops),
        _long_context_table(cfg, machine, context),
    ])


def communication_table(report: Any, floor_seconds: float, batch: int) -> str:
    """A compiled decode step's collectives priced with the v7x-16 per-call latency bands,
    beside the batch-1 HBM floor."""
    counts = report.count_by_kind()
    rows, low, high = [], 0.0, 0.0
    for kind, n in sorted(counts.items()):
        band = V7X16_CALL_LATENCY[kind]
        low, high = low + n * band.low, high + n * band.high
        rows.append([kind, f"{n:,}", f"{band.low * 1e6:.2f}-{band.high * 1e6:.2f}",
                     band.basis, f"{_ms(n * band.low)}-{_ms(n * band.high)}"])
    rows += [("-",), ["collectives", f"{report.count:,}", "", "",
                      f"{_ms(low)}-{_ms(high)}"],
             ["HBM floor", "", "", "", _ms(floor_seconds)],
             ["ratio", "", "", "", f"{low / floor_seconds:.1f}-{high / floor_seconds:.1f}x"]]
    return table(("collective", "per step", "us per call", "latency basis (K3 report §12.1)",
                  "ms per step"), rows,
                 title=f"Decode step communication at batch {batch}, counted from the compiled "
                       f"program ({report.partitioned_bytes / 1e6:,.2f} MB per device at the "
                       f"partitioner's dtypes); per-call latencies are the report's synthetic "
                       f"v7x-16 figures, a band, not a measurement of this program")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected fractions in (0, 1] like 0.3,0.45, got "
                                         f"{text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    keys = {"context": "tokens per sequence for the state traffic (default: max_target_length)"}
    p = cli.parser("k3text.tools.roofline", __doc__, keys)
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="v7x")
    p.add_argument("--chips", type=_positive_int,
                   help="chips (default: the config's devices / devices per chip)")
    p.add_argument("--latent-proj-format", choices=("bf16", "mxfp4"),
                   help="count the LatentMoE projections in this format (default: as stored)")
    p.add_argument("--mfu", type=_fractions, default=(0.3, 0.45),
                   help="comma-separated utilisations for the prefill table (default 0.3,0.45)")
    p.add_argument("--collectives", action="store_true",
                   help="also compile the config's decode step on fake CPU devices and price "
                        "its collectives per step with the v7x-16 per-call latency band")

    def body(args: argparse.Namespace, cfg: Config, values: dict[str, int]) -> str:
        if values.get("context", 1) < 1:
            raise ConfigError(f"context={values['context']}: must be at least 1")
        hardware = HARDWARE[args.hardware]
        chips = args.chips or max(1, cfg.num_devices // hardware.devices_per_chip)
        machine = Machine(hardware, chips)
        text = render(cfg, machine, args.latent_proj_format,
                      values.get("context", cfg.max_target_length), args.mfu)
        if args.collectives:
            import jax

            from k3text.tools import compile_check

            try:  # fake CPU devices for the config's mesh, unless a backend already started
                jax.config.update("jax_num_cpu_devices", max(cfg.num_devices, 1))
            except RuntimeError:
                pass  # then the mesh takes the devices there are, or says how many it needs
            report = compile_check.decode_step_collectives(cfg)
            floor = machine.memory_seconds(sum(decode_weight_bytes(
                cfg, inventory.inventory(cfg), 1, args.latent_proj_format).values()))
            text += "\n\n" + communication_table(report, floor, cfg.global_batch_size)
        return text

    return cli.run(p, argv, body, tuple(keys))


if __name__ == "__main__":
    sys.exit(main())
