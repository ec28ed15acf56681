"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): token-choice top-k
routing over SiLU-gated expert MLPs, computed as transformers computes it (softmax in
float32, top-k, optional renormalisation, the weights cast back unless the family keeps
them in float32; experts in ascending order, each adding its tokens by top-k position),
plus Qwen2-MoE's sigmoid-gated shared expert.

The reference path on every backend: each routed expert is a gather, two matmuls and an
index_add, with a host sync to list the experts hit, so a MoE model runs without CUDA
graphs.

LoRA on the experts (pool memory with --lora-experts): each slot holds PEFT's
target_parameters factors, A [r * E, in] with expert e's rows at e * r, and B transposed
[r * E, out] with expert e's at ri * E + e (ParamWrapper's layout; per-expert adapters land
there too, metrale.adapters.plan), added to the expert's outputs per token and slot; the
router's plain A [r, H] and B^T [r, E] added to its logits before the softmax. No LoRA on
the shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ModelConfig
from metrale.forward_context import get_context


class MoeMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        moe = cfg.moe
        e, h, i = moe.num_experts, cfg.hidden_size, moe.expert_size
        self.top_k, self.norm_topk, self.fp32_weights = moe.top_k, moe.norm_topk_prob, moe.fp32_weights
        self.experts_routed = 0
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
        lora = get_context().lora
        if lora is not None and "experts_gate_up" not in lora.pool.layout.pool.target_modules:
            lora = None  # no pool memory for expert and router LoRA
        logits = F.linear(x, self.router)  # [T, E]
        if lora is not None:  # the router's: PEFT's ParamWrapper on mlp.gate.weight
            logits = logits + self._lora(lora, "router", x, lora.slot_ids)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        hit = torch.unique(experts).tolist()
        self.experts_routed = len(hit)  # the experts this forward read (bench/decode.py's roofline)
        for e in hit:  # ascending, as transformers visits them
            pos, tok = torch.where(experts.T == e)  # by top-k position, then token
            gate_up = F.linear(x[tok], self.experts_gate_up[e])  # [n, 2I]
            if lora is not None:
                gate_up = gate_up + self._lora(lora, "experts_gate_up", x[tok],
                                               lora.slot_ids[tok], e)
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up  # [n, I]
            y = F.linear(h, self.experts_down[e])
            if lora is not None:
                y = y + self._lora(lora, "experts_down", h, lora.slot_ids[tok], e)
            out.index_add_(0, tok, (y * weights[tok, pos, None]).to(out.dtype))
        if self.shared_gate_up is not None:
            gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, self.shared_down)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return out

    def _lora(self, lora, module: str, x: torch.Tensor, slots: torch.Tensor,
              expert: int | None = None) -> torch.Tensor | int:
        """The LoRA delta of module on the rows x [n, in] -> [n, out]: scale * (x A^T) B by
        each row's slot (slots [n]); an expert module's A and B are expert `expert`'s rows
        of the stacked factors. 0 where no row's slot has the module."""
        pool, layer = lora.pool, self.layer
        m = pool.layout.module_index(module)
        delta = None
        for s in torch.unique(slots).tolist():
            rank = int(pool.ranks[s, layer, m]) if s >= 0 else 0
            if rank == 0:
                continue
            a, bt = pool.lora_a(layer, module)[s], pool.lora_bt(layer, module)[s]
            if expert is None:
                a, bt = a[:rank], bt[:rank]  # [r, in], [r, out]
            else:
                n_experts = self.experts_gate_up.shape[0]
                a = a[:rank * n_experts].view(n_experts, rank, -1)[expert]  # [r, in]
                bt = bt[:rank * n_experts].view(rank, n_experts, -1)[:, expert]  # [r, out]
            rows = slots == s
            h = x[rows].float() @ a.float().T  # [n_s, r]
            d = (h @ bt.float()) * float(pool.scales[s, layer, m])  # [n_s, out]
            if delta is None:
                delta = torch.zeros(x.shape[0], d.shape[1], dtype=torch.float32, device=x.device)
            delta[rows] = d
        return 0 if delta is None else delta.to(x.dtype)
