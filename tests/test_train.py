"""The training loop: the loss falls, and a run resumed from a checkpoint continues the loss curve
of an uninterrupted one; the export holds exactly the trained weights."""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from k3text import sharding, train
from k3text.checkpoint import load_model
from k3text.checkpoint.store import CheckpointError
from k3text.config import CONFIG_DIR, load_config
from k3text.data import token_batches
from k3text.tokenizer import ByteTokenizer

# k3-tiny cut to 5 layers (KDA with the dense MLP, two MoE KDA, two MLA; two AttnRes blocks) so
# that it compiles quickly; every K3 feature stays on. Byte tokenizer: no file needed.
TINY = [
    "num_hidden_layers=5", "linear_attn_config.kda_layers=[1,2,3]",
    "linear_attn_config.full_attn_layers=[4,5]", "tokenizer_type=byte", "vocab_size=259",
    "bos_token_id=256", "eos_token_id=257", "pad_token_id=258", "kda_chunk_size=16",
    "train_steps=50", "train_batch_size=4", "train_seq_len=64", "warmup_steps=5",
    "checkpoint_every=25", "log_every=25", "progress=false",
]


def test_batches_pack_every_document_once_per_epoch():
    docs = ["The capital of Olt is Varn.", "1 plus 2 is 3.", "Mira lives in Olt.", "x"]
    tok = ByteTokenizer()
    epoch = sum(len(d) + 2 for d in docs)  # bos + bytes + eos
    batches = iter(token_batches(docs, tok, tok.bos_id, tok.eos_id, seq_len=7, batch_size=3,
                                 seed=0))
    rows = [next(batches) for _ in range(-(-3 * epoch // 24))]
    assert all(b.shape == (3, 8) and b.dtype == np.int32 for b in rows)
    stream = np.concatenate(rows).reshape(-1).tolist()
    for start in (0, epoch, 2 * epoch):
        framed = stream[start:start + epoch]
        assert framed[0] == tok.bos_id and framed[-1] == tok.eos_id
        texts = tok.decode([t if t != tok.bos_id else ord("|") for t in framed])
        assert sorted(texts.strip("|").split("|")) == sorted(docs)


def tiny_config(tmp_path, *overrides):
    return load_config(CONFIG_DIR / "models" / "k3-tiny.yml",
                       [*TINY, f"checkpoint_dir={tmp_path / 'checkpoints'}", *overrides])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An uninterrupted 50-step run with checkpoints at steps 25 and 50, and its export."""
    tmp_path = tmp_path_factory.mktemp("train")
    cfg = tiny_config(tmp_path, f"export_path={tmp_path / 'export'}",
                      "expert_weight_format=bf16")
    return cfg, train.train(cfg)


def test_loss_falls(run):
    _, result = run
    losses = result.losses
    assert len(losses) == 50 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses


def test_resume_continues_the_same_loss_curve(run, tmp_path):
    cfg, result = run
    # A run that stopped at step 25: its newest checkpoint is step 25's.
    stopped = tmp_path / "checkpoints"
    shutil.copytree(cfg.checkpoint_dir, stopped)
    shutil.rmtree(stopped / "50")
    resumed = train.train(cfg.replace(checkpoint_dir=str(stopped), export_path=""))
    np.testing.assert_allclose(resumed.losses, result.losses[25:], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(result.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_export_holds_the_trained_weights(run):
    cfg, result = run
    ctx = sharding.MeshContext(sharding.make_mesh(cfg, jax.devices()[:1]), cfg.logical_axis_rules)
    exported = nnx.to_flat_state(nnx.state(load_model(cfg, ctx, cfg.export_path)))
    trained = dict(nnx.to_flat_state(result.params))
    assert len(exported) == len(trained)
    for path, variable in exported:
        np.testing.assert_array_equal(variable.get_value(), trained[path].get_value(),
                                      err_msg=str(path))


def test_resume_names_a_checkpoint_it_cannot_use_and_moves_nothing(run, tmp_path):
    cfg, _ = run
    stopped = Path(shutil.copytree(cfg.checkpoint_dir, tmp_path / "checkpoints"))
    cfg = cfg.replace(checkpoint_dir=str(stopped), export_path="")
    (stopped / "75").mkdir()  # a stray directory with a step's name
    with pytest.raises(CheckpointError, match=rf"checkpoint_dir {stopped}: step 75 is not a "
                                              rf"readable training checkpoint .*; move "
                                              rf"{stopped / '75'} aside"):
        train.train(cfg)
    (stopped / "75").rmdir()
    metadata = stopped / "50" / "state" / "_METADATA"
    good = metadata.read_bytes()
    metadata.write_text("{damaged")
    with pytest.raises(CheckpointError, match=rf"step 50 is not a readable training checkpoint "
                                              rf"\({metadata.parent}: Expecting"):
        train.train(cfg)
    metadata.write_bytes(good)
    with pytest.raises(CheckpointError, match=r"step 50 was written for another model or "
                                              r"optimizer config: params\.embed\.table\.value is "
                                              r"stored with shape \(259, 64\), this config needs "
                                              r"shape \(259, 96\)"):
        train.train(cfg.replace(hidden_size=96))
    assert sorted(p.name for p in stopped.iterdir()) == ["25", "50"]


def test_ctrl_c_leaves_only_complete_checkpoints_and_no_traceback(tmp_path):
    """Interrupted while it saves every step: one line, status 130, no save cut short on disk
    (the newest is one a new run resumes from)."""
    checkpoints = tmp_path / "checkpoints"
    argv = [sys.executable, "-m", "k3text.train", str(CONFIG_DIR / "base.yml"), *TINY[3:8],
            "num_hidden_layers=2", "linear_attn_config.full_attn_layers=[2]", "num_experts=0",
            "train_steps=100000", "train_batch_size=2", "train_seq_len=16", "warmup_steps=1",
            "checkpoint_every=1", "log_every=1000", "progress=false",
            f"checkpoint_dir={checkpoints}", "compilation_cache_dir="]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and len(
                [p for p in checkpoints.glob("*") if p.name.isdigit()]) < 3:
            time.sleep(0.2)
        time.sleep(0.37)  # somewhere inside a step or a save
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "k3text.train: interrupted" and "Traceback" not in err
    steps = sorted(int(p.name) for p in checkpoints.iterdir())  # no STEP.orbax-checkpoint-tmp
    cfg = load_config(CONFIG_DIR / "base.yml", [*argv[4:-1], f"train_steps={steps[-1]}"])
    assert train.train(cfg).losses == []  # restored the newest and found no step left to run
