#!/usr/bin/env python3
"""Models what the flash grids' block order is worth under a causal mask (no GPU needed).

Blocks start in linear index order and each takes the next free slot (2 per SM for the forward,
132 SMs: 264 slots on an H100; 1 per SM for the dK/dV kernel, bench/RESULTS.md's table). A block's time is its
number of key (or query) tiles plus one for its prologue and epilogue. The grid (blocks, heads,
batch) starts the blocks of one head after another; (heads, batch, blocks) starts position by
position across every head, longest first. Prints each order's time as a fraction of the ideal
(total work / slots) for bench_attn's shapes: B * S = 16K tokens, H * D = 2048."""
import heapq


def makespan(times, slots):
    free = [0.0] * slots
    for t in times:
        heapq.heappush(free, heapq.heappop(free) + t)
    return max(free)


def main():
    print("kernel   D      S   B   H  head by head  position-major")
    for kernel, tiles_per_block, d_slots in (("forward", 2, {64: 264, 128: 264}),
                                             ("dK/dV", 2, {64: 132, 128: 132})):
        for d in (64, 128):
            for s in (1024, 4096, 16384, 32768):
                b, h, n = max(1, 16384 // s), 2048 // d, s // 128
                # longest first within a head: tiles_per_block * (n - i) tiles, plus one
                head = [tiles_per_block * (n - i) + 1 for _ in range(b * h) for i in range(n)]
                ideal = sum(head) / d_slots[d]
                by_head = ideal / makespan(head, d_slots[d])
                by_pos = ideal / makespan(sorted(head, reverse=True), d_slots[d])
                print(f"{kernel:7s} {d:3d} {s:6d} {b:3d} {h:3d}  {by_head:12.3f}  {by_pos:14.3f}")


if __name__ == "__main__":
    main()
