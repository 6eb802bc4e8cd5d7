"""The paper's Table 1 ablation in miniature: variants of the objective on the tiny world.

    # long tasks (long-test), off-policy updates: 8 tasks x 6 rollouts in minibatches of 4; every
    # variant over seeds 0-4, then the three ratios (run names: the keys of VARIANTS) over 5-9
    python tools/ablation.py --seeds 0 1 2 3 4 --iterations 30 --config tools/ablation_long.json \
        --out runs/ablation-long
    python tools/ablation.py --seeds 5 6 7 8 9 --variants token turn trajectory --iterations 30 \
        --config tools/ablation_long.json --out runs/ablation-long
    # where learning is not saturated: 2 tasks x 6 rollouts an iteration at lr 1.5e-5
    python tools/ablation.py --seeds 0 1 2 3 4 --iterations 45 --config tools/ablation_hard.json \
        --out runs/ablation-hard
    # the first sweep, saturated: --tiny's settings
    python tools/ablation.py --seeds 0 1 2 --iterations 20 --eval-every 5 --out runs/ablation
    python tools/ablation.py --report runs/ablation-hard   # only redraw the tables and the figure

Every variant of every seed trains from the shipped tiny model (`--tiny`: assets/tiny-model)
with the same budget; the seed sets the tasks and the sampling. Runs that finished are skipped
and interrupted ones resumed, so a sweep that was stopped continues where it was, and a run of
fewer --iterations goes on to the sweep's. One setting a folder, as its report compares: before
anything trains, a run there of other settings, of more --iterations, or of other --iterations
and not named by the sweep (another seed or variant) stops it with one line. A run's settings are
read as a resume reads them: one that an older loop.py recorded and no longer exists is left out,
one newer than the run is its default. A run that went on trained as a run of that many
iterations from the start would (each iteration seeded by its number, a constant learning rate,
AdamW's state in the checkpoint), and the report counts the evaluations such a run makes (every
--eval-every and the last), not the one where it first ended. Flags this
script does not know go to every loop.py run (`--config FILE` of settings over --tiny's, or
`--tasks-per-iteration 2` for a quick try). The tables (per variant, per run, and the verdict on
each of the paper's orderings with a sign test over seeds) go to DIR/ablation.md and, with
matplotlib installed, the learning curves to DIR/ablation.png; then the tables to stdout (a
reader that went away, `| head`, ends it quietly: tools/console.py).
"""
import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import console  # noqa: E402
import infra  # noqa: E402
import loop  # noqa: E402

VARIANTS = {  # run name: (the settings it changes, its label)
    "token": ({"ratio": "token"}, "per-token (LOOP)"),
    "turn": ({"ratio": "turn"}, "per-turn"),
    "trajectory": ({"ratio": "trajectory"}, "per-trajectory"),
    # the paper's RLOO: the reference code's strictly_on_policy, one step an iteration
    "rloo": ({"ratio": "none", "epochs": 1, "minibatch_size": 0}, "RLOO, on-policy"),
    # RLOO's loss on the PPO schedule: every step after an iteration's first on stale samples
    "none": ({"ratio": "none"}, "RLOO's loss, PPO's steps"),
    "rwnorm": ({"ratio": "token", "normalize_rewards": True}, "per-token + RwNorm"),
}


def sweep(seeds, iterations, root, variants, extra):
    """The variant runs that are not finished yet, one after another in this process; before any
    trains, the folder they would leave is checked: one setting's runs, as its report compares."""
    planned = {f"{name}-{seed}": ["--tiny", "--seed", str(seed), *(infra.as_flag(key, value) for
                                  key, value in VARIANTS[name][0].items()), *extra, "--iterations",
                                  str(iterations), "--out", os.path.join(root, f"{name}-{seed}")]
               for seed in seeds for name in variants}
    at_end = training_runs(root) | {name: end_settings(os.path.join(root, name), iterations, flags)
                                    for name, flags in planned.items()}
    if why := one_setting(at_end, root, "give the settings of the runs there, or name their seeds "
                          "too (a run goes on to more --iterations), or another --out"):
        infra.die(f"this sweep would leave runs its report refuses: {why}")
    for name, flags in planned.items():
        run_once(os.path.join(root, name), iterations, flags)


def end_settings(run, iterations, flags):
    """The settings the sweep gives `run` (its flags), which it will have at the sweep's end: a run
    there of others, but of fewer --iterations (it goes on), stops the sweep with one line."""
    given = dataclasses.asdict(loop.parse_config(flags))
    if not os.path.exists(os.path.join(run, "config.json")):
        return given
    recorded = settings(run)
    key = mismatch(recorded, given, ignore=("iterations", "out", "resume", "track"))
    if key or recorded["iterations"] > iterations:  # (a run goes on to more iterations, not back)
        key = key or "iterations"
        infra.die(f"{run} was run with {key} = {recorded.get(key)!r}, and this sweep gives it "
                  f"{given.get(key)!r}: give the sweep's settings as they were, or another --out")
    return given


def run_once(run, iterations, flags):
    """Skip a finished run, resume one that started (from its checkpoint, or from iteration 0; or
    one of fewer iterations, on to the sweep's), start any other. No folder is deleted; a run that
    another process trains stops the sweep."""
    if not os.path.exists(os.path.join(run, "config.json")):
        return loop.main(flags)
    if infra.trained_to(os.path.join(run, "model")) != iterations:
        loop.main(["--resume", run, "--iterations", str(iterations)])


def settings(run):
    """A run's settings as a resume reads its config.json: a setting newer than the run at its
    default, one that no longer is (infra.RETIRED: an older run's) left out, as no difference."""
    with open(os.path.join(run, "config.json")) as fh:
        recorded = json.load(fh)
    defaults = {field.name: field.default for field in dataclasses.fields(loop.Config)}
    return defaults | {key: value for key, value in recorded.items() if key not in infra.RETIRED}


def mismatch(a, b, ignore):
    """The first setting (by name) in which two runs' settings differ, but for those in `ignore`."""
    return next((key for key in sorted(a.keys() | b.keys())
                 if key not in ignore and a.get(key) != b.get(key)), None)


def training_runs(root):
    """{name: settings} of the runs under root that trained (config.json and metrics.jsonl; an
    evaluation-only run is left out)."""
    runs = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        run = os.path.join(root, name)
        if all(os.path.exists(os.path.join(run, f)) for f in ("config.json", "metrics.jsonl")):
            if not (cfg := settings(run))["eval"]:
                runs[name] = cfg
    return runs


def one_setting(runs, root, advice):
    """Why `runs` ({name: settings}) are not one setting's, as a report compares them: a run that is
    not its variant's (named VARIANT-SEED, with the variant's settings), or two that differ in more
    than the variant and the seed (`advice`: what to do); None if they are."""
    keys, seen = set().union(*runs.values()) - {"seed", "out", "track"}, {}
    for name, cfg in runs.items():
        changes = VARIANTS.get(name.rsplit("-", 1)[0], ({}, ""))[0]
        if not changes or any(cfg.get(key) != value for key, value in changes.items()):
            return (f"{name} under {root} is no run of a variant (VARIANT-SEED, its settings the "
                    f"variant's: {', '.join(VARIANTS)})")
        for key in sorted(keys - changes.keys()):
            other, value = seen.setdefault(key, (name, cfg.get(key)))
            if value != cfg.get(key):
                return (f"{other} and {name} under {root} differ in {key} ({value!r}, "
                        f"{cfg.get(key)!r}), not only in the variant and the seed: {advice}")
    return None


def finished_runs(root):
    """{variant: [(seed, evaluations by iteration, training rows), ...]} of the runs under root
    (named VARIANT-SEED, as the sweep names them) that reached their last iteration;
    evaluation-only runs and others are left out. Runs that are not one setting's are one line. A
    run that went on to more iterations counts the evaluations a run of that many would have made:
    every --eval-every and the last (not the one where it first ended)."""
    runs = training_runs(root)
    if why := one_setting(runs, root, "report each setting's runs from a folder of their own"):
        infra.die(f"--report: {why}")
    finished = {}
    for name, cfg in runs.items():
        rows = infra.read_metrics(os.path.join(root, name, "metrics.jsonl"))
        curve = {r["iteration"]: r for r in rows if "split" in r and (
            r["iteration"] % cfg["eval_every"] == 0 or r["iteration"] == cfg["iterations"])}
        if cfg["iterations"] and max(curve, default=-1) == cfg["iterations"]:
            training = [r for r in rows if "split" not in r]
            finished.setdefault(name.rsplit("-", 1)[0], []).append((cfg["seed"], curve, training))
    for seeds in finished.values():
        seeds.sort(key=lambda run: run[0])
    return finished


def seed_figures(curve, training):
    """One run's figures: the first evaluation at which held-out TGC reaches 50% and 80% (None if
    it never does), the area under the TGC curve as a share of the perfect one (trapezoids over the
    evaluations: 1.0 is 100% from the start), final TGC and SGC; over the training iterations, the
    training rollouts' success (its area: the mean over iterations, as it does not jump a family
    at once as greedy TGC does), and means of optimiser steps, the clip fraction, the share of
    rollouts clipped whole, the KL estimate and the tokens per trajectory; its time (its rows'
    seconds summed)."""
    its = sorted(curve)
    tgc = [curve[i]["tgc"] for i in its]

    def first(level):
        return next((i for i, value in zip(its, tgc) if value >= level), None)
    area = sum((b - a) * (ta + tb) / 2 for a, b, ta, tb in zip(its, its[1:], tgc, tgc[1:]))
    final = curve[its[-1]]
    return {"to50": first(0.5), "to80": first(0.8),
            "auc": area / (its[-1] - its[0]) if len(its) > 1 else tgc[0],
            "tgc": final["tgc"], "sgc": final["sgc"],
            "success": loop.mean([r["success_rate"] for r in training]),
            "steps": loop.mean([r["steps"] for r in training]),
            "clip": loop.mean([r["clip_fraction"] for r in training]),
            "kl": loop.mean([r["kl"] for r in training]),
            "whole": loop.mean([r.get("clipped_rollouts", math.nan) for r in training]),
            "tokens": loop.mean([r["tokens_mean"] for r in training]),
            "seconds": sum(r["seconds"] for r in training) + sum(curve[i]["seconds"] for i in its)}


def spread(values, digits=".3f"):
    """Mean over seeds, with the lowest and highest seed in brackets."""
    return f"{loop.mean(values):{digits}} ({min(values):{digits}}-{max(values):{digits}})"


def pct(values):
    return spread([100 * v for v in values], ".1f")


def iterations(values):
    """Mean iteration over the seeds that got there, their range, and how many never did."""
    reached = [v for v in values if v is not None]
    text = f"{loop.mean(reached):.1f} ({min(reached)}-{max(reached)})" if reached else "never"
    missed = len(values) - len(reached)
    return text + (f", {missed} never" if reached and missed else "")


def differences(figures, key, base="token"):
    """The variant's TGC AUC minus `base`'s on each seed both ran, in points: seeds differ more
    than variants do (their tasks and samples differ), so the comparison is made within a seed."""
    if key == base or base not in figures or key not in figures:
        return {}
    base_auc = {f["seed"]: f["auc"] for f in figures[base]}
    return {f["seed"]: 100 * (f["auc"] - base_auc[f["seed"]]) for f in figures[key]
            if f["seed"] in base_auc}


def paired(figures, key):
    diffs = list(differences(figures, key).values())
    return f"{loop.mean(diffs):+.1f} ({min(diffs):+.1f} to {max(diffs):+.1f})" if diffs else "-"


CLAIMS = [  # (better, worse): the paper's orderings (Table 1), then what the clip buys a reuse
    ("token", "turn"), ("turn", "trajectory"), ("token", "trajectory"), ("token", "rloo"),
    ("token", "rwnorm"), ("token", "none")]


def verdicts(figures):
    """Per claim "A beats B": the seeds on which A's TGC AUC is above B's, and the one-sided sign
    test's p (ties left out): the chance of so many or more under a coin toss per seed."""
    lines = ["| claim | seeds where it holds (AUC) | mean AUC difference | sign test p |",
             "|---" * 4 + "|"]
    for better, worse in CLAIMS:
        diffs = list(differences(figures, better, worse).values())
        if not diffs:
            continue
        wins, n = sum(d > 0 for d in diffs), sum(d != 0 for d in diffs)  # (A's AUC - B's)
        p = sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n
        lines.append(f"| {label(better)} > {label(worse)} | {wins} of {len(diffs)} | "
                     f"{loop.mean(diffs):+.1f} | {p:.3f} |")
    return lines


def report(root):
    """Two tables, to DIR/ablation.md and then stdout: each variant over its seeds (mean, lowest and
    highest seed in brackets), then every run; the learning curves to DIR/ablation.png."""
    if not os.path.isdir(root):
        infra.die(f"--report: no directory {root}")
    runs = finished_runs(root)
    if not runs:
        infra.die(f"--report: no finished runs (config.json and metrics.jsonl) under {root}")
    order = sorted(runs, key=list(VARIANTS).index)
    figures = {key: [{"seed": seed, **seed_figures(curve, rows)} for seed, curve, rows in runs[key]]
               for key in order}
    lines = ["| variant | seeds | iterations to 50% TGC | iterations to 80% TGC | TGC AUC % | "
             "AUC - LOOP's, same seed | training success AUC % | final TGC % | final SGC % | "
             "steps an iteration | clip fraction | rollouts clipped whole | KL | "
             "tokens per trajectory | wall s |", "|---" * 15 + "|"]
    for key in order:
        f = {name: [seed[name] for seed in figures[key]] for name in figures[key][0]}
        lines.append(f"| {label(key)} | {len(f['tgc'])} | {iterations(f['to50'])} | "
                     f"{iterations(f['to80'])} | {pct(f['auc'])} | {paired(figures, key)} | "
                     f"{pct(f['success'])} | {pct(f['tgc'])} | {pct(f['sgc'])} | "
                     f"{loop.mean(f['steps']):.1f} | {spread(f['clip'])} | "
                     f"{spread(f['whole'])} | {spread(f['kl'])} | {loop.mean(f['tokens']):.0f} | "
                     f"{loop.mean(f['seconds']):.0f} |")
    lines += ["", "| variant | seed | to 50% | to 80% | TGC AUC % | AUC - LOOP's | success AUC % "
              "| final TGC % | final SGC % | clip fraction | clipped whole | KL | wall s |",
              "|---" * 13 + "|"]
    for key in order:
        diffs = differences(figures, key)
        for f in figures[key]:
            to50, to80 = ("-" if f[k] is None else f[k] for k in ("to50", "to80"))
            diff = f"{diffs[f['seed']]:+.1f}" if f["seed"] in diffs else "-"
            lines.append(f"| {label(key)} | {f['seed']} | {to50} | {to80} | {100 * f['auc']:.1f} | "
                         f"{diff} | {100 * f['success']:.1f} | {100 * f['tgc']:.1f} | "
                         f"{100 * f['sgc']:.1f} | "
                         f"{f['clip']:.3f} | {f['whole']:.3f} | {f['kl']:.3f} | "
                         f"{f['seconds']:.0f} |")
    lines += ["", *verdicts(figures)]
    table = "\n".join(lines)
    with open(os.path.join(root, "ablation.md"), "w") as fh:  # the files first: stdout may be gone
        fh.write(table + "\n")
    curves = {}  # each variant's TGC per seed at the evaluations all its seeds share
    for key in order:
        shared = sorted(set.intersection(*(set(curve) for _, curve, _ in runs[key])))
        curves[key] = {i: [curve[i]["tgc"] for _, curve, _ in runs[key]] for i in shared}
    plot(root, order, curves, {key: len(seeds) for key, seeds in runs.items()})
    print(table)


def label(key):
    return VARIANTS[key][1]


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
                f"{n_seeds[key]} seeds", lw=2.5 if key == "token" else 1.5)
        ax.fill_between(iterations, [min(s) for s in per_seed], [max(s) for s in per_seed],
                        alpha=0.12)
    ax.set(xlabel="iteration", ylabel="held-out TGC %", ylim=(0, 100),
           title="mean over seeds; band: lowest to highest seed")
    ax.legend(loc="lower right", ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(os.path.join(root, "ablation.png"), dpi=120)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", metavar="DIR", type=os.path.expanduser,
                        help="only draw the table and figure of DIR")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="run names of the variants to run, each over every seed")
    parser.add_argument("--iterations", type=int, default=100, help="RL iterations per run")
    parser.add_argument("--out", default="runs/ablation", type=os.path.expanduser,
                        help="directory of the sweep's runs")
    args, extra = parser.parse_known_args(argv)
    if args.report:
        return report(args.report)
    sweep(args.seeds, args.iterations, args.out, args.variants, extra)
    report(args.out)


if __name__ == "__main__":
    console.run(main)  # a closed pipe, a full stdout: as a Unix tool
