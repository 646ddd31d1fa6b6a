"""llmgw: LLM inference across a GPU fleet, one command, one gateway."""

__version__ = "0.1.0"
