"""Watch a model play tasks you name: each episode printed as evaluation plays it (greedy).

    python tools/play.py --tiny --model runs/tiny-seed0/model --task payback01_2 --task phone02_1
    python tools/play.py --env appworld --model runs/x/model --split test_normal --task 5a0f1c2_1

Every other flag is loop.py's (--eval-max-turns, --max-new-tokens, --eval-temperature, ...). A task
is one of --split's or --train-split's. Nothing is written but what the world itself keeps
(AppWorld: its outputs under experiments/outputs/loop-play).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loop  # noqa: E402


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", action="append", required=True, help="a task id; repeatable")
    args, settings = parser.parse_known_args(argv)
    cfg = loop.parse_config(settings)
    env = loop.ENVS[cfg.env]
    try:
        known = set(env.tasks(cfg.split)) | set(env.tasks(cfg.train_split))
    except ValueError as e:
        loop.die(str(e))
    unknown = [task for task in args.task if task not in known]
    if unknown:
        loop.die(f"no task {unknown[0]!r} in the {cfg.split} or {cfg.train_split} split")
    model, tok = loop.load_model_and_tokenizer(cfg)
    chat = loop.chat_of(model, tok)
    envs = [env(task, cfg.code_timeout, "loop-play") for task in args.task]
    with torch.autocast(loop.DEVICE.type, torch.bfloat16, enabled=cfg.bf16):
        episodes = loop.rollout(model, chat, envs, args.task, cfg, cfg.eval_temperature,
                                cfg.eval_max_turns, desc="play")
    for e in episodes:
        print(loop.transcript(e), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
