"""Export: DeepSpeed checkpoints (ZeRO 0-3, 2 ranks) -> HF directory -> Auto classes, fresh process.

A module fixture runs one real 2-rank DeepSpeed job (this file, run as a script per rank) that
trains several tiny models for 2 optimizer steps, saves each checkpoint in the trainer's layout
and dumps, as the reference, the fully gathered training weights and the training engine's
MLM logits on a fixed padded input.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

from linformer_ds.dist_env import free_port, without_launcher_vars
from linformer_ds.engine import import_muon_lazily
from linformer_ds.model_dir import MODEL_FILES
from tests.pretrain_utils import child_env, init_gloo_rank

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 384, 32
BASE_MODEL = dict(
    vocab_size=VOCAB,
    max_seq_len=SEQ,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    k=8,
    dropout=0.1,
    attention_dropout=0.1,
)
# name -> (ZeRO stage, model options): every attention schedule and sharing mode that owns a
# shared parameter, under the stages where DeepSpeed stores weights differently.
CASES = {
    "z3_linear_layerwise": (3, dict(projection="linear", sharing="layerwise")),
    "z2_hybrid_layerwise": (2, dict(projection="hybrid", hybrid_linear_layers=1)),
    "z3_hybrid_kv": (3, dict(projection="hybrid", hybrid_linear_layers=1, sharing="kv")),
    "z1_dense": (1, dict(projection="dense")),
    "z0_conv_headwise": (0, dict(projection="conv", sharing="headwise")),
}
TAG = "step_00000002"
pytestmark = pytest.mark.slow  # 2-rank DeepSpeed jobs (CI runs them)


# ============================================================================== rank worker
def _init_rank(rank: int, world: int, port: int):
    """Join a single-node gloo group as ``rank`` of ``world``; returns (deepspeed, deepspeed.comm)."""
    import deepspeed.comm as dist

    return init_gloo_rank(rank, world, port), dist


def _worker(rank: int, world: int, port: int, spec_path: str) -> None:
    """One rank of the checkpoint-making job (run as ``python tests/test_export.py ...``)."""
    deepspeed, dist = _init_rank(rank, world, port)

    from linformer_ds.model import LinformerForMaskedLM, ModelConfig

    spec = json.loads(Path(spec_path).read_text())
    for name, (stage, options) in spec["cases"].items():
        torch.manual_seed(0)
        model_config = ModelConfig(**{**spec["base_model"], **options})
        model = LinformerForMaskedLM(model_config)
        ds_config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**6,
        }
        import_muon_lazily()  # as the trainer: no inductor import for DeepSpeed's Muon
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )
        gen = torch.Generator().manual_seed(1000 + rank)
        for _ in range(2):
            ids = torch.randint(5, VOCAB, (2, SEQ), generator=gen)
            labels = ids.clone()
            masked = torch.rand(ids.shape, generator=gen) < 0.3
            ids[masked] = 4
            labels[~masked] = -100
            loss = engine(ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
        ckpt = os.path.join(spec["out"], name)
        engine.save_checkpoint(ckpt, tag=TAG, client_state={"step": 2})

        # Reference: the training engine's logits and fully gathered weights.
        engine.eval()
        ref_gen = torch.Generator().manual_seed(7)
        ids = torch.randint(5, VOCAB, (3, SEQ - 5), generator=ref_gen)
        mask = torch.ones_like(ids)
        mask[1, 20:] = 0
        ids[1, 20:] = 0
        with torch.no_grad():
            logits = engine(ids, attention_mask=mask).logits
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3):
            weights = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
        dist.barrier()
        if rank == 0:
            tag_dir = os.path.join(ckpt, TAG)
            meta = {
                "format_version": 1,
                "step": 2,
                "epoch": 0,
                "sampler": {"epoch": 0, "consumed": 8},
                "world_size": 2,
                "zero_stage": stage,
                "model": model_config.to_dict(),
                "config": {"name": name, "deepspeed": ds_config},
                "tokenizer": "tokenizer.model",
            }
            Path(tag_dir, "linformer_meta.json").write_text(json.dumps(meta, indent=2))
            shutil.copyfile(spec["tokenizer"], os.path.join(tag_dir, "tokenizer.model"))
            Path(tag_dir, "COMPLETE").write_text("ok\n")
            torch.save(
                {"input_ids": ids, "attention_mask": mask, "logits": logits, "weights": weights},
                os.path.join(ckpt, "reference.pt"),
            )
        dist.barrier()
        engine.destroy()


def _reload_worker(rank: int, world: int, port: int, spec_path: str) -> None:
    """Resume each real-trainer checkpoint into a DeepSpeed engine, as training resumes it, and
    dump that engine's MLM logits on a fixed input (the reference for the exported model)."""
    deepspeed, dist = _init_rank(rank, world, port)

    from linformer_ds.config import JobConfig
    from linformer_ds.ds_config import deepspeed_config as make_ds_config
    from linformer_ds.model import LinformerForMaskedLM, ModelConfig
    from linformer_ds.optim import param_groups

    spec = json.loads(Path(spec_path).read_text())
    for ckpt, out in spec["reload"]:
        tag = Path(ckpt, "latest").read_text().strip()
        meta = json.loads(Path(ckpt, tag, "linformer_meta.json").read_text())
        model_config = ModelConfig.from_dict(meta["model"])
        cfg = JobConfig()
        cfg.deepspeed.zero.stage = meta["zero_stage"]
        cfg.deepspeed.precision = meta["config"]["deepspeed"]["precision"]
        ds_config = make_ds_config(cfg, world)
        ds_config["train_micro_batch_size_per_gpu"] = 1
        ds_config["train_batch_size"] = world
        ds_config.pop("gradient_accumulation_steps", None)
        model = LinformerForMaskedLM(model_config)
        import_muon_lazily()  # as the trainer: no inductor import for DeepSpeed's Muon
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, 0.01), config=ds_config
        )
        path, _ = engine.load_checkpoint(ckpt, tag=tag, load_lr_scheduler_states=False)
        assert path is not None, ckpt
        engine.eval()
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(
            5, model_config.vocab_size, (2, model_config.max_seq_len), generator=gen
        )
        ids[:, 0] = 2
        mask = torch.ones_like(ids)
        mask[0, 40:] = 0
        ids[0, 40:] = 0
        with torch.no_grad():
            logits = engine(ids, attention_mask=mask).logits
        if rank == 0:
            torch.save({"input_ids": ids, "attention_mask": mask, "logits": logits}, out)
        dist.barrier()
        engine.destroy()


# ===================================================================================== helpers
def _env() -> dict:
    env = child_env(TOKENIZERS_PARALLELISM="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def train_tokenizer(path: Path, vocab_size: int = VOCAB, files: list | None = None) -> Path:
    """A SentencePiece unigram model on stdlib source, with the project's special ids."""
    import io

    import sentencepiece as spm

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = files or sorted((stdlib / "json").glob("*.py"))
    text = "\n".join(p.read_text(encoding="utf-8") for p in files)
    lines = [line for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        pad_piece="<pad>",
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        user_defined_symbols=["<mask>"],
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return path


# Runs in a fresh interpreter (-I: no PYTHONPATH, no user site), cwd elsewhere, with the
# editable-install finder of linformer_ds removed: the export must load with transformers alone.
FRESH_LOADER = textwrap.dedent(
    """
    import json, sys
    sys.meta_path[:] = [f for f in sys.meta_path if "linformer_ds" not in getattr(f, "__module__", "")]
    try:
        import linformer_ds  # noqa: F401
        importable = True
    except ImportError:
        importable = False
    import torch
    from transformers import (AutoConfig, AutoModel, AutoModelForMaskedLM,
                              AutoModelForSequenceClassification)
    results = {"linformer_ds_importable": importable}
    for name, out, ref in json.loads(sys.argv[1]):
        r = torch.load(ref, weights_only=True)
        mlm = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)
        with torch.no_grad():
            logits = mlm(input_ids=r["input_ids"], attention_mask=r["attention_mask"]).logits
            cls = AutoModelForSequenceClassification.from_pretrained(
                out, trust_remote_code=True, num_labels=3)
            cls_logits = cls(input_ids=r["input_ids"], attention_mask=r["attention_mask"]).logits
            base = AutoModel.from_pretrained(out, trust_remote_code=True)
            hidden = base(input_ids=r["input_ids"], attention_mask=r["attention_mask"])
        w = r["weights"]
        results[name] = {
            "mlm_class": type(mlm).__name__,
            "mlm_module": type(mlm).__module__,
            "config_class": type(AutoConfig.from_pretrained(out, trust_remote_code=True)).__name__,
            "logits_max_abs_diff": (logits - r["logits"]).abs().max().item(),
            "tied": mlm.lm_head.decoder.weight is mlm.encoder.token_embeddings.weight,
            "cls_shape": list(cls_logits.shape),
            "cls_encoder_equal": all(torch.equal(p, w["encoder." + k])
                                     for k, p in cls.encoder.named_parameters()),
            "base_hidden_shape": list(hidden.last_hidden_state.shape),
            "mlm_weights_equal": all(torch.equal(p, w[k]) for k, p in mlm.named_parameters()),
        }
    print("RESULT " + json.dumps(results))
    """
)


def run_fresh(script: str, args: list, cwd: Path, timeout: int = 300) -> dict:
    """Run ``script`` with ``python -I`` in ``cwd``; returns its ``RESULT`` JSON line."""
    # No launcher or rendezvous variables: a RANK/WORLD_SIZE/MASTER_* left in this process by an
    # earlier in-process test would make transformers' Trainer (accelerate) wait for a process
    # group in the child
    env = without_launcher_vars(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    env.update(TOKENIZERS_PARALLELISM="0", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-I", "-c", script, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # (transformers' trust_remote_code prompt may leave text without a newline before it)
    line = [ln for ln in proc.stdout.splitlines() if "RESULT " in ln][-1]
    return json.loads(line.split("RESULT ", 1)[1])


# ==================================================================================== fixtures
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """Run the 2-rank DeepSpeed job once; returns the directory holding one checkpoint per case."""
    root = tmp_path_factory.mktemp("ckpts")
    tok = train_tokenizer(root / "tokenizer.model")
    spec = root / "spec.json"
    spec.write_text(
        json.dumps(
            {"cases": CASES, "base_model": BASE_MODEL, "out": str(root), "tokenizer": str(tok)}
        )
    )
    _run_ranks(spec, root)
    return root


def _run_ranks(spec: Path, cwd: Path, mode: str = "train") -> None:
    """Run this file's 2-rank worker job (``mode``: train or reload) and wait for it."""
    port = free_port()
    extra = ["reload"] if mode == "reload" else []
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), "2", str(port), str(spec), *extra],
            env=_env(),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out)
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory) -> dict:
    """Export every case (float32); returns name -> export directory."""
    from linformer_ds.export import export_checkpoint

    out_root = tmp_path_factory.mktemp("exports")
    return {
        name: Path(export_checkpoint(str(checkpoints / name), str(out_root / name)))
        for name in CASES
    }


# ======================================================================================= tests
def test_export_weights_equal_training_weights(checkpoints, exported):
    """Every stored tensor equals the gathered training weight bit for bit, shared ones too."""
    from safetensors.torch import load_file

    for name, out in exported.items():
        ref = torch.load(checkpoints / name / "reference.pt", weights_only=True)["weights"]
        stored = load_file(out / "model.safetensors")
        assert "lm_head.decoder.weight" not in stored  # tied: re-tied on load
        assert set(stored) == set(ref), name
        for key, value in stored.items():
            assert value.dtype == torch.float32
            assert torch.equal(value, ref[key]), f"{name}: {key}"
        if "layerwise" in name:
            assert "encoder.shared_linear.weight" in stored
            assert not any(".attention.proj_" in k for k in stored)
        if "hybrid_layerwise" in name:
            assert "encoder.shared_conv.weight" in stored
        if "kv" in name:  # one E = F per linear/conv layer
            assert "encoder.layers.0.attention.proj_k.weight" in stored
            assert "encoder.layers.0.attention.proj_v.weight" not in stored
        if "headwise" in name:
            assert "encoder.layers.1.attention.proj_v.weight" in stored
        meta = json.loads((out / "linformer_export.json").read_text())
        assert (meta["tag"], meta["step"], meta["dtype"]) == (TAG, 2, "float32")
        assert meta["checkpoint"] == ".../" + name  # outside the working directory: no abs path


def _strings(obj):
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def test_export_modes_follow_umask_and_provenance_is_portable(checkpoints, exported, tmp_path):
    """Directory 0777 & ~umask, files 0666 & ~umask (not mkdtemp's 0700 / safetensors' 0600);
    no absolute path in linformer_export.json unless --provenance full."""
    from linformer_ds.export import main

    umask = os.umask(0)
    os.umask(umask)
    out = exported["z1_dense"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    for f in out.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f.name
    ckpt = checkpoints / "z1_dense"
    ckpt_cfg = {"deepspeed": {}, "data": {"path": str(tmp_path / "data")}}
    meta_path = ckpt / TAG / "linformer_meta.json"
    original = meta_path.read_text()
    meta_path.write_text(json.dumps({**json.loads(original), "config": ckpt_cfg}))
    try:
        assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "p")]) == 0
        assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "f"),
                     "--provenance", "full"]) == 0  # fmt: skip
    finally:
        meta_path.write_text(original)
    portable = json.loads((tmp_path / "p" / "linformer_export.json").read_text())
    assert not [s for s in _strings(portable) if os.path.isabs(s)], portable
    assert portable["training_config"]["data"]["path"] == ".../data"
    full = json.loads((tmp_path / "f" / "linformer_export.json").read_text())
    assert full["checkpoint"] == str(ckpt) and full["training_config"] == ckpt_cfg


def test_export_directory_layout(exported):
    out = exported["z3_linear_layerwise"]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [
            "config.json",
            "configuration_linformer.py",
            "linformer_export.json",
            "linformer_model.py",
            "model.safetensors",
            "modeling_linformer.py",
            "tokenizer.json",
            "tokenizer.model",
            "tokenizer_config.json",
            *MODEL_FILES,
        ]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "linformer"
    assert config["architectures"] == ["LinformerForMaskedLM"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_linformer.LinformerConfig",
        "AutoModel": "modeling_linformer.LinformerModel",
        "AutoModelForMaskedLM": "modeling_linformer.LinformerForMaskedLM",
        "AutoModelForSequenceClassification": "modeling_linformer.LinformerForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_linformer.LinformerForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_linformer.LinformerForQuestionAnswering",
        "AutoModelForMultipleChoice": "modeling_linformer.LinformerForMultipleChoice",
        "AutoModelForCausalLM": "modeling_linformer.LinformerForCausalLM",
    }
    assert (config["hidden_size"], config["k"], config["sharing"]) == (32, 8, "layerwise")
    ids = {k: config[k + "_token_id"] for k in ("pad", "bos", "eos", "cls", "sep", "mask")}
    assert ids == {"pad": 0, "bos": 2, "eos": 3, "cls": 2, "sep": 3, "mask": 4}
    # the model package ships file for file (its __init__ as linformer_model.py); the wrappers
    # import it flat
    model_dir = REPO / "linformer_ds" / "model"
    assert (out / "linformer_model.py").read_text() == (model_dir / "__init__.py").read_text()
    assert set(MODEL_FILES) == {p.name for p in model_dir.glob("*.py")} - {"__init__.py"}
    for name in MODEL_FILES:
        assert (out / name).read_text() == (model_dir / name).read_text(), name
    for f in ("configuration_linformer.py", "modeling_linformer.py"):
        text = (out / f).read_text()
        assert "linformer_ds" not in text and "from ..model" not in text
        assert "from .linformer_model import" in text


def test_auto_classes_load_in_fresh_process_and_logits_match(checkpoints, exported, tmp_path):
    """Tiny pretrain (2 ranks, ZeRO 0-3) -> export -> Auto classes without linformer_ds."""
    jobs = [
        [name, str(out), str(checkpoints / name / "reference.pt")] for name, out in exported.items()
    ]
    res = run_fresh(FRESH_LOADER, [json.dumps(jobs)], cwd=tmp_path)
    assert res.pop("linformer_ds_importable") is False
    assert set(res) == set(CASES)
    for name, r in res.items():
        print(f"{name}: max |logits diff| {r['logits_max_abs_diff']:.3g}")
        assert r["mlm_class"] == "LinformerForMaskedLM", name
        assert r["mlm_module"].startswith("transformers_modules."), name
        assert r["config_class"] == "LinformerConfig"
        assert r["logits_max_abs_diff"] <= 1e-5, (name, r["logits_max_abs_diff"])
        assert r["tied"] and r["mlm_weights_equal"] and r["cls_encoder_equal"], (name, r)
        assert r["cls_shape"] == [3, 3]
        assert r["base_hidden_shape"] == [3, SEQ - 5, 32]


def test_tokenizer_matches_sentencepiece_in_fresh_process(exported, tmp_path):
    out = exported["z2_hybrid_layerwise"]
    script = textwrap.dedent(
        """
        import json, sys
        import sentencepiece as spm
        from transformers import AutoTokenizer
        out = sys.argv[1]
        texts = ["def encode(self, o):\\n    return  o + 1  # done",
                 "JSON (JavaScript Object Notation) is a subset of JavaScript",
                 "unicode: caf\\u00e9 \\u2603 tabs\\tand   spaces"]
        sp = spm.SentencePieceProcessor(model_file=out + "/tokenizer.model")
        res = {}
        for trust in (False, True):
            tok = AutoTokenizer.from_pretrained(out, trust_remote_code=trust) if trust else \\
                AutoTokenizer.from_pretrained(out)
            res[str(trust)] = {
                "class": type(tok).__name__,
                "plain_equal": all(tok(t, add_special_tokens=False)["input_ids"] == sp.encode(t)
                                   for t in texts),
                "with_special": [tok(t)["input_ids"] == [2] + sp.encode(t) + [3] for t in texts],
                "ids": {n: getattr(tok, n + "_token_id") for n in
                        ("pad", "unk", "cls", "sep", "mask", "bos", "eos")},
                "masked": tok("a <mask> b", add_special_tokens=False)["input_ids"],
                "sp_masked": sp.encode("a ") + [4] + sp.encode(" b"),
                "batch": tok(texts[:2], padding=True)["attention_mask"],
                "batch_ids": tok(texts[:2], padding=True)["input_ids"],
                "max_len": tok.model_max_length,
                "decode": tok.decode(tok(texts[1])["input_ids"], skip_special_tokens=True),
            }
        print("RESULT " + json.dumps(res))
        """
    )
    res = run_fresh(script, [str(out)], cwd=tmp_path)
    for r in res.values():
        assert r["class"] == "TokenizersBackend"
        assert r["plain_equal"] and all(r["with_special"])
        assert r["ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3}
        assert r["max_len"] == SEQ
        assert r["decode"] == "JSON (JavaScript Object Notation) is a subset of JavaScript"
        short, long_ = (0, 1) if sum(r["batch"][0]) < sum(r["batch"][1]) else (1, 0)
        n_short = sum(r["batch"][short])
        assert all(m == 1 for m in r["batch"][long_])
        assert r["batch"][short] == [1] * n_short + [0] * (len(r["batch"][short]) - n_short)
        assert r["batch_ids"][short][n_short:] == [0] * (len(r["batch"][short]) - n_short)
        assert 4 in r["masked"]


def test_cli_bfloat16_export(checkpoints, tmp_path):
    from safetensors.torch import load_file

    ckpt = checkpoints / "z2_hybrid_layerwise"
    out = tmp_path / "bf16"
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch/export.py"), "--checkpoint", str(ckpt), "--out",
         str(out), "--dtype", "bfloat16"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = torch.load(ckpt / "reference.pt", weights_only=True)["weights"]
    stored = load_file(out / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in stored.values())
    for k, v in stored.items():
        assert torch.equal(v, ref[k].to(torch.bfloat16)), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


# ================================================================ end to end: the real trainer
TRAINER_RUNS = {  # name -> overrides of configs/tiny_cpu.yaml
    "zero3_linear": ["deepspeed.zero.stage=3"],
    "zero2_hybrid": [
        "deepspeed.zero.stage=2",
        "model.projection=hybrid",
        "model.hybrid_linear_layers=1",
    ],
}


def test_real_trainer_pretrain_export_load_logits_equal(tmp_path):
    """data_prep -> launch/pretrain.py (2 ranks, 3 steps) -> launch/export.py -> Auto classes in a
    fresh process; logits equal those of the checkpoint resumed into a DeepSpeed engine."""
    from linformer_ds.export import main as export_main

    stdlib = sysconfig.get_paths()["stdlib"]
    env = _env()

    def run(cmd: list) -> None:
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-3000:])

    run([sys.executable, "-m", "data_prep", "--source", f"{stdlib}/json", f"{stdlib}/email",
         "--out", "data", "--seq-len", "64", "--vocab-size", "400", "--valid-fraction", "0.1",
         "--workers", "0", "--quiet"])  # fmt: skip
    small = [
        "model.vocab_size=400", "model.max_seq_len=64", "model.k=16", "model.hidden_size=32",
        "model.num_heads=2", "model.intermediate_size=64", "data.path=data", "train.max_steps=3",
        "train.micro_batch_size=2", "train.eval_interval=0", "train.peak_tflops=1.0",
        "deepspeed.precision=fp32", "logging.tensorboard=false",
    ]  # fmt: skip
    jobs = []
    for name, overrides in TRAINER_RUNS.items():
        run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--master_port", str(free_port()), str(REPO / "launch/pretrain.py"),
             "--config", str(REPO / "configs/tiny_cpu.yaml"), *small, *overrides,
             f"logging.dir=runs/{name}"])  # fmt: skip
        ckpt = tmp_path / "runs" / name / "checkpoints"
        assert (ckpt / "latest").read_text().strip() == "step_00000003"
        assert (
            export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "exported" / name)])
            == 0
        )
        jobs.append([name, str(tmp_path / "exported" / name), str(tmp_path / f"{name}.pt")])

    spec = tmp_path / "reload.json"
    spec.write_text(
        json.dumps(
            {"reload": [[str(tmp_path / "runs" / j[0] / "checkpoints"), j[2]] for j in jobs]}
        )
    )
    _run_ranks(spec, tmp_path, mode="reload")
    loader = FRESH_LOADER.replace(
        'w = r["weights"]', "w = {k: p for k, p in mlm.named_parameters()}"
    )
    res = run_fresh(loader, [json.dumps(jobs)], cwd=tmp_path)
    assert res.pop("linformer_ds_importable") is False
    for name, r in res.items():
        print(f"{name}: max |logits diff| {r['logits_max_abs_diff']:.3g}")
        assert r["mlm_class"] == "LinformerForMaskedLM" and r["tied"], (name, r)
        assert r["logits_max_abs_diff"] <= 1e-5, (name, r["logits_max_abs_diff"])
        assert r["cls_encoder_equal"] and r["cls_shape"] == [2, 3], (name, r)
    exported = tmp_path / "exported" / "zero2_hybrid"
    cfg = json.loads((exported / "config.json").read_text())
    assert (cfg["projection"], cfg["max_seq_len"], cfg["vocab_size"]) == ("hybrid", 64, 400)
    meta = json.loads((exported / "linformer_export.json").read_text())
    assert meta["step"] == 3 and meta["training_config"]["deepspeed"]["zero"]["stage"] == 2


# ============================================================================== refusals
def _copy_ckpt(checkpoints: Path, tmp_path: Path, name: str = "z2_hybrid_layerwise") -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints / name, dst)
    return dst


def _edit_meta(ckpt: Path, **model_changes) -> None:
    path = ckpt / TAG / "linformer_meta.json"
    meta = json.loads(path.read_text())
    meta["model"].update(model_changes)
    path.write_text(json.dumps(meta))


def test_refuses_directory_that_is_not_a_checkpoint(tmp_path):
    from linformer_ds.export import ExportError, export_checkpoint

    with pytest.raises(ExportError, match="no such directory"):
        export_checkpoint(str(tmp_path / "nope"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"is not a linformer_ds checkpoint directory: no step_"):
        export_checkpoint(str(tmp_path / "empty"), str(tmp_path / "out"))
    (tmp_path / "empty" / "latest").write_text("step_00000001")
    (tmp_path / "empty" / "step_00000001").mkdir()
    with pytest.raises(
        ExportError,
        match=r"no usable checkpoint: step_00000001 \(not a linformer_ds checkpoint \(no "
        r"linformer_meta.json\)\)",
    ):
        export_checkpoint(str(tmp_path / "empty"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_refuses_missing_tag_and_incomplete_tag(checkpoints, tmp_path, capsys):
    from linformer_ds.export import ExportError, export_checkpoint

    ckpt = _copy_ckpt(checkpoints, tmp_path)
    with pytest.raises(ExportError, match=r"tag 'step_00000099' not found .*step_00000002"):
        export_checkpoint(str(ckpt), str(tmp_path / "out"), tag="step_00000099")
    # a dangling 'latest' falls back to the newest valid tag, with a warning (as resume does)
    (ckpt / "latest").write_text("step_00000042")
    with pytest.warns(UserWarning, match="'latest' names 'step_00000042'"):
        export_checkpoint(str(ckpt), str(tmp_path / "fallback"))
    assert json.loads((tmp_path / "fallback" / "linformer_export.json").read_text())["tag"] == TAG
    (ckpt / TAG / "COMPLETE").unlink()
    with pytest.raises(ExportError, match="incomplete"):
        export_checkpoint(str(ckpt), str(tmp_path / "out"), tag=TAG)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(hidden_size=64),
            r"shape mismatch encoder\.embed_ln\.bias: checkpoint \(32,\) vs config \(64,\)",
        ),
        (dict(num_layers=3), r"missing .*encoder\.layers\.2\."),
        (dict(sharing="headwise"), r"missing .*proj_k.*unexpected .*encoder\.shared_linear"),
        (dict(k=4), r"shape mismatch .*encoder\.shared_linear\.weight"),
        (dict(num_heads=5), r"invalid model config: model\.hidden_size"),
    ],
)
def test_refuses_mismatched_config(checkpoints, tmp_path, change, message):
    from linformer_ds.export import ExportError, export_checkpoint

    ckpt = _copy_ckpt(checkpoints, tmp_path)
    _edit_meta(ckpt, **change)
    with pytest.raises(ExportError, match=message):
        export_checkpoint(str(ckpt), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_refuses_bad_tokenizer_and_existing_output(checkpoints, tmp_path):
    import sentencepiece as spm

    from linformer_ds.export import ExportError, export_checkpoint

    ckpt = _copy_ckpt(checkpoints, tmp_path)
    # a SentencePiece model with the default ids (unk=0, bos=1, eos=2) and no <mask>
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = (stdlib / "json" / "decoder.py").read_text().splitlines()
    bad = tmp_path / "bad.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([ln for ln in lines if ln.strip()]),
        model_prefix=str(bad.with_suffix("")),
        vocab_size=200,
        minloglevel=2,
    )
    with pytest.raises(ExportError, match=r"special token '<pad>' has id -?\d+, expected 0"):
        export_checkpoint(str(ckpt), str(tmp_path / "out"), tokenizer=str(bad))
    (ckpt / TAG / "tokenizer.model").unlink()
    with pytest.raises(ExportError, match="tokenizer .* not found.*--tokenizer"):
        export_checkpoint(str(ckpt), str(tmp_path / "out"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_checkpoint(
            str(ckpt), str(tmp_path / "full"), tokenizer=str(checkpoints / "tokenizer.model")
        )
    assert (tmp_path / "full" / "x").read_text() == "x"


def test_cli_reports_errors_with_exit_code_2(tmp_path):
    from linformer_ds.export import main

    assert main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o")]) == 2


if __name__ == "__main__":
    fn = _reload_worker if sys.argv[5:] == ["reload"] else _worker
    fn(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
