"""The training data: ``data_prep`` shards in, device batches out.

- :mod:`~linformer_ds.data.shards`: the shard dataset, its manifest checks and the checks of
  several datasets against the model and each other (tokenizer, N).
- :mod:`~linformer_ds.data.masking`: MLM masking, a function of (seed, epoch, row) only.
- :mod:`~linformer_ds.data.sampler`: the blended, resumable global stream of several sources.
- :mod:`~linformer_ds.data.stages`: the run's stages from the job config, opened and checked.
- :mod:`~linformer_ds.data.stream`: the trainer's data component (``TrainData``): rows ->
  masks -> device tensors, stage by stage.

Reproducibility contract: the rows a rank sees depend only on (seed, epoch, position in the
epoch's permutation), and the masking of a row only on (seed, epoch, row index). Neither depends
on the rank or on how rows are grouped into batches, so a run resumed from a checkpoint, even
with a different number of ranks, continues exactly.
"""
