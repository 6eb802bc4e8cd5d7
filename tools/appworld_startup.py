"""Seconds from the start of an iteration to its first generated token, in AppWorld.

    python tools/appworld_startup.py --split train --episodes 24 --iterations 3

Each iteration creates one AppWorld env per episode (tasks of the split in turn) and plays one
turn with the tiny model; what is timed is the wait for the worlds, up to the first generation.
It needs AppWorld data under $APPWORLD_ROOT: `appworld download data`, or offline the small root
of `python tools/appworld_root.py /tmp/awroot` (split fixture).
"""
import argparse
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import infra  # noqa: E402
import loop  # noqa: E402
from chat import Chat  # noqa: E402


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="train")
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args(argv)
    cfg = loop.parse_config(["--tiny", "--env", "appworld", "--max-new-tokens", "4",
                             "--max-context", "4096"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    chat = Chat(tok, model.generation_config.eos_token_id)
    tasks = loop.AppWorldEnv.tasks(args.split)
    tasks = [tasks[i % len(tasks)] for i in range(args.episodes)]
    generate = loop.generate
    first = []

    def timed_generate(*inputs):
        first.append(time.monotonic())
        return generate(*inputs)
    loop.generate = timed_generate
    for iteration in range(args.iterations):
        first.clear()
        start = time.monotonic()
        envs = [infra.Hosted(loop.AppWorldEnv, task, cfg.code_timeout, f"startup-{iteration}-{i}")
                for i, task in enumerate(tasks)]
        loop.rollout(model, chat, envs, tasks, cfg, 1.0, 1)
        print(f"iteration {iteration}: first generated token after {first[0] - start:.1f} s "
              f"({len(tasks)} episodes)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
