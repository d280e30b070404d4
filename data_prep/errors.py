"""The one exception type data_prep raises for bad input or a bad output directory."""

from linformer_ds.errors import LinformerError


class DataPrepError(LinformerError, ValueError):
    """Bad input, configuration or output directory; the message names the problem."""


class EmptySplitError(DataPrepError):
    """The output would have an empty split: nothing of it is kept (other flags are needed)."""
