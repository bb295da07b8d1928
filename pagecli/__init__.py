"""pagecli: run open-weight LLMs on a paged KV cache with continuous batching."""

from pagecli.config import EngineConfig
from pagecli.llm import LLM
from pagecli.outputs import CompletionOutput, RequestOutput
from pagecli.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
