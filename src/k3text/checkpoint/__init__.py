"""Checkpoints: Hugging Face safetensors in (`convert`, `hf`, `names`), k3text checkpoints out
and back (`store`): `load_model(cfg, ctx, path)` restores a model straight into its shardings,
`save_model(cfg, model, out_dir)` writes one."""

from k3text.checkpoint.store import load_model, save_model

__all__ = ["load_model", "save_model"]
