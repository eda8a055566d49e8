"""Where the warps of each profiled kernel wait, from ncu's per-SASS-instruction source page
(ncu_source.csv.gz): the share of warp-state samples in the prologue, the main loop and the
epilogue (the main loop: from the first to the last instruction executed more than twice per
warp), and the stall reasons of each part.

    python3 stalls.py > stalls.txt
"""
import collections
import csv
import gzip
import io
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path: Path):
    """(name, header, rows) per kernel of the CSV."""
    cur = None
    for r in csv.reader(io.TextIOWrapper(gzip.open(path), encoding="utf-8")):
        if r and r[0] == "Kernel Name":
            if cur:
                yield cur
            cur = [r[1], None, []]
        elif r and r[0] == "Address":
            cur[1] = {n: i for i, n in enumerate(r)}
        elif cur and r:
            cur[2].append(r)
    if cur:
        yield cur


def main():
    seen = set()
    for name, ix, rows in kernels(Path(__file__).with_name("ncu_source.csv.gz")):
        n = lambda r, key: int(r[ix[key]] or 0)  # noqa: E731
        executed = [n(r, "Instructions Executed") for r in rows]
        warps = n(rows[0], "Instructions Executed")  # the first instruction runs once per warp
        if (name, warps) in seen:  # ncu lists some kernels twice
            continue
        seen.add((name, warps))
        total = sum(n(r, SAMPLES) for r in rows)
        hot = [i for i, e in enumerate(executed) if e > 2 * warps]
        parts = {"prologue": rows[:hot[0]], "main loop": rows[hot[0]:hot[-1] + 1], "epilogue": rows[hot[-1] + 1:]}
        stalls = [k for k in ix if k.startswith("stall_") and "Not Issued" not in k]
        print(f"{name[:70]}  ({warps} warps, {sum(executed)} instructions, {total} samples)")
        for part, rs in parts.items():
            c = collections.Counter()
            for r in rs:
                for k in stalls:
                    c[k[6:]] += n(r, k)
            top = ", ".join(f"{k} {100 * v / total:.1f}" for k, v in c.most_common(4))
            print(f"  {part:<10} {100 * sum(n(r, SAMPLES) for r in rs) / total:5.1f}% of samples  ({top})")


if __name__ == "__main__":
    main()
