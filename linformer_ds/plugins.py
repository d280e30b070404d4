"""``--plugin MODULE``: the user's own extension modules, imported before a command reads its
config (``launch/pretrain.py`` on every rank, ``python -m data_prep`` on every rank), so what
they register (a metrics sink, a data source kind, a projection kind: docs/extending.md) is
there when the config names it. Standard library only (data_prep's processes import it).

``MODULE`` is a dotted module name, found on ``sys.path`` or in the working directory, or the
path of a ``.py`` file.
"""

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable

from linformer_ds.errors import LinformerError


class PluginError(LinformerError, ValueError):
    """A plugin module that cannot be imported: one line, exit 2."""


def import_plugin(name: str) -> None:
    """Import one ``--plugin`` module (its top level registers what it adds)."""
    try:
        if name.endswith(".py") or os.sep in name:
            path = os.path.abspath(name)
            if not os.path.isfile(path):
                raise PluginError(f"--plugin {name}: no such file")
            stem = os.path.splitext(os.path.basename(path))[0]
            spec = importlib.util.spec_from_file_location(stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[stem] = module
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            importlib.import_module(name)
    except PluginError:
        raise
    except Exception as e:  # a missing module or an error in its top level: named, one line
        raise PluginError(f"--plugin {name}: {type(e).__name__}: {e}") from e


def import_plugins(names: Iterable[str]) -> None:
    """Import every ``--plugin`` module, in order."""
    for name in names:
        import_plugin(name)
