import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*max_grad_norm.*")


@pytest.fixture(autouse=True)
def _same_environment_for_every_test():
    # NOTE: transformers < 5 writes TrainingArguments' settings into os.environ (ACCELERATE_MIXED_PRECISION,
    # ACCELERATE_USE_FSDP, FSDP_*), where every later Accelerator of the process reads them: a bf16 or FSDP test would
    # change the tests after it.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
