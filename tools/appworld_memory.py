"""AppWorld workers alive and host memory at their peak, in an evaluation and a training iteration.

    python tools/appworld_memory.py --tasks 48 --batch-episodes 8

Offline: it builds the tests' small AppWorld data root in a temporary folder and copies its tasks
under new ids into a split of --tasks tasks (16 scenarios of 3 for 48). Then loop.py runs in a
process of its own, the tiny model playing 2 turns an episode: `--eval` of that split, and one
training iteration of the same number of episodes (N = tasks / 6, K = 6; its evaluations are of
the 3-task fixture split). Every 0.5 s the process tree is sampled: the workers alive (the
forkserver's children) and the proportional set size (PSS) of the trainer and all its
descendants. Prints one JSON line per run: peaks, and the wall time (the evaluation from the
command's start, the iteration from its metrics row).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_root(folder, tasks):
    """The small data root of appworld_root.py, its 3 tasks copied to `tasks` tasks of a split
    named "big"."""
    builder = os.path.join(HERE, "tools", "appworld_root.py")
    made = subprocess.run([sys.executable, builder, folder], capture_output=True, text=True)
    if made.returncode:
        sys.exit(f"the data root was not built: {made.stderr[-2000:]}")
    data = os.path.join(folder, "data")
    originals = sorted(os.listdir(os.path.join(data, "tasks")))
    ids = [f"{0xa00000 + i // 3:07x}_{1 + i % 3}" for i in range(tasks)]
    for i, task in enumerate(ids):
        shutil.copytree(os.path.join(data, "tasks", originals[i % len(originals)]),
                        os.path.join(data, "tasks", task))
    with open(os.path.join(data, "datasets", "big.txt"), "w") as fh:
        fh.write("\n".join(ids) + "\n")


def tree(root):
    """The pids of `root` and all its descendants, and every live process's parent."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state, parent = fh.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if state != "Z":
            parents[int(pid)] = int(parent)
    family = {root}
    while True:
        more = {pid for pid, parent in parents.items() if parent in family} - family
        if not more:
            return family, parents
        family |= more


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as fh:
            return fh.read()
    except OSError:
        return ""


def pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def watch(process, peaks, stop):
    while not stop.is_set():
        family, parents = tree(process.pid)
        servers = {pid for pid in family if "forkserver" in cmdline(pid)}
        workers = sum(parents.get(pid) in servers for pid in family)
        peaks["workers"] = max(peaks["workers"], workers)
        peaks["pss_gb"] = max(peaks["pss_gb"], sum(pss(pid) for pid in family) / 1e9)
        stop.wait(0.5)


def run(args, root, out):
    env = dict(os.environ, APPWORLD_ROOT=root, PYTHONUNBUFFERED="1")
    command = [sys.executable, os.path.join(HERE, "loop.py"), *args, "--out", out]
    peaks, stop = {"workers": 0, "pss_gb": 0.0}, threading.Event()
    start = time.monotonic()
    process = subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    watcher = threading.Thread(target=watch, args=(process, peaks, stop))
    watcher.start()
    _, err = process.communicate()
    stop.set()
    watcher.join()
    if process.returncode:
        sys.exit(f"loop.py failed: {err[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return peaks | {"seconds": round(time.monotonic() - start, 1), "rows": rows}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=48)
    parser.add_argument("--batch-episodes", type=int, default=8)
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="aw-peaks-")  # ("memory" in a path makes AppWorld use RAM)
    build_root(folder, args.tasks)
    common = ["--tiny", "--env", "appworld", "--batch-episodes", str(args.batch_episodes),
              "--max-new-tokens", "32", "--max-context", "4096", "--code-timeout", "30",
              "--eval-max-turns", "2", "--max-turns", "2"]
    evaluation = run([*common, "--eval", "--split", "big"], folder, os.path.join(folder, "eval"))
    evaluation.pop("rows")
    print(json.dumps({"run": f"--eval of {args.tasks} tasks", **evaluation}), flush=True)
    training = run([*common, "--iterations", "1", "--train-split", "big", "--split", "fixture",
                    "--tasks-per-iteration", str(args.tasks // 6), "--rollouts-per-task", "6"],
                   folder, os.path.join(folder, "train"))
    (row,) = [r for r in training.pop("rows") if "rollouts_used" in r]
    training["iteration_seconds"] = row["seconds"]
    print(json.dumps({"run": f"1 iteration of {args.tasks} episodes", **training}), flush=True)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
