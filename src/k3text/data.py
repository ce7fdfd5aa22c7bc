"""The training data pipeline (grain): tokenize documents, pack them into fixed-length rows, batch.

Every row has the same length, so one compiled train step serves the whole run. Documents are
framed as bos + tokens + eos, reshuffled every epoch, concatenated and cut into rows of
`seq_len + 1` tokens (inputs are `row[:-1]`, targets `row[1:]`); a document may straddle two rows.
The iterator's position is checkpointable (`grain.checkpoint.CheckpointSave`), so a resumed run
sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from k3text.tokenizer import Tokenizer


def token_batches(documents: Sequence[str], tokenizer: Tokenizer, bos_id: int, eos_id: int,
                  seq_len: int, batch_size: int, seed: int) -> grain.IterDataset:
    """An endless dataset of int32 batches [batch_size, seq_len + 1] of packed documents."""

    def tokenize(text: str) -> dict[str, np.ndarray]:
        return {"tokens": np.asarray([bos_id, *tokenizer.encode(text), eos_id], np.int32)}

    framed = (grain.MapDataset.source(list(documents))
              .shuffle(seed=seed)
              .repeat()  # reshuffled every epoch
              .map(tokenize)
              .to_iter_dataset())
    rows = grain.experimental.ConcatThenSplitIterDataset(
        framed, length_struct={"tokens": seq_len + 1})
    return rows.map(lambda row: row["tokens"]).batch(batch_size, drop_remainder=True)
