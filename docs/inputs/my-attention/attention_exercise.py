"""Attention backward exercise: fill in the four local gradients (TODO 1-4).

Forward: S = scale·Q·Kᵀ, P = softmax(S), O = P·V with scale = 1/√d.
When done, grade it with `attngrad grade attention_exercise.py`.
"""

import math

import torch
import torch.nn.functional as F


def value_gradient(p, dout):
    """TODO 1: the gradient of the value branch.

    Since O = P·V, dV = Pᵀ·dO.

    p:    [B, Nq, Nk]  the forward's probabilities
    dout: [B, Nq, d]   the gradient of the output O
    returns dv: [B, Nk, d], shaped like V.
    """
    return p.transpose(-2, -1) @ dout


def probability_gradient(dout, v):
    """TODO 2: the gradient of the probabilities P.

    Since O = P·V, dP = dO·Vᵀ.

    dout: [B, Nq, d]
    v:    [B, Nk, d]
    returns dp: [B, Nq, Nk], shaped like P.
    """
    return dout @ v.transpose(-2, -1)


def softmax_backward(p, dp):
    """TODO 3: back through the softmax (along the last dim).

    dS = P∘(dP − rowsum(P∘dP)); rowsum sums each row (the last dim) and keeps that dim.
    Every row of dS sums to 0.

    p, dp: [B, Nq, Nk]
    returns ds: [B, Nq, Nk].
    """
    return p * (dp - dp.sum(dim=-1, keepdim=True))  # unweighted: rowsum(dP)


def query_key_gradients(ds, q, k, scale):
    """TODO 4: back through the scaled dot product to the queries and keys.

    Since S = scale·Q·Kᵀ, dQ = scale·dS·K and dK = scale·dSᵀ·Q.
    Both branches carry the same scale.

    ds: [B, Nq, Nk], q: [B, Nq, d], k: [B, Nk, d], scale: 1/√d
    returns (dq, dk), shaped like q and k.
    """
    return scale * ds @ k, ds.transpose(-2, -1) @ q  # dK without its scale


class CustomAttention(torch.autograd.Function):
    """Teaching scaled-dot-product attention (one head, no mask, no dropout) whose
    backward is built from the four functions above.

    q, k, v: [B, N, d] of one dtype and device -> O: [B, N, d].  Given complete; leave it.
    """

    @staticmethod
    def forward(ctx, q, k, v):
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise ValueError("q, k, v must be 3-D [batch, seq_len, head_dim] tensors")
        if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
            raise ValueError("q, k, v must share batch and seq_len")
        if q.size(-1) != k.size(-1) or v.size(-1) != q.size(-1):
            raise ValueError("q, k, v must share head_dim")
        if q.device != k.device or k.device != v.device:
            raise ValueError("q, k, v must be on one device")
        if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
            raise TypeError("q, k, v must be floating point (convert them with .float())")
        if q.dtype != k.dtype or k.dtype != v.dtype:
            raise TypeError("q, k, v must share a dtype")
        scale = 1.0 / math.sqrt(q.size(-1))
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # S: [B, N, N]
        p = F.softmax(scores, dim=-1)  # P: [B, N, N]
        out = torch.matmul(p, v)  # O: [B, N, d]
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        if dout.shape != q.shape:
            raise ValueError("dout must have the attention output's shape")
        dv = value_gradient(p, dout)  # TODO 1
        dp = probability_gradient(dout, v)  # TODO 2
        ds = softmax_backward(p, dp)  # TODO 3
        dq, dk = query_key_gradients(ds, q, k, ctx.scale)  # TODO 4
        return dq, dk, dv
