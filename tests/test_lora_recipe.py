"""The LoRA recipe of docs/export.md ("PEFT / LoRA"; studies/lora_recipe.RECIPE: every linear
layer of the encoder, r 16, alpha 32, lr 5e-3) learns: on a small export and a generated
two-class task whose label is one keyword somewhere in the sentence (so the frozen encoder's
first-token state alone does not tell it: the trained head alone stays at chance), LoRA with
the recipe reaches >= 0.9 test accuracy and >= 0.9 of full fine-tuning's with the same steps,
while PEFT's defaults on qkv/out at lr 1e-3 (the recipe the docs gave before) stay at chance.
Same loop as launch/finetune.py (studies/lora_recipe.train_eval), seeded."""

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_hf_heads import WORDS, tiny_export  # noqa: E402

from studies.lora_recipe import ALL_LINEAR, RECIPE, Setting, train_eval  # noqa: E402

COLOURS = ["red", "green", "blue", "pink"]
FILLER = ["the", "a", "of", "and", "to", "in", "is", "was", "for", "on", "with", "as", "by"]
STEPS = dict(epochs=3.0)  # 320 rows, batch 16: 60 steps for every setting
FULL_LR = 1.5e-3  # full fine-tuning of the tiny export; its default (5e-4) is at chance at 60 steps


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.mktemp("lora_recipe"))


def keyword_task(n: int, seed: int) -> tuple:
    """``(texts, labels)``: 6-12 filler words with one keyword inserted after the first;
    label 1 when it is a colour, 0 when a Greek letter name; balanced, shuffled."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(FILLER) for _ in range(rng.randint(6, 12))]
        words.insert(rng.randrange(1, len(words) + 1), rng.choice(COLOURS if i % 2 else WORDS[:4]))
        rows.append((" ".join(words), i % 2))
    rng.shuffle(rows)
    return [t for t, _ in rows], [y for _, y in rows]


def test_lora_recipe_reaches_full_finetuning(export):
    assert RECIPE.targets == ALL_LINEAR and (RECIPE.r, RECIPE.alpha, RECIPE.lr) == (16, 32, 5e-3)
    train, test = keyword_task(320, 1), keyword_task(200, 2)
    runs = {
        "full": Setting("full", lr=FULL_LR, **STEPS),
        "recipe": dataclasses.replace(RECIPE, **STEPS),
        "old": Setting("lora", lr=1e-3, targets=("qkv", "out"), **STEPS),  # PEFT defaults r 8
        "head": Setting("head", lr=RECIPE.lr, **STEPS),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums on any machine
    try:
        res = {k: train_eval(str(export), train, test, s, 0, 64) for k, s in runs.items()}
    finally:
        torch.set_num_threads(threads)
    acc = {k: r["test_accuracy"] for k, r in res.items()}
    print(f"accuracy {acc}; trainable {({k: r['trainable_params'] for k, r in res.items()})}")
    assert {r["steps"] for r in res.values()} == {60}
    assert acc["full"] >= 0.95, acc  # the task is learnable (chance: 0.5)
    assert acc["recipe"] >= 0.9 and acc["recipe"] >= 0.9 * acc["full"], acc
    assert acc["old"] <= 0.6 and acc["head"] <= 0.6, acc  # the old recipe and the head stay at chance
    assert res["old"]["head_update_norm"] > 0 and res["head"]["head_update_norm"] > 0  # head trained
    assert res["recipe"]["trainable_params"] < 0.35 * res["full"]["trainable_params"]
