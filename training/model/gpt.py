"""A byte-level decoder-only transformer, in the spirit of nanoGPT: one readable file.

Vocabulary: the run's ids, by default the 256 byte values plus one document separator (`BOS`), so
that bits per byte are counted over exactly the bytes of the text (or a tokenizer's ids plus one
separator, `data.tokenizer`). The feed-forward can be a sparse mixture of experts
with top-k routing and a Switch-style load-balancing loss.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from infra.spec.model import BYTE_VOCAB

BLOCK = re.compile(r"^blocks\.(\d+)\.")


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    width: int
    heads: int
    max_seq_len: int
    vocab: int = BYTE_VOCAB
    experts: int = 0
    top_k: int = 1
    balance_loss_weight: float = 0.0
    qk_norm: bool = False
    z_loss_weight: float = 0.0

    @classmethod
    def from_spec(cls, model_spec, max_seq_len: int, vocab: int = BYTE_VOCAB) -> "GPTConfig":
        moe = model_spec.moe
        return cls(layers=model_spec.layers, width=model_spec.width, heads=model_spec.heads,
                   max_seq_len=max_seq_len, vocab=vocab, experts=moe.experts if moe else 0,
                   top_k=moe.top_k if moe else 1, balance_loss_weight=moe.balance_loss_weight if moe else 0.0,
                   qk_norm=model_spec.qk_norm, z_loss_weight=model_spec.z_loss_weight)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        head_width = cfg.width // cfg.heads
        self.q_norm = nn.LayerNorm(head_width) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head_width) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-k routed experts. `aux_loss` holds the load-balancing term of the last forward.

    A token's output is the gate-weighted sum of its top-k experts: the router probabilities of
    the chosen experts, renormalised to sum to 1 when k > 1, the raw probability when k = 1.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.width, cfg.experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.width) for _ in range(cfg.experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            # Top-1 keeps the raw probability as its gate (Switch Transformer): renormalised it would be
            # exactly 1, and the router would get no gradient from the language-model loss.
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = None
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                routed_out = expert(tokens[rows]) * weights[rows, slot, None]
                # The experts' dtype, which autocast may make bf16 while the residual stream is fp32.
                out = tokens.new_zeros(tokens.shape, dtype=routed_out.dtype) if out is None else out
                out.index_add_(0, rows, routed_out)
        out = torch.zeros_like(tokens) if out is None else out
        # Switch Transformer balance loss: experts * sum_e (fraction routed to e) * (mean prob of e).
        routed = F.one_hot(chosen, len(self.experts)).sum(dim=1).float().mean(dim=0) / self.top_k
        self.aux_loss = len(self.experts) * (routed * probs.mean(dim=0)).sum()
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.ffn = MoE(cfg) if cfg.experts else MLP(cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class ByteGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        if self.tok.weight.is_meta:  # built for its shapes alone (plans): no values to draw, and drawing is slow
            return
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Training loss: next-byte cross-entropy, plus the experts' balance term and the z-loss when set."""
        logits = self(idx).reshape(-1, self.cfg.vocab)
        loss = F.cross_entropy(logits, targets.reshape(-1))
        if self.cfg.z_loss_weight:
            loss = loss + self.cfg.z_loss_weight * logits.logsumexp(dim=-1).square().mean()
        if self.cfg.experts:
            aux = sum(b.ffn.aux_loss for b in self.blocks) / self.cfg.layers
            loss = loss + self.cfg.balance_loss_weight * aux
        return loss

    @staticmethod
    def block_of(name: str) -> int | None:
        """The transformer block a parameter belongs to, None outside the blocks."""
        match = BLOCK.match(name)
        return int(match.group(1)) if match else None

    def parameter_counts(self) -> dict[str, int]:
        """Total parameters, and those active for one token (top_k of the experts)."""
        total = sum(p.numel() for p in self.parameters())
        if not self.cfg.experts:
            return {"total": total, "active": total}
        per_expert = sum(p.numel() for p in self.blocks[0].ffn.experts[0].parameters())
        idle = self.cfg.layers * (self.cfg.experts - self.cfg.top_k) * per_expert
        return {"total": total, "active": total - idle}


def build(spec) -> ByteGPT:
    return ByteGPT(GPTConfig.from_spec(spec.model, spec.max_seq_len, spec.vocab_size))
