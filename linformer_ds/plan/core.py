"""One layout's plan: per-rank peak memory by part, FLOPs and step time at a sustained rate,
bytes per step on each collective, tokens/s; every layout of G GPUs that fits, ranked; the
largest N that fits a layout."""

import dataclasses
from dataclasses import dataclass

from ..model import flops_per_token
from .activations import Step, activation_peak
from .states import model_states, sp_bytes_per_layer, sp_mask_bytes, zero_buffers

GiB = 2**30
CHECKPOINTS = (None, "layer", "sublayer")


@dataclass(frozen=True)
class Layout:
    """How one job runs on ``gpus`` devices: ``sp`` ranks per sequence, ZeRO ``stage``,
    activation ``checkpoint`` (None, layer, sublayer), ``micro_batch`` rows per rank,
    ``seq_len`` N, ``accumulation`` micro-batches per step."""

    gpus: int
    sp: int
    stage: int
    checkpoint: str | None
    micro_batch: int
    seq_len: int
    accumulation: int = 1

    @property
    def dp(self) -> int:
        return self.gpus // self.sp

    def text(self) -> str:
        ck = self.checkpoint or "off"
        return f"P={self.sp} DP={self.dp} ZeRO-{self.stage} ckpt={ck} B={self.micro_batch}"


@dataclass(frozen=True)
class Hardware:
    """``memory`` bytes per GPU; ``tflops``: the sustained rate per GPU (a stated MFU x peak);
    ``intra``/``inter`` bytes/s a rank moves over the node's links / between nodes; ``node``
    GPUs per node; ``device``: cuda (fused attention) or cpu (torch's CPU kernels);
    ``usable``: the share of ``memory`` a plan may fill (the rest: the CUDA context, NCCL's
    buffers, the allocator's fragmentation)."""

    memory: float = 80 * GiB
    usable: float = 0.9
    tflops: float = 400.0
    intra: float = 150e9
    inter: float = 25e9
    node: int = 8
    device: str = "cuda"


def job_model(job, seq_len: int):  # noqa: ANN001
    """The job's model at length ``seq_len`` (``max_seq_len`` = N, as sharded runs need)."""
    return dataclasses.replace(job.model, max_seq_len=seq_len)


def zero_group(job, layout: Layout) -> int:  # noqa: ANN001
    """The ranks ZeRO partitions over: the data-parallel replicas, or every rank (DP x P) when
    sequence parallelism leaves E/F whole (DeepSpeed's sequence-data-parallel group; sharded,
    the SP group is its model-parallel group: docs/sequence_parallel.md)."""
    shard = layout.sp > 1 and job.parallel.shard_sequence_parameters is not False
    return layout.dp if shard or layout.sp == 1 else layout.dp * layout.sp


def plan_layout(job, layout: Layout, hw: Hardware) -> dict:  # noqa: ANN001
    """Everything predicted for ``layout`` of ``job`` (a JobConfig) on ``hw``."""
    config = job_model(job, layout.seq_len)
    ds = job.deepspeed
    z = ds.zero
    elem = 4 if ds.precision == "fp32" else 2
    n = layout.seq_len // layout.sp
    shard = layout.sp > 1 and job.parallel.shard_sequence_parameters is not False
    states = model_states(
        config, ds.precision, layout.stage, zero_group(job, layout), layout.sp, shard,
        z.offload_optimizer and layout.stage > 0, z.offload_param and layout.stage == 3,
        ds.fp32_grad_accum,
    )  # fmt: skip
    step = Step(layout.micro_batch, n, layout.seq_len, elem, hw.device,
                job.data.mlm_probability, layout.sp)  # fmt: skip
    act = activation_peak(config, step, layout.checkpoint)
    buffers = zero_buffers(config, ds.precision, layout.stage, z.reduce_bucket_size,
                           z.allgather_bucket_size, z.overlap_comm)  # fmt: skip
    memory = {
        "parameters": states["parameters"],
        "gradients": states["gradients"],
        "optimizer": states["optimizer"],
        "activations": act["peak"],
        "buffers": buffers,
    }
    peak = sum(memory.values())
    # FLOPs: the model's count per token (3x forward), plus one forward again when recomputed
    fpt = flops_per_token(config, layout.seq_len, job.data.mlm_probability)
    if layout.checkpoint:
        fpt *= 4 / 3
    tokens = layout.micro_batch * layout.seq_len * layout.accumulation * layout.dp
    compute_s = fpt * tokens / layout.gpus / (hw.tflops * 1e12)
    comm = collectives(job, config, layout, elem, states)
    link = hw.intra if layout.sp <= hw.node else hw.inter
    dp_link = hw.intra if layout.gpus <= hw.node else hw.inter
    # exposed: the sequence-parallel exchange sits on the critical path; ZeRO-3's parameter
    # gathers mostly so; gradient reduction overlaps the backward pass (not counted)
    exposed = comm["sp"] / link + comm["zero_allgather"] * (layout.stage == 3) / dp_link
    step_s = compute_s + exposed
    return {
        "layout": layout,
        "memory": memory,
        "peak": peak,
        "cpu": states["cpu"],
        "per_layer": act["per_layer"],
        "fits": peak <= hw.memory * hw.usable,
        "flops_per_token": fpt,
        "step_flops": fpt * tokens,
        "step_s": step_s,
        "compute_s": compute_s,
        "tokens_per_s_per_gpu": tokens / step_s / layout.gpus,
        "collectives": comm,
        "parameters": states["count"],
    }


def collectives(job, config, layout: Layout, elem: int, states: dict) -> dict:  # noqa: ANN001
    """Bytes one rank hands to collectives per optimizer step (payloads, as
    ``bench.sp_collectives.count_collectives`` counts them): ``sp`` the sequence-parallel
    exchange of every layer, forward and backward (checkpointed: the forward twice), per
    micro-batch; ZeRO's gradient ``zero_reduce`` (all-reduce under 0/1 at the step, reduce-
    scatter under 2/3 per micro-batch) and ``zero_allgather`` (the updated partitions under
    1/2, every layer's parameters forward and backward under 3); ``sp_grad`` the replicated
    parameters' gradients summed over the SP group (sharded, per micro-batch)."""
    acc = layout.accumulation
    sp = 0
    for i in range(config.num_layers):
        b = sp_bytes_per_layer(config, i, layout.seq_len, layout.sp, layout.micro_batch, elem)
        sp += b["forward"] * (2 if layout.checkpoint else 1) + b["backward"]
    sp += sp_mask_bytes(config, layout.sp, layout.micro_batch, layout.seq_len // layout.sp)
    sp *= acc
    psi = states["per_rank_count"]
    grad_e = 4 if (job.deepspeed.precision == "fp32" or job.deepspeed.fp32_grad_accum) else 2
    pe = 4 if job.deepspeed.precision == "fp32" else 2
    reduce = allgather = 0
    group = zero_group(job, layout)
    if group > 1:
        if layout.stage <= 1:
            reduce = psi * grad_e
        else:
            reduce = psi * grad_e * acc
        if layout.stage in (1, 2):
            allgather = psi * pe // group
        elif layout.stage == 3:
            passes = 3 if layout.checkpoint else 2
            allgather = passes * psi * pe // group * acc
    shard = layout.sp > 1 and job.parallel.shard_sequence_parameters is not False
    sp_grad = 0
    if shard:
        from .states import parameter_counts

        total, seq = parameter_counts(config)
        sp_grad = (total - seq) * grad_e * acc
    return {"sp": sp, "zero_reduce": reduce, "zero_allgather": allgather, "sp_grad": sp_grad}


def candidate_layouts(job, gpus: int, seq_len: int, hw: Hardware) -> list:  # noqa: ANN001
    """Every layout of ``gpus`` for N = ``seq_len`` that the model allows: P a power of two
    dividing both (heads divisible by P where a layer is dense; N/P a multiple of every
    stride), ZeRO 0-3, checkpointing off / per layer / per sub-layer, and for each the largest
    micro-batch (a power of two up to 64) that fits; ranked by tokens/s per GPU (three
    figures), then by memory."""
    from ..model import layer_kinds, projection_stride

    config = job_model(job, seq_len)
    strides = [projection_stride(config, i) or 1 for i in range(config.num_layers)]
    kinds = layer_kinds(config)
    sp_ok = all(k.sequence_parallel for k in kinds)  # a kind without it: P = 1 only (refused)
    full = any(k.full_attention for k in kinds)  # Ulysses: heads divisible by P
    plans = []
    p = 1
    while p <= gpus and p <= seq_len:
        allowed = p == 1 or (sp_ok and not (full and config.num_heads % p))
        if (
            allowed
            and gpus % p == 0
            and seq_len % p == 0
            and all((seq_len // p) % s == 0 for s in strides)
        ):
            for stage in range(4):
                for ck in CHECKPOINTS:
                    best = None
                    b = 1
                    while b <= 64:
                        plan = plan_layout(job, Layout(gpus, p, stage, ck, b, seq_len), hw)
                        if not plan["fits"]:
                            break
                        best = plan
                        b *= 2
                    if best is not None:
                        plans.append(best)
        p *= 2
    # tokens/s to three figures (closer is noise of the model), then the least memory
    plans.sort(key=lambda x: (-float(f"{x['tokens_per_s_per_gpu']:.3g}"), x["peak"]))
    return plans


def largest_seq_len(job, layout: Layout, hw: Hardware, multiple: int = 1024) -> int:  # noqa: ANN001
    """The largest N (a multiple of ``multiple`` x P, up to 2**24) at which ``layout`` fits."""
    step = multiple * layout.sp
    lo, hi = 0, 2**24 // step

    def fits(k: int) -> bool:
        lay = dataclasses.replace(layout, seq_len=k * step)
        try:
            return plan_layout(job, lay, hw)["fits"]
        except ValueError:
            return False

    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * step
