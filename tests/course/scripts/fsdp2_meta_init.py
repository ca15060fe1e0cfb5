"""A script in the style of PyTorch's FSDP2 example (``examples/distributed/FSDP2``) and of
torchtitan's launch (written here, in our own words), started by ``torchrun
--nproc_per_node 2``: it reads ``LOCAL_RANK`` and ``WORLD_SIZE`` from the environment,
refuses when the node has fewer GPUs than the job, joins ``dist.init_process_group("nccl")``,
builds the model on the meta device (no memory), shards each block with ``fully_shard`` and
then the whole model, materialises its shard with ``model.to_empty(device="cuda")``,
initialises it in place with each block's ``reset_parameters()``, and trains with AdamW.

Exercises: torchrun's environment, ``torch.cuda.device_count()``, the meta device, FSDP2's
DTensor parameters (each rank holds half of every tensor on 2 GPUs), ``to_empty``.

Run: ``torchrun --nproc_per_node 2 fsdp2_meta_init.py``; on the simulated GPU,
``%%gpumem --backend sim --gpu H100 --world-size 2`` (the cell is rank 0 of 2)."""

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class ModelArgs:
    vocab_size: int = 1024
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 128


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.wq(x)), split(self.wk(x)), split(self.wv(x)),
                                           is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))

    def reset_parameters(self):
        for lin in (self.wq, self.wk, self.wv, self.wo):
            nn.init.trunc_normal_(lin.weight, std=0.02)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))

    def reset_parameters(self):
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=0.02)


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self):
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def reset_parameters(self):
        """The root's own tensors; the blocks initialise themselves."""
        nn.init.normal_(self.tok_embeddings.weight)
        nn.init.normal_(self.pos_embeddings.weight)
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=0.02)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 reduce")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() < world_size:
        print(f"this job needs {world_size} GPUs on the node, it has {torch.cuda.device_count()}",
              file=sys.stderr)
        sys.exit(1)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()

    model_args = ModelArgs()
    with torch.device("meta"):
        model = Transformer(model_args)
    fsdp_kwargs = {}
    if args.mixed_precision:
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)

    model.to_empty(device="cuda")
    model.reset_parameters()
    for layer in model.layers:
        layer.reset_parameters()
    if rank == 0:
        local = sum(p.to_local().numel() for p in model.parameters())
        print(f"rank {rank}/{world_size}: {local:,} parameters held here of "
              f"{sum(p.numel() for p in model.parameters()):,}")

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(args.steps):
        tokens = torch.randint(0, model_args.vocab_size, (args.batch_size, model_args.max_seq_len),
                               device="cuda")
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
