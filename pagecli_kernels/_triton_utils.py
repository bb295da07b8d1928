"""Helpers shared by the Triton launchers: interpreter detection and argument checks."""

from __future__ import annotations

import os

import torch

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128)
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_triton_support(head_dim: int, block_size: int, *tensors: torch.Tensor) -> None:
    """Reject what the Triton kernels were not built for, with a ValueError."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} is not supported by the Triton kernels; supported: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size {block_size} is not supported by the Triton kernels; supported: "
            f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))}"
        )
    for tensor in tensors:
        if tensor.device.type == "cpu" and not interpreting():
            raise ValueError(
                "the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton "
                "is imported to run them on the CPU"
            )
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"the Triton kernels need a unit stride along head_dim, got strides "
                f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)}"
            )
