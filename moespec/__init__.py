"""moespec: serving DeepSeek-V3-class MoE models and Llama with lossless speculative decoding."""
from moespec.sampling import SamplingParams
from moespec.structured import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # importing the engine pulls in torch models; keep `import moespec` light
        from moespec.llm import LLM

        return LLM
    raise AttributeError(name)
