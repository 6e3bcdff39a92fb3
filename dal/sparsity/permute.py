"""Input-channel permutation search that lets an N:M mask keep more magnitude.

An N:M mask can only keep N of each M *consecutive* input channels. Reordering the input
channels of a layer (and, consistently, the output channels of the layer producing them)
does not change the function but changes which channels share a group; a good order keeps
more ``|w|`` (NVIDIA ASP, Pool & Yu 2021).

Search (greedy channel swaps, exact gains)
------------------------------------------
Let ``M[c, k]`` be ``|w|`` of input channel ``c`` at output position ``k`` (every
``(out, *kernel)`` index). A group keeps, per column, its N largest entries. For a group
without channel ``a`` (its remaining M-1 channels, N-th largest ``t_a[k]``), adding channel
``c`` keeps ``topN(rest) + relu(M[c, k] - t_a[k])``. So the change of retained magnitude
when ``a`` and ``b`` (different groups) swap is ``D[a, b] + D[b, a]`` with
``D[a, c] = sum_k topN(rest_a)[k] + relu(M[c, k] - t_a[k]) - topN(group(a))[k]``. Each
iteration applies the best swap if it gains, then refreshes only the rows of the two groups
touched. Costs ``O(C^2 K)`` once plus ``O(C K)`` per swap (C input channels, K outputs x
kernel size): instant for C <= 256, seconds for C = 512 with 3x3 kernels.

Guarantee: the returned permutation never keeps less magnitude than the identity; when the
search finds no strict improvement (measured in float64) the identity is returned.

Scope of :func:`permute_sequential_pairs`
-----------------------------------------
Only producer/consumer pairs inside an ``nn.Sequential`` (nested Sequentials flattened),
where the consumer's input is the producer's output through nothing but channel-wise
modules, are permuted:

- ``nn.Linear`` -> [channel-wise modules] -> ``nn.Linear``
- ``nn.ConvNd`` -> [channel-wise modules] -> ``nn.ConvNd`` (same N, ``groups == 1`` for both)

Channel-wise modules: element-wise activations (ReLU, ReLU6, LeakyReLU, GELU, SiLU, Tanh,
Sigmoid, Hardswish, Hardsigmoid, Mish, ELU), Dropout, Identity, and BatchNormNd whose
``num_features`` is the channel count (its weight, bias, running mean and variance are
permuted with the producer's rows and bias). Producer and consumer must be exactly the torch
classes: subclasses (e.g. dal QAT modules) may hold per-channel quantizer state that would
need permuting too, so run the search on the float model, before ``prepare_qat``.
Everything else (residual blocks, Flatten between Conv and Linear, LayerNorm, attention)
is left unpermuted and the reason is reported.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ..nn.norm import batch_norm_types
from .layout import reduction_axis, weighted_types

__all__ = ["search_permutation", "retained_with_permutation", "find_sequential_pairs",
           "permute_sequential_pairs"]

_ACTS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Hardswish,
         nn.Hardsigmoid, nn.Mish, nn.ELU, nn.Dropout, nn.Identity)
_ROW_BUDGET = 1 << 24  # elements of the [rows, C, K] temporary when building D


@functools.cache
def _family() -> dict:
    """Layer type -> its op's name (dal.ops): the plain layers whose weight is ``[out, in, *k]``
    (nn.Linear, nn.Conv1d/2d/3d: :func:`~dal.sparsity.layout.weighted_types` of linear and conv).
    A producer and a consumer pair up only when they are the same op."""
    from ..ops import by_module

    return {t: by_module(t).name for t in weighted_types("linear", "conv")}


def _magnitudes(weight: Tensor, axis: int) -> Tensor:
    """``M[c, k]``: float64 ``|w|`` with input channel ``c`` first, all else flattened."""
    return weight.detach().abs().movedim(axis, 0).reshape(weight.shape[axis], -1).double()


def _group_topn(mags: Tensor, n: int) -> Tensor:
    """Sum over the N largest of each column of ``mags`` [..., rows, K] -> [..., K]."""
    return mags.topk(n, dim=-2).values.sum(dim=-2)


def retained_with_permutation(weight: Tensor, axis: int, perm: "Tensor | None" = None,
                              n: int = 2, m: int = 4) -> float:
    """``sum |w|`` kept by the N:M magnitude mask after reordering the ``axis`` channels by
    ``perm`` (new channel j = old channel ``perm[j]``; None = identity), in float64."""
    mag = _magnitudes(weight, axis)
    if perm is not None:
        mag = mag[perm]
    return float(_group_topn(mag.view(-1, m, mag.shape[1]), n).sum())


def _rows(mag: Tensor, members: Tensor, chans: "list[int]", n: int, m: int):
    """For each channel a in ``chans``: (base_a, t_a) of the formula in the module docstring."""
    base, thr = [], []
    for a in chans:
        grp = members[a]                      # [m] channel ids of a's group
        rest = mag[grp[grp != a]]             # [m-1, K]
        top = rest.topk(n, dim=0).values
        base.append(float((top.sum(0) - _group_topn(mag[grp], n)).sum()))
        thr.append(top[n - 1])
    return torch.tensor(base, dtype=torch.float64), torch.stack(thr)


def _d_rows(mag: Tensor, base: Tensor, thr: Tensor) -> Tensor:
    c, k = mag.shape
    step = max(1, _ROW_BUDGET // max(1, c * k))
    out = []
    for r0 in range(0, thr.shape[0], step):
        t = thr[r0:r0 + step]
        out.append((mag.unsqueeze(0) - t.unsqueeze(1)).clamp_min_(0).sum(-1))
    return base.unsqueeze(1) + torch.cat(out)


def search_permutation(weight: Tensor, axis: int, n: int = 2, m: int = 4,
                       max_swaps: "int | None" = None) -> Tensor:
    """Permutation (int64, length ``weight.shape[axis]``) of the reduction channels that keeps
    at least as much magnitude under an N:M mask as the identity (module docstring).

    ``max_swaps`` bounds the greedy iterations (default ``4 * channels``).
    """
    c = weight.shape[axis]
    if c % m:
        raise ValueError(f"{c} channels along axis {axis} are not a multiple of {m}")
    ident = torch.arange(c)
    if c <= m:
        return ident
    mag = _magnitudes(weight, axis).cpu()
    group = ident // m                                     # group of each channel
    members = ident.view(-1, m)[group]                     # [C, m]: a's group members

    def refresh(chans: "list[int]") -> None:
        base, thr = _rows(mag, members, chans, n, m)
        d[chans] = _d_rows(mag, base, thr)

    d = torch.empty(c, c, dtype=torch.float64)
    refresh(list(range(c)))
    total = float(mag.sum())
    tol = 1e-12 * max(total, 1e-300)
    for _ in range(4 * c if max_swaps is None else max_swaps):
        gain = d + d.t()
        gain[group.unsqueeze(0) == group.unsqueeze(1)] = float("-inf")
        best = int(gain.argmax())
        a, b = divmod(best, c)
        if not float(gain[a, b]) > tol:
            break
        ga, gb = int(group[a]), int(group[b])
        group[a], group[b] = gb, ga
        for g in (ga, gb):
            ids = (group == g).nonzero().flatten()
            members[ids] = ids
        refresh((members[a].tolist() + members[b].tolist()))
    perm = torch.sort(group * c + ident).indices           # by group, then channel id
    if retained_with_permutation(weight, axis, perm, n, m) > \
            retained_with_permutation(weight, axis, None, n, m):
        return perm
    return ident


# ---------------------------------------------------------------------- model surgery
def _leaves(seq: nn.Sequential, prefix: str):
    for name, child in seq.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if type(child) is nn.Sequential:
            yield from _leaves(child, full)
        else:
            yield full, child


def find_sequential_pairs(model: nn.Module):
    """``[(producer_name, [middle names], consumer_name)]`` for every supported pair (scope in
    the module docstring), consumers unique."""
    pairs, seen = [], set()
    for name, mod in model.named_modules():
        if type(mod) is not nn.Sequential:
            continue
        leaves = list(_leaves(mod, name))
        for i, (pname, prod) in enumerate(leaves):
            family = _family()
            fam = family.get(type(prod))
            if fam is None or getattr(prod, "groups", 1) != 1:
                continue
            ch = prod.weight.shape[0]
            mids = []
            for cname, cons in leaves[i + 1:]:
                if type(cons) in family:
                    ok = (family[type(cons)] == fam and getattr(cons, "groups", 1) == 1
                          and cons.weight.shape[reduction_axis(cons)] == ch)
                    if ok and cname not in seen:
                        seen.add(cname)
                        pairs.append((pname, mids, cname))
                    break
                if type(cons) in _ACTS:
                    mids.append(cname)
                elif type(cons) in batch_norm_types() and cons.num_features == ch:
                    mids.append(cname)
                else:
                    break
    return pairs


@torch.no_grad()
def _apply(model: nn.Module, prod_name: str, mids: "list[str]", cons_name: str,
           perm: Tensor) -> None:
    prod, cons = model.get_submodule(prod_name), model.get_submodule(cons_name)
    ax = reduction_axis(cons)
    cons.weight.copy_(cons.weight.index_select(ax, perm.to(cons.weight.device)))
    tensors = [prod.weight, prod.bias]
    for mid in mids:
        bn = model.get_submodule(mid)
        if isinstance(bn, batch_norm_types()):
            tensors += [bn.weight, bn.bias, bn.running_mean, bn.running_var]
    for t in tensors:
        if t is not None:
            t.copy_(t.index_select(0, perm.to(t.device)))


def permute_sequential_pairs(model: nn.Module, consumers: "set[str]", n: int = 2,
                             m: int = 4) -> "dict[str, str]":
    """Search and apply permutations for the ``consumers`` (names of layers about to be
    pruned) that have a supported producer; the model's function is unchanged.

    Returns ``{consumer name: note}`` for every name in ``consumers``: the retained-magnitude
    gain, "identity kept", or why it was not attempted.
    """
    notes = {}
    for name in consumers:
        mod = model.get_submodule(name)
        if type(mod) not in _family():
            notes[name] = (f"not permuted: {type(mod).__name__} is not a plain torch "
                           "Linear/ConvNd (permute the float model, before prepare_qat)")
        else:
            notes[name] = ("not permuted: no producer in an nn.Sequential chain "
                           "(only Linear->Linear / ConvNd->ConvNd pairs there are supported)")
    for prod_name, mids, cons_name in find_sequential_pairs(model):
        if cons_name not in consumers:
            continue
        cons = model.get_submodule(cons_name)
        ax = reduction_axis(cons)
        before = retained_with_permutation(cons.weight, ax, None, n, m)
        perm = search_permutation(cons.weight, ax, n, m)
        if torch.equal(perm, torch.arange(perm.numel())):
            notes[cons_name] = f"identity kept (no improving swap; producer {prod_name})"
            continue
        _apply(model, prod_name, mids, cons_name, perm)
        after = retained_with_permutation(cons.weight, ax, None, n, m)
        notes[cons_name] = (f"permuted with producer {prod_name}: retained |w| "
                            f"{before:.6g} -> {after:.6g} (+{100 * (after / before - 1):.2f}%)")
    return notes
