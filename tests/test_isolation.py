"""Document isolation in packed rows (issue 29): a packed row with ``position_ids`` restarting per
document gives the outputs, loss (sum of per-token cross-entropies) and every parameter gradient
of its documents run alone, each as its own row with positions from 0 (fp32, within 1e-6)."""

import json

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from linformer_ds.model import (
    LinformerForMaskedLM,
    LinformerForMaskedLMPretraining,
    ModelConfig,
    document_spans,
)

TOL = 1e-6  # absolute for hidden states; gradients and the loss: relative to max(1, |reference|)
SHARINGS = ("none", "headwise", "kv", "layerwise")
SCHEDULES = ("linear", "conv", "hybrid", "dense")
N = 24  # row length (conv stride 32 / 4 = 8: windows cross document ends)
WORST: dict[str, float] = {}  # the largest deviation seen per quantity (printed with -s)


def config(projection: str, sharing: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=40, max_seq_len=32, hidden_size=16, num_layers=3, num_heads=2,
        intermediate_size=24, k=4, dropout=0.0, attention_dropout=0.0, sharing=sharing,
        projection=projection,
    )  # fmt: skip


def make_model(projection: str, sharing: str) -> LinformerForMaskedLMPretraining:
    torch.manual_seed(0)
    model = LinformerForMaskedLMPretraining(config(projection, sharing))
    with torch.no_grad():  # non-zero biases so padding and window tails matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    return model


def packed_row(
    lengths: list[int], pad: int, pad_pos_zero: bool, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """``(ids, mask, position_ids, labels)`` ``[N]`` of documents of ``lengths`` then ``pad``
    padding tokens (positions 0, or continuing the last document)."""
    total = sum(lengths)
    ids = torch.randint(4, 40, (total + pad,), generator=gen)
    ids[total:] = 0
    mask = torch.ones(total + pad, dtype=torch.long)
    mask[total:] = 0
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(0, dtype=torch.long)])
    tail = torch.zeros(pad, dtype=torch.long) if pad_pos_zero else lengths[-1] + torch.arange(pad)
    pos = torch.cat([pos, tail])
    labels = torch.randint(4, 40, (total + pad,), generator=gen)
    labels[torch.rand(total + pad, generator=gen) < 0.3] = -100
    labels[total:] = -100
    return ids, mask, pos, labels


def run(model, ids, mask, pos, labels):
    """Hidden states, summed loss and gradients of one batch."""
    model.zero_grad()
    hidden = model.encoder(ids, mask, position_ids=pos)
    out = model(ids, mask, labels=labels, loss_denominator=torch.tensor(1.0), position_ids=pos)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), out.loss.detach(), grads


def note(what: str, dev: float) -> None:
    WORST[what] = max(WORST.get(what, 0.0), dev)


def check_packed_equals_alone(model, rows: list[tuple[list[int], int, bool]], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    built = [packed_row(lengths, pad, zero, gen) for lengths, pad, zero in rows]
    ids, mask, pos, labels = (torch.stack(t) for t in zip(*built))
    hidden, loss, grads = run(model, ids, mask, pos, labels)
    # every document alone: its own [1, L] row, positions 0..L-1, no padding
    alone_loss = torch.zeros(())
    alone_grads: dict[str, torch.Tensor] = {}
    for r, (lengths, _, _) in enumerate(rows):
        start = 0
        for length in lengths:
            sl = slice(start, start + length)
            a_ids, a_lab = ids[r : r + 1, sl], labels[r : r + 1, sl]
            a_hidden, a_loss, a_grads = run(model, a_ids, None, None, a_lab)
            dev = (hidden[r, sl] - a_hidden[0]).abs().max().item()
            note("hidden", dev)
            assert dev <= TOL, f"row {r} document at {start}: hidden states differ by {dev}"
            alone_loss = alone_loss + a_loss
            for n, g in a_grads.items():
                alone_grads[n] = alone_grads[n] + g if n in alone_grads else g
            start += length
    dev = abs(loss.item() - alone_loss.item())
    note("loss", dev)
    note("loss_relative", dev / max(1.0, abs(alone_loss.item())))
    assert dev <= TOL * max(1.0, abs(alone_loss.item())), f"loss {loss} vs {alone_loss}"
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = grads.get(n, torch.zeros_like(p))
        ref = alone_grads.get(n, torch.zeros_like(p))
        dev = (g - ref).abs().max().item()
        scale = max(1.0, ref.abs().max().item())  # fp32 rounding grows with the magnitude
        note("gradient", dev)
        note("gradient_relative", dev / scale)
        assert dev <= TOL * scale, f"gradient of {n} differs by {dev} (scale {scale:.3g})"


@st.composite
def rows_strategy(draw):
    """One or two rows of N tokens: documents of random lengths, then padding."""
    out = []
    for _ in range(draw(st.integers(1, 2))):
        used = draw(st.integers(1, N))  # real tokens; the rest is padding
        cuts = draw(st.sets(st.integers(1, max(1, used - 1)), max_size=3)) if used > 1 else set()
        bounds = [0] + sorted(cuts) + [used]  # at most 4 documents
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        out.append((lengths, N - used, draw(st.booleans())))
    return out


# both ways of running linear and conv layers over the documents: one product and attention
# per span (the CPU default), and batched over chunks (the default on accelerators)
PER_SPAN = pytest.mark.parametrize("per_span", [True, False], ids=["per_span", "chunks"])


@PER_SPAN
@pytest.mark.parametrize(
    "projection,sharing",
    [(p, s) for p in SCHEDULES if p != "dense" for s in SHARINGS] + [("dense", "none")],
)
@settings(max_examples=5, deadline=None, derandomize=True, phases=[Phase.generate])
@given(rows=rows_strategy(), seed=st.integers(0, 2**16))
def test_packed_row_equals_documents_alone(projection, sharing, per_span, rows, seed):
    model = make_model(projection, sharing)
    model.encoder.document_per_span = per_span
    check_packed_equals_alone(model, rows, seed)


@PER_SPAN
@pytest.mark.parametrize("projection", SCHEDULES)
def test_fixed_split_across_windows(projection, per_span):
    """Documents of 5, 11 and 3 tokens, 5 padding: conv windows of 8 end inside documents."""
    model = make_model(projection, "none")
    model.encoder.document_per_span = per_span
    check_packed_equals_alone(model, [([5, 11, 3], 5, True), ([24], 0, False)], seed=1)


@pytest.mark.parametrize("projection", SCHEDULES)
def test_single_document_row_unchanged(projection):
    """A padded one-document row: the same result with and without position_ids."""
    model = make_model(projection, "layerwise").eval()
    gen = torch.Generator().manual_seed(3)
    ids, mask, pos, labels = (t[None] for t in packed_row([17], 7, False, gen))
    with torch.no_grad():
        plain = model.encoder(ids, mask)
        iso = model.encoder(ids, mask, position_ids=pos)
        iso_zero = model.encoder(ids, mask, position_ids=torch.where(mask.bool(), pos, 0))
    assert torch.equal(plain, iso)
    assert torch.equal(plain[:, :17], iso_zero[:, :17])


def test_masked_lm_head_accepts_position_ids():
    torch.manual_seed(0)
    model = LinformerForMaskedLM(config("linear", "kv")).eval()
    ids = torch.randint(4, 40, (1, 10))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        packed = model(ids, position_ids=pos).logits
        alone = model(ids[:, 4:7]).logits
    assert (packed[:, 4:7] - alone).abs().max() <= TOL


def test_document_spans():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [3, 4, 0, 1, 2, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    docs = document_spans(pos, mask)
    assert [(s.row, s.start, s.end, s.padded) for s in docs.spans] == [
        (0, 0, 3, False), (0, 3, 5, False), (0, 5, 8, True), (1, 0, 2, False), (1, 2, 8, False),
    ]  # fmt: skip
    assert not docs.whole_rows
    # sequence-parallel slice [4, 8) of the same rows: the documents crossing position 4 shared
    docs = document_spans(pos, mask, offset=4, n_local=4)
    assert [(s.row, s.start, s.end, s.column, s.shared) for s in docs.spans] == [
        (0, 0, 1, 1, 0), (0, 1, 4, 0, -1), (1, 0, 4, 2, 1),
    ]  # fmt: skip
    assert docs.num_shared == 2
    with pytest.raises(ValueError, match="position_ids must lie"):
        document_spans(pos + 40, mask, max_position=32)


def test_worst_deviations_reported():
    """Runs last in this file: prints the largest deviations seen (pytest -s)."""
    print("isolation worst deviations:", {k: f"{v:.2e}" for k, v in WORST.items()})


def check_export_on_packed_row(exported) -> tuple:
    """The exported MLM given a packed row (4 documents, 16 padding) with position_ids equals
    the training model with its weights; the same row left-padded too. Returns the training
    model and the row's ids."""
    from linformer_ds.model import LinformerForMaskedLM as TrainingMLM

    torch.manual_seed(0)
    training = TrainingMLM(exported.encoder.config).eval()
    training.load_state_dict(exported.state_dict(), strict=False)
    lengths, pad = [9, 20, 4, 15], 16
    ids = torch.randint(5, 1000, (1, sum(lengths) + pad))
    ids[:, sum(lengths) :] = 0
    mask = (ids != 0).long()
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])[None]
    with torch.no_grad():
        ref = training(ids, mask, position_ids=pos).logits
        got = exported(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        left = exported(input_ids=ids.roll(pad, 1), attention_mask=mask.roll(pad, 1),
                        position_ids=pos.roll(pad, 1)).logits.roll(-pad, 1)  # fmt: skip
    real = mask[0].bool()
    assert (got - ref)[:, real].abs().max() <= 1e-5
    assert (left - ref)[:, real].abs().max() <= 1e-5
    return training, ids


def test_export_accepts_position_ids(tmp_path):
    """The exported MLM (remote code, loaded by transformers) given a packed row with
    position_ids equals the training model; right and left padding agree; a one-document row
    gives the same logits with position_ids 0..n-1 as without."""
    import sys
    from pathlib import Path

    from transformers import AutoModelForMaskedLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_hf_heads import tiny_export

    out = tiny_export(tmp_path)
    exported = AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True).eval()
    _, ids = check_export_on_packed_row(exported)
    with torch.no_grad():
        one = ids[:, :30]
        plain = exported(input_ids=one).logits
        counted = exported(input_ids=one, position_ids=torch.arange(30)[None]).logits
    assert torch.equal(plain, counted)


def test_masking_adds_position_ids_only_when_isolating():
    """MLMMasking(document_sep_id=sep): position_ids from the row before masking (0 at the row
    start and after every sep); without it the output is unchanged (no position_ids)."""
    from linformer_ds.data.masking import MLMMasking, document_positions

    sep = 3
    tokens = torch.tensor(
        [[1, 7, 8, sep, 9, sep, 5, 6, 7, 0, 0], [1, 6, 6, 6, 6, 6, sep, 5, 5, 5, 5]]
    )
    want = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    assert torch.equal(document_positions(tokens, sep), want)
    plain = MLMMasking(40, 4, [0, 1, 2, 3, 4], mlm_probability=0.5, seed=1)
    iso = MLMMasking(40, 4, [0, 1, 2, 3, 4], mlm_probability=0.5, seed=1, document_sep_id=sep)
    a, b = plain(tokens, torch.arange(2), 0), iso(tokens, torch.arange(2), 0)
    assert "position_ids" not in a and torch.equal(b.pop("position_ids"), want)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def short_documents_corpus(tmp_path):
    """data_prep (full packing, N = 128) on short documents (8 lines of stdlib source each):
    several documents per row."""
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    from tests.pretrain_utils import REPO

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = [ln for f in sorted((stdlib / "email").glob("*.py"))
             for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]  # fmt: skip
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "\n".join(lines[i : i + 8])}) + "\n"
                            for i in range(0, len(lines), 8)))  # fmt: skip
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "data_prep", "--source", str(docs), "--out", str(data),
         "--seq-len", "128", "--vocab-size", "2000", "--valid-fraction", "0.05", "--quiet"],
        check=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    return data


def test_trainer_isolation_auto_on_full_packing(tmp_path):
    """A one-rank run on full-packed data: ``data.document_isolation=auto`` turns isolation on
    (the [setup] line says so), training and evaluation run, and the first loss differs from
    the same run without isolation (the documents no longer see each other)."""
    from tests.pretrain_utils import read_metrics, run_pretrain

    data = short_documents_corpus(tmp_path)
    losses = {}
    for setting in ("auto", "false"):
        run_dir = tmp_path / setting
        proc = run_pretrain(
            data, run_dir, nproc=1, launcher="python",
            overrides=[f"data.document_isolation={setting}", "train.max_steps=2",
                       "train.eval_interval=2", "train.eval_batches=1", "model.num_layers=2"],
        )  # fmt: skip
        setup = [ln for ln in proc.stdout.splitlines() if ln.startswith("[setup]")][0]
        want = "isolation=on (auto: full packing)" if setting == "auto" else "isolation=off"
        assert want in setup, setup
        losses[setting] = read_metrics(run_dir)[1]["loss"]
        assert read_metrics(run_dir, "eval"), "no eval record"
    assert losses["auto"] != losses["false"], losses


def test_isolation_bench_dry_run(tmp_path):
    """bench.isolation_bench at a tiny size: a row per variant with both step times, the rows'
    documents cut as asked."""
    from bench.isolation_bench import IsolationBenchConfig, document_position_ids, main

    pos = document_position_ids(3, 64, 8, seed=0)
    assert ((pos == 0).sum(dim=1) == 8).all()
    bc = IsolationBenchConfig(
        seq_len=64, docs=4, batch=2, layers=2, hidden=32, heads=2, intermediate=64, k=8,
        vocab=100, warmup=0, iters=1, precision="fp32", device="cpu", out=str(tmp_path),
    )  # fmt: skip
    skip = ("variants", "attention_dropout", "mlm_fraction")  # not options of the command
    args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(bc).items() if k not in skip]
    assert main(args + ["--variants", "linear", "conv", "hybrid", "dense"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["linear", "conv", "hybrid", "dense"]
    assert all(r["packed_ms"] > 0 and r["isolated_ms"] > 0 for r in rows)
    assert "| linear | 64 | 2 | 4 |" in (tmp_path / "results.md").read_text()
