"""linformer_ds.data: the shard reader, MLM masking, and the resumable distributed sampler
of the one-dataset stream before mixtures (tests/legacy_batches.py)."""

import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

import data_prep
from data_prep import PrepConfig, prepare
from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.shards import (
    MANIFEST_FORMAT_VERSION,
    DataError,
    ShardDataset,
    check_compatible,
)
from linformer_ds.loss import IGNORE_INDEX
from linformer_ds.model import ModelConfig
from tests.legacy_batches import ResumableDistributedSampler

N = 32
V = 48  # tokenizer vocabulary of the test corpus
WORDS = (
    "alpha beta gamma delta key value query token shard rank epoch layer head norm linear "
    "encoder attention projection sequence softmax dropout residual batch corpus document"
).split()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A small data_prep output: 60 generated documents, vocab V, N = 32, 3+ train shards."""
    tmp = tmp_path_factory.mktemp("data")
    src = tmp / "src"
    src.mkdir()
    rng = random.Random(1)
    for i in range(60):
        lines = [
            " ".join(rng.choices(WORDS, k=rng.randint(2, 12))) for _ in range(rng.randint(1, 9))
        ]
        (src / f"{i:03d}.txt").write_text("\n".join(lines) + "\n")
    cfg = PrepConfig(sources=[str(src)], out=str(tmp / "out"), seq_len=N, vocab_size=V,
                     valid_fraction=0.2, shard_rows=10, workers=0, progress=False)  # fmt: skip
    prepare(cfg)
    return tmp / "out"


def copy_of(built: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(built, dst)
    return dst


def edit_manifest(path: Path, fn) -> None:
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


# ------------------------------------------------------------------------------ dataset
def test_dataset_reads_the_shards_exactly(built):
    m = json.loads((built / "manifest.json").read_text())
    for split in ("train", "valid"):
        ds = ShardDataset(built, split, verify_checksums=True)
        ref = np.concatenate([np.load(built / s["file"]) for s in m["splits"][split]["shards"]])
        assert len(ds) == len(ref) == m["splits"][split]["rows"]
        got = torch.stack([ds[i] for i in range(len(ds))])
        assert got.dtype == torch.long and got.shape == (len(ref), N)
        assert torch.equal(got, torch.from_numpy(ref.astype(np.int64)))
        assert torch.equal(ds[-1], got[-1])
    ds = ShardDataset(built)
    assert (ds.seq_len, ds.vocab_size, ds.split, ds.path) == (N, V, "train", built)
    assert (ds.pad_id, ds.unk_id, ds.cls_id, ds.sep_id, ds.mask_id) == (0, 1, 2, 3, 4)
    assert ds.special_ids == [0, 1, 2, 3, 4] and ds.manifest == m
    assert len(m["splits"]["train"]["shards"]) >= 3
    with pytest.raises(IndexError):
        ds[len(ds)]
    # Pickles without the memory maps (DataLoader workers re-open them).
    clone = pickle.loads(pickle.dumps(ds))
    ds[0]
    assert len(pickle.dumps(ds)) < 20_000
    assert torch.equal(clone[5], ds[5])
    # The tokenizer in the directory decodes rows back to text of the corpus.
    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    stream = torch.cat([ds[i][1:] for i in range(len(ds))]).tolist()
    assert set(sp.decode(stream).split()) == set(WORDS)


def test_format_version_agrees_with_data_prep():
    assert MANIFEST_FORMAT_VERSION == data_prep.FORMAT_VERSION


def test_corrupt_shard_fails_verification(built, tmp_path):
    d = copy_of(built, tmp_path)
    shard = d / "train" / "shard_00001.npy"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01  # one bit in the data: sizes still match
    shard.write_bytes(bytes(raw))
    ds = ShardDataset(d)  # cheap checks pass
    with pytest.raises(DataError, match=r"shard_00001.npy is corrupt: sha256 .* does not match"):
        ds.verify()
    with pytest.raises(DataError, match="shard_00001.npy is corrupt"):
        ShardDataset(d, verify_checksums=True)


def test_truncated_missing_and_garbage_shards(built, tmp_path):
    d = copy_of(built, tmp_path)
    shard = d / "train" / "shard_00000.npy"
    good = shard.read_bytes()
    shard.write_bytes(good[:-7])
    with pytest.raises(DataError, match=r"shard_00000.npy is truncated: \d+ bytes, expected \d+"):
        ShardDataset(d)
    shard.write_bytes(good + b"\0" * 64)
    with pytest.raises(DataError, match="longer than its header says"):
        ShardDataset(d)
    shard.write_bytes(b"not numpy at all")
    with pytest.raises(DataError, match="not a readable .npy file"):
        ShardDataset(d)
    shard.unlink()
    with pytest.raises(DataError, match="shard_00000.npy is missing"):
        ShardDataset(d)
    np.save(shard, np.zeros((3, N), dtype=np.uint16))
    with pytest.raises(DataError, match=r"shape \(3, 32\), expected \(10, 32\)"):
        ShardDataset(d)
    np.save(shard, np.zeros((10, N), dtype=np.int32))
    with pytest.raises(DataError, match="has dtype int32, the manifest says uint16"):
        ShardDataset(d)


def test_manifest_problems(built, tmp_path):
    d = copy_of(built, tmp_path)
    with pytest.raises(
        DataError, match=r"no split 'test' in the manifest \(splits: \['train', 'valid'\]\)"
    ):
        ShardDataset(d, "test")
    edit_manifest(d, lambda m: m["splits"]["train"].update(rows=999))
    with pytest.raises(DataError, match="manifest mismatch: split 'train' lists 999 rows"):
        ShardDataset(d)
    edit_manifest(d, lambda m: m["splits"]["valid"].update(shards=[], rows=0))
    with pytest.raises(DataError, match="split 'valid' is empty"):
        ShardDataset(d, "valid")
    edit_manifest(d, lambda m: m.update(format_version=99))
    with pytest.raises(DataError, match="format_version 99"):
        ShardDataset(d)
    (d / "manifest.json").write_text("{ not json")
    with pytest.raises(DataError, match="corrupt manifest"):
        ShardDataset(d)
    (d / "manifest.json").unlink()
    with pytest.raises(DataError, match="no manifest.json .not a data_prep output"):
        ShardDataset(d)
    (d / "progress.json").write_text("{}")
    with pytest.raises(DataError, match="unfinished data_prep run"):
        ShardDataset(d)


def test_token_ids_outside_the_vocabulary(built, tmp_path):
    d = copy_of(built, tmp_path)
    edit_manifest(d, lambda m: m.update(vocab_size=10))
    ds = ShardDataset(d)
    with pytest.raises(DataError, match=r"holds token id \d+ >= vocab_size 10"):
        for i in range(len(ds)):
            ds[i]


def test_uint32_shards(built, tmp_path):
    """Vocabularies over 65535 are stored as uint32; the reader handles both."""
    d = copy_of(built, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    for s in m["splits"]["train"]["shards"]:
        np.save(d / s["file"], np.load(d / s["file"]).astype(np.uint32))
    m["dtype"] = "uint32"
    (d / "manifest.json").write_text(json.dumps(m))
    a, b = ShardDataset(built), ShardDataset(d)
    assert all(torch.equal(a[i], b[i]) for i in range(len(a)))
    from data_prep.pipeline import dtype_for_vocab

    assert dtype_for_vocab(65535) == np.uint16 and dtype_for_vocab(65536) == np.uint32


def test_check_compatible(built):
    ds = ShardDataset(built)
    check_compatible(ds, ModelConfig(vocab_size=V, max_seq_len=N, hidden_size=32, num_heads=2, k=8))
    check_compatible(
        ds, ModelConfig(vocab_size=100, max_seq_len=64, hidden_size=32, num_heads=2, k=8)
    )
    with pytest.raises(DataError, match="dataset vocab_size 48 > model vocab_size 40"):
        check_compatible(
            ds, ModelConfig(vocab_size=40, max_seq_len=N, hidden_size=32, num_heads=2, k=8)
        )
    with pytest.raises(DataError, match="dataset seq_len 32 > model max_seq_len 16"):
        check_compatible(
            ds, ModelConfig(vocab_size=V, max_seq_len=16, hidden_size=32, num_heads=2, k=8)
        )


# ------------------------------------------------------------------------------ masking
SPECIALS = [0, 1, 2, 3, 4]


def random_tokens(b: int, n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab, (b, n), generator=g)
    tokens[:, 0] = 2  # cls
    tokens[:, n // 2] = 3  # sep
    tokens[:, -5:] = 0  # pad
    tokens[::7, 10] = 1  # unk
    return tokens


def test_masking_statistics():
    vocab, b, n = 1000, 256, 512
    tokens = random_tokens(b, n, vocab)
    out = MLMMasking(vocab, 4, SPECIALS, mlm_probability=0.15, seed=3)(tokens, torch.arange(b), 0)
    ids, labels, att = out["input_ids"], out["labels"], out["attention_mask"]
    assert ids.shape == labels.shape == att.shape == (b, n)
    assert ids.dtype == labels.dtype == att.dtype == torch.long
    special = torch.isin(tokens, torch.tensor(SPECIALS))
    selected = labels != IGNORE_INDEX
    # Special tokens are never selected, never changed.
    assert not (selected & special).any()
    assert torch.equal(ids[special], tokens[special])
    assert torch.equal(att, (tokens != 0).long())
    assert torch.equal(labels[selected], tokens[selected])
    assert torch.equal(ids[~selected], tokens[~selected])
    n_candidates = int((~special).sum())  # ~128k tokens
    frac = selected.sum().item() / n_candidates
    assert abs(frac - 0.15) < 0.005  # std ~0.001
    n_sel = selected.sum().item()
    masked = (ids == 4) & selected
    randomized = selected & (ids != 4) & (ids != tokens)
    kept = selected & (ids == tokens)
    assert abs(masked.sum().item() / n_sel - 0.8) < 0.01
    # A random replacement equals the original with probability 1/995.
    assert abs(randomized.sum().item() / n_sel - 0.1 * (1 - 1 / 995)) < 0.008
    assert abs(kept.sum().item() / n_sel - (0.1 + 0.1 / 995)) < 0.008
    assert not torch.isin(ids[randomized], torch.tensor(SPECIALS)).any()
    # Random replacements cover the non-special vocabulary roughly uniformly.
    k = randomized.sum().item()
    expected_distinct = 995 * (1 - (1 - 1 / 995) ** k)
    assert ids[randomized].min() >= 5 and ids[randomized].max() < vocab
    assert abs(len(torch.unique(ids[randomized])) - expected_distinct) < 40


def test_masking_depends_only_on_seed_epoch_and_index():
    vocab, n = 500, 64
    tokens = random_tokens(8, n, vocab, seed=1)
    idx = torch.tensor([11, 3, 42, 7, 1000, 5, 6, 99])
    mlm = MLMMasking(vocab, 4, SPECIALS, seed=0)
    full = mlm(tokens, idx, epoch=2)
    # Another batch composition and order (as another rank or world size would see it).
    perm = [5, 2, 7, 0]
    part = mlm(tokens[perm], idx[perm], epoch=2)
    for j, p in enumerate(perm):
        for k in full:
            assert torch.equal(part[k][j], full[k][p])
    single = mlm(tokens[3:4], idx[3:4], epoch=2)
    assert all(torch.equal(single[k][0], full[k][3]) for k in full)
    # A fresh masker with the same seed agrees; another epoch or seed does not.
    assert torch.equal(
        MLMMasking(vocab, 4, SPECIALS, seed=0)(tokens, idx, 2)["labels"], full["labels"]
    )
    assert not torch.equal(mlm(tokens, idx, epoch=3)["labels"], full["labels"])
    assert not torch.equal(
        MLMMasking(vocab, 4, SPECIALS, seed=1)(tokens, idx, 2)["labels"], full["labels"]
    )


# ------------------------------------------------------------------------------ sampler
def run_ranks(samplers, steps=None):
    """Draw from all ranks in lockstep; returns per-rank lists."""
    its = [iter(s) for s in samplers]
    out = [[] for _ in samplers]
    step = 0
    while steps is None or step < steps:
        try:
            for r, it in enumerate(its):
                out[r].append(next(it))
        except StopIteration:
            break
        step += 1
    return out


def test_sampler_disjoint_cover_and_seeded():
    n, world = 101, 3
    samplers = [ResumableDistributedSampler(n, r, world, seed=5) for r in range(world)]
    per_rank = run_ranks(samplers)
    assert [len(x) for x in per_rank] == [33, 33, 33] and [len(s) for s in samplers] == [0, 0, 0]
    flat = [i for x in per_rank for i in x]
    assert len(set(flat)) == 99  # disjoint
    perm = np.random.default_rng([5, 0]).permutation(n)
    assert sorted(flat) == sorted(perm[:99].tolist())  # the ragged tail (2 samples) is dropped
    assert per_rank[1] == perm[1:99:3].tolist()
    assert samplers[0].state_dict() == {"epoch": 0, "consumed": 99}
    # Next epoch: another permutation, the same one for the same (seed, epoch).
    for s in samplers:
        s.set_epoch(1)
    e1 = run_ranks(samplers)
    assert e1 != per_rank and sorted(i for x in e1 for i in x) != sorted(flat)
    again = run_ranks([ResumableDistributedSampler(n, r, world, seed=5) for r in range(world)])
    assert again == per_rank
    unshuffled = ResumableDistributedSampler(10, 1, 2, shuffle=False)
    assert list(unshuffled) == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("old_world, new_world", [(2, 2), (2, 3), (4, 1), (3, 2)])
def test_sampler_exact_resume(old_world, new_world):
    n, seed, epoch, steps = 103, 7, 4, 9
    perm = np.random.default_rng([seed, epoch]).permutation(n).tolist()
    before = [ResumableDistributedSampler(n, r, old_world, seed=seed) for r in range(old_world)]
    for s in before:
        s.set_epoch(epoch)
    first = run_ranks(before, steps)
    state = before[0].state_dict()
    assert all(s.state_dict() == state for s in before)
    assert state == {"epoch": epoch, "consumed": steps * old_world}
    state = json.loads(json.dumps(state))  # as saved in a checkpoint
    after = [ResumableDistributedSampler(n, r, new_world, seed=seed) for r in range(new_world)]
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(epoch)  # what the trainer does after loading: keeps the position
    assert [len(s) for s in after] == [(n - steps * old_world) // new_world] * new_world
    second = run_ranks(after)
    consumed_first = [i for step in zip(*first) for i in step]  # global order
    consumed_second = [i for step in zip(*second) for i in step]
    everything = consumed_first + consumed_second
    assert len(everything) == len(set(everything))  # nothing repeated
    # Nothing skipped: exactly the permutation's prefix, in order, minus a ragged tail < world.
    assert everything == perm[: len(everything)] and n - len(everything) < new_world
    if old_world == new_world:  # the same streams as a run that never stopped
        never = [ResumableDistributedSampler(n, r, old_world, seed=seed) for r in range(old_world)]
        for s in never:
            s.set_epoch(epoch)
        whole = run_ranks(never)
        assert [a + b for a, b in zip(first, second)] == whole


def test_sampler_state_errors_and_epoch_reset():
    s = ResumableDistributedSampler(10, 0, 2)
    with pytest.raises(ValueError, match="outside"):
        s.load_state_dict({"epoch": 0, "consumed": 11})
    with pytest.raises(ValueError, match="bad rank 2"):
        ResumableDistributedSampler(10, 2, 2)
    s.load_state_dict({"epoch": 3, "consumed": 6})
    assert len(s) == 2 and s.epoch == 3
    s.set_epoch(4)
    assert s.state_dict() == {"epoch": 4, "consumed": 0} and len(s) == 5
