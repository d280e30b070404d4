"""Whole trainers side by side: linformer_ds against Hugging Face's Trainer on the same rows.

``python -m bench.trainer_bench --data DIR [DIR ...]`` trains, for every data_prep output
``DIR`` (its N) and every seed in ``--seeds``, these arms on the same rows:

* ``ours:VARIANT`` for each ``--variants`` entry: linformer_ds's own :class:`Trainer` (DeepSpeed
  engine, its data stream, masking, optimizer and schedule), one optimizer step at a time
  (``train_step`` + ``_after_step``: the loop's body). A variant is a projection kind
  (``dense``, ``linear``, ``local``, ...) or model overrides joined by ``;``
  (``projection=local;local_window=128``, ``layer_projections=[local,local,dense]``);
* ``hf-bert``: ``transformers.Trainer`` with ``BertForMaskedLM`` (``attn_implementation=
  "sdpa"``);
* ``hf-modernbert``: ``transformers.Trainer`` with ``ModernBertForMaskedLM`` (its default
  schedule: global attention every 3rd layer, a 128-token local window elsewhere).

The same rows: the HF arms read the batches of linformer_ds's own data stream (``TrainData``:
the sampler's order, the MLM masks of ``(seed, epoch, row)``), so every arm sees the same
token ids and labels in the same order (``first_batch`` in each row: a checksum). The same
model width, layers, heads, batch, dropout, the same AdamW (lr, betas, eps, weight decay
off biases and norms, gradient clipping 1.0) and linear warm-up/decay over
``--schedule-steps``. ModernBERT's FFN is gated (``Wi``: d -> 2I'): it gets ``I' = 2I/3`` so
that its FFN has the FFN parameters and FLOPs of the others.

Precision: ``auto`` (default) is bf16 where the CPU multiplies bf16 natively
(``linformer_ds.perf.native_bf16``, the rule of the trainer's ``precision: auto``), else fp32;
linformer_ds runs DeepSpeed's bf16 (bf16 weights, fp32 master weights), the HF Trainer its
``bf16=True`` (fp32 weights under bf16 autocast). The results say which.

Interleaved, equal wall-clock: each arm runs in a process of its own (spawned: its memory and
allocator are its own; ``--isolation shared`` runs all in this process, for tests). The arms
start one after another (``first_step_s``: from the start of the arm's process, imports
included, to the end of its first optimizer step, the other arms idle); then ``--rounds``
rounds, each arm training ``--budget-s / rounds`` seconds of optimizer steps in turn (the order
rotates every round; an arm waiting on its pipe uses no CPU). Every arm thus trains the same
wall-clock (``train_s``: at most one step over). Afterwards, the hidden-label loss (the
cross-entropy of the positions whose input is the mask token) of the same ``--eval-rows``
valid rows and masks, and the process's peak RSS.

Reported per (N, seed, arm): steady-state tokens/s (tokens of the steps after ``--warmup``
steps over their time), time to the first step, peak RSS, steps, and the hidden-label loss
after the budget; per (N, arm) the means over seeds and the ratios of ours to each HF arm,
computed from those recorded means (tokens/s ratio, loss difference). The machine, the load
average before and after, and ``--beside`` (what else ran) go into ``results.json`` and
``results.md`` under ``--out``. Benchmarks run alone: a figure measured beside other work
measures that work.
"""

import argparse
import contextlib
import hashlib
import io
import multiprocessing as mp
import os
import queue
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import BenchError, environment, write_results

HF_ARMS = ("hf-bert", "hf-modernbert")
ISOLATIONS = ("process", "shared")
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class TrainerBenchConfig:
    """Everything one run depends on (stored in results.json)."""

    data: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=lambda: ["dense", "linear"])
    hf: list[str] = field(default_factory=lambda: list(HF_ARMS))
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    layers: int = 4
    hidden: int = 768
    heads: int = 12
    intermediate: int = 3072
    k: int = 256
    dropout: float = 0.0
    batch: int = 2
    lr: float = 5e-4
    warmup_steps: int = 10
    schedule_steps: int = 1000
    budget_s: float = 120.0
    rounds: int = 4
    warmup: int = 2
    eval_rows: int = 16
    precision: str = "auto"
    zero: int = 2
    threads: int = 0  # torch threads of every arm; 0: this process's count
    isolation: str = "process"
    beside: str = ""
    out: str = "bench/results/trainer"

    def validate(self) -> None:
        """Raise BenchError naming the first bad option."""
        if not self.data:
            raise BenchError("--data: give one or more data_prep output directories")
        for d in self.data:
            if not (Path(d) / "manifest.json").is_file():
                raise BenchError(f"--data: {d} is not a data_prep output (no manifest.json)")
        if not self.variants and not self.hf:
            raise BenchError("--variants / --hf: nothing to run")
        if any(a not in HF_ARMS for a in self.hf):
            raise BenchError(f"--hf: choose from {HF_ARMS}, got {self.hf}")
        for name in ("layers", "hidden", "heads", "intermediate", "k", "batch", "rounds"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise BenchError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if self.budget_s <= 0 or self.eval_rows < 1 or self.warmup < 0:
            raise BenchError("--budget-s and --eval-rows must be > 0, --warmup >= 0")
        if self.schedule_steps <= self.warmup_steps:
            raise BenchError("--schedule-steps must exceed --warmup-steps")
        if self.precision not in PRECISIONS:
            raise BenchError(f"--precision: one of {PRECISIONS}, got {self.precision!r}")
        if self.isolation not in ISOLATIONS:
            raise BenchError(f"--isolation: one of {ISOLATIONS}, got {self.isolation!r}")
        if not self.seeds:
            raise BenchError("--seeds: give at least one seed")
        for v in self.variants:
            variant_overrides(v)


# ===================================================================================== helpers
def variant_overrides(variant: str) -> list[str]:
    """``model.*`` overrides of one ``--variants`` entry: a projection kind, or ``KEY=VALUE``
    pairs joined by ``;`` (keys of the job config's ``model`` section)."""
    parts = [p.strip() for p in variant.split(";") if p.strip()]
    if not parts:
        raise BenchError(f"--variants: an empty variant in {variant!r}")
    if len(parts) == 1 and "=" not in parts[0]:
        return [f"model.projection={parts[0]}"]
    if any("=" not in p for p in parts):
        raise BenchError(f"--variants: {variant!r}: give a kind or KEY=VALUE;KEY=VALUE")
    return [p if p.startswith("model.") else f"model.{p}" for p in parts]


def resolve_precision(setting: str) -> tuple[str, str]:
    """``(bf16 | fp32, why)``: ``auto`` by the trainer's rule (native bf16 on this CPU)."""
    if setting != "auto":
        return setting, "--precision"
    from linformer_ds.perf import native_bf16

    why = native_bf16("cpu")
    return ("bf16", f"auto: {why}") if why else ("fp32", "auto: no native bf16")


def batch_digest(batch: dict[str, Any]) -> str:
    """A short checksum of a batch's token ids and labels (the same rows in every arm)."""
    h = hashlib.sha256()
    for key in ("input_ids", "labels"):
        h.update(batch[key].cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@dataclass
class ArmSpec:
    """One arm of one (N, seed) group: ``name`` (``ours:VARIANT`` or an HF arm)."""

    name: str
    data: str
    seed: int
    precision: str
    config: dict[str, Any]  # asdict(TrainerBenchConfig)
    workdir: str
    started: float = 0.0  # time.time() when its process (or its turn) began


def job_overrides(spec: ArmSpec, variant: str = "dense") -> list[str]:
    """The linformer_ds job config of an arm as ``key=value`` overrides (the HF arms read their
    rows through the same config's data stream)."""
    from linformer_ds.data.shards import ShardDataset

    c = spec.config
    train = ShardDataset(spec.data, "train")
    return [
        f"data.path={spec.data}",
        f"model.vocab_size={train.vocab_size}", f"model.max_seq_len={train.seq_len}",
        f"model.hidden_size={c['hidden']}", f"model.num_layers={c['layers']}",
        f"model.num_heads={c['heads']}", f"model.intermediate_size={c['intermediate']}",
        f"model.k={min(c['k'], train.seq_len)}", f"model.dropout={c['dropout']}",
        f"model.attention_dropout={c['dropout']}",  # the HF arms' attention dropout too
        f"model.pad_token_id={train.pad_id}",
        *variant_overrides(variant),
        f"optimizer.lr={c['lr']}",
        f"scheduler.warmup_steps={c['warmup_steps']}", "scheduler.decay=linear",
        f"train.max_steps={c['schedule_steps']}", f"train.micro_batch_size={c['batch']}",
        f"train.seed={spec.seed}", "train.log_interval=1000000000", "train.eval_interval=0",
        "train.peak_tflops=1.0", "train.save_on_signal=false",
        *([f"train.threads={c['threads']}"] if c["threads"] else []),
        f"deepspeed.precision={spec.precision}", f"deepspeed.zero.stage={c['zero']}",
        *(["deepspeed.fp32_grad_accum=false"] if c["zero"] == 0 else []),
        f"logging.dir={spec.workdir}/run", "logging.tensorboard=false",
        "checkpoint.save_interval=0", "checkpoint.save_final=false", "checkpoint.resume=never",
    ]  # fmt: skip


def eval_batches(spec: ArmSpec) -> list[dict[str, Any]]:
    """The same ``eval_rows`` valid rows and masks for every arm, with ``hidden``: labels only
    where the input is the mask token (the hidden labels), -100 elsewhere."""
    import torch

    from linformer_ds.data.masking import MLMMasking
    from linformer_ds.data.shards import ShardDataset

    valid = ShardDataset(spec.data, "valid")
    masker = MLMMasking(valid.vocab_size, valid.mask_id, valid.special_ids, seed=12345,
                        pad_id=valid.pad_id)  # fmt: skip
    rows = min(len(valid), spec.config["eval_rows"])
    out = []
    for start in range(0, rows, spec.config["batch"]):
        idx = list(range(start, min(rows, start + spec.config["batch"])))
        b = masker(torch.stack([valid[i] for i in idx]), torch.tensor(idx), 0)
        b["hidden"] = torch.where(b["input_ids"] == valid.mask_id, b["labels"], -100)
        out.append(b)
    return out


def hidden_loss(logits_of, batches: list[dict[str, Any]], autocast: bool) -> float:
    """Mean cross-entropy of the hidden labels; ``logits_of(batch) -> (logits [M, V],
    targets [M])`` of the hidden positions."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for b in batches:
            logits, targets = logits_of(b)
            total += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
            count += int(targets.numel())
    return total / max(count, 1)


# ======================================================================================== arms
class OursArm:
    """linformer_ds's Trainer in this process, driven one optimizer step at a time."""

    def __init__(self, spec: ArmSpec):
        from linformer_ds.config import load_config
        from linformer_ds.trainer import Trainer

        self.spec, self.variant = spec, spec.name.split(":", 1)[1]
        self.log = io.StringIO()
        cfg = load_config(None, job_overrides(spec, self.variant))
        with contextlib.redirect_stdout(self.log):
            self.trainer = Trainer(cfg)
        t = self.trainer
        self.tokens_per_step = spec.config["batch"] * t.batches.seq_len
        self.first_batch: str | None = None
        take = t.batches.next_batch

        def tapped():
            b = take()
            if self.first_batch is None:
                self.first_batch = batch_digest(b)
            return b

        t.batches.next_batch = tapped
        t.engine.train()
        t.watchdog.training_started()

    def step(self) -> float:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(self.log):
            self.trainer.train_step()
            self.trainer._after_step()
        return time.perf_counter() - t0

    def start(self) -> dict[str, Any]:
        dt = self.step()
        return {"first_step_s": time.time() - self.spec.started, "step_s": [dt],
                "tokens_per_step": self.tokens_per_step, "first_batch": self.first_batch,
                "params": self.trainer.model.num_parameters()}  # fmt: skip

    def run(self, seconds: float) -> list[float]:
        """Steps until ``seconds`` are used, or the schedule's end (--schedule-steps)."""
        times: list[float] = []
        while sum(times) < seconds and self.trainer.step < self.trainer.end:
            times.append(self.step())
        return times

    def evaluate(self) -> float:
        from linformer_ds.model import labelled_positions

        model = self.trainer.engine.module
        model.eval()

        def logits_of(b):
            out = model(b["input_ids"], b["attention_mask"], labels=b["hidden"],
                        labelled_index=labelled_positions(b["hidden"]))  # fmt: skip
            return out.labelled_logits, out.labelled_targets

        return hidden_loss(logits_of, eval_batches(self.spec), autocast=False)

    def close(self) -> None:
        self.trainer.close()


def hf_model(spec: ArmSpec):
    """``BertForMaskedLM`` (SDPA) or ``ModernBertForMaskedLM`` (its default local/global
    schedule) at the benchmark's sizes, on the data's tokenizer ids."""
    import torch

    from linformer_ds.data.shards import ShardDataset

    c, ds = spec.config, ShardDataset(spec.data, "train")
    torch.manual_seed(spec.seed)
    common = dict(vocab_size=ds.vocab_size, hidden_size=c["hidden"],
                  num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                  max_position_embeddings=ds.seq_len, pad_token_id=ds.pad_id,
                  attn_implementation="sdpa")  # fmt: skip
    if spec.name == "hf-bert":
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(intermediate_size=c["intermediate"], hidden_dropout_prob=c["dropout"],
                         attention_probs_dropout_prob=c["dropout"], type_vocab_size=1,
                         **common)  # fmt: skip
        return BertForMaskedLM(cfg)
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    cfg = ModernBertConfig(
        intermediate_size=max(1, round(2 * c["intermediate"] / 3)),  # gated: equal FFN work
        embedding_dropout=c["dropout"], mlp_dropout=c["dropout"], attention_dropout=c["dropout"],
        bos_token_id=ds.cls_id, eos_token_id=ds.sep_id, cls_token_id=ds.cls_id,
        sep_token_id=ds.sep_id, **common,
    )  # fmt: skip
    return ModernBertForMaskedLM(cfg)


class HFArm:
    """``transformers.Trainer`` in a thread of this process; a callback hands control back at
    the end of the first step and whenever a slice of time is used (it waits on a queue)."""

    def __init__(self, spec: ArmSpec):
        import torch
        from transformers import Trainer, TrainerCallback, TrainingArguments

        from linformer_ds.config import load_config
        from linformer_ds.data.stages import open_stages
        from linformer_ds.data.stream import TrainData

        self.spec, c = spec, spec.config
        cfg = load_config(None, job_overrides(spec))
        stages, train_sets, _ = open_stages(cfg, 1, False)
        stream = TrainData(stages, train_sets, 0, 1, cfg.train.seed, "cpu",
                           mlm_probability=cfg.data.mlm_probability)  # fmt: skip
        stream.begin_step(1)
        self.tokens_per_step = c["batch"] * stream.seq_len
        self.first_batch: str | None = None
        arm = self

        class Rows(torch.utils.data.IterableDataset):
            def __iter__(self):
                while True:
                    b = stream.next_batch()
                    if arm.first_batch is None:
                        arm.first_batch = batch_digest(b)
                    yield {k: b[k] for k in ("input_ids", "attention_mask", "labels")}

        self.commands: queue.Queue[tuple[str, float]] = queue.Queue()
        self.reports: queue.Queue[tuple[str, Any]] = queue.Queue()

        class Slices(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                arm._mark, arm._times, arm._budget = time.perf_counter(), [], None

            def on_step_end(self, args, state, control, **kw):
                now = time.perf_counter()
                arm._times.append(now - arm._mark)
                if arm._budget is None or sum(arm._times) >= arm._budget:
                    arm.reports.put(("ok", arm._times))
                    cmd, seconds = arm.commands.get()
                    if cmd == "finish":
                        control.should_training_stop = True
                    arm._times, arm._budget = [], seconds
                arm._mark = time.perf_counter()

        self.bf16 = spec.precision == "bf16"
        self.model = hf_model(spec)
        args = TrainingArguments(
            output_dir=f"{spec.workdir}/hf", max_steps=c["schedule_steps"],
            per_device_train_batch_size=1, learning_rate=c["lr"], adam_beta1=0.9,
            adam_beta2=0.98, adam_epsilon=1e-6, weight_decay=0.01, max_grad_norm=1.0,
            lr_scheduler_type="linear", warmup_steps=c["warmup_steps"], bf16=self.bf16,
            use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
            eval_strategy="no", dataloader_num_workers=0, disable_tqdm=True, seed=spec.seed,
            remove_unused_columns=False,
        )  # fmt: skip
        self.trainer = Trainer(model=self.model, args=args, train_dataset=Rows(),
                               data_collator=lambda items: items[0], callbacks=[Slices()])  # fmt: skip
        self.done, self._times = False, []
        self.thread = threading.Thread(target=self._train, daemon=True)

    def _train(self) -> None:
        try:
            self.trainer.train()
            self.done = True  # at the schedule's end (--schedule-steps): the steps since
            self.reports.put(("ok", self._times))  # the last report
        except Exception:  # noqa: BLE001 - reported to the driver
            self.reports.put(("error", traceback.format_exc()))

    def _report(self) -> list[float]:
        status, value = self.reports.get()
        if status != "ok":
            raise RuntimeError(f"{self.spec.name}: the HF Trainer failed:\n{value}")
        return value

    def start(self) -> dict[str, Any]:
        self.thread.start()
        times = self._report()
        return {"first_step_s": time.time() - self.spec.started, "step_s": times,
                "tokens_per_step": self.tokens_per_step, "first_batch": self.first_batch,
                "params": sum(p.numel() for p in {id(p): p for p in
                                                   self.model.parameters()}.values())}  # fmt: skip

    def run(self, seconds: float) -> list[float]:
        if self.done:
            return []
        self.commands.put(("run", seconds))
        return self._report()

    def evaluate(self) -> float:
        if not self.done:
            self.commands.put(("finish", 0.0))
        self.thread.join()
        model = self.model.eval()

        def logits_of(b):
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            where = b["hidden"] != -100
            return logits[where], b["hidden"][where]

        return hidden_loss(logits_of, eval_batches(self.spec), autocast=self.bf16)

    def close(self) -> None:
        del self.trainer, self.model


def make_arm(spec: ArmSpec):
    return OursArm(spec) if spec.name.startswith("ours:") else HFArm(spec)


def _clean_rank_env() -> None:
    """A spawned arm is a single process of its own (no launcher variables inherited)."""
    from linformer_ds.dist_env import clear_launcher_vars

    clear_launcher_vars(os.environ)


def _worker(conn: Any, spec: ArmSpec) -> None:
    """A process owning one arm: answers ``start``/``run``/``eval``/``stop`` over its pipe."""
    try:
        _clean_rank_env()
        if spec.config["threads"]:
            import torch

            torch.set_num_threads(spec.config["threads"])
        arm = make_arm(spec)
        conn.send(("ok", arm.start()))
        while True:
            cmd, arg = conn.recv()
            if cmd == "run":
                conn.send(("ok", arm.run(arg)))
            elif cmd == "eval":
                conn.send(("ok", arm.evaluate()))
            else:
                arm.close()
                conn.send(("ok", {"peak_rss_gib": peak_rss_gib()}))
                return
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


class ProcessArm:
    """An arm in a spawned process of its own; the same calls, over a pipe."""

    def __init__(self, spec: ArmSpec):
        ctx = mp.get_context("spawn")
        self.name = spec.name
        self.conn, child = ctx.Pipe()
        spec.started = time.time()
        self.proc = ctx.Process(target=_worker, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._recv()

    def _recv(self) -> Any:
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name}: worker died (exit {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"{self.name}: worker failed:\n{value}")
        return value

    def run(self, seconds: float) -> list[float]:
        self.conn.send(("run", seconds))
        return self._recv()

    def evaluate(self) -> float:
        self.conn.send(("eval", 0.0))
        return self._recv()

    def close(self) -> dict[str, Any]:
        self.conn.send(("stop", 0.0))
        out = self._recv()
        self.proc.join(timeout=60)
        return out


class SharedArm:
    """An arm in this process (``--isolation shared``): no RSS of its own to report."""

    def __init__(self, spec: ArmSpec):
        self.name = spec.name
        if not spec.name.startswith("ours:"):  # the HF Trainer would take ours' rank variables
            _clean_rank_env()  # for a distributed run (DDP)
        spec.started = time.time()
        self.arm = make_arm(spec)
        self.info = self.arm.start()

    def run(self, seconds: float) -> list[float]:
        return self.arm.run(seconds)

    def evaluate(self) -> float:
        return self.arm.evaluate()

    def close(self) -> dict[str, Any]:
        self.arm.close()
        return {"peak_rss_gib": None}


# ========================================================================================= run
def arm_names(c: TrainerBenchConfig) -> list[str]:
    return [f"ours:{v}" for v in c.variants] + list(c.hf)


def steady_tokens_per_s(times: Sequence[float], tokens_per_step: int, warmup: int) -> float:
    """Tokens/s of the steps after the first ``warmup`` ones (all but the first when fewer)."""
    timed = list(times[warmup:]) or list(times[1:]) or list(times)
    return tokens_per_step * len(timed) / sum(timed)


def run_group(c: TrainerBenchConfig, data: str, seed: int, precision: str, workdir: Path,
              log=print) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of one (data, seed) group: the arms started in turn, trained interleaved for
    the same budget, evaluated, closed."""
    load_before = os.getloadavg()
    kind = ProcessArm if c.isolation == "process" else SharedArm
    arms, times = [], {}
    try:
        for name in arm_names(c):
            d = workdir / f"{Path(data).name}_{seed}_{name.replace(':', '_').replace('/', '_')}"
            spec = ArmSpec(name, data, seed, precision, asdict(c), str(d))
            arms.append(kind(spec))
            times[name] = list(arms[-1].info["step_s"])
            log(f"  {name}: first step after {arms[-1].info['first_step_s']:.1f} s")
        for rnd in range(c.rounds):
            for j in range(len(arms)):
                arm = arms[(rnd + j) % len(arms)]
                used = sum(times[arm.name])
                times[arm.name] += arm.run(max(0.0, c.budget_s * (rnd + 1) / c.rounds - used))
        losses = {arm.name: arm.evaluate() for arm in arms}
    finally:
        closed = {arm.name: arm.close() for arm in arms}
    load_after = os.getloadavg()
    n = arms[0].info["tokens_per_step"] // c.batch
    rows = []
    for arm in arms:
        ts, info = times[arm.name], arm.info
        row = {
            "n": n, "data": data, "seed": seed, "arm": arm.name, "params": info["params"],
            "first_step_s": info["first_step_s"], "steps": len(ts), "train_s": sum(ts),
            "tokens_per_s": steady_tokens_per_s(ts, info["tokens_per_step"], c.warmup),
            "hidden_loss": losses[arm.name], "first_batch": info["first_batch"],
            "schedule_end": len(ts) >= c.schedule_steps,  # stopped by the schedule, not the budget
            "step_s": ts, "load_avg_before": load_before, "load_avg_after": load_after,
            **closed[arm.name],
        }  # fmt: skip
        rows.append(row)
        log(f"N={n} seed={seed} {arm.name:<24} {row['tokens_per_s']:9.1f} tok/s  "
            f"{row['steps']} steps  hidden loss {row['hidden_loss']:.4f}")  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (N, arm): the means over seeds, and for ours the ratios to each HF arm computed from
    those means (tokens/s ours / HF; hidden loss ours - HF, below 0: ours is better)."""
    out: list[dict[str, Any]] = []
    for n in sorted({r["n"] for r in rows}):
        group = [r for r in rows if r["n"] == n]
        means = {}
        for arm in dict.fromkeys(r["arm"] for r in group):
            mine = [r for r in group if r["arm"] == arm]
            rss = [r["peak_rss_gib"] for r in mine if r.get("peak_rss_gib") is not None]
            means[arm] = {
                "n": n, "arm": arm, "seeds": [r["seed"] for r in mine],
                "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in mine),
                "first_step_s": statistics.mean(r["first_step_s"] for r in mine),
                "hidden_loss": statistics.mean(r["hidden_loss"] for r in mine),
                "hidden_loss_all": [r["hidden_loss"] for r in mine],
                "steps": statistics.mean(r["steps"] for r in mine),
                "peak_rss_gib": max(rss) if rss else None,
            }  # fmt: skip
        for arm, m in means.items():
            if arm.startswith("ours:"):
                for hf in HF_ARMS:
                    if hf in means:
                        m[f"speed_vs_{hf}"] = m["tokens_per_s"] / means[hf]["tokens_per_s"]
                        m[f"loss_minus_{hf}"] = m["hidden_loss"] - means[hf]["hidden_loss"]
            out.append(m)
    return out


def run_benchmark(c: TrainerBenchConfig, log=print) -> dict[str, Any]:
    c.validate()
    import torch

    c.threads = c.threads or torch.get_num_threads()  # every arm the same (ours: train.threads)
    precision, why = resolve_precision(c.precision)
    env = environment("bench.trainer_bench")
    env["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")  # every arm's (inherited)
    env["beside"], env["precision"], env["precision_why"] = c.beside, precision, why
    for name in ("transformers", "deepspeed", "accelerate"):
        env[name] = _version(name)
    log(f"precision {precision} ({why}); arms {arm_names(c)}")
    work = Path(tempfile.mkdtemp(prefix="trainer_bench_"))
    rows: list[dict[str, Any]] = []
    try:
        for data in c.data:
            for seed in c.seeds:
                rows += run_group(c, data, seed, precision, work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env["load_avg_end"] = os.getloadavg()
    return {"config": asdict(c), "environment": env, "rows": rows, "summary": summarize(rows)}


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _ratio(m: dict[str, Any], hf: str) -> str:
    if f"speed_vs_{hf}" not in m:
        return "-"
    return f"{m[f'speed_vs_{hf}']:.2f}x / {m[f'loss_minus_{hf}']:+.3f}"


def markdown_table(results: dict[str, Any]) -> str:
    c, env = results["config"], results["environment"]
    load = lambda x: "/".join(f"{v:.1f}" for v in x)  # noqa: E731
    lines = [
        f"{c['layers']} layers, d={c['hidden']}, {c['heads']} heads, FFN {c['intermediate']}, "
        f"k={c['k']}, batch {c['batch']} rows, {env['precision']} ({env['precision_why']}), "
        f"budget {c['budget_s']:g} s of training per arm in {c['rounds']} interleaved rounds, "
        f"seeds {c['seeds']}; {env['cpu']} ({env['cpu_count']} CPUs, {env['torch_threads']} "
        f"threads), torch {env['torch']}, deepspeed {env.get('deepspeed')}, transformers "
        f"{env.get('transformers')}; isolation {c['isolation']}; load average (1/5/15 min) "
        f"{load(env['load_avg_start'])} at start, {load(env['load_avg_end'])} at end; beside: "
        f"{env.get('beside') or 'not recorded'}",
        "",
        "| N | arm | tokens/s | first step (s) | steps | hidden-label loss (per seed) | "
        "peak RSS (GiB) | vs HF BERT: speed / loss | vs ModernBERT: speed / loss |",
        "|---:|---|---:|---:|---:|---|---:|---|---|",
    ]
    for m in results["summary"]:
        rss = m["peak_rss_gib"]
        lines.append(
            f"| {m['n']} | {m['arm']} | {m['tokens_per_s']:.0f} | {m['first_step_s']:.1f} | "
            f"{m['steps']:g} | {m['hidden_loss']:.3f} "
            f"({', '.join(f'{v:.3f}' for v in m['hidden_loss_all'])}) | "
            + (f"{rss:.2f}" if rss is not None else "-")
            + f" | {_ratio(m, 'hf-bert')} | {_ratio(m, 'hf-modernbert')} |"
        )
    return "\n".join(lines) + "\n"


# ========================================================================================= CLI
def parse_args(argv: Sequence[str] | None = None) -> TrainerBenchConfig:
    d = TrainerBenchConfig()
    p = argparse.ArgumentParser(prog="python -m bench.trainer_bench",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--data", nargs="+", required=True, help="data_prep output directories")
    p.add_argument("--variants", nargs="*", default=d.variants,
                   help="ours: projection kinds or KEY=VALUE;KEY=VALUE model overrides")  # fmt: skip
    p.add_argument("--hf", nargs="*", default=d.hf, help=f"some of {HF_ARMS}")
    p.add_argument("--seeds", type=int, nargs="+", default=d.seeds)
    for name in ("layers", "hidden", "heads", "intermediate", "k", "batch", "warmup_steps",
                 "schedule_steps", "rounds", "warmup", "eval_rows", "zero", "threads"):  # fmt: skip
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("dropout", "lr", "budget_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--precision", default=d.precision, help=f"one of {PRECISIONS}")
    p.add_argument("--isolation", default=d.isolation, help=f"one of {ISOLATIONS}")
    p.add_argument("--beside", default=d.beside, help="what else ran on the machine (recorded)")
    p.add_argument("--out", default=d.out)
    c = TrainerBenchConfig(**vars(p.parse_args(argv)))
    c.validate()
    return c


def main(argv: Sequence[str] | None = None) -> int:
    try:
        c = parse_args(argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = run_benchmark(c)
    for path in write_results(results, Path(c.out), markdown_table):
        print(f"wrote {path}")
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
