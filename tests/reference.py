"""An independent float64 numpy reference, written with explicit loops over batch, head and
query so that it shares nothing with the package's vectorised code."""

from __future__ import annotations

import math

import numpy as np


def visible_keys(b, i, tq, tk, lengths, causal):
    hi = lengths[b] if not causal else min(lengths[b], lengths[b] - tq + i + 1)
    return np.arange(min(max(hi, 0), tk))


def np_attention_state(q, k, v, *, scale=None, causal=False, kv_lengths=None):
    """Returns `(out [B, Tq, Hq, Dv], lse [B, Tq, Hq], cov [B, Tq, Hq, Dv, Dv])` in float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Tq, Hq, D = q.shape
    Tk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    lengths = np.full(B, Tk) if kv_lengths is None else np.asarray(kv_lengths)
    out = np.zeros((B, Tq, Hq, Dv))
    lse = np.full((B, Tq, Hq), -np.inf)
    cov = np.zeros((B, Tq, Hq, Dv, Dv))
    for b in range(B):
        for h in range(Hq):
            kv = h // G
            for i in range(Tq):
                idx = visible_keys(b, i, Tq, Tk, lengths, causal)
                if idx.size == 0:
                    continue
                s = scale * (k[b, idx, kv] @ q[b, i, h])
                m = s.max()
                w = np.exp(s - m)
                lse[b, i, h] = m + np.log(w.sum())
                w /= w.sum()
                vals = v[b, idx, kv]
                mean = w @ vals
                out[b, i, h] = mean
                cov[b, i, h] = (vals - mean).T @ (w[:, None] * (vals - mean))
    return out, lse, cov


def np_attention(q, k, v, **kw):
    return np_attention_state(q, k, v, **kw)[0]


def np_attention_grads(q, k, v, g, *, scale=None, causal=False, kv_lengths=None):
    """Gradients of `sum(attention(q, k, v) * g)` in q, k and v, from the textbook backward
    pass (dv = Pᵀg, ds = P ⊙ (g·vᵀ − rowsum(P ⊙ g·vᵀ)), dq = scale·ds k, dk = scale·dsᵀ q),
    written with the same explicit loops as `np_attention_state`, in float64."""
    q, k, v, g = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g))
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    lengths = np.full(B, Tk) if kv_lengths is None else np.asarray(kv_lengths)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for h in range(Hq):
            kv = h // G
            for i in range(Tq):
                idx = visible_keys(b, i, Tq, Tk, lengths, causal)
                if idx.size == 0:
                    continue
                s = scale * (k[b, idx, kv] @ q[b, i, h])
                p = np.exp(s - s.max())
                p /= p.sum()
                dv[b, idx, kv] += p[:, None] * g[b, i, h][None, :]
                dp = v[b, idx, kv] @ g[b, i, h]
                ds = p * (dp - p @ dp)
                dq[b, i, h] += scale * ds @ k[b, idx, kv]
                dk[b, idx, kv] += scale * ds[:, None] * q[b, i, h][None, :]
    return dq, dk, dv
