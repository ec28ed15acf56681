from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """What one step produced for one request (cumulative text plus this step's delta)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    adapter: str | None = None
    num_cached_tokens: int = 0
    error: Exception | None = None
    # seconds from arrival until its adapter was resident, and from then until it ran
    adapter_wait_s: float | None = None
    queue_wait_s: float | None = None
