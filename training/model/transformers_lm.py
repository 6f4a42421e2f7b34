"""A transformers causal LM behind the interface every arm uses: `forward` gives logits, `loss` the
training loss (the router's auxiliary loss included for sparse MoE architectures), `block_of` which
transformer block a parameter belongs to (fragments are dealt by block), `parameter_counts` total and
active parameters. Built from its config, so nothing is downloaded; transformers is imported only
when a spec asks for such a model.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

BLOCK = re.compile(r"^lm\.model\.layers\.(\d+)\.")
EXPERTS = re.compile(r"\.experts\.")


class TransformersLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_config(config)
        self.experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
        self.experts_per_token = getattr(config, "num_experts_per_tok", 1)

    @classmethod
    def from_spec(cls, spec) -> "TransformersLM":
        return cls(spec.model.transformers.library_config(spec.vocab_size, spec.max_seq_len))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy, plus the router's load-balancing loss weighted as the config says."""
        if not self.experts:
            logits = self(idx)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        out = self.lm(input_ids=idx, output_router_logits=True)
        loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
        return loss + self.lm.config.router_aux_loss_coef * out.aux_loss

    @staticmethod
    def block_of(name: str) -> int | None:
        match = BLOCK.match(name)
        return int(match.group(1)) if match else None

    def parameter_counts(self) -> dict[str, int]:
        """Total parameters, and those active for one token: of the routed experts' (held as one tensor
        per layer with an expert axis, or as a module per expert), top-k of every expert's share."""
        total = routed = 0
        for name, p in self.named_parameters():
            total += p.numel()
            if self.experts and EXPERTS.search(name + "."):
                routed += p.numel()
        idle = routed - routed * self.experts_per_token // self.experts if self.experts else 0
        return {"total": total, "active": total - idle}
