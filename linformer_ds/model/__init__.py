"""Linformer encoder (Wang et al. 2020, arXiv 2006.04768) in plain PyTorch.

Every file of this package imports nothing but torch, the standard library and its siblings
(relatively): the Hugging Face export ships the files unchanged as the model's remote code (this
``__init__`` as ``linformer_model.py``), so an exported model loads without linformer_ds.

Files (flat: the export ships them as they are):

* ``registry``: the attention kinds' registry: what every kind answers about itself.
* ``kinds``: the built-in kinds, one registration each.
* ``projections``: the summary modules (linear E/F, conv, local, dynamic).
* ``dense``: dense attention; ``routed``: routed block attention; ``selective``: per-query
  selective block attention; ``window``: the exact sliding window (local + global); ``rotary``:
  rotary positions; ``kernels``: the short-attention kernel rule.
* ``attention``: one layer's attention, dispatched by its kind; ``layers``: FFN, local mixer,
  encoder layer; ``documents``: document isolation in packed rows; ``encoder``.
* ``config``: options and validation; ``heads``: task models; ``losses``, ``init`` (weight
  initialisation), ``flops`` (FLOPs per token) beside them.

Attention kinds (per layer, see ``ModelConfig.projection_schedule``; more: ``register_projection``):

* ``linear``: keys and values are projected along the sequence axis by learned ``E, F`` of shape
  ``[k, N_max]``: ``softmax(Q (E K)^T / sqrt(d_h)) (F V)``. Cost O(n k), no n x n tensor.
* ``conv`` (Conv-Linformer): keys and values are compressed by a strided 1-D convolution over the
  sequence with kernel = stride = ``N_max / k``.
* ``local``: the exact sliding window alone (``local_window``).
* ``dynamic``: Transformer-LS's input-dependent projection (softmax over positions).
* ``dense``: full softmax attention (the baseline), through ``scaled_dot_product_attention``.
* ``routed``: content-routed block attention: block-mean summaries plus an exact read of the
  ``routed_blocks`` blocks each block of queries scores best (it can look things up).
* ``selective``: each query reads its own ``routed_blocks`` best blocks (of ``N_max / k``
  tokens) exactly, beside the means of the blocks it does not read.
* ``linear``, ``conv`` and ``dynamic`` layers also attend through the window when
  ``local_window`` is set (Transformer-LS's local + global).

Sharing modes (the paper's section 4 meaning):

* ``none``: separate ``E_h, F_h`` for every head of every layer.
* ``headwise``: one ``E`` and one ``F`` per layer, shared by all heads.
* ``kv``: one matrix per layer, used for keys and values (``E = F``), shared by all heads.
* ``layerwise``: one matrix for all layers, heads, keys and values (owned by the encoder).
"""

from .attention import LinformerSelfAttention
from .config import (
    _FLOAT_RANGES,
    _INT_RANGES,
    LOCAL_MIXERS,
    MODEL_FORMAT_VERSION,
    NORM_STYLES,
    OUTPUT_BIAS_INITS,
    POSITION_INITS,
    PROJECTION_INITS,
    PROJECTIONS,
    SCHEDULES,
    SHARING_MODES,
    ModelConfig,
)
from .dense import dense_attention
from .documents import (
    DocumentChunks,
    Documents,
    DocumentSpan,
    document_block_mask,
    document_chunks,
    document_spans,
    document_starts,
)
from .encoder import LinformerEncoder, check_inputs
from .flops import flops_per_token
from .heads import (
    ClassificationHead,
    LabelledMLMOutput,
    LinformerForMaskedLM,
    LinformerForMaskedLMPretraining,
    LinformerForSequenceClassification,
    LinformerPreTrainedModel,
    MaskedLMOutput,
    MLMHead,
    SequenceClassifierOutput,
)
from .init import init_weights, sinusoidal_positions
from .layers import EncoderLayer, FeedForward, LocalMixer, LocalMixing, local_mixer_valid
from .losses import labelled_positions, mlm_loss, sequence_classification_loss
from .projections import ConvProjection, DynamicProjection, LinearProjection, LocalProjection
from .registry import (
    ModelConfigError,
    ProjectionKind,
    get_projection,
    layer_kinds,
    onnx_problem,
    projection_names,
    projection_stride,
    register_projection,
    tracing,
    unregister_projection,
)
from .rotary import rotary_tables, rotate
from .window import LocalContext, Window, local_global, make_window

__all__ = [
    "ClassificationHead",
    "ConvProjection",
    "DynamicProjection",
    "LocalContext",
    "LocalProjection",
    "Window",
    "dense_attention",
    "layer_kinds",
    "local_global",
    "make_window",
    "onnx_problem",
    "rotary_tables",
    "rotate",
    "DocumentChunks",
    "DocumentSpan",
    "Documents",
    "EncoderLayer",
    "FeedForward",
    "LOCAL_MIXERS",
    "LabelledMLMOutput",
    "LinearProjection",
    "LinformerEncoder",
    "LinformerForMaskedLM",
    "LinformerForMaskedLMPretraining",
    "LinformerForSequenceClassification",
    "LinformerPreTrainedModel",
    "LinformerSelfAttention",
    "LocalMixer",
    "LocalMixing",
    "MLMHead",
    "MODEL_FORMAT_VERSION",
    "MaskedLMOutput",
    "ModelConfig",
    "ModelConfigError",
    "NORM_STYLES",
    "OUTPUT_BIAS_INITS",
    "POSITION_INITS",
    "PROJECTIONS",
    "PROJECTION_INITS",
    "ProjectionKind",
    "SCHEDULES",
    "SHARING_MODES",
    "SequenceClassifierOutput",
    "_FLOAT_RANGES",
    "_INT_RANGES",
    "check_inputs",
    "document_block_mask",
    "document_chunks",
    "document_spans",
    "document_starts",
    "flops_per_token",
    "get_projection",
    "init_weights",
    "labelled_positions",
    "local_mixer_valid",
    "mlm_loss",
    "projection_names",
    "projection_stride",
    "register_projection",
    "sequence_classification_loss",
    "sinusoidal_positions",
    "tracing",
    "unregister_projection",
]
