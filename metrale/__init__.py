"""metrale: one base LLM, many LoRA adapters, swapped at run time."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import metrale` (the CLI, the errors) does not pay for torch and transformers.
    if name == "LLM":
        from metrale.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from metrale.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
