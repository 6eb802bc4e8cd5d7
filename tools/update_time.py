"""The update's seconds and padding of a run, measured from outside loop.py, so that any commit's
loop.py (an old one in a `git worktree`) is measured the same way, back to back:

    git worktree add /tmp/base ac758bb
    python tools/update_time.py /tmp/base base.json --tiny --iterations 3 --eval-every 100 --out runs/b
    python tools/update_time.py . new.json --tiny --iterations 3 --eval-every 100 --out runs/n

REPO's loop.update, loop.old_logprobs and loop.pad_batch are wrapped: the seconds of the update
(old log-probs included) and of the old log-probs, and per kind of pass (0: the old log-probs',
without gradients; 1: the update's) the passes, the cells computed (rows x the longest) and the
rollouts' tokens. The flags after OUT are loop.py's; the figures go to OUT and stdout as JSON.
"""
import json
import os
import sys
import time


def main(repo, out, flags):
    sys.path.insert(0, os.path.abspath(repo))
    import torch
    import loop
    record = {"update_s": 0.0, "old_s": 0.0, "passes": [0, 0], "cells": [0, 0], "tokens": [0, 0]}
    update, old_logprobs, pad_batch = loop.update, loop.old_logprobs, loop.pad_batch

    def timed(function, key):
        def wrapper(*args):
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                record[key] += time.perf_counter() - start
        return wrapper

    def counted(episodes):
        kind = int(torch.is_grad_enabled())  # the old log-probs run without gradients
        if episodes:  # (an empty pass of a rank without rollouts computes nothing of theirs)
            record["passes"][kind] += 1
            record["cells"][kind] += len(episodes) * max(len(e.ids) for e in episodes)
            record["tokens"][kind] += sum(len(e.ids) for e in episodes)
        return pad_batch(episodes)
    loop.update, loop.old_logprobs = timed(update, "update_s"), timed(old_logprobs, "old_s")
    loop.pad_batch = counted
    loop.main(flags)
    record["padding_old_logprobs"] = record["cells"][0] / max(record["tokens"][0], 1)
    record["padding_update"] = record["cells"][1] / max(record["tokens"][1], 1)
    with open(out, "w") as fh:
        json.dump(record, fh)
    print(json.dumps(record))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
