"""plot_attn.py OURS.csv SDPA.csv [PNG] - bench_attn.cu and bench_sdpa.py side by side: a markdown
table (TFLOP/s and the ratio to PyTorch; "-" where SDPA has no number) on stdout and, when
matplotlib is installed, PNG (default bench/attention.png: forward and backward TFLOP/s against S,
one panel per D and mask)."""
import csv
import sys


def load(path):
    with open(path) as f:
        return {(r["impl"], int(r["d"]), int(r["causal"]), int(r["seq"])): r
                for r in csv.DictReader(f)}


def cells(ours, ref, pas):
    """Our TFLOP/s, SDPA's and the ratio of the times (TFLOP/s round to 0 at smoke sizes)."""
    if not ref:
        return f"{float(ours[pas + '_tflops']):.0f} | - | -"
    return (f"{float(ours[pas + '_tflops']):.0f} | {float(ref[pas + '_tflops']):.0f} | "
            f"{float(ref[pas + '_ms']) / float(ours[pas + '_ms']):.2f}")


def main():
    png = sys.argv[3] if len(sys.argv) > 3 else "bench/attention.png"
    rows = {**load(sys.argv[1]), **load(sys.argv[2])}
    keys = sorted({k[1:] for k in rows})
    print("| D | causal | S | fwd ours | fwd sdpa | ratio | bwd ours | bwd sdpa | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d, causal, s in keys:
        ours, ref = rows.get(("ulysses", d, causal, s)), rows.get(("sdpa", d, causal, s))
        if not ours:
            continue
        print(f"| {d} | {causal} | {s} | {cells(ours, ref, 'fwd')} | {cells(ours, ref, 'bwd')} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no {png}", file=sys.stderr)
        return
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    for col, (d, causal) in enumerate([(64, 0), (64, 1), (128, 0), (128, 1)]):
        for row, pas in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            for impl in ("ulysses", "sdpa"):
                pts = sorted((k[3], float(r[pas + "_tflops"])) for k, r in rows.items()
                             if k[:3] == (impl, d, causal))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pas} D={d} {'causal' if causal else 'full'}")
            ax.set_ylabel("TFLOP/s")
            if row == 1:
                ax.set_xlabel("S (B * S fixed)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
