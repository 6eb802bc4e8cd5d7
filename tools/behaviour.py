"""How a run's behaviour moved over training, drawn from its metrics.jsonl.

    python tools/behaviour.py runs/tiny-seed0                 # -> runs/tiny-seed0/behaviour.png
    python tools/behaviour.py runs/tiny-seed0 --out assets/behaviour.png

Per training iteration (its K rollouts per task, sampled at the training temperature): the share
of episodes whose first code reads the API docs, the share that met an error observation, the
share of those that still solved the task, and the success rate; the held-out TGC of each
evaluation beside them. Needs matplotlib; without it, prints the numbers as a table.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loop  # noqa: E402

SERIES = {"looked_first": "first code reads the docs", "error_rate": "met an error",
          "recovered": "solved after an error", "success_rate": "solved (training rollouts)"}


def smooth(values, width=5):
    """Running mean over the last `width` iterations: one iteration is only 72 episodes."""
    return [loop.mean(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory with metrics.jsonl")
    parser.add_argument("--out", help="the PNG to write (default RUN/behaviour.png)")
    args = parser.parse_args(argv)
    metrics = os.path.join(args.run, "metrics.jsonl")
    if not os.path.exists(metrics):
        loop.die(f"no {metrics}: give a run directory (--out of a loop.py run)")
    rows = loop.read_metrics(metrics)
    train = [r for r in rows if "looked_first" in r]
    evals = [r for r in rows if "tgc" in r]
    if not train:
        loop.die(f"{metrics} has no training rows with behaviour metrics")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("iteration " + " ".join(SERIES))
        for r in train:
            print(r["iteration"], *(round(r[key], 3) for key in SERIES))
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    iterations = [r["iteration"] for r in train]
    for key, label in SERIES.items():
        ax.plot(iterations, smooth([100 * r[key] for r in train]), label=label)
    ax.plot([r["iteration"] for r in evals], [100 * r["tgc"] for r in evals], "ko-",
            label="held-out TGC (greedy)")
    ax.set(xlabel="iteration", ylabel="% of episodes", ylim=(0, 100),
           title=f"{os.path.basename(os.path.abspath(args.run))}: running mean over 5 iterations")
    ax.legend(loc="center right", fontsize="small")
    fig.tight_layout()
    out = args.out or os.path.join(args.run, "behaviour.png")
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
