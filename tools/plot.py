"""A run's figures, drawn from its metrics.jsonl: the training curves and how behaviour moved.

    python tools/plot.py runs/tiny                  # -> runs/tiny/curves.png, behaviour.png
    python tools/plot.py runs/tiny --out-dir assets  # redraws the README's figures in assets/

curves.png: one panel per training signal over iterations (training reward, success rate, KL
estimate, clip fraction, gradient norm) and the held-out TGC and SGC of each evaluation.
behaviour.png: per training iteration (its K rollouts per task, sampled at the training
temperature), the share of episodes whose first code reads the API docs, the share that met an
error observation, the share of those that still solved the task, and the success rate, beside
the held-out TGC. A series whose metric the run did not log is left out; with none of the
behaviour metrics (an environment that does not define them) there is no behaviour.png.
Needs matplotlib (pip install matplotlib); without it, prints the numbers as tables.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import console  # noqa: E402
import infra  # noqa: E402
import loop  # noqa: E402

CURVES = [  # (metric of the training rows, panel title, drawn in %)
    ("reward_mean", "training reward (mean)", False),
    ("success_rate", "training success %", True),
    ("kl", "KL estimate (old || new)", False),
    ("clip_fraction", "clip fraction", False),
    ("grad_norm", "gradient norm", False)]
BEHAVIOUR = {"looked_first": "first code reads the docs", "error_rate": "met an error",
             "recovered": "solved after an error", "success_rate": "solved (training rollouts)"}
WIDTH = 5  # iterations in a running mean: one iteration is only tasks x K episodes


def smooth(values, width=WIDTH):
    """Running mean over the last `width` values, so the first points are not left out."""
    return [loop.mean(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def split_rows(rows):
    """Training rows and evaluation rows; an evaluation row has a split (older logs: only tgc)."""
    evals = [r for r in rows if "split" in r or "tgc" in r]
    train = [r for r in rows if not ("split" in r or "tgc" in r)]
    return train, evals


def series(rows, key, scale=1.0):
    """(iterations, values) of the rows that logged `key`: a metric can be missing or null."""
    kept = [r for r in rows if r.get(key) is not None]
    return [r["iteration"] for r in kept], [scale * r[key] for r in kept]


def by_split(evals):
    """Evaluation rows per split name, in the order they first appear."""
    splits = {}
    for r in evals:
        splits.setdefault(r.get("split", "test"), []).append(r)
    return splits


def print_table(title, rows, keys):
    """The figure's numbers for a machine without matplotlib: one line per iteration."""
    print(f"{title}\niteration " + " ".join(keys))
    for r in rows:
        print(r["iteration"], *(cell(r.get(k)) for k in keys))


def cell(value):
    """A number in 3 digits, a split by its name, a metric the row did not log as -."""
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else value


def integer_iterations(ax):
    """Ticks at whole iterations only: 2.5 is not an iteration."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


EVAL_STYLES = {"tgc": dict(fmt="o-", ms=4, mfc="black", zorder=3),  # drawn over SGC:
               "sgc": dict(fmt="s--", ms=7, mfc="none", zorder=2)}  # they often coincide


def draw_eval(ax, evals, scale, keys=("tgc", "sgc")):
    """Held-out TGC and SGC of each split, in black and greys: they are not training signals."""
    for (split, rows), color in zip(by_split(evals).items(), ["black", "C7", "C5", "C8", "C9"]):
        for key in keys:
            xs, ys = series(rows, key, scale)
            style = dict(EVAL_STYLES[key])
            if xs:
                ax.plot(xs, ys, style.pop("fmt"), color=color, lw=1.2, **style,
                        label=f"held-out {key.upper()} ({split}, greedy)")


def draw_curves(plt, title, train, evals, out):
    """Small multiples with a shared x axis: each signal at its own scale, raw per iteration."""
    panels = [c for c in CURVES if series(train, c[0])[0]]
    if series(evals, "tgc")[0]:
        panels.append(("tgc", "held-out TGC / SGC %", True))
    if not panels:  # rows of some other logger: nothing this figure knows how to draw
        print(f"no {', '.join(c[0] for c in CURVES)} or tgc in the rows: no {out}")
        return None
    cols = 2
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, sharex=True, figsize=(7.2, 1.9 * nrows + 0.6),
                             squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (key, name, percent) in zip(flat, panels):
        scale = 100.0 if percent else 1.0
        if key == "tgc":
            draw_eval(ax, evals, scale)
        else:
            xs, ys = series(train, key, scale)
            ax.plot(xs, smooth(ys), color="C0", lw=4, alpha=0.25,
                    label=f"running mean over {WIDTH} iterations")
            ax.plot(xs, ys, "o-", color="C0", ms=3, lw=1.2, label="per iteration")
        if percent:
            ax.set_ylim(-5, 105)  # a rate at 0 or 100% stays off the frame
        ax.set_title(name, fontsize="medium")
        ax.grid(alpha=0.3)
        integer_iterations(ax)
    for ax in flat[len(panels):]:
        ax.set_visible(False)  # an odd number of panels: the spare one stays blank
    for ax in flat[max(0, len(panels) - cols):len(panels)]:  # the lowest panel of each column
        ax.set_xlabel("iteration")
        ax.xaxis.set_tick_params(labelbottom=True)  # sharex hides them above a spare panel
    fig.suptitle(title)
    return save(fig, [flat[0], flat[len(panels) - 1]], out)


def save(fig, legend_axes, out, ncol=2):
    """One legend for the figure, below every panel so it covers no curve; then write `out`."""
    handles, labels = [], []
    for ax in legend_axes:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            if text not in labels:
                handles.append(handle)
                labels.append(text)
    fig.tight_layout()
    if handles:  # anchored under the figure; bbox_inches="tight" widens the canvas to hold it
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol,
                   fontsize="small", frameon=False)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    return out


def draw_behaviour(plt, title, train, evals, keys, out):
    """The behaviour shares, smoothed (one iteration's share is noisy), and held-out TGC."""
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for key in keys:
        xs, ys = series(train, key, 100.0)
        ax.plot(xs, smooth(ys), label=BEHAVIOUR[key])
    draw_eval(ax, evals, 100.0, keys=("tgc",))
    ax.set(xlabel="iteration", ylabel="% of episodes", ylim=(-3, 103),  # 0 and 100 in view
           title=f"{title}: running mean over {WIDTH} iterations")
    ax.grid(alpha=0.3)
    integer_iterations(ax)
    return save(fig, [ax], out, ncol=3)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory with metrics.jsonl")
    parser.add_argument("--out-dir", help="where to write the PNGs (default: the run directory)")
    args = parser.parse_args(argv)
    metrics = os.path.join(args.run, "metrics.jsonl")
    if not os.path.exists(metrics):
        infra.die(f"no {metrics}: give a run directory (--out of a loop.py run)")
    train, evals = split_rows(infra.read_metrics(metrics))
    if not train:
        infra.die(f"{metrics} has no training rows (only evaluations): give a run that trained")
    keys = [k for k in BEHAVIOUR if any(k in r for r in train)]
    own = [k for k in BEHAVIOUR if k != "success_rate"]  # success alone: a panel of curves.png
    if not set(own) & set(keys):
        keys = []
        print(f"{metrics} logs no behaviour metrics ({', '.join(own)}): no behaviour.png")
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display on a training machine
        import matplotlib.pyplot as plt
    except ImportError:
        print("pip install matplotlib to draw the figures; their numbers:", file=sys.stderr)
        curve_keys = [c[0] for c in CURVES]
        print_table("training", train, curve_keys + [k for k in keys if k not in curve_keys])
        print_table("evaluation", evals, ["split", "tgc", "sgc"])
        return []
    out_dir = args.out_dir or args.run
    os.makedirs(out_dir, exist_ok=True)
    title = os.path.basename(os.path.abspath(args.run))
    written = [draw_curves(plt, title, train, evals, os.path.join(out_dir, "curves.png"))]
    if keys:
        written.append(draw_behaviour(plt, title, train, evals, keys,
                                      os.path.join(out_dir, "behaviour.png")))
    plt.close("all")
    written = [path for path in written if path]
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    console.run(main)  # a closed pipe, a full stdout: as a Unix tool
