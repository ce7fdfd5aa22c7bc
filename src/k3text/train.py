"""Training small models on CPU: `python -m k3text.train CONFIG [key=value ...]`.

config -> tokenizer (BPE trained on the corpus when `tokenizer_path` does not exist yet) -> grain
batches of packed documents (`k3text.data`) -> a jitted AdamW step (warmup, cosine decay, global
norm clipping) on next-token cross-entropy through `Decoder.forward`, whose chunked KDA is
differentiated by plain autodiff -> Orbax checkpoints of parameters, optimizer state and data
position every `checkpoint_every` steps, from the latest of which a run resumes -> at the end,
the model exported with `save_model` to `export_path`.

Routed experts train in full precision whatever `expert_weight_format` says (packed MXFP4 bytes
have no gradient). The export writes the model config as given, so `expert_weight_format: mxfp4`
quantises them once, there.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from k3text import corpus, files
from k3text.checkpoint import save_model
from k3text.checkpoint.store import (
    CheckpointError,
    check_replaceable,
    root_cause,
    stderr_kept_for_success,
)
from k3text.config import MESH_AXES, Config, ConfigError
from k3text.data import token_batches
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.tokenizer import (
    DEFAULT_SPECIAL_TOKENS,
    Tokenizer,
    load_tokenizer,
    save_tiktoken_bpe,
    train_bpe,
)
from k3text.tools import cli

log = logging.getLogger("k3text.train")


class TrainState(NamedTuple):
    params: nnx.State
    opt_state: optax.OptState


# (state, rows [batch, seq_len + 1]) -> (next state, loss)
TrainStep = Callable[[TrainState, jax.Array], tuple[TrainState, jax.Array]]


class TrainResult(NamedTuple):
    params: nnx.State  # the trained parameters (routed experts in full precision)
    losses: list[float]  # the loss of every step this call ran


# --------------------------------------------------------------------------------------------
# Tokenizer and data.
# --------------------------------------------------------------------------------------------


def corpus_documents(cfg: Config) -> list[str]:
    return corpus.documents(cfg.corpus_seed)


def train_tokenizer(cfg: Config) -> None:
    """Train BPE on the corpus and write it to `tokenizer_path`, leaving room after the ranks
    for the special tokens (bos, eos, pad) so the vocabulary is exactly `vocab_size`."""
    ranks = train_bpe("\n".join(corpus_documents(cfg)),
                      cfg.vocab_size - len(DEFAULT_SPECIAL_TOKENS))
    path = Path(cfg.tokenizer_path)
    save_tiktoken_bpe(ranks, path)
    log.info("trained a %d-rank BPE on the corpus: %s", len(ranks), path)


def _trains_tokenizer(cfg: Config) -> bool:
    """Whether the run trains its tokenizer: a tiktoken file that does not exist yet."""
    return cfg.tokenizer_type == "tiktoken" and bool(cfg.tokenizer_path) \
        and not Path(cfg.tokenizer_path).exists()


def training_tokenizer(cfg: Config) -> Tokenizer:
    """The config's tokenizer (trained first if it is a tiktoken file that does not exist),
    checked against the model's vocabulary and special ids."""
    if _trains_tokenizer(cfg):
        train_tokenizer(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path or None)
    if tokenizer is None:
        raise ConfigError("training needs a tokenizer: set tokenizer_type (byte | tiktoken)")
    ids = {"vocab_size": (tokenizer.vocab_size, cfg.vocab_size),
           "bos_token_id": (tokenizer.bos_id, cfg.bos_token_id),
           "eos_token_id": (tokenizer.eos_id, cfg.eos_token_id),
           "pad_token_id": (tokenizer.pad_id, cfg.pad_token_id)}
    differ = [f"{key} = {model} (tokenizer: {tok})" for key, (tok, model) in ids.items()
              if tok != model]
    if differ:
        raise ConfigError(f"the model config disagrees with the tokenizer: {'; '.join(differ)}")
    return tokenizer


def training_batches(cfg: Config, tokenizer: Tokenizer) -> grain.DatasetIterator:
    dataset = token_batches(corpus_documents(cfg), tokenizer, cfg.bos_token_id,
                            cfg.eos_token_id, cfg.train_seq_len, cfg.train_batch_size,
                            cfg.corpus_seed)
    return iter(dataset)


# --------------------------------------------------------------------------------------------
# Model, loss and optimizer.
# --------------------------------------------------------------------------------------------


def trainable_config(cfg: Config) -> Config:
    """The model as trained: routed experts in full precision."""
    return cfg.replace(expert_weight_format="bf16")


def learning_rate(cfg: Config) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then cosine decay to a tenth of it at `train_steps`.
    With train_steps=0 (export what there is, train nothing) no step reads it, but optax still
    needs decay steps after the warmup."""
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.train_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate / 10)


def _decayed(variable: nnx.Variable) -> bool:
    """Weight decay applies to matrices, not to norms, biases and per-channel gates (a stacked
    layer axis does not count as a matrix dimension)."""
    return sum(axis != "layers" for axis in variable.get_metadata()["axes"]) >= 2


def make_optimizer(cfg: Config, params: nnx.State) -> optax.GradientTransformation:
    mask = jax.tree.map(_decayed, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(learning_rate(cfg), b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                    mask=mask))


def next_token_loss(model: Decoder, rows: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting rows[:, 1:] from rows[:, :-1]."""
    logits = model.forward(rows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    ) -> TrainStep:
    """The jitted step; the state is donated (updated in place)."""

    def loss_of(params: nnx.State, rows: jax.Array) -> jax.Array:
        return next_token_loss(nnx.merge(graphdef, params), rows)

    def step(state: TrainState, rows: jax.Array) -> tuple[TrainState, jax.Array]:
        loss, grads = jax.value_and_grad(loss_of)(state.params, rows)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=0)


# --------------------------------------------------------------------------------------------
# Checkpoints.
# --------------------------------------------------------------------------------------------


def checkpoint_manager(cfg: Config) -> ocp.CheckpointManager | None:
    if not cfg.checkpoint_dir:
        return None
    return ocp.CheckpointManager(
        Path(cfg.checkpoint_dir).resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def save_checkpoint(manager: ocp.CheckpointManager, step: int, state: TrainState,
                    data: grain.DatasetIterator) -> None:
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               data=grain.checkpoint.CheckpointSave(data)))


def restore_checkpoint(manager: ocp.CheckpointManager, state: TrainState,
                       data: grain.DatasetIterator) -> tuple[int, TrainState]:
    """(step, state) of the latest checkpoint; `data` is moved to its position in place.

    The stored shapes are compared first, so a checkpoint another model config wrote is named
    as such; one that cannot be read (a stray directory with a step's name, damaged metadata
    or chunks) is one CheckpointError naming it. Nothing is moved or deleted: the user decides
    whether to set it aside and resume from the one before."""
    step = manager.latest_step()
    where = Path(str(manager.directory)) / str(step)
    advice = (f"move {where} aside to resume from the checkpoint before it, or give another "
              f"checkpoint_dir")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        with stderr_kept_for_success():
            stored = _leaf_shapes(handler.metadata(where / "state").tree)
    except Exception as e:  # a directory Orbax did not write, or its metadata damaged
        raise CheckpointError(f"checkpoint_dir {manager.directory}: step {step} is not a "
                              f"readable training checkpoint ({where / 'state'}: "
                              f"{root_cause(e)}); {advice}") from None
    finally:
        handler.close()
    needed = _leaf_shapes(abstract)
    # The parameters first: the optimizer's moments differ wherever they do.
    differing = sorted((p for p in needed.keys() | stored.keys()
                        if needed.get(p) != stored.get(p)), key=lambda p: (p[0] != "params", p))
    if differing:
        first = differing[0]
        raise CheckpointError(
            f"checkpoint_dir {manager.directory}: step {step} was written for another model or "
            f"optimizer config: {'.'.join(first)} is stored "
            + (f"with shape {stored[first]}" if first in stored else "nowhere")
            + ", this config needs "
            + (f"shape {needed[first]}" if first in needed else "none")
            + (f" ({len(differing) - 1} more arrays differ)" if len(differing) > 1 else "")
            + "; give the config it was trained with, or another checkpoint_dir")
    try:
        with stderr_kept_for_success():
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                data=grain.checkpoint.CheckpointRestore(data)))
    except Exception as e:  # Orbax wraps tensorstore's and grain's errors in its own
        raise CheckpointError(f"checkpoint_dir {manager.directory}: step {step} cannot be "
                              f"restored ({root_cause(e)}); {advice}") from e
    return step, restored.state


def _leaf_shapes(tree: object) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: shape} of a pytree's leaves, paths as plain names: the stored tree holds dicts
    and lists where the live state holds named tuples and nnx States."""
    def name(key: object) -> str:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return {tuple(map(name, path)): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def close_checkpoints(manager: ocp.CheckpointManager, completed: bool) -> None:
    """Finish the save in flight and close `manager`. When the run did not complete (an error,
    Ctrl-C, SIGTERM) this runs with signals held off, its own errors are logged rather than
    raised over the one that stopped the run, and a save the interruption cut short (Orbax's
    `STEP.orbax-checkpoint-tmp` directory) is removed: the newest complete checkpoint stays the
    one a new run resumes from."""
    if completed:
        manager.wait_until_finished()
        manager.close()
        return
    with files.uninterrupted():
        try:
            manager.wait_until_finished()
            manager.close()
        except Exception as e:  # the run is already failing on its own error
            log.warning("closing the checkpoints after the run stopped: %s", e)
        for partial in Path(str(manager.directory)).glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)
            log.info("removed %s, a checkpoint the stop cut short", partial)


def check_export_path(cfg: Config) -> None:
    """Before any work: an existing export is replaced only when `export_overwrite` says so,
    and a new one must be a directory this process can create."""
    if not cfg.export_path:
        return
    if Path(cfg.export_path).exists() and not cfg.export_overwrite:
        raise ConfigError(f"export_path {cfg.export_path} already exists; set "
                          f"export_overwrite=true to replace it, or give another export_path")
    if cfg.export_overwrite:
        check_replaceable(cfg.export_path, "export_overwrite=true")
    _check_directory_target(cfg.export_path, "export_path")


def check_checkpoint_dir(cfg: Config) -> None:
    """Before any work: `checkpoint_dir` is a directory this process can write in, or one it
    can create (Orbax would fail only at the first save, `checkpoint_every` steps in), and
    neither it nor `tokenizer_path` overlaps `export_path`, whose replacement would take them
    along."""
    if cfg.checkpoint_dir:
        _check_directory_target(cfg.checkpoint_dir, "checkpoint_dir")
    if not cfg.export_path:
        return
    export_to = Path(cfg.export_path).resolve()
    for key in ("checkpoint_dir", "tokenizer_path"):
        if not cfg[key]:
            continue
        path = Path(cfg[key]).resolve()
        if path == export_to or export_to in path.parents or path in export_to.parents:
            raise ConfigError(f"export_path {cfg.export_path} and {key} {cfg[key]} overlap; "
                              f"an export replaces its whole directory, so give them "
                              f"separate places")


def check_tokenizer_path(cfg: Config) -> None:
    """Before any work: a tokenizer the run will train (a tiktoken file that does not exist
    yet) can be written where `tokenizer_path` says."""
    if _trains_tokenizer(cfg):
        try:
            files.check_output_file(cfg.tokenizer_path, "tokenizer_path")
        except files.OutputError as e:
            raise ConfigError(str(e)) from None


def _check_directory_target(value: str, key: str) -> None:
    """The directory config key `key` names exists and this process can write in it, or it can
    be created."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key} {value} is a file, not a directory")
    try:  # an existing directory: probe a file inside it; a new one: that it can be made
        files.check_output_file(path / ".probe" if path.exists() else path, key)
    except files.OutputError as e:
        raise ConfigError(str(e)) from None


def export(cfg: Config, params: nnx.State, path: str) -> None:
    """Write the trained model as a k3text checkpoint of `cfg` (experts in its format)."""
    save_model(cfg, jax.device_get(params), path, force=cfg.export_overwrite)
    log.info("exported the model (%s experts) to %s", cfg.expert_weight_format, path)


# --------------------------------------------------------------------------------------------
# The loop.
# --------------------------------------------------------------------------------------------


def compile_train_step(cfg: Config, graphdef: nnx.GraphDef,
                       optimizer: optax.GradientTransformation, state: TrainState,
                       ) -> TrainStep:
    """The train step compiled ahead of time for the configured batch shape (one program for
    the whole run: every batch has that shape)."""
    rows = jax.ShapeDtypeStruct((cfg.train_batch_size, cfg.train_seq_len + 1), jnp.int32)
    began = time.perf_counter()
    compiled = make_train_step(graphdef, optimizer).lower(state, rows).compile()
    log.info("compiled the train step in %.1f s", time.perf_counter() - began)
    return compiled


def run_steps(cfg: Config, train_step: TrainStep, state: TrainState,
              data: grain.DatasetIterator,
              manager: ocp.CheckpointManager | None, start: int,
              ) -> tuple[TrainState, list[float]]:
    """Steps start .. train_steps - 1 with loss logging, a progress bar and checkpoints."""
    schedule = learning_rate(cfg)
    losses: list[float] = []
    with files.progress_bar(total=cfg.train_steps, initial=start, desc="train", unit="step",
                            disable=not cfg.progress) as bar:
        logged, logged_at = start, time.perf_counter()
        for step in range(start, cfg.train_steps):
            state, loss = train_step(state, jnp.asarray(next(data)))
            losses.append(float(loss))  # waits for the step, so the bar and timings are honest
            done = step + 1
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if done % cfg.log_every == 0 or done == cfg.train_steps:
                now = time.perf_counter()
                window = losses[logged - start:]
                tqdm.write(f"step {done:5d} | loss {np.mean(window):.4f} | lr "
                           f"{float(schedule(step)):.2e} | "
                           f"{(now - logged_at) / len(window) * 1e3:.0f} ms/step", file=sys.stderr)
                logged, logged_at = done, now
            if manager is not None and (done % cfg.checkpoint_every == 0
                                        or done == cfg.train_steps):
                with files.signals_deferred():  # Ctrl-C stops the run once the save is out
                    save_checkpoint(manager, done, state, data)
    return state, losses


def train(cfg: Config) -> TrainResult:
    """Train from the latest checkpoint in `checkpoint_dir` (or from `init_seed`) up to
    `train_steps`, then export to `export_path` when it is set."""
    spread = {k: cfg[k] for a in MESH_AXES for k in (f"ici_{a}_parallelism",
                                                    f"dcn_{a}_parallelism") if cfg[k] != 1}
    if spread:
        raise ConfigError(f"k3text.train runs on one device; it would ignore "
                          f"{', '.join(f'{k}={v}' for k, v in spread.items())}")
    if cfg.load_parameters_path:
        raise ConfigError(f"k3text.train starts from init_seed (or resumes from checkpoint_dir); "
                          f"it would ignore load_parameters_path={cfg.load_parameters_path}")
    if cfg.train_steps and cfg.warmup_steps >= cfg.train_steps:
        raise ConfigError(f"warmup_steps ({cfg.warmup_steps}) must be below train_steps "
                          f"({cfg.train_steps}): the schedule would never leave its warmup")
    check_export_path(cfg)
    check_checkpoint_dir(cfg)
    check_tokenizer_path(cfg)
    tokenizer = training_tokenizer(cfg)
    graphdef, params = nnx.split(Decoder(trainable_config(cfg), Init(cfg.init_seed)))
    optimizer = make_optimizer(cfg, params)
    state = TrainState(params, optimizer.init(params))
    data = training_batches(cfg, tokenizer)
    manager = checkpoint_manager(cfg)
    completed = False
    try:
        start = 0
        if manager is not None and manager.latest_step() is not None:
            start, state = restore_checkpoint(manager, state, data)
            log.info("resumed from %s at step %d", cfg.checkpoint_dir, start)
        losses: list[float] = []
        if start < cfg.train_steps:
            train_step = compile_train_step(cfg, graphdef, optimizer, state)
            state, losses = run_steps(cfg, train_step, state, data, manager, start)
        completed = True
    finally:
        if manager is not None:
            close_checkpoints(manager, completed)
    if cfg.export_path:
        export(cfg, state.params, cfg.export_path)
    return TrainResult(state.params, losses)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, "k3text.train", __doc__, train)


if __name__ == "__main__":
    sys.exit(main())
