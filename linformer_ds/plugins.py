"""``--plugin MODULE``: the user's own extension modules, imported before a command reads its
config (``launch/pretrain.py`` on every rank, ``python -m data_prep`` on every rank), so what
they register (a metrics sink, a data source kind, a projection kind: docs/extending.md) is
there when the config names it. Standard library only (data_prep's processes import it).

``MODULE`` is one of

* a dotted module name, found on ``sys.path`` or in the working directory (an installed plugin
  package included);
* the path of a ``.py`` file (imported under its file name's stem);
* the path of a package directory (one holding ``__init__.py``; imported under the
  directory's name, its submodules importable as ``NAME.sub``).

A plugin never replaces a module the process could import otherwise: a file or package
directory whose module name is a standard-library module, a module importable from
``sys.path`` (an installed one) or a module already imported is refused in one line before
anything of it runs (:class:`PluginError`, exit 2), and so are a dotted name that is a
standard-library module and one whose file in the working directory would be hidden by (or
would hide) an installed module of that name. The rule is :func:`shadowed`.
"""

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterable

from linformer_ds.errors import LinformerError


class PluginError(LinformerError, ValueError):
    """A plugin module that cannot be imported: one line, exit 2."""


def _real(path: str) -> str:
    return os.path.realpath(path or os.curdir)


def _spec_origin(spec: importlib.machinery.ModuleSpec | None) -> str | None:
    """Where ``spec`` loads from (a file or a package directory); '' for a module without a
    file (built in, frozen, a namespace package: its first directory); None for no spec."""
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return spec.origin
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else ""


def shadowed(module: str, own: str | None = None) -> str | None:
    """What else the top-level module name ``module`` is in this process, or None when
    nothing: a standard-library module, a module already imported, or a module found by the
    import system (``sys.meta_path``: ``sys.path`` entries and installed finders). ``own``: the
    plugin's own file or package directory, and the directory holding it is not searched (a
    module found there is the plugin itself, not another)."""
    if module in sys.stdlib_module_names or module in sys.builtin_module_names:
        return f"the standard-library module {module}"
    own_real = _real(own) if own else None
    owned = {own_real, os.path.join(own_real, "__init__.py")} if own_real else set()
    loaded = sys.modules.get(module)
    if loaded is not None:
        where = getattr(loaded, "__file__", None)
        if where is None or _real(where) not in owned:
            return f"the module {module}, already imported" + (f" ({where})" if where else "")
    skip = _real(os.path.dirname(own_real)) if own_real else None
    search = [p for p in sys.path if _real(p) != skip]
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            if finder is importlib.machinery.PathFinder:
                spec = importlib.machinery.PathFinder.find_spec(module, search)
            else:
                spec = find(module, None)
        except (ImportError, ValueError, AttributeError, OSError):
            continue
        origin = _spec_origin(spec)
        if origin is None:
            continue
        if origin and _real(origin) in owned:
            continue
        return f"the installed module {module}" + (f" ({origin})" if origin else "")
    return None


def _refuse(name: str, module: str, other: str) -> PluginError:
    return PluginError(
        f"--plugin {name}: its module name {module!r} is also {other}; a plugin may not replace "
        "a module the process imports: rename it"
    )


def _from_path(name: str) -> tuple[str, str, importlib.machinery.ModuleSpec]:
    """``(module name, file or directory, spec)`` of a ``--plugin`` path, checked."""
    path = os.path.abspath(name)
    if os.path.isdir(path):
        init = os.path.join(path, "__init__.py")
        if not os.path.isfile(init):
            raise PluginError(
                f"--plugin {name}: a directory without __init__.py; pass a package directory "
                "(one holding __init__.py), a .py file or a dotted module name"
            )
        module = os.path.basename(os.path.normpath(path))
        spec = importlib.util.spec_from_file_location(
            module, init, submodule_search_locations=[path]
        )
    elif os.path.isfile(path):
        if not path.endswith(".py"):
            raise PluginError(f"--plugin {name}: not a .py file; pass a .py file, a package "
                              "directory or a dotted module name")  # fmt: skip
        module = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(module, path)
    else:
        raise PluginError(f"--plugin {name}: no such file or directory; pass a .py file, a "
                          "package directory or a dotted module name")  # fmt: skip
    if not module.isidentifier():
        raise PluginError(f"--plugin {name}: {module!r} is not a module name (letters, digits "
                          "and _; not starting with a digit): rename it")  # fmt: skip
    other = shadowed(module, own=path)
    if other is not None:
        raise _refuse(name, module, other)
    return module, path, spec


def _check_dotted(name: str) -> None:
    """A dotted ``--plugin`` name: well formed, not a standard-library module, and not a file
    of the working directory that an installed module of the same name hides (or the other
    way round: which one is imported would depend on ``sys.path``'s order)."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise PluginError(f"--plugin {name}: not a module name, a .py file or a directory; "
                          "no such file or directory")  # fmt: skip
    top = parts[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        raise PluginError(f"--plugin {name}: {top!r} is a standard-library module, not a "
                          "plugin; give your plugin module another name")  # fmt: skip
    cwd = os.getcwd()
    for local in (os.path.join(cwd, f"{top}.py"), os.path.join(cwd, top)):
        if os.path.isfile(local) or os.path.isfile(os.path.join(local, "__init__.py")):
            other = shadowed(top, own=local)
            if other is not None:
                raise _refuse(os.path.relpath(local, cwd), top, other)


def import_plugin(name: str) -> None:
    """Import one ``--plugin`` module (its top level registers what it adds); every check of
    the module docstring first."""
    if not isinstance(name, str) or not name.strip():
        raise PluginError("--plugin: an empty name; pass a .py file, a package directory or a "
                          "dotted module name")  # fmt: skip
    path_form = name.endswith(".py") or os.sep in name or "/" in name or os.path.isdir(name)
    if path_form:
        module, path, spec = _from_path(name)
    else:
        _check_dotted(name)
    try:
        if path_form:
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[module] = loaded
            try:
                spec.loader.exec_module(loaded)
            except BaseException:
                sys.modules.pop(module, None)  # a failed plugin leaves no half module behind
                raise
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            importlib.import_module(name)
    except PluginError:
        raise
    except Exception as e:  # a missing module or an error in its top level: named, one line
        detail = " ".join(str(e).split())
        raise PluginError(f"--plugin {name}: {type(e).__name__}: {detail}") from e


def import_plugins(names: Iterable[str]) -> None:
    """Import every ``--plugin`` module, in order."""
    for name in names:
        import_plugin(name)
