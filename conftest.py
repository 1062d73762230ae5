"""Root pytest configuration.

Triton kernels run under the interpreter when no CUDA GPU is present; the variable must
be set before any kernel module is imported, so it is set here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
