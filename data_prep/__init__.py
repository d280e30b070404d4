"""data_prep: raw corpora -> a SentencePiece tokenizer and packed fixed-length shards.

Run ``python -m data_prep --help``. The training side reads the output with
``linformer_ds.data.shards.ShardDataset``.
"""

from data_prep.errors import DataPrepError
from data_prep.pipeline import FORMAT_VERSION, PrepConfig, PrepResult, prepare

__all__ = ["DataPrepError", "FORMAT_VERSION", "PrepConfig", "PrepResult", "prepare"]
