"""Parallelism for the Linformer encoder, one module per concern.

* :mod:`~linformer_ds.parallel.checks`: which sequence-parallel settings can run
  (``config_errors``, ``isolation_errors``, ``check_config``, ``SequenceParallelConfigError``).
* :mod:`~linformer_ds.parallel.groups`: the DP x P grid, its process groups and DeepSpeed's
  ``mpu`` objects (``SequenceParallelMPU``, ``ShardedSequenceParallelMPU``).
* :mod:`~linformer_ds.parallel.collectives`: what crosses ranks inside the model (the autograd
  functions and the :class:`~linformer_ds.parallel.collectives.SequenceParallel` hooks the layers
  call: projection sums, conv blocks, halos, documents, Ulysses for dense layers), the global
  label count and the gradient hook of replicated parameters.
* :mod:`~linformer_ds.parallel.sharding`: what each rank holds: batch slices, the sharded
  sequence-axis parameters (E/F columns, position rows), whole state dicts again, and the
  universal-checkpoint metadata of sharded runs.
* :mod:`~linformer_ds.parallel.parallelize`: the parallelize step that applies the layout to the
  plain model (the loss/gradient scaling rule that goes with it, ``LossScaling``, is in
  :mod:`linformer_ds.loss`).

The package imports nothing itself; its modules import the config, the model and each other,
never the engine, the data or the loss (``linformer_ds.engine`` imports ``groups``,
``linformer_ds.loss`` imports ``parallelize``, the data pipeline imports ``checks`` and
``sharding``: tests/test_import_graph.py keeps the subpackages free of cycles).
"""
