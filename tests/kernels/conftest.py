"""Kernel tests run the Triton kernels through Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a @triton.jit function is decorated, i.e. when
pagecli_kernels/<op>.py is first imported (pagecli_kernels.ops imports them lazily, on the first
impl="triton" call). Setting it here, before any kernel test runs, is enough even if something
imported triton earlier in the session. The compile test unsets it in a subprocess.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
