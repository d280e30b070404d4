import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A real data_prep output (stdlib subset, vocab 2000, N = 128), built once per session."""
    from tests.pretrain_utils import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus") / "stdlib_128")
