"""bench_sdpa.py [--device cpu] [TOKENS [SMIN SMAX [WIDTH]]] - PyTorch's
scaled_dot_product_attention (flash backend) on bench_attn.cu's shapes, sizes (same arguments)
and FLOP convention, printed as the same CSV (impl "sdpa"). Median of 10 timed runs (time_ms);
q, k, v and dout [B, S, H, D] bf16, viewed as [B, H, S, D] as FlashAttention users do, so
neither side copies to another layout.
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


def uniform(b, s, h, d, dev):
    """bf16 [b, s, h, d] uniform in [-1, 1), as bench_cuda.h's bench_fill fills ours."""
    return torch.rand(b, s, h, d, device=dev).mul_(2).sub_(1).to(torch.bfloat16)


def time_ms(fn, cuda):
    """Median of 10 runs of fn, as bench_cuda.h's bench_median_ms: at least 2 untimed runs and
    100 ms of them (the clocks ramp up from idle), then on a GPU the timed runs back to back with
    an event between each, so an interval is one run's GPU time and not Python's dispatch."""
    start, runs = time.perf_counter(), 0
    while runs < 2 or time.perf_counter() - start < 0.1:
        fn()
        if cuda:
            torch.cuda.synchronize()
        runs += 1
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(11)]
        events[0].record()
        for e in events[1:]:
            fn()
            e.record()
        events[-1].synchronize()
        times = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    else:
        times = []
        for _ in range(10):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
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
                q, k, v = (uniform(b, s, h, d, dev).transpose(1, 2).requires_grad_()
                           for _ in range(3))
                dout = uniform(b, s, h, d, dev).transpose(1, 2)
                with backend():
                    fwd = time_ms(lambda: attention(q, k, v, is_causal=bool(causal)), cuda)
                    out = attention(q, k, v, is_causal=bool(causal))
                    bwd = time_ms(functools.partial(torch.autograd.grad, out, (q, k, v), dout,
                                                    retain_graph=True), cuda)
                flops = 4.0 * b * s * s * h * d / (2 if causal else 1)
                print(f"sdpa,{d},{causal},{s},{b},{h},{fwd:.3f},{bwd:.3f},"
                      f"{flops / fwd * 1e-9:.1f},{2.5 * flops / bwd * 1e-9:.1f}")
                sys.stdout.flush()
                s *= 2


if __name__ == "__main__":
    main()
