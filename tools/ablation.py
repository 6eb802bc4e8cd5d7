"""The paper's Table 1 ablation in miniature: five variants of the objective on the tiny world.

    python tools/ablation.py --seeds 0 1 2 --iterations 20 --eval-every 5 --out runs/ablation
    python tools/ablation.py --report runs/ablation      # only redraw the table and the figure

Every variant of every seed trains from the shipped tiny model (`--tiny`: assets/tiny-model)
with the same budget; the seed sets the tasks and the sampling. Runs that finished are skipped
and interrupted ones resumed, so a sweep that was stopped continues where it was. Flags this
script does not know go to every loop.py run (for example `--tasks-per-iteration 2` for a quick try). The table goes to
stdout and DIR/ablation.md; with matplotlib installed, the learning curves go to DIR/ablation.png.
"""
import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loop  # noqa: E402

VARIANTS = {  # (ratio, normalize_rewards): (run name, label)
    ("token", False): ("token", "per-token (LOOP)"),
    ("turn", False): ("turn", "per-turn"),
    ("trajectory", False): ("trajectory", "per-trajectory"),
    ("none", False): ("none", "RLOO, on-policy"),
    ("token", True): ("rwnorm", "per-token + RwNorm"),
}


def sweep(seeds, iterations, root, extra):
    """The variant runs that are not finished yet, one after another in this process."""
    for seed in seeds:
        for (ratio, normalize), (name, _) in VARIANTS.items():
            flags = ["--ratio", ratio] + (["--normalize-rewards"] if normalize else [])
            run = os.path.join(root, f"{name}-{seed}")
            run_once(run, iterations, ["--tiny", "--seed", str(seed), *flags, *extra])


def run_once(run, iterations, flags):
    """Skip a finished run, resume one that has a checkpoint, start any other afresh."""
    config = os.path.join(run, "config.json")
    if os.path.isdir(os.path.join(run, "model")) and os.path.exists(config):
        with open(config) as fh:
            if json.load(fh)["iterations"] == iterations:
                return
    if os.path.isdir(os.path.join(run, "checkpoint")):
        loop.main(["--resume", run, "--iterations", str(iterations)])
        return
    shutil.rmtree(run, ignore_errors=True)
    loop.main([*flags, "--iterations", str(iterations), "--out", run])


def finished_runs(root):
    """{(ratio, normalize_rewards): [(evaluations by iteration, training rows), ...]} of the runs
    under root that reached their last iteration; evaluation-only runs and others are left out."""
    runs = {}
    for name in sorted(os.listdir(root)):
        config = os.path.join(root, name, "config.json")
        metrics = os.path.join(root, name, "metrics.jsonl")
        if not (os.path.exists(config) and os.path.exists(metrics)):
            continue  # not a run directory
        with open(config) as fh:
            cfg = json.load(fh)
        rows = loop.read_metrics(metrics)
        curve = {r["iteration"]: r for r in rows if "split" in r}
        if cfg["iterations"] and max(curve, default=-1) == cfg["iterations"]:
            training = [r for r in rows if "split" not in r]
            runs.setdefault((cfg["ratio"], cfg["normalize_rewards"]), []).append((curve, training))
    return runs


def pct(values):
    """Mean over seeds, with the lowest and highest seed in brackets, in percent."""
    return f"{100 * loop.mean(values):.1f} ({100 * min(values):.1f}-{100 * max(values):.1f})"


def report(root):
    """Held-out TGC/SGC at the last iteration, the first evaluation at which the seed-mean TGC
    reaches half of LOOP's final one, the update's clip fraction and KL estimate (means over
    iterations) and the wall time per run."""
    if not os.path.isdir(root):
        loop.die(f"--report: no directory {root}")
    runs = finished_runs(root)
    if not runs:
        loop.die(f"--report: no finished runs (config.json and metrics.jsonl) under {root}")
    order = sorted(runs, key=lambda key: list(VARIANTS).index(key) if key in VARIANTS else 99)
    # each variant's TGC per seed at the evaluations all its seeds share: the table's and figure's
    curves = {}
    for key, seeds in runs.items():
        shared = sorted(set.intersection(*(set(curve) for curve, _ in seeds)))
        curves[key] = {i: [curve[i]["tgc"] for curve, _ in seeds] for i in shared}
    loop_curve = curves.get(("token", False))
    half = 0.5 * loop.mean(loop_curve[max(loop_curve)]) if loop_curve else 0.0
    lines = ["| variant | seeds | final TGC % | final SGC % | iterations to half LOOP's TGC | "
             "clip fraction | KL | wall s |", "|---|---|---|---|---|---|---|---|"]
    for key in order:
        seeds = runs[key]
        finals = [curve[max(curve)] for curve, _ in seeds]
        reached = [i for i, tgc in curves[key].items() if half > 0 and loop.mean(tgc) >= half]
        clip = loop.mean([loop.mean([r["clip_fraction"] for r in rows]) for _, rows in seeds])
        kl = loop.mean([loop.mean([r["kl"] for r in rows]) for _, rows in seeds])
        lines.append(f"| {label(key)} | {len(seeds)} | {pct([r['tgc'] for r in finals])} | "
                     f"{pct([r['sgc'] for r in finals])} | {reached[0] if reached else '-'} | "
                     f"{clip:.3f} | {kl:.3f} | {loop.mean([r['seconds'] for r in finals]):.0f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(root, "ablation.md"), "w") as fh:
        fh.write(table + "\n")
    plot(root, order, curves, {key: len(seeds) for key, seeds in runs.items()})


def label(key):
    return VARIANTS[key][1] if key in VARIANTS else str(key)


def plot(root, order, curves, n_seeds):
    """Held-out TGC against iteration, one line per variant: seed mean, band lowest to highest."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("pip install matplotlib to draw the learning curves", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key in order:
        iterations = list(curves[key])
        per_seed = [[100 * tgc for tgc in seeds] for seeds in curves[key].values()]
        ax.plot(iterations, [loop.mean(s) for s in per_seed], label=f"{label(key)}, "
                f"{n_seeds[key]} seeds", lw=2.5 if key == ("token", False) else 1.5)
        ax.fill_between(iterations, [min(s) for s in per_seed], [max(s) for s in per_seed],
                        alpha=0.12)
    ax.set(xlabel="iteration", ylabel="held-out TGC %", ylim=(0, 100),
           title="mean over seeds; band: lowest to highest seed")
    ax.legend(loc="upper left", ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(os.path.join(root, "ablation.png"), dpi=120)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", metavar="DIR", help="only draw the table and figure of DIR")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=100, help="RL iterations per run")
    parser.add_argument("--out", default="runs/ablation", help="directory of the sweep's runs")
    args, extra = parser.parse_known_args(argv)
    if args.report:
        return report(args.report)
    sweep(args.seeds, args.iterations, args.out, extra)
    report(args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
