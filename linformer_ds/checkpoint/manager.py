"""The trainer's checkpoint manager: what is saved, when, and resuming (see
:class:`CheckpointManager`)."""

import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

from linformer_ds.checkpoint.io import (
    _free_space,
    _reason,
    check_run_config,
    check_writable,
    load,
    save,
    select_resume,
)
from linformer_ds.checkpoint.reshard import (
    VIA_UNIVERSAL,
    check_engine_config,
    config_layout,
    convert_to_universal,
    cut_universal_per_sequence_rank,
    layout_route,
    optimizer_index_names,
    repair_zero3_universal_load,
    reshard_zero0,
    restore_frozen_params,
    saved_frozen,
    sequence_shards,
)
from linformer_ds.checkpoint.tags import (
    UNIVERSAL_DIR,
    CheckpointError,
    latest_tag,
    sharded_sp_size,
)
from linformer_ds.config import JobConfig
from linformer_ds.log import get_logger
from linformer_ds.resume_policy import Change, apply_changes, changed_line, changes, refusal

log = get_logger(__name__)

# ============================================================================ checkpoint manager
# Components whose state lies at the top level of the client state (and in the metadata), as
# checkpoints of format 1 have always stored it: name -> its state_dict's keys.
TOP_LEVEL_STATE = {"data": ("epoch", "sampler")}


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointManager:
    """The trainer's checkpoints: what is saved, when, and resuming.

    Components :meth:`register` their state (symmetric ``state_dict`` / ``load_state_dict``);
    the manager writes it into every checkpoint's client state and restores it on resume.
    Use: ``prepare()`` before any collective (writability, tag choice, metadata checks), then
    ``ds_config_overrides`` for the engine, then (collective) :meth:`resume`, and after each
    step :meth:`after_step`; :meth:`on_signal` and :meth:`on_finish` at the end. A checkpoint
    saved in another layout (ranks, P, sharding) is converted first (:func:`layout_route`).
    ``on_io(op, seconds)`` observes every save and load.
    """

    def __init__(self, cfg: JobConfig, rank: int, world_size: int, dataset: Any = None):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.dir = cfg.checkpoint.dir
        self.dataset = dataset  # its tokenizer.model and special ids go into each checkpoint
        self.tag: str | None = None
        self.meta: dict[str, Any] | None = None
        self.universal = False  # loaded through DeepSpeed's universal checkpoint
        self.route: str | None = None  # see layout_route
        self.last_saved_step = -1
        self.load_seconds = 0.0
        self.components: dict[str, Stateful] = {}
        self.changes: list[Change] = []  # config keys that differ from the checkpoint's
        self.on_io: Callable[[str, float], None] | None = None

    def register(self, name: str, component: Stateful) -> None:
        """Save ``component.state_dict()`` as ``name`` in every checkpoint; on resume give it
        back to ``component.load_state_dict`` (a checkpoint without it leaves it as it is)."""
        self.components[name] = component

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for name, component in self.components.items():
            if name in TOP_LEVEL_STATE:
                state.update(component.state_dict())
            else:
                state[name] = component.state_dict()
        return state

    def _restore(self, client: dict[str, Any]) -> None:
        for name, component in self.components.items():
            keys = TOP_LEVEL_STATE.get(name)
            sd = {k: client[k] for k in keys} if keys else client.get(name)
            if sd is None:
                continue
            try:
                component.load_state_dict(sd)
            except ValueError as e:
                raise CheckpointError(f"{self.dir}/{self.tag}: {e}") from None

    def prepare(self) -> str | None:
        """Check the directories and choose the tag to resume from (None: a fresh start)."""
        check_writable(self.dir, "checkpoint.dir")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.tag, self.meta = select_resume(self.dir, self.cfg.checkpoint.resume, self.cfg)
        if self.rank == 0:
            for w in caught:
                log.warning(f"[warn] {w.message}")
        if self.tag is not None:
            assert self.meta is not None
            where = os.path.join(self.dir, self.tag)
            check_run_config(self.meta, self.cfg, where)
            self.changes = changes(self.meta, self.cfg)  # every key's resume policy
            refused = refusal(self.changes, self.cfg, where)
            if refused:
                raise CheckpointError(refused)
            notice = check_engine_config(self.dir, self.tag, self.meta, self.cfg)
            route = layout_route(self.dir, self.tag, self.meta, self.cfg, self.world)
            self.route = VIA_UNIVERSAL if notice is not None else route
            self.universal = self.route == VIA_UNIVERSAL
            same_world = int(self.meta["world_size"]) == self.world
            saved_p, now_p = sharded_sp_size(self.meta), sharded_sp_size(config_layout(self.cfg))
            if saved_p != now_p and self.rank == 0 and same_world:
                how = "a universal checkpoint" if self.universal else "re-sharded ZeRO-0 files"
                log.info(
                    f"[resume] {where}: E/F and positions were sharded over {saved_p} rank(s), "
                    f"now {now_p}: loading it through {how}"
                )
            if notice and self.rank == 0 and same_world:
                log.info(f"[resume] {notice}")
            self.last_saved_step = int(self.meta["step"])
        return self.tag

    def ds_config_overrides(self) -> dict[str, Any]:
        """What the DeepSpeed config must say to load the chosen tag (fixed at initialize)."""
        return {"checkpoint": {"load_universal": True}} if self.universal else {}

    def load(self, engine) -> dict[str, Any]:
        """Collective: load the prepared tag into ``engine``; returns its client state."""
        # deepspeed is imported here, not at the top: train.py starts without it
        import deepspeed.comm as dist

        assert self.tag is not None and self.meta is not None
        load_dir = None
        if self.route is not None:
            root = os.path.join(self.dir, UNIVERSAL_DIR)
            now_p = sharded_sp_size(config_layout(self.cfg))
            per_sp_rank = self.universal and self.cfg.deepspeed.zero.stage == 3 and now_p > 1
            if self.rank == 0:
                if int(self.meta["world_size"]) != self.world:  # (else prepare said why)
                    how = (
                        "converting it to a universal checkpoint"
                        if self.universal
                        else "re-sharding its ZeRO-0 files"
                    )
                    log.info(
                        f"[resume] {self.dir}/{self.tag} was saved by {self.meta['world_size']} "
                        f"rank(s), this run has {self.world}: {how}"
                    )
                self._convert(engine, root, now_p, per_sp_rank)
            dist.barrier()
            load_dir = root
            if per_sp_rank:
                load_dir = os.path.join(root, f"sp{engine.mpu.get_model_parallel_rank()}")
        client = load(engine, self.dir, self.tag, self.cfg, load_dir=load_dir)
        if self.universal and saved_frozen(self.meta):
            # the universal copy holds no frozen parameters: from the saved files
            stage = self.cfg.deepspeed.zero.stage
            restore_frozen_params(engine, self.dir, self.tag, sharded_sp_size(self.meta), stage)
        if self.universal and self.cfg.deepspeed.zero.stage == 3:
            assert load_dir is not None
            repair_zero3_universal_load(engine, load_dir, self.tag)
        if self.route is not None:
            dist.barrier()
            if self.rank == 0:  # derived data: the next save writes a native checkpoint
                shutil.rmtree(os.path.join(self.dir, UNIVERSAL_DIR), ignore_errors=True)
        return client

    def _convert(self, engine, root: str, now_p: int, per_sp_rank: bool) -> None:
        """Rank 0: write the prepared tag in a form this layout loads, under ``root``."""
        assert self.tag is not None and self.meta is not None
        try:
            if self.universal:
                convert_to_universal(self.dir, self.tag, frozen=saved_frozen(self.meta))
                if per_sp_rank:
                    shards = sequence_shards(engine.module)
                    cut_universal_per_sequence_rank(root, self.tag, shards, now_p)
            else:
                saved_p = sharded_sp_size(self.meta)
                names = optimizer_index_names(engine)
                reshard_zero0(self.dir, self.tag, saved_p, now_p, names, root)
        except CheckpointError:
            raise
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            shutil.rmtree(root, ignore_errors=True)
            raise CheckpointError(
                f"re-sharding {self.dir}/{self.tag} for this layout failed: {_reason(e, root)}"
                f"{_free_space(self.dir)}; the checkpoint itself is intact"
            ) from None

    def resume(self, engine) -> int:
        """Collective: load the prepared tag into ``engine`` and every registered component;
        returns the step it was saved after (0: a fresh start, nothing loaded)."""
        if self.tag is None:
            return 0
        t0 = time.perf_counter()
        client = self.load(engine)
        self._restore(client)
        # DeepSpeed restored the optimizer's and scheduler's hyper-parameters: the config's again
        apply_changes(engine, self.cfg, self.changes)
        self.load_seconds = time.perf_counter() - t0
        step = int(client["step"])
        if self.rank == 0:
            assert self.meta is not None
            log.info(
                f"[resume] {self.dir}/{self.tag}: step {step}, epoch {int(client['epoch'])}, "
                f"sampler consumed {client['sampler']['consumed']} (saved by "
                f"{self.meta['world_size']} rank(s), now {self.world})"
            )
            line = changed_line(self.changes, self.cfg)
            if line:
                log.info(line)
        return step

    def save(self, engine, step: int, reason: str) -> str:
        """Collective: write ``step``'s checkpoint with every component's state (see
        :func:`save`); returns the tag."""
        t0 = time.perf_counter()
        layout = config_layout(self.cfg)
        tag = save(engine, self.cfg, self.dir, step, self._state(), self.dataset, layout)
        self.last_saved_step = step
        if self.on_io is not None:
            self.on_io("save", time.perf_counter() - t0)
        if self.rank == 0:
            log.info(f"[checkpoint] {reason}: {self.dir}/{tag} ({time.perf_counter() - t0:.1f}s)")
        return tag

    def after_step(self, engine, step: int) -> None:
        """Collective: the interval save (``checkpoint.save_interval``) when ``step`` is due."""
        interval = self.cfg.checkpoint.save_interval
        if interval and step % interval == 0:
            self.save(engine, step, "interval")

    def on_signal(self, engine, step: int, signum: int | None) -> None:
        """Collective: a signal asked the run to stop after ``step``: save it (once)."""
        if self.last_saved_step != step:
            self.save(engine, step, f"signal {signum}")

    def on_finish(self, engine, step: int) -> None:
        """Collective: the end of training: the final save (``checkpoint.save_final``)."""
        if self.cfg.checkpoint.save_final and self.last_saved_step != step:
            self.save(engine, step, "final")

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint, or None."""
        tag = latest_tag(self.dir)
        return os.path.join(self.dir, tag) if tag else None
