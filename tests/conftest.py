"""Shared fixtures, and the two test tiers.

``bash scripts/test.sh`` runs every test (CI). ``bash scripts/test.sh --quick`` runs
``-m "not slow and not gpu"``: the tests that run in one process (or start one trainer rank). A test is
``slow`` when it is marked so (``slow``, ``slurm``), when it, or a fixture it uses, starts
ranks in other processes, or when it is one of the few measured single-process heavyweights
(SLOW_TESTS); that is decided here at collection, so that a new test that launches ranks leaves
the quick tier without anyone having to remember a marker.
"""

import functools
import inspect
import os
import re
import sys
import types
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# The mlflow extra, beside the environment (scripts/setup_env.sh), is on the path only where it
# is used: tests/test_extending.py's tests (a module fixture there) and the runs that load
# tests.extending_plugin. Not here: `import deepspeed` imports mlflow when it can (+1.5 s), in
# the test process and in every process it spawns (they inherit sys.path: bench.sp_bench's
# ranks, the trainer and peer benchmarks' arms).
# One torch (OpenMP/MKL) thread in the test process and in the commands it starts (the trainer
# ranks of tests/pretrain_utils already had it): the tests' models are tiny, and two threads
# that spin on a 2-core machine, beside another process, stalled them (the isolation property
# tests: 98-150 s with 2 threads, 5-6 s with 1, same machine, same minute). Set before torch is
# imported (libgomp reads it once); a value set by the caller is kept.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # imported before this file (by a plugin): set it there too
        sys.modules["torch"].set_num_threads(1)

# Calls that start ranks in other processes: tests/pretrain_utils.run_pretrain (two ranks
# unless nproc=1 is passed in the call) and start/run_worker_ranks, a test's rank workers
# (_run_ranks, torch's start_processes/spawn) and launcher command lines (deepspeed, torchrun,
# mpirun). Searched in the test, its fixtures and the test module's own helpers they call.
LAUNCHES = re.compile(
    r"\brun_pretrain\((?![^()]*\bnproc=1\b)"
    r"|\b_run_ranks\(|\b(?:start|run)_worker_ranks\(|\bstart_processes\(|\bmp\.spawn\("
    r"|\"--num_gpus\"|\"--nproc_per_node\"|torch\.distributed\.run|\"mpirun\""
)
# Fixtures that run a whole tool once per module (several trainer processes or rank workers):
# module.name of the fixture function.
SLOW_FIXTURES = {
    "tests.test_gpu_kit.dry",  # the GPU kit's dry run: every step on the CPU
    "tests.test_sp_bench.tool_runs",  # the sequence-parallel benchmark's ranks (both runs)
    "tests.test_sweep.swept",  # a three-point quality sweep of real trainer runs
    "tests.test_bench.tiny_run",  # bench/model_bench.py's tool run on a tiny grid
    "tests.test_extending.plugin_runs",  # two launch/pretrain.py --plugin trainer processes
    "tests.conftest.layout_chains",  # the resume and frozen chains' 7 launches
}

# Slow tests the rule cannot see: the heaviest single-process ones (measured with --durations
# on 2 cores: the quick tier's slowest, so that it stays within 3 minutes) and ranks or
# processes started by hand or inside a tool.
SLOW_TESTS = {
    "tests/test_reliability.py::test_logged_metrics_after_resume_equal_uninterrupted",  # 4 runs
    "tests/test_hf.py::test_trainer_save_model_keeps_tokenizer_and_accuracy",  # HF Trainer
    # 3 data_prep ranks; 2 trainer ranks waiting out real deadlines
    "tests/test_data_prep_mpi.py::test_srun_transport_dead_rank_fails_the_run_in_time_then_resumes",
    "tests/test_dist_env.py::test_rank_0_killed_during_start_up_rank_1_leaves_within_the_deadline",
    "tests/test_dist_env.py::test_rank_leaves_when_its_launcher_dies",
    "tests/test_dist_env.py::test_sigterm_during_rendezvous_ends_the_rank_within_seconds",
    # ~100 one-rank resumes in a worker process (55 s, 22 s and 25 s alone on 2 cores)
    "tests/test_resume_policy.py::test_generated_resumes_are_refused_or_take_effect",
    "tests/test_resume_policy.py::test_generated_resumes_of_mixture_and_stage_keys",
    "tests/test_resume_policy.py::test_lr_change_on_resume_is_used_and_a_refusal_writes_nothing",
    # a trainer saving every step beside three export commands (23 s and 43 s under load: the
    # slowest of the quick tier after the one above)
    "tests/test_downstream_safety.py::test_export_while_training_saves_and_prunes_every_step",
    # bench/peer_bench.py's tool runs (one process per model)
    "tests/test_peer_bench.py::test_dense_pair_run_records_speedup_vs_hf_bert",
    "tests/test_peer_bench.py::test_one_process_per_model",
    "tests/test_peer_bench.py::test_tiny_run_writes_table",
    # transformers' Trainer fine-tuning in a fresh process (as test_hf's above)
    "tests/test_peft.py::test_lora_default_settings_survive_reload",
    "tests/test_hf_heads.py::test_heads_attention_checkpointing_in_transformers_only_process",
    # two or three one-rank trainer runs each (7-9 s each under load, 2 cores, 2026-12-04)
    "tests/test_context_meter.py::test_output_bias_init_starts_the_model_at_the_unigram_level",
    "tests/test_context_meter.py::test_trainer_eval_records_and_lines_carry_the_meter",
    "tests/test_isolation.py::test_trainer_isolation_auto_on_full_packing",
    "tests/test_downstream_safety.py::"
    "test_metrics_jsonl_once_per_step_after_resume_from_older_tag_and_failed_start_frees_dirs",
}


def _functions(item: pytest.Item) -> Iterator[Callable]:
    """The test function and every fixture function it depends on (transitively)."""
    if getattr(item, "function", None) is not None:
        yield item.function
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        for d in defs:
            yield d.func


def _names(code: types.CodeType) -> Iterator[str]:
    """Global names that ``code`` and the functions defined inside it use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


@functools.cache
def _starts_ranks(fn: Callable, depth: int = 2) -> bool:
    """Whether ``fn`` (or a helper of its own module that it calls, ``depth`` levels down)
    starts ranks in other processes."""
    if f"{fn.__module__}.{fn.__name__}" in SLOW_FIXTURES:
        return True
    try:
        if LAUNCHES.search(inspect.getsource(fn)):
            return True
    except (OSError, TypeError):
        return False
    code = getattr(fn, "__code__", None)
    if depth == 0 or code is None:
        return False
    helpers = (fn.__globals__.get(name) for name in set(_names(code)))
    return any(
        _starts_ranks(h, depth - 1)
        for h in helpers
        if inspect.isfunction(h) and h.__module__ == fn.__module__ and h is not fn
    )


# scripts/test.sh runs the suite on two pytest-xdist workers (``--dist loadfile``): a test module
# runs whole on one worker, so its module fixtures are built once. Modules that share a session
# fixture or a machine-wide resource go to the same worker, as one unit (ModuleGroups below).
SHARED_GROUPS = {
    "tests/test_resume_layout.py": "layout_chains",  # the session fixture layout_chains
    "tests/test_frozen_resume.py": "layout_chains",
    "tests/test_slurm.py": "slurm",  # the one local SLURM cluster (/etc/slurm, /run/munge)
    "tests/test_data_prep_mpi.py": "slurm",
}


def _group(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return SHARED_GROUPS.get(path, path)


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller (it runs no test and starts no rank) gets the mlflow extra on its
    path: a worker's warnings come back pickled with their category's module, and one from the
    extra's packages (a sqlalchemy warning in test_extending.py) is imported there to be shown;
    without the path that import failed and took the whole run down (INTERNALERROR, a worker
    'node down'). The workers start from the path the controller had at start-up, before this."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None and config.getoption("numprocesses", None):
        site = os.path.join(sys.prefix, "mlflow-site")
        if site not in sys.path:
            sys.path.append(site)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest without xdist runs too
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 (xdist's types)
    """``--dist loadfile`` with SHARED_GROUPS' modules merged into one unit each (xdist's own
    ``loadgroup`` marks do not take effect under pytest 9: it renames ``item._nodeid``)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleGroups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:  # noqa: ARG001
    slow = pytest.mark.slow
    for item in items:
        if item.get_closest_marker("slow"):
            continue
        if (
            item.get_closest_marker("slurm")
            or item.nodeid.split("[")[0] in SLOW_TESTS
            or any(_starts_ranks(f) for f in _functions(item))
        ):
            item.add_marker(slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection: the order units go out
        _slow_units_first(items)


def _slow_units_first(items: list) -> None:
    """The units (modules, SHARED_GROUPS merged) with slow tests first, in collection order
    otherwise (run with ``--no-loadscope-reorder``): the long multi-rank units start early and
    the short one-process ones fill the end on both workers. A unit's items stay together."""
    slow_units = {_group(i.nodeid) for i in items if i.get_closest_marker("slow")}
    first: dict[str, int] = {}
    for n, item in enumerate(items):
        first.setdefault(_group(item.nodeid), n)
    items.sort(key=lambda i: (_group(i.nodeid) not in slow_units, first[_group(i.nodeid)]))


def _launcher_vars() -> dict[str, str]:
    from linformer_ds.dist_env import is_launcher_var  # after OMP_NUM_THREADS (torch)

    return {k: v for k, v in os.environ.items() if is_launcher_var(k)}


@pytest.fixture(autouse=True)
def _launcher_vars_restored() -> Iterator[None]:
    """The rank and launcher variables are as they were after every test. The trainer's and
    data_prep's main() and setup_distributed_env fill them in os.environ, as a launcher would;
    a test that ran after them on the same worker found itself rank 1 of 2 and its trainer
    subprocess waited for a rank 0 that never came."""
    before = _launcher_vars()
    yield
    after = _launcher_vars()
    if after != before:
        for k in after.keys() - before.keys():
            del os.environ[k]
        os.environ.update(before)


@pytest.fixture
def _clean_env() -> Iterator[None]:
    """The test starts without the launcher variables (linformer_ds.dist_env.is_launcher_var)
    and gets the environment back as it was afterwards (the trainer's and data_prep's main()
    fill them in for a single process). Asked for by name, or by a whole module:
    ``pytestmark = pytest.mark.usefixtures(...)``."""
    from linformer_ds.dist_env import clear_launcher_vars

    saved = dict(os.environ)
    clear_launcher_vars(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A real data_prep output (stdlib subset, vocab 2000, N = 128), built once per session."""
    from tests.pretrain_utils import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus") / "stdlib_128")


@pytest.fixture(scope="session")
def layout_chains(tiny_corpus, tmp_path_factory) -> dict:
    """tests/test_resume_layout.py's chains and tests/test_frozen_resume.py's frozen chains,
    trained in shared process-group launches (tests/layout_worker.py; each launch's start-up
    paid once): each frozen launch joins the first launch of the resume chains, after the one
    it joined last, that has its world size (its runs after the resume runs: their unsharded
    hops first), or runs after them all. 7 launches instead of 6 + 4. Returns the two output
    folders (``resume``, ``frozen``) and rank 0's log of every launch (``logs``)."""
    from tests.test_frozen_resume import frozen_chain_launches
    from tests.test_resume_layout import _launch, chain_launches

    root = tmp_path_factory.mktemp("layout_chains")
    out = {"resume": root / "resume", "frozen": root / "frozen"}
    for d in out.values():
        d.mkdir()
    launches = [
        {"ranks": ranks, "runs": runs, "before": []}
        for ranks, runs in chain_launches(tiny_corpus, out["resume"], "resume")
    ]
    at = 0
    for fl in frozen_chain_launches(tiny_corpus, out["frozen"], "frozen"):
        later = range(at, len(launches))
        hit = next((i for i in later if launches[i]["ranks"] == fl["ranks"]), None)
        if hit is None:
            launches.append({"ranks": fl["ranks"], "runs": [], "before": []})
            hit = len(launches) - 1
        launches[hit]["runs"] += fl["runs"]
        launches[hit]["before"] += [fl["before"]] if fl["before"] else []
        at = hit + 1
    logs = []
    for j, launch in enumerate(launches):
        for before in launch["before"]:
            before()
        logs.append(_launch(launch["ranks"], launch["runs"], root, f"launch{j}"))
    return {**out, "logs": logs}
