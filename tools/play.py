"""Watch a model play tasks you name, or check a world with code you wrote, before any training.

    python tools/play.py --tiny --model runs/tiny/model --task payback01_2 --task phone02_1
    python tools/play.py --tiny --solution assets/tiny_solution.md --split test
    python tools/play.py --env my_env:MyWorld --solution my_solution.md --task a_1

Each episode is printed as evaluation plays it (greedy), with its reward and the checks it passed;
then how many tasks earned the full reward. Without --task, every task of --split is played.

--solution FILE plays code you wrote instead of a model (none is loaded): FILE's ```python blocks
are the turns, in order, every one of them. A line "## PREFIX" starts the turns of the tasks whose
id starts with PREFIX (a task, a scenario, a family; the longest PREFIX that matches wins); blocks
before any such line are played in every other task. Your reference solution should earn the
full reward on every task, and a wrong one should not: else the world's checks are wrong, not the
model.

Every other flag is loop.py's (--env, --split, --eval-max-turns, --code-timeout, ...). A task is
one of --split's or --train-split's. Nothing is written but what the world itself keeps
(AppWorld: its outputs under experiments/outputs/loop-play).
"""
import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import console  # noqa: E402
import infra  # noqa: E402
import loop  # noqa: E402


def read_solution(path, tasks):
    """{prefix: [code of each turn]} from FILE, read as loop.py reads a reply (```python and ```py
    blocks, an unterminated last one); "" holds the blocks before any "## PREFIX" line. A header
    that is not "## PREFIX", names no task of `tasks` or comes twice is one line, as is a section
    without a block."""
    try:
        text = open(path).read()
    except OSError as e:
        infra.die(f"cannot read the solution {path}: {e.strerror}")
    sections, prefix, in_code = {"": ""}, "", False
    for line in text.splitlines(keepends=True):
        in_code = in_code != line.startswith("```")  # a comment "## x" in code is code
        if in_code or not line.startswith("##"):
            sections[prefix] += line
            continue
        header = re.fullmatch(r"## +(\S+)\s*", line)
        if not header:
            infra.die(f"{path}: {line.strip()!r} is not a section header: write '## PREFIX' (a "
                     "task, a scenario or a family), with a space")
        prefix = header.group(1)
        if prefix in sections:
            infra.die(f"{path} has the section '## {prefix}' twice")
        if not any(task.startswith(prefix) for task in tasks):
            infra.die(f"{path}: '## {prefix}' matches no task of the world")
        sections[prefix] = ""
    solution = {prefix: re.findall(loop.CODE_BLOCK, part, flags=re.S)
                for prefix, part in sections.items()}
    empty = [prefix for prefix, turns in solution.items() if prefix and not turns]
    if empty or not any(solution.values()):
        where = f"its section '## {empty[0]}'" if empty else "it"
        infra.die(f"{path}: {where} holds no ```python block: each block is one turn's code")
    return {prefix: turns for prefix, turns in solution.items() if turns}


def turns_for(solution, task_id, path):
    matches = [prefix for prefix in solution if task_id.startswith(prefix)]
    if not matches:
        infra.die(f"{path} has no turns for task {task_id!r}: add a '## {task_id}' section")
    return solution[max(matches, key=len)]


def play_solution(env, turns, cfg):
    """Each task's turns played through its world, one world at a time, as a rollout plays them:
    every block, however many (--eval-max-turns bounds a model's episodes, not these). Returns the
    episodes and, per task, the blocks that did not play because the world was done before them."""
    episodes, unplayed = [], {}
    for task_id, codes in turns.items():
        world = infra.Hosted(env, task_id, cfg.code_timeout, "loop-play")
        e = loop.Episode(task_id, world, transcript=list(world.messages()))
        for played, code in enumerate(codes):
            if world.done:  # the task was completed, or its world failed
                unplayed[task_id] = (played, len(codes) - played)
                break
            e.transcript.append({"role": "assistant", "content": f"```python\n{code}```"})
            e.transcript.append({"role": "user", "content": world.step(code)})
        loop.score_wave([e])
        episodes.append(e)
    return episodes, unplayed


def play_model(env, task_ids, cfg):
    model, tok = infra.load_model_and_tokenizer(cfg)
    chat = infra.chat_of(model, tok)
    envs = [infra.Hosted(env, task, cfg.code_timeout, "loop-play") for task in task_ids]
    with torch.autocast(infra.DEVICE.type, torch.bfloat16, enabled=cfg.bf16):
        return loop.rollout(model, chat, envs, task_ids, cfg, cfg.eval_temperature,
                            cfg.eval_max_turns, desc="play")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", action="append", help="a task id; repeatable (default: --split)")
    parser.add_argument("--solution", help="a file of code blocks to play instead of a model")
    args, settings = parser.parse_known_args(argv)
    cfg = loop.parse_config(settings)
    env = loop.environment(cfg.env)
    split_tasks = infra.tasks_of(env, cfg.split)
    known = split_tasks + infra.tasks_of(env, cfg.train_split)
    task_ids = args.task or split_tasks
    unknown = [task for task in task_ids if task not in known]
    if unknown:
        infra.die(f"no task {unknown[0]!r} in the {cfg.split} or {cfg.train_split} split")
    unplayed = {}
    if args.solution:
        solution = read_solution(args.solution, known)
        turns = {task: turns_for(solution, task, args.solution) for task in task_ids}
        episodes, unplayed = play_solution(env, turns, cfg)
    else:
        episodes = play_model(env, task_ids, cfg)
    for e in episodes:
        print(infra.transcript(e), end="")
        if e.task_id in unplayed:
            played, left = unplayed[e.task_id]
            print(f"(the world was done after turn {played}: {left} more block(s) did not play)")
        print(f"reward {e.reward:.2f}{', success' if e.success else ''}\n")
    full = sum(e.success for e in episodes)
    print(f"{full} of {len(episodes)} tasks earned the full reward")


if __name__ == "__main__":
    console.run(main)  # a closed pipe, a full stdout: as a Unix tool
