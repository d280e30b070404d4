"""Experiment trackers as metrics sinks: ``logging.sinks: [wandb]`` (Weights & Biases) and
``logging.sinks: [mlflow]`` (MLflow), on rank 0 only (docs/observability.md).

Each tracker gets the resolved config once, flattened to ``section.key`` (W&B: the run's
config; MLflow: its params), and every scalar of every ``[train]`` / ``[eval]`` record under
the TensorBoard sink's tags (``train/loss``, ``eval/loss``, ...) at the same steps. The
tracker's run id travels in checkpoints (the ``metrics`` state, :meth:`Tracker.state_dict`), so
a resumed run appends to the run that wrote its checkpoint: W&B ``resume="allow"`` with that
id, MLflow the same ``run_id``.

W&B runs offline (a run directory under ``logging.dir/wandb``, uploaded later with ``wandb sync
DIR``) unless ``WANDB_MODE`` says otherwise or an API key is configured; an online start that
fails falls back to offline. MLflow logs to ``MLFLOW_TRACKING_URI`` (any URI MLflow takes:
``http://host:5000``, ``sqlite:///path.db``, ``databricks``) or, unset, to
``sqlite:///LOGGING_DIR/mlflow.db``. The W&B project and the MLflow experiment are
``WANDB_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME`` or the config's ``name``.

Neither library is a dependency: ``pip install linformer_ds[wandb]`` / ``[mlflow]``. A run
that names one which is not installed stops before any work, on every rank, with a config error
naming the extra (one installed but broken: the same error on rank 0, when the metrics are
built, before the checkpoint load). A tracker that fails while the run trains logs one warning
and is sent nothing more; training goes on.
"""

import importlib
import importlib.util
import netrc
import os
import time
import uuid
from typing import Any
from urllib.parse import urlparse

from linformer_ds.config import ConfigError, JobConfig, to_dict
from linformer_ds.log import get_logger

log = get_logger(__name__)


def flat_config(cfg: JobConfig) -> dict[str, Any]:
    """The resolved config (what ``logging.dir/config.json`` holds) as ``section.key`` -> value:
    nested sections joined with dots, lists and empty sections as they are."""
    out: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(to_dict(cfg), "")
    return out


class Tracker:
    """What both trackers share. The sink is built on rank 0 with the metrics (its library
    imported then); its run starts at the first of: the resume (a checkpoint's run id is known
    by then), the first record, the first checkpoint save. Events other than records, saves
    and the resume are no-ops."""

    name = ""  # logging.sinks' name, the pip extra and the module to import

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.lib = self._import()  # with the metrics, before the checkpoint load and any step
        self.run_id: str | None = None  # the checkpoint's (load_state_dict), then the run's
        self.started = False
        self.failed = False

    # ------------------------------------------------------------------------- registration
    @classmethod
    def check(cls, cfg: JobConfig) -> None:
        """Every rank, before any work: the library is installed (a config error naming the
        extra otherwise)."""
        try:
            found = importlib.util.find_spec(cls.name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(cls._missing())

    @classmethod
    def _missing(cls, why: str = "is not installed") -> str:
        return (f"logging.sinks: {cls.name} needs the {cls.name} package, which {why}; "
                f"install it with: pip install linformer_ds[{cls.name}]")  # fmt: skip

    @classmethod
    def _import(cls) -> Any:
        try:
            return importlib.import_module(cls.name)
        except ImportError as e:  # installed but broken (a dependency's version)
            raise ConfigError(cls._missing(f"does not import ({e})")) from None

    # ------------------------------------------------------------------------- sink events
    def _ensure(self, resume: bool) -> bool:
        """Start (or continue) the run once; False when the tracker is off after a failure."""
        if not self.started and not self.failed:
            self.started = True
            self._guard("start", self._start, resume and self.run_id is not None)
        return not self.failed

    def _guard(self, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            self.failed = True
            log.warning(f"[warn] {self.name}: {what} failed ({type(e).__name__}: {e}); "
                        "no further records are sent to it")  # fmt: skip

    def record(self, step: int, split: str, values: dict[str, float], console: dict) -> None:
        if self._ensure(False):
            self._guard(f"logging step {step}", self._log, step, split, values)

    def resumed(self, step: int, resumes: int) -> None:
        self._ensure(True)

    def state_dict(self) -> dict[str, Any]:
        """The run's id, saved in every checkpoint (the run starts here if no record came yet)."""
        self._ensure(False)
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id") or self.run_id

    def data_wait(self, seconds: float) -> None:
        pass

    def step_done(self, step: int, seconds: float, tokens: float, skipped: bool, eta: float):
        pass

    def checkpoint_done(self, op: str, seconds: float) -> None:
        pass

    def close(self) -> None:
        if self.started and not self.failed:
            self._guard("closing the run", self._finish)

    # ------------------------------------------------------------------------- per tracker
    def _start(self, resume: bool) -> None:
        raise NotImplementedError

    def _log(self, step: int, split: str, values: dict[str, float]) -> None:
        """Send ``split/name`` -> value of one record at ``step``."""
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


def _wandb_key_configured(wandb: Any) -> bool:
    """An API key in ``WANDB_API_KEY`` or in ~/.netrc for the W&B host (``wandb login``)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url).hostname
    try:
        return host is not None and netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbSink(Tracker):
    """Weights & Biases: ``wandb.init(id=..., resume="allow")``; ``run.log(scalars, step=)``."""

    name = "wandb"

    def _start(self, resume: bool) -> None:
        wandb, cfg = self.lib, self.cfg
        self.run_id = self.run_id or os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:12]
        mode = os.environ.get("WANDB_MODE") or (
            "online" if _wandb_key_configured(wandb) else "offline"
        )
        # no network: wandb retries until its init timeout (90 s by default); here 30 s
        timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", "30"))
        kwargs = dict(
            id=self.run_id,
            resume="allow",
            name=cfg.name,
            project=os.environ.get("WANDB_PROJECT") or cfg.name,
            dir=os.environ.get("WANDB_DIR") or cfg.logging.dir,
            config=None if resume else flat_config(cfg),  # once: a resumed run has it
            settings=wandb.Settings(console="off", quiet=True, init_timeout=timeout),
        )
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as e:  # noqa: BLE001 - no network: the run syncs later
            if mode != "online":
                raise
            log.warning(f"[warn] wandb: online start failed ({type(e).__name__}: "
                        f"{' '.join(str(e).split())}); logging offline")  # fmt: skip
            wandb.teardown()  # the failed run holds its id in wandb's service until then
            mode = "offline"
            self.run = wandb.init(mode=mode, **kwargs)
        where = os.path.dirname(self.run.dir)
        how = f"; upload it with: wandb sync {where}" if mode == "offline" else ""
        log.info(f"[wandb] run {self.run_id} ({'resumed, ' if resume else ''}{mode}) in {where}"
                 f"{how}")  # fmt: skip

    def _log(self, step: int, split: str, values: dict[str, float]) -> None:
        self.run.log({f"{split}/{k}": float(v) for k, v in values.items()}, step=step)

    def _finish(self) -> None:
        self.run.finish()


class MlflowSink(Tracker):
    """MLflow through ``MlflowClient``: the config as params, scalars by ``log_batch``."""

    name = "mlflow"
    PARAMS_PER_BATCH = 100  # MLflow's limit of params in one log_batch

    def _start(self, resume: bool) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        cfg = self.cfg
        default = f"sqlite:///{os.path.abspath(os.path.join(cfg.logging.dir, 'mlflow.db'))}"
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or default
        self.client = MlflowClient(tracking_uri=self.uri)
        if resume:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
                log.info(f"[mlflow] run {self.run_id} (resumed) at {self.uri}")
                return
            except Exception as e:  # noqa: BLE001 - another store: a new run
                log.warning(f"[warn] mlflow: run {self.run_id} of the checkpoint is not at "
                            f"{self.uri} ({type(e).__name__}); starting a new run")  # fmt: skip
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.name
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=cfg.name).info.run_id
        params = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in flat_config(cfg).items()]
        for i in range(0, len(params), self.PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + self.PARAMS_PER_BATCH])
        log.info(f"[mlflow] run {self.run_id} (experiment {name}) at {self.uri}")

    def _log(self, step: int, split: str, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{split}/{k}", float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def _finish(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackerFactory:
    """``logging.sinks`` factory of a tracker: the sink on rank 0, nothing on other ranks;
    ``check`` (every rank, from ``metrics.check_sinks``): the library is installed."""

    def __init__(self, sink: type[Tracker]) -> None:
        self.sink = sink

    def __call__(self, cfg: JobConfig, rank: int, world_size: int) -> Tracker | None:
        return self.sink(cfg) if rank == 0 else None

    def check(self, cfg: JobConfig) -> None:
        self.sink.check(cfg)


TRACKERS = {"wandb": TrackerFactory(WandbSink), "mlflow": TrackerFactory(MlflowSink)}
