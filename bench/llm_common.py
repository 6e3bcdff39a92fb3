"""The tiny Llama of the LLM benchmarks: built from a transformers config, pre-trained in float on
the pydoc_data.topics corpus (dal_examples.datasets.text, byte-level tokens) for a few CPU minutes, cached
outside the repository, and its held-out perplexity.

    python bench/llm_common.py            # pre-train (or load the cached weights) and print the perplexity

The cache file is ``~/.cache/dal/tiny_llama_<hash>.pt`` (``$XDG_CACHE_HOME`` respected), the hash
taken over the config, the training settings, the training text and the torch / transformers
versions: change any and the model is trained again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: the issue's tiny Llama: 4 layers, width 256, 4 heads (2 KV heads), byte vocabulary; MLP 768 rather than the
#: issue's 688: 688 = 16 x 43 is divisible by no int4 group size the a2000 or torchao take (32, 64, 128)
CONFIG = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=768, vocab_size=256, max_position_embeddings=256)
#: float pre-training: AdamW, linear warm-up then cosine to 0, batch 8 x 128 tokens
PRETRAIN = dict(steps=1000, batch=8, length=128, lr=3e-3, warmup=50, weight_decay=0.1, seed=0)
SEQ = 128


def config():
    """The transformers ``LlamaConfig`` of :data:`CONFIG` (transformers' default attention, sdpa)."""
    import transformers as T

    return T.LlamaConfig(**CONFIG)


def build(seed: int = 0):
    """A randomly initialised ``LlamaForCausalLM`` of :func:`config` (``torch.manual_seed(seed)`` first)."""
    import transformers as T

    torch.manual_seed(seed)
    return T.LlamaForCausalLM(config())


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """(train_ids, held_out_ids): 1-D int64 byte tokens of dal_examples.datasets.text.split()."""
    from dal_examples.datasets import text

    train, held = text.split()
    return text.token_tensor(train), text.token_tensor(held)


def cosine_lr(step: int, steps: int, lr: float, warmup: int) -> float:
    """Learning rate at ``step`` of ``steps``: ``lr * step / warmup`` during warm-up, then
    ``lr * (1 + cos(pi * t)) / 2`` with ``t`` going from 0 to 1 over the remaining steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * t))


def train(model, ids: torch.Tensor, steps: int, batch: int, length: int, lr: float, warmup: int = 0,
          weight_decay: float = 0.0, seed: int = 0, after_step=None) -> float:
    """Train ``model`` (next-token cross-entropy) for ``steps`` AdamW steps on seeded random windows of
    ``ids`` (dal_examples.datasets.text.random_batches, ``seed`` fixes the data order), learning rate
    :func:`cosine_lr`, gradients clipped to norm 1. Returns the seconds it took."""
    from dal_examples.datasets import text

    model.train()
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    t0 = time.perf_counter()
    for step, x in enumerate(text.random_batches(ids, batch, length, steps, seed=seed)):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, warmup)
        opt.zero_grad(set_to_none=True)
        model(x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if after_step is not None:
            after_step(step)
    return time.perf_counter() - t0


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, length: int = SEQ, batch: int = 16) -> float:
    """``exp`` of the mean next-token negative log-likelihood over the consecutive ``length``-token
    blocks of ``ids`` (dal_examples.datasets.text.blocks; each block scored on its own, its first token
    unpredicted), summed in float64. The model is put in eval mode."""
    from dal_examples.datasets import text

    model.eval()
    rows = text.blocks(ids, length)
    nll, count = 0.0, 0
    for i in range(0, len(rows), batch):
        x = rows[i: i + batch]
        logits = model(x).logits[:, :-1].double()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


def _cache_path() -> str:
    import transformers

    from dal_examples.datasets import text

    key = json.dumps({"config": CONFIG, "pretrain": PRETRAIN, "torch": torch.__version__.split("+")[0],
                      "transformers": transformers.__version__,
                      "train_text": hashlib.sha256(text.split()[0].encode()).hexdigest()}, sort_keys=True)
    root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dal")
    return os.path.join(root, f"tiny_llama_{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt")


def pretrained(verbose: bool = True):
    """(model, info): the float tiny Llama pre-trained with :data:`PRETRAIN` on the training split,
    loaded from the cache when there (trained and saved otherwise); ``info`` holds the training
    seconds and the cache path. A fresh copy on every call."""
    path = _cache_path()
    model = build(PRETRAIN["seed"])
    if os.path.exists(path):
        payload = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(payload["state_dict"])
        return model, {"seconds": float(payload["seconds"]), "path": path, "cached": True}
    train_ids, _ = data()
    if verbose:
        print(f"pre-training the tiny Llama ({PRETRAIN['steps']} steps) -> {path}", flush=True)
    p = PRETRAIN
    seconds = train(model, train_ids, p["steps"], p["batch"], p["length"], p["lr"], p["warmup"],
                    p["weight_decay"], p["seed"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".{os.getpid()}.tmp"
    torch.save({"state_dict": model.state_dict(), "seconds": seconds}, tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return model, {"seconds": seconds, "path": path, "cached": False}


def main() -> None:
    torch.set_num_threads(1)
    model, info = pretrained()
    _, held = data()
    print(f"tiny Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"pre-trained in {info['seconds']:.0f} s ({'cached' if info['cached'] else 'trained now'}: {info['path']}); "
          f"held-out perplexity {perplexity(model, held):.3f} (bytes)")


if __name__ == "__main__":
    main()
