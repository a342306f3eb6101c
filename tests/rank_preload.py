"""What the forkserver of the suite's ranks imports (and computes) once (conftest.py): each rank forked from it
starts with these instead of paying for them (~4 s of CPU per rank in imports; ~0.5 s listing the standard library
for a training rank's data stream), then moves all of it out of the garbage collector's reach (`gc.freeze`:
transformers' Trainer runs gc.collect() at each train(), which scanned every imported object: GRPO's test 36.9 ->
30.2 s)."""

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401

import deltacp  # noqa: F401
import deltacp.train.trainer  # noqa: F401
import helpers  # noqa: F401
from deltacp.train.data import stdlib_files

stdlib_files()

import gc  # noqa: E402

gc.freeze()  # module-level objects: never garbage; each rank's collections skip them
