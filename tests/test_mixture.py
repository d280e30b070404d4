"""linformer_ds.data (sampler, stream): the blended stream tracks its weights at every prefix, re-shards to any
rank count, resumes exactly, and one source is the TrainBatches stream from before mixtures
(tests/legacy_batches.py) bit for bit."""

import json
import math
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.sampler import MixtureSampler, normalized_weights
from linformer_ds.data.shards import DataError, ShardDataset, check_same_tokenizer, open_sources
from linformer_ds.data.stages import Stage, combine_eval
from linformer_ds.data.stream import MixtureBatches
from tests.legacy_batches import TrainBatches
from tests.pretrain_utils import (
    PRETRAIN,
    REPO,
    TEST_OVERRIDES,
    TINY_CONFIG,
    child_env,
    free_port,
    read_metrics,
    run_pretrain,
)

weights_st = st.lists(
    st.one_of(st.integers(0, 20).map(float), st.floats(1e-3, 1.0)), min_size=1, max_size=6
).filter(lambda w: sum(w) > 0)


def sampler(sizes, weights, rank=0, world=1, seed=3, **kw) -> MixtureSampler:
    return MixtureSampler(
        [f"s{i}" for i in range(len(sizes))], sizes, weights, rank, world, seed, **kw
    )


def global_stream(sizes, weights, world, rounds, seed=3, state=None):
    """The global stream (source, epoch, row) read through ``world`` ranks in lockstep."""
    ranks = [sampler(sizes, weights, r, world, seed) for r in range(world)]
    if state is not None:
        for s in ranks:
            s.load_state_dict(state)
    out = []
    for _ in range(rounds):
        out += [s.next() for s in ranks]
    states = [s.state_dict() for s in ranks]
    assert all(x == states[0] for x in states)  # the state is the same on every rank
    return out, states[0]


# ======================================================================= blending invariants
@settings(max_examples=60, deadline=None)
@given(weights=weights_st, n=st.integers(1, 400))
def test_realized_shares_track_weights_at_every_prefix(weights, n):
    w = normalized_weights(weights)
    s = sampler([5] * len(w), weights)
    counts = np.zeros(len(w))
    for p in range(1, n + 1):
        i, _, _ = s.next()
        counts[i] += 1
        dev = counts - np.array(w) * p
        # proven for the max-gap rule: never more than one ahead, never S - 1 behind
        assert dev.max() < 1.0 + 1e-9
        assert dev.min() > -(len(w) - 1) - 1e-9
        if len(w) == 2:
            assert np.abs(dev).max() < 1.0 + 1e-9
        assert all(c == 0 for c, x in zip(counts, w) if x == 0)  # weight 0: never drawn
    assert s.shares() == {f"s{i}": c / n for i, c in enumerate(counts)}


def test_shares_within_one_percent_after_200_samples():
    s = sampler([37, 11], [0.75, 0.25])
    for _ in range(200):
        s.next()
    shares = s.shares()
    assert shares == {"s0": 0.75, "s1": 0.25}  # 150 / 50 exactly
    # the small source wrapped: 50 draws from 11 rows = 4 whole epochs + 6 rows
    assert s.epochs()["s1"] == pytest.approx(50 / 11)
    assert s.state_dict()["sources"]["s1"]["epoch"] == 4


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    data=st.data(),
)
def test_each_source_walks_its_own_permutations(sizes, data):
    weights = data.draw(st.lists(st.floats(0.05, 1.0), min_size=len(sizes), max_size=len(sizes)))
    s = sampler(sizes, weights)
    seen = {i: [] for i in range(len(sizes))}
    for _ in range(60):
        i, e, row = s.next()
        seen[i].append((e, row))
    for i, rows in seen.items():
        for k, (e, row) in enumerate(rows):  # draw k of source i: epoch k // n, its permutation
            assert e == k // sizes[i]
            assert row == s.permutation(i, e)[k % sizes[i]]


# ================================================================== sharding and exact resume
@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=2, max_size=4),
    world=st.integers(1, 4),
    total=st.integers(0, 60),
)
def test_global_stream_does_not_depend_on_rank_count(sizes, world, total):
    weights = [1.0 + i for i in range(len(sizes))]
    rounds = total // world
    ref, ref_state = global_stream(sizes, weights, 1, rounds * world)
    got, state = global_stream(sizes, weights, world, rounds)
    assert got == ref
    assert state == ref_state


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    w1=st.integers(1, 4),
    w2=st.integers(1, 4),
    k=st.integers(0, 30),
)
def test_resume_at_any_point_on_any_rank_count(sizes, w1, w2, k):
    """Saved after k rounds of w1 ranks, resumed on w2 ranks: the same continuation as a run
    that never stopped and switched to w2 ranks at that point (for one source: today's rule)."""
    weights = [2.0, 1.0, 0.5, 3.0][: len(sizes)]
    if len(sizes) == 1 and max(w1, w2) > sizes[0]:
        sizes = [max(w1, w2) + sizes[0]]
    _, state = global_stream(sizes, weights, w1, k)
    ranks = [sampler(sizes, weights, r, w1) for r in range(w1)]
    for _ in range(k):
        for s in ranks:
            s.next()
    # the uninterrupted objects, re-sharded in place to w2 ranks
    cont = [sampler(sizes, weights, r, w2) for r in range(w2)]
    for s in cont:
        s.load_state_dict(ranks[0].state_dict())
    resumed, _ = global_stream(sizes, weights, w2, 10, state=state)
    ref = []
    for _ in range(10):
        ref += [s.next() for s in cont]
    assert resumed == ref
    if len(sizes) > 1:  # several sources: the stream is independent of the rank counts
        full, _ = global_stream(sizes, weights, 1, k * w1 + 10 * w2)
        assert resumed == full[k * w1 :]


def test_load_state_refuses_other_sources_and_changed_data():
    s = sampler([5, 7], [1, 1])
    s.next()
    with pytest.raises(ValueError, match="the checkpoint's mixture has sources"):
        sampler([5, 7, 9], [1, 1, 1]).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="dataset changed"):
        sampler([5, 4], [1, 1]).load_state_dict(s.state_dict())


def test_bad_weights():
    for bad, msg in (([1, -1], "negative"), ([0, 0], "all weights are zero"),
                     ([1, math.nan], "not a finite"), ([math.inf], "not a finite")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            normalized_weights(bad)


# ======================================================= one source = today's TrainBatches
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    world=st.integers(1, 4),
    mb=st.integers(1, 5),
    steps=st.integers(1, 25),
    world2=st.integers(1, 4),
)
def test_one_source_is_todays_sampler(n, world, mb, steps, world2):
    """Indices, epochs and the saved state of one source equal ResumableDistributedSampler's as
    TrainBatches drives it, across epoch ends and a resume on another rank count."""
    n = max(n, world, world2)

    class Rows:  # TrainBatches only asks the length here (indices are compared, not rows)
        path, split = "rows", "train"

        def __len__(self):
            return n

    def todays(rank, w, state=None):
        tb = TrainBatches(Rows(), None, rank, w, mb, seed=11)
        if state is not None:
            tb.load_state_dict(state)
        return tb

    old = [todays(r, world) for r in range(world)]
    new = [sampler([n], [1.0], r, world, seed=11) for r in range(world)]
    for _ in range(steps):
        for o, m in zip(old, new):
            want = [o._next_index() for _ in range(mb)]
            got = [m.next() for _ in range(mb)]
            assert want == [row for _, _, row in got]
            assert got[-1][1] == o.epoch  # the batch's epoch (TrainBatches masks with it)
    st_old = old[0].state_dict()
    src = new[0].state_dict()["sources"]["s0"]
    assert (src["epoch"], src["consumed"]) == (st_old["epoch"], st_old["sampler"]["consumed"])
    # resume both on world2 ranks
    old2 = [todays(r, world2, st_old) for r in range(world2)]
    new2 = [sampler([n], [1.0], r, world2, seed=11) for r in range(world2)]
    for m in new2:
        m.load_state_dict(new[0].state_dict())
    for _ in range(steps):
        for o, m in zip(old2, new2):
            assert [o._next_index() for _ in range(mb)] == [m.next()[2] for _ in range(mb)]


def test_one_source_batches_equal_train_batches(tiny_corpus):
    """Rows and masks: MixtureBatches over one source == TrainBatches, 2 ranks, many epochs."""
    ds = ShardDataset(tiny_corpus, "valid")  # small: the run crosses several epochs
    n, mb, world = len(ds), 3, 2
    masker = MLMMasking(ds.vocab_size, ds.mask_id, ds.special_ids, 0.15, seed=5, pad_id=ds.pad_id,
                        short_seq_prob=0.1)  # fmt: skip
    for rank in range(world):
        old = TrainBatches(ds, masker, rank, world, mb, seed=5)
        new = MixtureBatches(["only"], [ds], [1.0], rank, world, mb, seed=5,
                             mlm_probability=0.15, short_seq_prob=0.1)  # fmt: skip
        for _ in range(3 * n // (mb * world) + 2):
            a, b = old.next_batch(), new.next_batch()
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert new.epoch == old.epoch >= 2


# ================================================================== real sources, real checks
PROSE = (
    "the a of to and in is that for it as with on by this be are from or at an which not have "
    "model sequence attention training layer token rank data shard corpus step loss memory "
    "projection encoder length checkpoint gradient matrix vector batch value key query head "
    "linear dense window source weight mixture stage epoch sample split valid train write read"
).split()


def docs_corpus(tmp_path_factory) -> str:
    """A second corpus: 16 English-like documents generated from a fixed seed (the same bytes on
    every machine and commit; the repository's docs/*.md used to be it, and an edit of those
    moved every document of the first 12 into the train split). A glob for data_prep."""
    base = tmp_path_factory.getbasetemp() / "docs_corpus"
    if not base.exists():
        import random

        rng = random.Random(23)
        syllables = "ka lo mi ne su ta ri po de va gu ze shi tor ban lek mur pin sol dra".split()
        words = PROSE + ["".join(rng.choices(syllables, k=rng.randint(2, 4))) for _ in range(400)]
        tmp = tmp_path_factory.mktemp("docs_corpus_tmp")
        for i in range(16):
            paras = []
            for _ in range(rng.randint(4, 9)):
                line = [rng.choice(words) for _ in range(rng.randint(40, 90))]
                paras.append(" ".join(line).capitalize() + ".")
            (tmp / f"doc_{i:02d}.md").write_text(f"# Document {i}\n\n" + "\n\n".join(paras) + "\n")
        tmp.rename(base)
    return str(base / "*.md")


def prepare(out, source, seq_len, *flags):
    """``python -m data_prep`` into ``out`` (quiet); returns ``out``."""
    cmd = [sys.executable, "-m", "data_prep", "--source", str(source), "--out", str(out),
           "--seq-len", str(seq_len), "--quiet", *map(str, flags)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)
    return out


@pytest.fixture(scope="module")
def second_source(tiny_corpus, tmp_path_factory):
    """A second corpus (this repo's docs) prepared with tiny_corpus's tokenizer, N = 128."""
    out = tmp_path_factory.mktemp("docs") / "docs_128"
    return prepare(out, docs_corpus(tmp_path_factory), 128, "--tokenizer", tiny_corpus / "tokenizer.model",
                   "--valid-fraction", "0.2", "--max-docs", "12")  # fmt: skip


def test_two_sources_mask_each_row_by_its_source(tiny_corpus, second_source):
    names = ["code", "docs"]
    dss = open_sources(names, [tiny_corpus, second_source], "train")
    mb = 4
    mix = MixtureBatches(names, dss, [0.75, 0.25], 0, 1, mb, seed=9)
    maskers = mix.maskers
    assert maskers[0].seed != maskers[1].seed  # sources have their own mask randomness
    ref = MixtureSampler(names, [len(d) for d in dss], [0.75, 0.25], 0, 1, seed=9)
    for _ in range(60):
        batch = mix.next_batch()
        for r in range(mb):
            i, e, row = ref.next()
            want = maskers[i](dss[i][row][None], torch.tensor([row]), e)
            assert all(torch.equal(batch[k][r], want[k][0]) for k in want)
    shares = mix.shares()
    assert abs(shares["code"] - 0.75) <= 1 / 240 and abs(shares["docs"] - 0.25) <= 1 / 240
    assert mix.epochs()["docs"] == pytest.approx(60 / len(dss[1]))


@pytest.fixture(scope="module")
def other_sources(tiny_corpus, tmp_path_factory):
    """A corpus with its own tokenizer, and the docs at N = 64 with the shared one."""
    base = tmp_path_factory.mktemp("others")
    docs = docs_corpus(tmp_path_factory)
    other = prepare(
        base / "other_tok",
        docs,
        128,
        "--vocab-size",
        "300",
        "--max-docs",
        "6",
        "--valid-fraction",
        "0",
    )  # 6 documents: no valid split (else refused empty)
    short = prepare(base / "short", docs, 64, "--tokenizer", tiny_corpus / "tokenizer.model",
                    "--max-docs", "6", "--valid-fraction", "0")  # fmt: skip
    return other, short


def test_sources_must_share_tokenizer_and_n(tiny_corpus, second_source, other_sources):
    other, short = other_sources
    a, b = ShardDataset(tiny_corpus), ShardDataset(other)
    with pytest.raises(DataError, match="different tokenizers"):
        check_same_tokenizer(["a", "b"], [a, b])
    with pytest.raises(DataError, match="different sequence lengths"):
        check_same_tokenizer(["a", "s"], [a, ShardDataset(short)])
    check_same_tokenizer(["a", "s"], [a, ShardDataset(short)], same_seq_len=False)
    check_same_tokenizer(["a", "d"], [a, ShardDataset(second_source)])


# ============================================================================ the trainer
def sources_override(*entries) -> str:
    """``data.sources=[...]`` for the command line: entries of (name, path, weight)."""
    items = ", ".join(f"{{name: {n}, path: '{p}', weight: {w}}}" for n, p, w in entries)
    return f"data.sources=[{items}]"


MIX_STEPS = 30  # 2 ranks x 4 rows = 8 samples a step: 200 samples at step 25


def mix_overrides(tiny_corpus, second_source):
    return [
        sources_override(("code", tiny_corpus, 0.75), ("docs", second_source, 0.25)),
        f"train.max_steps={MIX_STEPS}", "train.eval_interval=15", "train.eval_batches=2",
        "checkpoint.save_interval=10",
    ]  # fmt: skip


def sample_picks(run_dir) -> dict[int, list]:
    """step -> the [source, row] pairs both ranks trained on (the trainer's sample log; a step
    replayed after a resume counts once, as its last record)."""
    last: dict[tuple, list] = {}
    for path in sorted((run_dir / "samples").glob("samples.rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            last[rec["step"], rec["rank"]] = [tuple(x) for x in rec["indices"]]
    out: dict[int, list] = {}
    for (step, _), picks in sorted(last.items()):
        out.setdefault(step, []).extend(picks)
    return out


def launch(run_dir, overrides) -> subprocess.Popen:
    ov = TEST_OVERRIDES + [f"logging.dir={run_dir}", f"debug.sample_log={run_dir / 'samples'}"]
    ov += list(overrides)
    env = child_env()
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), PRETRAIN,
           "--config", TINY_CONFIG, *ov]  # fmt: skip
    log = open(run_dir / "launch.log", "a")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def logged_steps(run_dir) -> set:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return set()
    steps = set()
    for line in text.splitlines():
        try:
            steps.add(json.loads(line)["step"])
        except ValueError:
            pass  # a line being written
    return steps


def rank_processes(proc: subprocess.Popen, timeout: float = 180) -> list[psutil.Process]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if PRETRAIN in p.cmdline() and "RANK" in p.environ():
                    found.append(p)
            except psutil.Error:
                continue
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise AssertionError("the training ranks did not start")


@pytest.fixture(scope="module")
def mixture_runs(tiny_corpus, second_source, tmp_path_factory):
    """Two 2-rank runs of the same 0.75 / 0.25 mixture: uninterrupted, and SIGKILLed (rank 1,
    a few steps after the step-10 checkpoint) then restarted to the end."""
    ov = mix_overrides(tiny_corpus, second_source)
    ref = tmp_path_factory.mktemp("mix_ref")
    # data.path is ignored when data.sources is set
    run_pretrain(tiny_corpus, ref, ov + [f"debug.sample_log={ref / 'samples'}"])
    crashed = tmp_path_factory.mktemp("mix_crash")
    proc = launch(crashed, ov)
    ranks = rank_processes(proc)
    deadline = time.time() + 300
    while not logged_steps(crashed) & set(range(12, MIX_STEPS)):
        assert time.time() < deadline and proc.poll() is None, "no step 12 before the kill"
        time.sleep(0.005)
    ranks[1].send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=120)
    killed_after = max(logged_steps(crashed))
    final = run_pretrain(tiny_corpus, crashed, ov + [f"debug.sample_log={crashed / 'samples'}"])
    return ref, crashed, final, rc, killed_after, tiny_corpus, second_source


def test_two_rank_mixture_shares_eval_and_exact_resume_after_kill(mixture_runs):
    ref, crashed, final, rc, killed_after, code, docs = mixture_runs
    # realized shares after 200 samples (step 25): the trainer's figure and the rows it read
    rec = read_metrics(ref)[25]
    assert abs(rec["share/code"] - 0.75) <= 0.01 and abs(rec["share/docs"] - 0.25) <= 0.01
    picks = sample_picks(ref)
    first_200 = [src for s in range(1, 26) for src, _ in picks[s]]
    assert len(first_200) == 200
    assert (first_200.count(0), first_200.count(1)) == (150, 50)
    assert rec["share/code"] == 150 / 200
    # per-source epochs: the rows each source gave so far over its train rows
    rows = {"code": len(ShardDataset(code, "train")), "docs": len(ShardDataset(docs, "train"))}
    assert rec["epochs/code"] == pytest.approx(150 / rows["code"])
    assert rec["epochs/docs"] == pytest.approx(50 / rows["docs"])
    # per-source evaluation: loss, perplexity and accuracy of each source; the mixture's figures
    # are the weighted means
    for step in (15, 30):
        ev = read_metrics(ref, "eval")[step]
        for name in ("code", "docs"):
            assert ev[f"perplexity/{name}"] == pytest.approx(math.exp(ev[f"loss/{name}"]))
            assert 0.0 <= ev[f"mlm_accuracy/{name}"] <= 1.0
        assert ev["loss"] == pytest.approx(0.75 * ev["loss/code"] + 0.25 * ev["loss/docs"])
        assert ev["loss/code"] != ev["loss/docs"]
    # the kill: a non-zero exit after step 12; the restart resumed from a checkpoint before it
    assert rc != 0 and 12 <= killed_after < MIX_STEPS
    assert "[resume] " in final.stdout
    # bit-identical losses of every step, and the same evaluations, as the uninterrupted run
    a, b = read_metrics(ref), read_metrics(crashed)
    assert [a[s]["loss"] for s in range(1, MIX_STEPS + 1)] == [
        b[s]["loss"] for s in range(1, MIX_STEPS + 1)
    ]
    assert read_metrics(ref, "eval") == read_metrics(crashed, "eval")
    assert sample_picks(crashed) == picks


# ========================================================== bad input: one line, exit 2
BAD = [  # id, sources (name, path key, weight), more overrides, the message
    ("negative-weight", [("a", "code", -1), ("b", "docs", 1)], [], "data.sources[0].weight"),
    ("all-zero", [("a", "code", 0), ("b", "docs", 0)], [], "all weights are zero"),
    ("nan-weight", [("a", "code", ".nan"), ("b", "docs", 1)], [], "must be a finite number"),
    ("unknown-name", [("a", "code", 1)],
     ["train.stages=[{end_step: 2, sources: [b]}]"], "unknown source 'b'"),
    ("other-tokenizer", [("a", "code", 1), ("b", "other", 1)], [], "different tokenizers"),
    ("other-n", [("a", "code", 1), ("b", "short", 1)], [], "different sequence lengths"),
    ("end-steps", [("a", "code", 1), ("s", "short", 1)],
     ["train.stages=[{end_step: 2, sources: [s]}, {end_step: 2, sources: [a]}]"],
     "must be greater than the previous stage's end"),
    ("n-over-max", [("a", "code", 1), ("s", "short", 1)],
     ["model.max_seq_len=64", "train.stages=[{end_step: 1, sources: [s]}, {sources: [a]}]"],
     "dataset seq_len 128 > model max_seq_len 64"),
    ("conv-stride", [("a", "code", 1), ("s", "short", 1)],
     ["model.projection=conv", "model.k=1",
      "train.stages=[{end_step: 1, sources: [s]}, {sources: [a]}]"], "conv layer 0 has stride"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_mixtures_and_stages_are_one_line_exit_2(
    case, tiny_corpus, second_source, other_sources, tmp_path, capsys, _clean_env
):
    from linformer_ds import train

    _, entries, more, message = case
    paths = {"code": tiny_corpus, "docs": second_source, "other": other_sources[0],
             "short": other_sources[1]}  # fmt: skip
    argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"logging.dir={tmp_path}",
            sources_override(*[(n, paths[k], w) for n, k, w in entries]),
            "train.max_steps=2", *more]  # fmt: skip
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "checkpoints").exists()


def test_per_source_figures_reach_prometheus(tmp_path):
    """combine_eval's record (the mixture's weighted figures + each source's) and the train
    record's shares, served as labelled gauges."""
    from linformer_ds.config import load_config
    from linformer_ds.metrics import Metrics
    from linformer_ds.prometheus import TARGETS_FILE
    from tests.test_observability import scrape

    stage = Stage(10, ["web", "code"], ["w", "c"], [0.75, 0.25], 4)
    figures = {
        "web": {"loss": 2.0, "perplexity": math.exp(2.0), "mlm_accuracy": 0.5},
        "code": {"loss": 4.0, "perplexity": math.exp(4.0), "mlm_accuracy": 0.25},
    }
    record = combine_eval(stage, figures, legacy=False)
    assert record["loss"] == 0.75 * 2.0 + 0.25 * 4.0 and record["mlm_accuracy"] == 0.4375
    assert record["perplexity"] == math.exp(2.5) and record["loss/code"] == 4.0
    assert combine_eval(stage, {"web": figures["web"]}, legacy=True) == figures["web"]
    ov = [f"logging.dir={tmp_path}", "logging.prometheus_port=0", "logging.tensorboard=false"]
    cfg = load_config(TINY_CONFIG, ov + ["train.peak_tflops=1.0"])
    m = Metrics(cfg, 0, 1, torch.device("cpu"), flops_per_token=1e6, tokens_per_step=1024)
    try:
        m.log_eval(5, record)
        train = {"loss": 3.0, "mlm_accuracy": 0.1, "lr": 1e-3, "grad_norm": 1.0}
        train.update({"tokens_per_s": 10.0, "mfu": 0.1, "share/web": 0.75, "share/code": 0.25})
        for sink in m.sinks:
            sink.record(5, "train", train, {})
        endpoint = json.loads((tmp_path / TARGETS_FILE).read_text())[0]["targets"][0]
        s = scrape(endpoint)
    finally:
        m.close()
    assert s["linformer_eval_loss"] == 2.5
    assert s["linformer_eval_source_loss{source=code}"] == 4.0
    assert s["linformer_eval_source_perplexity{source=web}"] == pytest.approx(math.exp(2.0))
    assert s["linformer_eval_source_mlm_accuracy{source=code}"] == 0.25
    assert s["linformer_source_share{source=web}"] == 0.75
    assert s["linformer_source_share{source=code}"] == 0.25
    assert read_metrics(tmp_path, "eval")[5]["loss/web"] == 2.0  # metrics.jsonl has them too
