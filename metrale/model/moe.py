"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): token-choice top-k
routing over SiLU-gated expert MLPs, computed as transformers computes it (softmax in
float32, top-k, optional renormalisation, the weights cast back unless the family keeps
them in float32; experts in ascending order, each adding its tokens by top-k position),
plus Qwen2-MoE's sigmoid-gated shared expert.

The reference path on every backend: each routed expert is a gather, two matmuls and an
index_add, with a host sync to list the experts hit, so a MoE model runs without CUDA
graphs. No LoRA on the experts, the router or the shared expert yet: adapters that target
them are refused at registration (the layer offers only the attention modules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ModelConfig


class MoeMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        e, h, i = moe.num_experts, cfg.hidden_size, moe.expert_size
        self.top_k, self.norm_topk, self.fp32_weights = moe.top_k, moe.norm_topk_prob, moe.fp32_weights
        self.inter = i
        self.router = nn.Parameter(torch.empty(e, h))  # [E, H]
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))  # [E, 2I, H]: gate, up
        self.experts_down = nn.Parameter(torch.empty(e, h, i))  # [E, H, I]
        if moe.shared_expert_size:
            s = moe.shared_expert_size
            self.shared_gate_up = nn.Parameter(torch.empty(2 * s, h))  # [2S, H]
            self.shared_down = nn.Parameter(torch.empty(h, s))  # [H, S]
            self.shared_expert_gate = nn.Parameter(torch.empty(1, h))  # [1, H]
        else:
            self.shared_gate_up = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        logits = F.linear(x, self.router)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():  # ascending, as transformers visits them
            pos, tok = torch.where(experts.T == e)  # by top-k position, then token
            gate, up = F.linear(x[tok], self.experts_gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts_down[e]) * weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if self.shared_gate_up is not None:
            gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, self.shared_down)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return out
