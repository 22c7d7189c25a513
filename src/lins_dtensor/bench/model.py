"""A self-contained LLaMA-style decoder for the benchmark.

Token embedding, ``n_layers`` pre-norm blocks (RMSNorm, multi-head attention with
rotary position embeddings and causal SDPA, SwiGLU MLP), final RMSNorm and an untied
output projection: the module layout of torchtitan's llama3 ``Transformer``
(``tok_embeddings``, ``layers``, ``norm``, ``output``), so that
:func:`lins_dtensor.runtime.default_units` makes one FSDP unit per block and the
planner reads the same units with :func:`lins_dtensor.planner.model_from_module`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class BenchModelArgs:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    vocab_size: int = 2048
    ffn_dim: int = 768  # SwiGLU hidden size (LLaMA rule: ~8/3 dim, rounded)
    max_seq_len: int = 1024
    rope_theta: float = 10000.0

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    def num_params(self) -> int:
        d, f, v = self.dim, self.ffn_dim, self.vocab_size
        block = 4 * d * d + 3 * d * f + 2 * d
        return v * d + self.n_layers * block + d + v * d


# Sizes the benchmark knows; "small" is the default of scripts/bench_cluster.sh.
MODEL_SIZES = {
    # 2 x 2048 x 256 + 6 x (4 x 256^2 + 3 x 256 x 768 + 512) + 256 = 6,163,712 parameters.
    "small": BenchModelArgs(dim=256, n_layers=6, n_heads=8, vocab_size=2048, ffn_dim=768),
    # For the end-to-end test: 0.05 M parameters.
    "tiny": BenchModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=256, ffn_dim=96, max_seq_len=256),
}


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the last dim of ``x`` (b, heads, s, head_dim)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: BenchModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, args: BenchModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: BenchModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class BenchLlama(nn.Module):
    def __init__(self, args: BenchModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.model_args.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def build_model(size: str, seed: int = 0) -> BenchLlama:
    torch.manual_seed(seed)
    return BenchLlama(MODEL_SIZES[size])


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def batch(step: int, rank: int, microbatch: int, vocab: int, seq: int, size: int) -> torch.Tensor:
    """Synthetic tokens: a fixed function of (step, rank, micro-batch)."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + microbatch)
    return torch.randint(0, vocab, (size, seq + 1), generator=g)
