"""The offline API: `LLM(...).generate(prompts, params, adapters=[...])`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from metrale.config import EngineConfig, PoolConfig
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.outputs import RequestOutput
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.siblings import sibling_id
from metrale.errors import ChatTemplateError, MetraleError

Message = dict[str, str]  # {"role": ..., "content": ...}


def load_tokenizer(model_dir: Path):
    """The model dir's tokenizer, or None for a checkpoint that ships none."""
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                  "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class LLM:
    """The offline engine (vLLM's LLM). Its requests wait for an adapter slot as long as
    that takes (promotion_timeout_s: inf): a generate() batch is finite and its running
    requests free their slots, so POOL_FULL after a wall-clock wait would only fail a batch
    on a slow machine. The server passes its --promotion-timeout instead."""

    def __init__(self, model: str | Path | None = None, *, max_loras: int | None = None,
                 max_lora_rank: int = 16, device: str = "cpu", dtype: str | None = None,
                 allow_runtime_swaps: bool = True, host_tier_bytes: int = 0,
                 adapter_eviction: str = "cost", promotion_timeout_s: float = math.inf,
                 tensor_parallel_size: int = 1, **engine_kwargs) -> None:
        """tensor_parallel_size: ranks (processes, one GPU each on CUDA) the base and the
        adapters are split over (vLLM's spelling); close() stops them."""
        if model is None:
            from metrale.model.default_model import default_model_dir

            model = default_model_dir()
        model_dir = Path(model)
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        cfg = EngineConfig(
            pool=PoolConfig(max_loras, max_lora_rank, allow_runtime_swaps=allow_runtime_swaps,
                            host_tier_bytes=host_tier_bytes, eviction=adapter_eviction),
            device=device, dtype=dtype, promotion_timeout_s=promotion_timeout_s,
            tensor_parallel_size=tensor_parallel_size, **engine_kwargs,
        )
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = LLMEngine(model_dir, cfg, self.tokenizer)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to stop on one device)."""
        self.engine.close()

    def register_adapter(self, name: str, adapter_dir: str | Path, pinned: bool = False,
                         reload: bool = False) -> None:
        """An existing name is refused (AdapterExistsError) unless reload=True: then requests
        from here on get the new files, never the old weights or their cached KV."""
        self.engine.register_adapter(name, adapter_dir, pinned, reload)

    def chat_prompt(self, message: str) -> str:
        return self._template([{"role": "user", "content": message}])

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             adapters: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {role, content}) or a list of them;
        one RequestOutput per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt_ids(c) for c in conversations]
        return self.generate(prompts, sampling_params, adapters)

    def chat_prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The token ids apply_chat_template(tokenize=True) gives: the template writes
        the special tokens (BOS...) itself, so encoding adds none (no double BOS)."""
        return self.tokenizer.encode(self._template(messages), add_special_tokens=False)

    def _template(self, messages: Sequence[Message]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError("this model has no chat template")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises on roles/orders the template does not accept
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from e

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; n of them, in a row, for a prompt whose
        sampling params ask n > 1 completions."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = sampling_params if isinstance(sampling_params, Sequence) else [
            sampling_params or SamplingParams()] * n
        names = adapters if isinstance(adapters, (list, tuple)) else [adapters] * n
        if len(params) != n or len(names) != n:
            raise MetraleError("prompts, sampling_params and adapters must have the same length")
        # a request with n > 1 answers n outputs in a row, index 0 .. n-1
        ids = []
        for p, sp, a in zip(prompts, params, names):
            request_id = self.engine.add_request(p, sp, a)
            ids += [sibling_id(request_id, i) for i in range(sp.n)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
            if not outputs:
                self.engine.wait_for_work(0.05)
        for out in final.values():
            if out.error is not None:
                raise out.error
        return [final[i] for i in ids]
