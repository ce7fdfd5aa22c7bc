"""Parameter counts: `python -m k3text.tools.params CONFIG [key=value ...]`.

Total and active parameters, and a per-component table, counted on the abstract model the stack
builds (`k3text.tools.inventory`), not from a formula. Parameters are logical weights (an MXFP4
packed byte holds two, its scale bytes none); bytes are as stored.

Active parameters (those one token multiplies through) = total
  - the embedding table (a row lookup; kept when it is tied to the LM head)
  - the routed experts a token does not choose: num_experts - num_experts_per_token per MoE layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from k3text.config import Config
from k3text.tools import cli, inventory
from k3text.tools.inventory import COMPONENTS, Tensor
from k3text.tools.tables import count, gib, nbytes, table


@dataclasses.dataclass(frozen=True)
class ParamReport:
    params: dict[str, int]  # component -> logical parameters
    nbytes: dict[str, int]  # component -> bytes as stored
    dtypes: dict[str, tuple[str, ...]]  # component -> stored dtypes
    layers: dict[str, int]  # per-layer component -> layers holding it
    bytes_by_dtype: dict[str, int]
    experts: int  # routed experts of the whole model (num_experts x MoE layers)

    @property
    def total(self) -> int:
        return sum(self.params.values())

    @property
    def stored_bytes(self) -> int:
        return sum(self.nbytes.values())

    def per_layer(self, component: str) -> int:
        """Parameters of one layer's `component` (all layers of a kind are identical)."""
        return self.params[component] // self.layers[component]

    @property
    def one_routed_expert(self) -> int:
        return self.params["routed_experts"] // self.experts


def param_report(cfg: Config, tensors: Sequence[Tensor] | None = None) -> ParamReport:
    tensors = inventory.inventory(cfg) if tensors is None else tensors
    params = inventory.sum_by(tensors, lambda t: t.component, lambda t: t.params)
    layers = {c: n for c, n in inventory.layer_counts(cfg).items() if c in params}
    return ParamReport(
        params=params,
        nbytes=inventory.sum_by(tensors, lambda t: t.component, lambda t: t.nbytes),
        dtypes={c: tuple(sorted({t.dtype.name for t in tensors if t.component == c}))
                for c in params},
        layers=layers,
        bytes_by_dtype=inventory.sum_by(tensors, lambda t: t.dtype.name, lambda t: t.nbytes),
        experts=cfg.num_experts * inventory.moe_layers(cfg),
    )


def inactive_routed(cfg: Config, report: ParamReport) -> int:
    """Routed-expert parameters a token does not touch (every MoE layer skips E - k experts)."""
    if not report.experts:
        return 0
    skipped = cfg.num_experts - cfg.num_experts_per_token
    return report.params["routed_experts"] // cfg.num_experts * skipped


def active_params(cfg: Config, report: ParamReport) -> int:
    embedding = 0 if cfg.tie_word_embeddings else report.params["embedding"]
    return report.total - embedding - inactive_routed(cfg, report)


def render(cfg: Config, report: ParamReport) -> str:
    total = report.total
    rows = []
    for c, n in inventory.ordered(report.params):
        per_layer = count(report.per_layer(c)) if c in report.layers else "-"
        rows.append([COMPONENTS[c], str(report.layers.get(c, "-")), per_layer, count(n),
                     nbytes(report.nbytes[c]), ",".join(report.dtypes[c]),
                     f"{100 * n / total:.2f}%"])
        if c == "routed_experts":
            expert_bytes = report.nbytes[c] // report.experts
            rows.append(["  one routed expert", "", "", count(report.one_routed_expert),
                         nbytes(expert_bytes), "", ""])
    active = active_params(cfg, report)
    rows += [("-",),
             ["total", "", "", count(total), nbytes(report.stored_bytes), "", "100.00%"],
             ["active per token", "", "", count(active), "", "", f"{100 * active / total:.2f}%"]]
    main = table(("component", "layers", "per layer", "params", "stored", "dtypes", "share"),
                 rows, title=f"{cfg.model_name or 'model'}: parameters of the abstract model "
                             f"(an MXFP4 packed byte holds 2 parameters, its scales 0)")
    dtype_rows = [[d, gib(b)] for d, b in sorted(report.bytes_by_dtype.items())]
    by_dtype = table(("stored dtype", "bytes"), dtype_rows)
    excluded = [] if cfg.tie_word_embeddings else ["embedding table"]
    if report.experts:
        excluded.append(f"{cfg.num_experts - cfg.num_experts_per_token} unchosen routed experts "
                        f"x {report.layers['routed_experts']} MoE layers")
    notes = (f"total  {total:,} parameters\n"
             f"active {active:,} = total" + "".join(f" - {e}" for e in excluded))
    return "\n\n".join([main, by_dtype, notes])


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("k3text.tools.params", __doc__)

    def body(args: argparse.Namespace, cfg: Config, _: dict[str, int]) -> str:
        return render(cfg, param_report(cfg))

    return cli.run(p, argv, body)


if __name__ == "__main__":
    sys.exit(main())
