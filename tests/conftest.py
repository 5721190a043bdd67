"""Test set-up shared by the whole suite.

Without a GPU, Triton kernels run under Triton's interpreter: the variable has
to be set before any ``@triton.jit`` decorator runs, so it is set here, before
fusepass is imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()

from fusepass.testing import without_inductor_cpu_int8_woq  # noqa: E402 - after TRITON_INTERPRET is set

if not HAS_CUDA:  # the lowering's CPU kernel is the broken one
    without_inductor_cpu_int8_woq()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="long mode: set FUSEPASS_LONG=1")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and os.environ.get("FUSEPASS_LONG") != "1":
            item.add_marker(skip_slow)


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"



def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker a core, at most four (each holds torch, Inductor and
    the compiled models of the file it runs)."""
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_configure(config):
    """Rules whose forms hold collectives (all_reduce_rms_norm) run them on the
    default group: a single gloo rank in this process (tests/test_tp.py spawns
    several).  Before collection: tests/test_ops.py runs every rule's
    replacement to list the ops' cases."""
    from fusepass.testing import single_rank_group

    single_rank_group()
