"""data_prep: raw corpora -> a SentencePiece tokenizer and packed shards of fixed-length rows.

Run ``python -m data_prep --help``. The training side reads the output with
``linformer_ds.data.shards.ShardDataset``. The pipeline's names are imported on first use
(PEP 562), so that ``python -m data_prep`` handles Ctrl-C (linformer_ds.entry) before numpy and
the pipeline load.
"""

import importlib
from typing import Any

from data_prep.errors import DataPrepError  # standard library and linformer_ds.errors only

__all__ = ["DataPrepError", "FORMAT_VERSION", "PrepConfig", "PrepResult", "prepare"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # the pipeline's names (DataPrepError is bound above)
        return getattr(importlib.import_module("data_prep.pipeline"), name)
    raise AttributeError(f"module 'data_prep' has no attribute {name!r}")


def console_main() -> None:
    """The ``linformer-data-prep`` console script: ``python -m data_prep`` through the same entry
    (Ctrl-C while the pipeline imports is one line and exit 130, linformer_ds.entry)."""
    from linformer_ds import entry

    entry.arm("data_prep")
    from data_prep.__main__ import main

    entry.run(main)
