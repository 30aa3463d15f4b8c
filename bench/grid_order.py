#!/usr/bin/env python3
"""Models what the flash grids' block order is worth under a causal mask (no GPU needed).

Blocks start in linear index order and each takes the next free slot (2 per SM for the forward,
132 SMs: 264 slots on an H100; 1 per SM for the dK/dV kernel, bench/RESULTS.md's table). A
block's time is its number of key (or query) tiles plus one for its prologue and epilogue. The grid (blocks, heads,
batch) starts the blocks of one head after another; (heads, batch, blocks) starts position by
position across every head, longest first. Prints each order's time as a fraction of the ideal
(total work / slots) for bench_attn's shapes: B * S = 16K tokens, H * D = 2048.

Then the case the dK/dV grid does not fill: an SP rank with one kv head (Llama 3 8B and 70B,
Hkv = 8, over SP = 8: g = 4 or 8 query heads per block, B = 1, D = 128). Its grid is S / 128
blocks, each looping over the group's heads; splitting a group over g blocks (fp32 partials
summed after) would fill the GPU. Prints both as fractions of the ideal, and their ratio."""
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
    print("\ndK/dV, one kv head a rank, B = 1")
    print("  g      S  causal  a block a group  a block a head  speedup")
    for g in (4, 8):
        for s in (4096, 8192, 16384, 32768, 65536):
            for causal in (1, 0):
                n = s // 128
                tiles = [2 * (n - i) if causal else 2 * n for i in range(n)]
                group = [g * t + 1 for t in tiles]
                head = [t + 1 for t in tiles for _ in range(g)]
                ideal = g * sum(tiles) / 132
                a, b = makespan(group, 132), makespan(head, 132)
                print(f"{g:3d} {s:6d} {causal:7d}  {ideal / a:15.3f}  {ideal / b:14.3f}"
                      f"  {a / b:7.2f}")


if __name__ == "__main__":
    main()
