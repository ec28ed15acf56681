"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): token-choice top-k
routing over SiLU-gated expert MLPs, computed as transformers computes it (softmax in
float32, top-k, optional renormalisation, the weights cast back unless the family keeps
them in float32; experts in ascending order, each adding its tokens by top-k position),
plus Qwen2-MoE's sigmoid-gated shared expert.

On CUDA (and in Triton's interpreter when tests ask) the routed experts run through
metrale.ops.moe_triton without a host sync, so a MoE step fits in a CUDA graph: the pairs
sorted into single-expert blocks, one grouped GEMM per projection with the expert LoRA's
expand in its epilogue (after a per-pair shrink launch), each output weighted in the
activation dtype as transformers does, a token's k summed in float32 and rounded once
(transformers adds them one expert at a time in that dtype). The reference path (the
CPU's) is each routed expert's gather, two matmuls and index_add, with a host sync to list
the experts.

LoRA on the experts (pool memory with --lora-experts): each slot holds PEFT's
target_parameters factors, A [r * E, in] with expert e's rows at e * r, and B transposed
[r * E, out] with expert e's at ri * E + e (ParamWrapper's layout; per-expert adapters land
there too, metrale.adapters.plan), added to the expert's outputs per token and slot; the
router's plain A [r, H] and B^T [r, E] added to its logits before the softmax, as any
projection's (metrale.ops.lora). The shared expert's four Linears take plain LoRA (and
DoRA) the same way, in the default pool memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ROUTER_MODULE, ModelConfig
from metrale.forward_context import LoraBatch, get_context
from metrale.ops import fused_triton as fused
from metrale.ops import lora as lora_ops
from metrale.ops import lora_triton, moe_triton


class MoeMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        moe = cfg.moe
        e, h, i = moe.num_experts, cfg.hidden_size, moe.expert_size
        self.top_k, self.norm_topk, self.fp32_weights = moe.top_k, moe.norm_topk_prob, moe.fp32_weights
        # [E] pairs routed to each expert by the last forward (bench/decode.py's roofline
        # reads how many experts a step touched; written inside CUDA graphs too)
        self.register_buffer("expert_counts", torch.zeros(e, dtype=torch.int32), persistent=False)
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
        lora = get_context().lora  # modules without pool memory (no --lora-experts) add nothing
        # [T, E], with the router's LoRA (PEFT's ParamWrapper on mlp.gate.weight): on CUDA
        # its shrink overlaps the router GEMM
        logits = self._linear(x, self.router, lora, (ROUTER_MODULE,),
                              (slice(0, self.router.shape[0]),))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(logits.dtype)
        if x.is_cuda or lora_ops.TRITON_ON_CPU:
            out = self._routed_fused(x, weights, experts, lora)
        else:
            out = self._routed_reference(x, weights, experts, lora)
        if self.shared_gate_up is not None:
            out = out + self._shared_expert(x, lora)
        return out

    def _shared_expert(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """Qwen2-MoE's sigmoid(gate(x)) * down(silu(gate_proj(x)) * up_proj(x)), each
        Linear with its LoRA as PEFT wraps it. x: [T, H] -> [T, H]."""
        s, h = self.shared_down.shape[1], self.shared_down.shape[0]
        gate, up = self._linear(x, self.shared_gate_up, lora, ("shared_gate_proj", "shared_up_proj"),
                                (slice(0, s), slice(s, 2 * s))).chunk(2, dim=-1)
        shared = self._linear(F.silu(gate) * up, self.shared_down, lora, ("shared_down_proj",),
                              (slice(0, h),))
        g = self._linear(x, self.shared_expert_gate, lora, ("shared_expert_gate",), (slice(0, 1),))
        return torch.sigmoid(g) * shared

    def _linear(self, x: torch.Tensor, w: torch.Tensor, lora: LoraBatch | None,
                modules: tuple[str, ...], out_slices: tuple[slice, ...]) -> torch.Tensor:
        if lora is None:
            return F.linear(x, w)
        return lora_ops.lora_linear(x, lambda t: F.linear(t, w), None, lora, self.layer, modules,
                                    out_slices)

    def shared_weight(self, module: str) -> torch.Tensor:
        """The base weight W [out, in] a shared-expert module's LoRA adds to (DoRA's norms)."""
        s = self.shared_down.shape[1]
        return {"shared_gate_proj": self.shared_gate_up[:s], "shared_up_proj": self.shared_gate_up[s:],
                "shared_down_proj": self.shared_down,
                "shared_expert_gate": self.shared_expert_gate}[module]

    def _routed_fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                      lora: LoraBatch | None) -> torch.Tensor:
        """x [T, H], weights and experts [T, k] -> the routed experts' sum [T, H]."""
        T, k = experts.shape
        pair_experts = experts.reshape(-1)  # [P]
        # the gate_up shrink reads only x and the picks: on CUDA it runs beside the routing
        # kernel (a single program, leaving the other SMs idle)
        side = lora_triton.side_stream(x.device) if x.is_cuda and lora_triton.OVERLAP else None
        gate_up_lora = self._expert_lora(lora, "experts_gate_up", x, pair_experts, k, side)
        blocks = moe_triton.route_blocks(experts, self.experts_gate_up.shape[0],
                                         self.expert_counts)
        if gate_up_lora is not None and side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        gate_up = moe_triton.grouped_gemm(x, self.experts_gate_up, blocks, rows_div=k,
                                          lora=gate_up_lora)  # [P, 2I]
        h = fused.silu_mul(gate_up) if fused.usable(gate_up) else fused.silu_mul_ref(gate_up)
        y = moe_triton.grouped_gemm(  # [P, H]
            h, self.experts_down, blocks, rows_div=1,
            lora=self._expert_lora(lora, "experts_down", h, pair_experts, 1, None))
        return (y.view(T, k, -1) * weights.unsqueeze(-1)).sum(1).to(x.dtype)

    def _expert_lora(self, lora: LoraBatch | None, module: str, x: torch.Tensor,
                     pair_experts: torch.Tensor, rows_div: int,
                     stream: torch.cuda.Stream | None) -> moe_triton.ExpertLoraDelta | None:
        """The shrink of a module's expert LoRA, for its grouped GEMM to expand and add."""
        views = lora.pool.expert_views(self.layer, module) if lora is not None else None
        if views is None:
            return None
        return moe_triton.expert_shrink(x, lora.slot_ids, pair_experts, views, rows_div,
                                        stream=stream)

    def _routed_reference(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                          lora: LoraBatch | None) -> torch.Tensor:
        flat = experts.reshape(-1)
        self.expert_counts.zero_().scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():  # ascending, as transformers visits them
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
        return out

    def _lora(self, lora: LoraBatch, module: str, x: torch.Tensor, slots: torch.Tensor,
              expert: int) -> torch.Tensor | int:
        """The LoRA delta of expert `expert`'s module on the rows x [n, in] -> [n, out]:
        scale * (x A^T) B by each row's slot (slots [n]); 0 where no row's slot has it."""
        views = lora.pool.expert_views(self.layer, module)
        if views is None:
            return 0
        n_experts = views.num_experts
        delta = None
        for s in torch.unique(slots).tolist():
            rank = int(views.ranks[s]) if s >= 0 else 0
            if rank == 0:
                continue
            a = views.a[s, :rank * n_experts].view(n_experts, rank, -1)[expert]  # [r, in]
            bt = views.bt[s, :rank * n_experts].view(rank, n_experts, -1)[:, expert]  # [r, out]
            rows = slots == s
            h = x[rows].float() @ a.float().T  # [n_s, r]
            d = (h @ bt.float()) * float(views.scales[s])  # [n_s, out]
            if delta is None:
                delta = torch.zeros(x.shape[0], d.shape[1], dtype=torch.float32, device=x.device)
            delta[rows] = d
        return 0 if delta is None else delta.to(x.dtype)
