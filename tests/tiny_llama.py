"""A small LLaMA-shaped model for the tests: embedding, attention, SwiGLU MLP,
RMSNorm, output head. The vocabulary (50) does not divide by 4 or 8, the per-head
gain (3 rows) leaves some shards empty at 4 and 8 ranks, and a frozen positional
table checks that parameters without gradients stay replicated. ``tied=True`` ties the
output head to the embedding (GPT-2, Llama 3.2 1B). ``tree`` arranges the same modules
as the model trees people bring (:data:`TREES`). ``branch=True`` gives each block a
linear layer that takes part only while its ``use_branch`` is True (a conditional branch,
an auxiliary head, a routed expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.head_gain = nn.Parameter(torch.ones(n_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        gain = self.head_gain.to_local() if isinstance(self.head_gain, DTensor) else self.head_gain  # this rank's heads
        q = q * gain.view(1, -1, 1, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int, branch: bool = False) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)
        self.branch = nn.Linear(dim, dim) if branch else None
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        if self.branch is not None and self.use_branch:
            x = x + self.branch(x)
        return x + self.feed_forward(self.ffn_norm(x))


# Where the embedding, the blocks and the final norm sit:
TREES = {
    "flat": "tok_embeddings, layers (ModuleList), norm: torchtitan's LLaMA",
    "hf": "under transformer, a plain module: Hugging Face's GPT-2 (transformer.h)",
    "nanogpt": "transformer = ModuleDict(wte, h=ModuleList, ln_f): nanoGPT",
    "lists": "layers = ModuleList of ModuleLists of blocks",
    "dicts": "layers = ModuleDict of ModuleDicts of blocks",
    "sequential": "layers = nn.Sequential of blocks",
}


class Trunk(nn.Module):
    """Embedding, blocks and final norm, under ``transformer`` (``tree="hf"``)."""

    def __init__(self, tok_embeddings: nn.Module, layers: nn.ModuleList, norm: nn.Module) -> None:
        super().__init__()
        self.tok_embeddings, self.layers, self.norm = tok_embeddings, layers, norm


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 24, n_heads: int = 3, hidden: int = 40, n_layers: int = 2, seq: int = 8,
                 tied: bool = False, tree: str = "flat", branch: bool = False) -> None:
        super().__init__()
        tok_embeddings = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1, requires_grad=False)
        blocks = [Block(dim, n_heads, hidden, branch) for _ in range(n_layers)]
        norm = nn.RMSNorm(dim)
        half = n_layers // 2
        if tree == "hf":
            self.transformer = Trunk(tok_embeddings, nn.ModuleList(blocks), norm)
        elif tree == "nanogpt":
            self.transformer = nn.ModuleDict(dict(wte=tok_embeddings, h=nn.ModuleList(blocks), ln_f=norm))
        else:
            layers = {
                "flat": lambda: nn.ModuleList(blocks),
                "lists": lambda: nn.ModuleList([nn.ModuleList(blocks[:half]), nn.ModuleList(blocks[half:])]),
                "dicts": lambda: nn.ModuleDict({
                    "early": nn.ModuleDict({str(i): b for i, b in enumerate(blocks[:half])}),
                    "late": nn.ModuleDict({str(i): b for i, b in enumerate(blocks[half:], half)}),
                }),
                "sequential": lambda: nn.Sequential(*blocks),
            }[tree]()
            self.tok_embeddings, self.layers, self.norm = tok_embeddings, layers, norm
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = tok_embeddings.weight
        self.vocab, self.seq, self.tree = vocab, seq, tree

    def _trunk(self) -> tuple[nn.Module, list[nn.Module], nn.Module]:
        """The embedding, the blocks in order, and the final norm, wherever ``tree`` put them."""
        if self.tree == "nanogpt":
            t = self.transformer
            return t.wte, list(t.h), t.ln_f
        trunk = self.transformer if self.tree == "hf" else self
        if self.tree == "lists":
            blocks = [b for inner in trunk.layers for b in inner]
        elif self.tree == "dicts":
            blocks = [b for inner in trunk.layers.values() for b in inner.values()]
        else:
            blocks = list(trunk.layers)
        return trunk.tok_embeddings, blocks, trunk.norm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tok_embeddings, blocks, norm = self._trunk()
        x = tok_embeddings(tokens) + self.pos[: tokens.shape[1]]
        for block in blocks:
            x = block(x)
        return self.output(norm(x))


def tensor_parallelize(model: TinyLlama, tp_mesh: DeviceMesh) -> TinyLlama:
    """torchtitan's LLaMA TP plan on the tiny model: column-parallel q/k/v, w1/w3 and
    output head, row-parallel wo/w2 and embedding, sequence-parallel norms (replicated
    weights whose gradients come out Partial), the per-head gain sharded with its heads.
    The embedding's output stays whole so the frozen positional table can be added to it;
    the blocks then run on sequence shards, as torchtitan's do."""
    tp = tp_mesh.size()
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
        attention = block.attention
        attention.n_heads //= tp
        gain = attention.head_gain
        attention.head_gain = nn.Parameter(distribute_tensor(gain.detach(), tp_mesh, [Shard(0)]), requires_grad=gain.requires_grad)
    return model


def build_model(seed: int = 0, **kwargs) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(**kwargs)


def batch(step: int, rank: int, microbatch: int, vocab: int = 50, seq: int = 8, size: int = 2) -> torch.Tensor:
    """The tokens rank ``rank`` trains on: a fixed function of (step, rank, micro-batch)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + microbatch)
    return torch.randint(0, vocab, (size, seq + 1), generator=g)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
