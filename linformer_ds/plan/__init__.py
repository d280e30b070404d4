"""The cluster on paper (issue 55): per-rank memory, FLOPs, step time and collective bytes of a
layout, from tensor shapes and dtypes. ``python -m linformer_ds.plan --config CONFIG``;
docs/cluster.md ("Planning a run") has the table it generates. ``measure.LiveBytes`` is the
measured side its tests compare against."""

from .activations import Step, activation_peak
from .core import Hardware, Layout, candidate_layouts, collectives, largest_seq_len, plan_layout
from .states import model_states, parameter_counts, sp_bytes_per_layer, sp_mask_bytes

__all__ = [
    "Hardware",
    "Layout",
    "Step",
    "activation_peak",
    "candidate_layouts",
    "collectives",
    "largest_seq_len",
    "model_states",
    "parameter_counts",
    "plan_layout",
    "sp_bytes_per_layer",
    "sp_mask_bytes",
]
