"""The one base of the errors that linformer_ds and data_prep raise: ``except LinformerError``.

Each error keeps its own builtin base too (``class ConfigError(LinformerError, ValueError)``), so
``except ValueError`` / ``except RuntimeError`` go on catching what they caught. Standard library
only: any module may import it (data_prep's torch-free workers included).

Outside it, on purpose:

- the model package (``linformer_ds.model``, ``linformer_ds.hf``: ``ModelConfigError``, a
  ``ValueError``): its files ship unchanged inside every exported model directory and import only
  torch, the standard library and each other (tests/test_import_graph.py), so they cannot import
  this module; catch ``(LinformerError, ModelConfigError)`` for both;
- ``linformer_ds.trainer.StopTraining``: not an error but the trainer's stop signal (it carries
  the exit code and never leaves ``Trainer.train``);
- the tools beside the installed packages (bench/'s ``BenchError``, scripts/gpu_check.py's
  ``KitError``).
"""


class LinformerError(Exception):
    """An error of linformer_ds or data_prep (bad configuration, data, paths or environment);
    the message names the problem."""
