"""demo: the built-in GPT-style model and a tiny task whose loss visibly falls.

The task is next-token prediction on "Fibonacci sequences mod V": each sequence starts with two
random tokens and continues with ``x[t] = (x[t-1] + x[t-2]) % V``. Only the first two tokens are
unpredictable, so a model that learns the rule drives the loss from ``ln V`` towards
``2·ln V / T``; the fall is visible within a few hundred steps of a very small model on a CPU.

The model is a plain pre-LayerNorm decoder (token + position embeddings, causal attention,
GELU MLP, tied output head) written with ordinary ``nn.Module`` code: nothing in it knows about
pipelines, which is the point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "fibonacci_batch", "demo_factory", "lm_loss"]


@dataclass
class GPTConfig:
    vocab_size: int = 32  # tokens 0..V-1; the task is sequences mod V
    block_size: int = 32  # longest sequence (positions)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_weights: bool = True  # lm_head shares the token embedding, as in GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (self.dropout(att) @ v).transpose(1, 2).reshape(B, T, C)
        return self.dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """A small GPT: ``forward(idx[B, T]) -> logits[B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy: ``logits[B, T, V]`` against ``target[B, T]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def fibonacci_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of shape ``[batch, seq_len]``: Fibonacci sequences mod ``vocab``,
    targets shifted by one token."""
    seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
    seq[:, :2] = torch.randint(0, vocab, (batch, 2), generator=generator)
    for t in range(2, seq_len + 1):
        seq[:, t] = (seq[:, t - 1] + seq[:, t - 2]) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def demo_factory(microbatch: int = 4, seq_len: int = 32, **cfg):
    """``(model, example_inputs)`` for ``fxpipe inspect fxpipe.demo:demo_factory``."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=max(seq_len, GPTConfig.block_size), **cfg)
    model = GPT(config)
    x, _ = fibonacci_batch(microbatch, seq_len, config.vocab_size, torch.Generator().manual_seed(0))
    return model, (x,)


def add_demo_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--out", default="fxpipe-out/demo", help="folder for the dumps")


def main(args) -> int:
    """``fxpipe demo``: trace the demo model and write its node table and graph."""
    from .inspect import inspect

    model, example = demo_factory()
    paths = inspect(model, example, args.out)
    print(f"traced {type(model).__name__}: wrote " + ", ".join(paths))
    return 0
