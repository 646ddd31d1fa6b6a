"""Engine adapters: how to launch vLLM, SGLang, any command, or the simulated engine."""

from llmgw.agent.engines.base import Adapter, LaunchError, adapter_for, tensor_parallel_arg

__all__ = ["Adapter", "LaunchError", "adapter_for", "tensor_parallel_arg"]
