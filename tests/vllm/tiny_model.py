"""The tiny random Llama the vLLM tests run: built by the CPU P/D example (one builder)."""

from examples.pd_cpu.tiny_model import CORPUS, build_tiny_llama, make_prompt

__all__ = ["CORPUS", "build_tiny_llama", "make_prompt"]
