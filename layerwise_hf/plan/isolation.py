"""A plan made inside a running training process, as if it were a single process of its own.

The simulation makes `TrainingArguments`, whose device setup resets accelerate's process-wide state
(`AcceleratorState._reset_state(reset_partial_state=True)`) and makes a `PartialState(cpu=True)`. Inside a launched
run (torchrun, `accelerate launch`) two things go wrong without care:

- that `PartialState` reads the launcher's rendezvous variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `LOCAL_RANK`,
  `PMI_SIZE`, ...) and joins this run's process group, or waits for it forever (so does the process a plan spawns for
  one rank of a running group, which inherits `os.environ`);
- the running Trainer's `Accelerator` reads that state afterwards (`num_processes` in `compute_loss`).

`single_process()` hides the rendezvous variables and puts accelerate's state and the environment back afterwards;
`plan()` runs every simulation inside it, so a direct call behaves as the preflight does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

RENDEZVOUS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
})  # fmt: skip
RENDEZVOUS_PREFIXES = ("PMI_", "OMPI_COMM_WORLD_", "MV2_COMM_WORLD_", "TORCHELASTIC_")


def is_rendezvous(name: str) -> bool:
    """Whether the environment variable `name` is one a launcher sets for a process group."""
    return name in RENDEZVOUS or name.startswith(RENDEZVOUS_PREFIXES)


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """
    The environment of a single process (no rendezvous variables) and accelerate's process-wide state, both put back
    as they were when the context ends.

    Example:

    ```python
    >>> import os
    >>> from layerwise_hf.plan.isolation import single_process
    >>> os.environ["WORLD_SIZE"] = "8"
    >>> with single_process():
    ...     "WORLD_SIZE" in os.environ
    False
    >>> os.environ.pop("WORLD_SIZE")
    '8'
    ```
    """
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = [(cls._shared_state, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)]
    environ = dict(os.environ)
    for key in [k for k in os.environ if is_rendezvous(k)]:
        del os.environ[key]
    try:
        yield
    finally:
        for shared, copied in saved:
            shared.clear()
            shared.update(copied)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
