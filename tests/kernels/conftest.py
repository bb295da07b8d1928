"""Kernel tests run the Triton kernels through Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a @triton.jit function is decorated, i.e. when
pagecli_kernels/<op>.py is first imported (pagecli_kernels.ops imports them lazily, on the first
impl="triton" call). Setting it here, before any kernel test runs, is enough even if something
imported triton earlier in the session. The compile test unsets it in a subprocess.

On a GPU machine, PAGECLI_KERNEL_TEST_DEVICE=cuda runs the same cases on CUDA tensors with the
kernels compiled (scripts/gpu_check.sh does this); the interpreter is then left off.
"""

import os

if os.environ.get("PAGECLI_KERNEL_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
