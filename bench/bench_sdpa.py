"""bench_sdpa.py [--device cpu] [TOKENS [SMIN SMAX [WIDTH]]] - PyTorch's
scaled_dot_product_attention (flash backend) on bench_attn.cu's shapes, sizes (same arguments)
and FLOP convention, printed as the same CSV (impl "sdpa"). Median of 10 timed runs after 2
warm-ups; inputs [B, S, H, D] bf16, viewed as [B, H, S, D] as FlashAttention users do.
--device cpu is make test's smoke run of this script, timed by the wall clock: the flash backend
where torch has it (sdpa_kernel from torch 2.3, the CPU flash kernel from 2.1), else the MATH
backend's formula written out, as Debian's torch 1.13 has no scaled_dot_product_attention."""
import argparse
import contextlib
import functools
import sys
import time

import torch

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    sdpa_kernel = None


def math_attention(q, k, v, is_causal):
    """SDPBackend.MATH's formula, for a torch without scaled_dot_product_attention."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if is_causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s.softmax(-1) @ v


def time_ms(fn, cuda):
    times = []
    for i in range(12):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t) * 1e3
        if i >= 2:
            times.append(ms)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(usage="bench_sdpa.py [--device cpu] [TOKENS [SMIN SMAX [WIDTH]]]")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("sizes", nargs="*", type=int)
    args = p.parse_args()
    n = len(args.sizes)
    tokens, smin, smax, width = (args.sizes + [16384, 1024, 32768, 2048][n:])[:4]
    if n == 2 or n > 4 or tokens < 1 or smin < 1 or width < 128 or width % 128:
        p.error("sizes: TOKENS [SMIN SMAX [WIDTH]], WIDTH a multiple of 128")
    if sdpa_kernel:
        attention = torch.nn.functional.scaled_dot_product_attention
        backend = functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION)
    elif args.device == "cpu":
        attention, backend = math_attention, contextlib.nullcontext
    else:
        sys.exit(f"bench_sdpa: torch {torch.__version__} has no torch.nn.attention (>= 2.3)")
    dev, cuda = args.device, args.device == "cuda"
    print("impl,d,causal,seq,batch,heads,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops")
    for d in (64, 128):
        for causal in (0, 1):
            s = smin
            while s <= smax:
                b, h = max(1, tokens // s), width // d
                q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
                           .transpose(1, 2).requires_grad_() for _ in range(3))
                dout = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
                with backend():
                    fwd = time_ms(lambda: attention(q, k, v, is_causal=bool(causal)), cuda)
                    out = attention(q, k, v, is_causal=bool(causal))
                    bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), cuda)
                flops = 4.0 * b * s * s * h * d / (2 if causal else 1)
                print(f"sdpa,{d},{causal},{s},{b},{h},{fwd:.3f},{bwd:.3f},"
                      f"{flops / fwd * 1e-9:.1f},{2.5 * flops / bwd * 1e-9:.1f}")
                sys.stdout.flush()
                s *= 2


if __name__ == "__main__":
    main()
