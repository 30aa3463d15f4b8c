"""bench_sdpa.py - PyTorch's scaled_dot_product_attention (flash backend) on bench_attn.cu's
shapes and FLOP convention, printed as the same CSV (impl "sdpa"). Median of 10 timed runs after
2 warm-ups; inputs [B, S, H, D] bf16, viewed as [B, H, S, D] as FlashAttention users do."""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn):
    times = []
    for i in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    tokens, width = 16384, 2048
    print("impl,d,causal,seq,batch,heads,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops")
    for d in (64, 128):
        for causal in (0, 1):
            s = 1024
            while s <= 32768:
                b, h = tokens // s, width // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                           .transpose(1, 2).requires_grad_() for _ in range(3))
                dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fwd = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=bool(causal)))
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
                    bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                flops = 4.0 * b * s * s * h * d / (2 if causal else 1)
                print(f"sdpa,{d},{causal},{s},{b},{h},{fwd:.3f},{bwd:.3f},"
                      f"{flops / fwd * 1e-9:.1f},{2.5 * flops / bwd * 1e-9:.1f}")
                sys.stdout.flush()
                s *= 2


if __name__ == "__main__":
    main()
