"""torch_attention.py - the attention reference of test_torch.c, by PyTorch autograd in float64.

Usage: torch_attention.py DIR N. For each i < N, reads DIR/case_i.bin and writes DIR/torch_i.bin.
case_i.bin: int64 B, Sq, Sk, H, Hkv, D, causal, 0; float64 scale (0 = 1/sqrt(D)); then float32
q [B, Sq, H, D], k [B, Sk, Hkv, D], v like k, dout like q. torch_i.bin: float64 out like q,
lse [B, H, Sq], dq, dk, dv. The math is spelled out (no fused attention): scores, a bottom-right
causal mask (row i keeps keys j <= i + Sk - Sq), softmax, GQA by repeat_interleave, and
autograd for the backward. A row with no key kept outputs 0 and has lse = +inf."""
import math
import struct
import sys

import torch


def attention(q, k, v, causal, scale):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    qh = q.permute(0, 2, 1, 3)                                       # [B, H, Sq, D]
    kh = k.permute(0, 2, 1, 3).repeat_interleave(H // Hkv, dim=1)    # [B, H, Sk, D]
    vh = v.permute(0, 2, 1, 3).repeat_interleave(H // Hkv, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale                          # [B, H, Sq, Sk]
    i = torch.arange(Sq).unsqueeze(1)
    j = torch.arange(Sk).unsqueeze(0)
    keep = (j <= i + Sk - Sq) if causal else torch.ones(Sq, Sk, dtype=torch.bool)
    has_key = keep.any(dim=1)                                        # [Sq]
    s = torch.where(keep, s, torch.full_like(s, -math.inf))
    # rows with no key: plain zeros, so nothing is inf - inf; their probabilities are then zeroed
    s = torch.where(has_key.unsqueeze(1), s, torch.zeros_like(s))
    lse = torch.logsumexp(s, dim=-1)                                 # [B, H, Sq]
    p = torch.exp(s - lse.unsqueeze(-1)) * has_key.unsqueeze(1)
    o = (p @ vh).permute(0, 2, 1, 3)                                 # [B, Sq, H, D]
    lse = torch.where(has_key, lse.detach(), torch.full_like(lse, math.inf))
    return o, lse


def run(src, dst):
    data = open(src, "rb").read()
    B, Sq, Sk, H, Hkv, D, causal, _ = struct.unpack_from("<8q", data, 0)
    (scale,) = struct.unpack_from("<d", data, 64)
    off = 72

    def take(shape):
        nonlocal off
        n = math.prod(shape)
        vals = struct.unpack_from("<%df" % n, data, off)
        off += 4 * n
        return torch.tensor(vals, dtype=torch.float64).reshape(shape)

    q, k, v = take((B, Sq, H, D)), take((B, Sk, Hkv, D)), take((B, Sk, Hkv, D))
    dout = take((B, Sq, H, D))
    for t in (q, k, v):
        t.requires_grad_(True)
    o, lse = attention(q, k, v, bool(causal), scale if scale != 0 else 1 / math.sqrt(D))
    o.backward(dout)
    with open(dst, "wb") as f:
        for t in (o, lse, q.grad, k.grad, v.grad):
            vals = t.detach().reshape(-1).tolist()
            f.write(struct.pack("<%dd" % len(vals), *vals))


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    for n in range(int(sys.argv[2])):
        run("%s/case_%d.bin" % (sys.argv[1], n), "%s/torch_%d.bin" % (sys.argv[1], n))
