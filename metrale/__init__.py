"""metrale: one base LLM, many LoRA adapters, swapped at run time."""

__version__ = "0.1.0"
