"""Synthetic Hugging Face checkpoints of any model config (tools/convert/make_tiny_checkpoint.py).

    python tools/convert/make_tiny_checkpoint.py --model-config YML --out DIR
        [--layout k3|moonshot|transformers] [--seed N] [--shards N] [--force]

The weights are k3text's own fan-in scaled random initialisation (`Init(seed)`), so a test can
build the same model in memory from the same config and seed and expect the converted
checkpoint to decode identically. They go through the reverse name table into a released
layout: by default K3's for MXFP4 experts (`language_model.` names, `text_config` with the
compressed-tensors `quantization_config`, experts as `weight_packed` / `weight_scale`, `A_log`
padded to head_dim, two vision tensors to drop), else Moonshot's Kimi Linear layout; written as
sharded safetensors plus index, each shard in the reference writer's order (by dtype, then
name), so layers interleave the way real checkpoints do.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx

from k3text import files
from k3text.checkpoint import hf, hf_config, names, store
from k3text.checkpoint.safetensors_io import save_sharded
from k3text.config import Config, load_config
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder

# What the K3 layout carries besides the text model (dropped by the converter).
VISION_TENSORS = {
    "vision_tower.encoder.blocks.0.attn.wqkv.weight": (24, 8),
    "mm_projector.proj.0.weight": (8, 8),
}


def random_params(cfg: Config, seed: int) -> dict[hf.Path, np.ndarray]:
    """The flat parameters of `Decoder(cfg, Init(seed))` as host arrays."""
    state = nnx.state(Decoder(cfg, Init(seed)))
    return {tuple(str(p) for p in path): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(state)}


def hf_checkpoint_tensors(cfg: Config, params: dict[hf.Path, np.ndarray], layout: str,
                          seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of a `layout` checkpoint holding `params` (vision stubs for K3)."""
    tensors = dict(hf.hf_tensors(cfg, params, layout))
    if layout == "k3":
        rng = np.random.default_rng(seed)
        for name, shape in VISION_TENSORS.items():
            tensors[name] = rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
    return tensors


def _split(tensors: dict[str, np.ndarray], shards: int) -> list[dict[str, np.ndarray]]:
    """Consecutive groups of roughly equal bytes."""
    total = sum(t.nbytes for t in tensors.values())
    groups: list[dict[str, np.ndarray]] = [{} for _ in range(shards)]
    seen = 0
    for name, tensor in tensors.items():
        groups[min(shards - 1, seen * shards // max(total, 1))][name] = tensor
        seen += tensor.nbytes
    return [g for g in groups if g]


def write_checkpoint(cfg: Config, out: str | Path, layout: str | None = None, seed: int = 0,
                     shards: int = 2, force: bool = False) -> str:
    """Write a random `layout` checkpoint of `cfg`'s model to `out`; returns the layout."""
    layout = layout or names.default_layout(cfg)
    # The output is checked (an existing one needs `force`) before the model is built.
    with store.staged_directory(out, force, "--force") as (staging, _):
        tensors = hf_checkpoint_tensors(cfg, random_params(cfg, seed), layout, seed)
        save_sharded(_split(tensors, shards), staging)
        (staging / "config.json").write_text(
            json.dumps(hf_config.config_json(cfg, layout), indent=2) + "\n")
    return layout


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make_tiny_checkpoint",
        description="Write a random Hugging Face checkpoint of a k3text model config.")
    parser.add_argument("--model-config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", choices=names.LAYOUTS,
                        help="default: k3 for MXFP4 experts, else moonshot")
    parser.add_argument("--seed", type=_at_least(0), default=0, help="Init seed of the weights")
    parser.add_argument("--shards", type=_at_least(1), default=2, help="safetensors files")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    status = _write_main(args)
    files.quiet_from_here()  # the command has said how it ended: nothing may print after it
    return status


def _write_main(args: argparse.Namespace) -> int:
    """`main` once its flags are parsed: the exit status, with the one line that explains it."""
    try:  # a signal unwinds, so the staging directory is removed
        with files.unwinding_signals():
            cfg = load_config(args.model_config)
            layout = write_checkpoint(cfg, args.out, args.layout, args.seed, args.shards,
                                      args.force)
            with files.uninterrupted():  # the checkpoint is complete: say so whatever arrives
                print(f"wrote {args.out}: {layout} layout of "
                      f"{cfg.model_name or args.model_config}")
            return 0
    except (ValueError, OSError) as e:  # CheckpointError, ConfigError, OutputError included
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    except (KeyboardInterrupt, SystemExit) as e:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else (e.code or 1)


if __name__ == "__main__":
    sys.exit(main())
