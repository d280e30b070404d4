"""The three extensions of docs/extending.md as one ``--plugin`` module, as a user writes it:
imported by ``launch/pretrain.py --plugin tests.extending_plugin`` (every rank) and
``python -m data_prep --plugin tests.extending_plugin`` before either reads its config.
The extensions themselves are defined in tests/test_extending.py."""

import sys
from pathlib import Path

from data_prep.sources import register_source_kind
from linformer_ds.metrics import register_sink
from tests.test_extending import CollectSink, ZipKind, register_pool

# The mlflow extra lives beside the environment (scripts/setup_env.sh says why): on the path of
# the runs that use the mlflow sink, these, not of every process that imports deepspeed.
MLFLOW_SITE = str(Path(sys.prefix) / "mlflow-site")
if MLFLOW_SITE not in sys.path:
    sys.path.append(MLFLOW_SITE)

register_source_kind(ZipKind(), replace=True)  # --source zip:ARCHIVE
register_pool()  # model.projection / layer_projections: pool
register_sink("collect", CollectSink.for_rank, replace=True)  # logging.sinks: [collect]
