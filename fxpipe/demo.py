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

import functools
import math
import os
import time
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


def train(args) -> int:
    """Train the demo GPT with fxpipe on this rank (under torchrun) or in one process."""
    import fxpipe

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    m, b, seq = args.microbatches, args.microbatch_size, cfg.block_size
    data = torch.Generator().manual_seed(1)  # the same batches on every rank
    example, _ = fibonacci_batch(b, seq, cfg.vocab_size, torch.Generator().manual_seed(0))
    pipe = fxpipe.compile(
        model,
        (example,),
        loss_fn=lm_loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0),
        microbatches=m,
        schedule=args.schedule,
        stages=max(world, 2),
        max_grad_norm=1.0,
        verbose=True,
    )
    batch = m * b * pipe.plan.width
    say = pipe.rank == pipe.world_size - 1  # the last stage holds the loss
    ckpt = args.checkpoint_dir
    if ckpt and os.path.exists(os.path.join(ckpt, "latest")):
        # Resume: weights, optimizer, step count, RNG; the data stream's position is ours to keep.
        data.set_state(pipe.load(ckpt)["data"])
        if pipe.rank == 0:
            print(f"resumed from {ckpt} after step {pipe.steps}", flush=True)
    first = last = None
    start, done = time.perf_counter(), pipe.steps
    for step in range(pipe.steps + 1, args.steps + 1):
        x, y = fibonacci_batch(batch, seq, cfg.vocab_size, data)
        pipe.record = step > args.steps - 2  # keep the last two steps' timeline
        loss = pipe.step(x, y)  # a float here; elsewhere a Loss that would wait for it
        if say:
            first = loss if first is None else first
            last = loss
            if step % 25 == 0 or step == 1:
                rate = (step - done) * batch / (time.perf_counter() - start)
                print(f"step {step:4d}  loss {loss:.4f}  {rate:8.1f} samples/s", flush=True)
        if ckpt and (step == args.steps or args.save_every and step % args.save_every == 0):
            pipe.save(ckpt, extra={"data": data.get_state()}, keep=args.keep)
    pipe.flush()
    pipe.wait_for_checkpoint()
    elapsed = time.perf_counter() - start
    ran = args.steps - done
    paths = pipe.dump(args.out)
    if say and ran > 0:
        print(
            f"done: {ran} steps of {batch} sequences in {elapsed:.1f} s "
            f"({ran * batch / elapsed:.1f} samples/s); loss {first:.4f} -> {last:.4f} "
            f"(chance level {math.log(cfg.vocab_size):.4f})",
            flush=True,
        )
    if pipe.rank == 0:
        print("wrote " + ", ".join(p for p in paths if "timeline" in p or p.endswith("plan.txt")), flush=True)
    return 0


def train_or_exit(args) -> int:
    """:func:`train`, with what the user can fix (a :class:`fxpipe.errors.FxpipeError`, a folder
    that cannot be written) as one line and exit code 1 instead of a traceback."""
    from .errors import FxpipeError

    try:
        return train(args)
    except FxpipeError as e:
        raise SystemExit(f"fxpipe demo: {e}") from None
    except OSError as e:
        raise SystemExit(f"fxpipe demo: {e}") from None


if __name__ == "__main__":
    import argparse

    from .cli import add_demo_arguments, check_demo_args

    parser = argparse.ArgumentParser(prog="python -m fxpipe.demo")
    add_demo_arguments(parser)
    ns = parser.parse_args()
    check_demo_args(parser, ns)
    raise SystemExit(train_or_exit(ns))
