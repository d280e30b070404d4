"""Shared fixtures, and the two test tiers.

``bash scripts/test.sh`` runs every test (CI). ``bash scripts/test.sh --quick`` runs
``-m "not slow"``: the tests that run in one process (or start one trainer rank). A test is
``slow`` when it is marked so (``slow``, ``slurm``), when it, or a fixture it uses, starts
ranks in other processes, or when it is one of the few measured single-process heavyweights
(SLOW_TESTS); that is decided here at collection, so that a new test that launches ranks leaves
the quick tier without anyone having to remember a marker.
"""

import functools
import inspect
import os
import re
from typing import Callable, Iterator

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Calls that start ranks in other processes: tests/pretrain_utils.run_pretrain (two ranks
# unless nproc=1 is passed in the call), a test's rank workers (_run_ranks, torch's
# start_processes/spawn) and launcher command lines.
LAUNCHES = re.compile(
    r"\brun_pretrain\((?![^()]*\bnproc=1\b)"
    r"|\b_run_ranks\(|\bstart_processes\(|\bmp\.spawn\("
    r"|\"--num_gpus\"|\"--nproc_per_node\"|\"mpirun\""
)
# Fixtures that run a whole tool once per module (several trainer processes or rank workers):
# module.name of the fixture function.
SLOW_FIXTURES = {
    "tests.test_gpu_kit.dry",  # the GPU kit's dry run: every step on the CPU
    "tests.test_sp_bench.tiny_run",  # the sequence-parallel benchmark's ranks
    "tests.test_sweep.swept",  # a three-point quality sweep of real trainer runs
}

# Single-process tests measured as the heaviest of the quick tier (--durations on 2 cores):
# each alone took a fifth to a tenth of the tier.
SLOW_TESTS = {
    "tests/test_reliability.py::test_logged_metrics_after_resume_equal_uninterrupted",  # 4 runs
    "tests/test_hf.py::test_trainer_save_model_keeps_tokenizer_and_accuracy",  # HF Trainer
}


def _functions(item: pytest.Item) -> Iterator[Callable]:
    """The test function and every fixture function it depends on (transitively)."""
    if getattr(item, "function", None) is not None:
        yield item.function
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        for d in defs:
            yield d.func


@functools.cache
def _starts_ranks(fn: Callable) -> bool:
    if f"{fn.__module__}.{fn.__name__}" in SLOW_FIXTURES:
        return True
    try:
        return bool(LAUNCHES.search(inspect.getsource(fn)))
    except (OSError, TypeError):
        return False


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


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A real data_prep output (stdlib subset, vocab 2000, N = 128), built once per session."""
    from tests.pretrain_utils import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus") / "stdlib_128")
