"""LOOP: Leave-One-Out PPO for LLM agents in stateful environments (arXiv 2502.01600), in one file.

The agent writes Python that calls app APIs over many turns; the whole episode is one token
sequence in which only the tokens the policy sampled are actions (the POMDP of paper §4.1).
Each iteration samples N tasks x K rollouts, scores them, turns returns into leave-one-out
advantages (Eq. 3) and takes PPO steps on a per-token clipped objective (Eq. 5): no critic,
no reference model, one copy of the LLM. After the settings (1), sections 2-6 are the algorithm
(ALGO LOGIC: read them first); 7-12 are infrastructure (loading, FSDP, the log-prob head, the
KV-cache pre-flight, checkpoints, the log); 13 is main. The worlds live beside this file:
tiny_world.py (its docstring is their interface) and appworld_env.py.

    python loop.py --tiny                      # a tiny model in a tiny world, minutes on a CPU
    python loop.py --eval --split test --tiny  # TGC/SGC only
"""
import argparse
import collections
import contextlib
import dataclasses
import functools
import glob
import importlib.util
import inspect
import itertools
import json
import math
import multiprocessing
import os
import pathlib
import random
import re
import shlex
import shutil
import sys
import threading
import time
import types
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from appworld_env import AppWorldEnv
from chat import Chat
from tiny_world import Hosted, TinyWorld


# 1. Settings: each field of Config is a flag with its help line; the world --env names
def setting(default, doc, at_least=None, at_most=None, choices=None):
    """A field with its one-line help and its rule, kept at run time (--help needs no source file).
    A number is finite, and > 0 unless at_least says otherwise."""
    rule = {"at_least": at_least, "at_most": at_most, "choices": choices}
    return dataclasses.field(default=default, metadata={"doc": doc, **rule})

@dataclasses.dataclass
class Config:
    # the run
    env: str = setting("appworld", "appworld, tiny (AppWorld in miniature), or your module:Class.")
    model: str = setting("Qwen/Qwen2.5-32B-Instruct", "Hugging Face model id or local directory.")
    seed: int = setting(0, "Seed for Python, torch and task sampling.", at_least=0,
                        at_most=2**32 - 1)
    out: str = setting("", "Run directory of metrics, transcripts, weights (default runs/<time>).")
    resume: str = setting("", "Run directory to continue from its last complete checkpoint.")
    iterations: int = setting(200, "Training iterations (reference code: 200); 0: evaluate only.",
                              at_least=0)
    train_split: str = setting("train", "Split the training tasks come from.")
    split: str = setting("test", "Split that evaluation reports TGC/SGC on.")
    eval: bool = setting(False, "Only evaluate `split`, no training.")
    eval_every: int = setting(10, "Iterations between evaluations (also at the first and last).")
    track: str = setting("", "Also log metrics to tensorboard, wandb, or both (tensorboard,wandb).")
    # the paper's hyper-parameters
    tasks_per_iteration: int = setting(40, "N: tasks sampled per iteration (paper: 40).")
    rollouts_per_task: int = setting(6, "K: rollouts per task, the leave-one-out group (paper: 6).",
                                     at_least=2)
    lr: float = setting(5e-5, "AdamW learning rate, constant (paper: 5e-5).")
    weight_decay: float = setting(0.01, "AdamW weight decay (reference code: 0.01).", at_least=0)
    grad_clip: float = setting(1.0, "Gradient-norm clip (paper: 1.0; reference code: 0.1).")
    epochs: int = setting(2, "Passes over an iteration's rollouts (paper: 2).")
    minibatch_size: int = setting(32, "Rollouts per optimiser step, across tasks (paper: 32).")
    clip_eps: float = setting(0.1, "Ratio clip [1/(1+eps), 1+eps] (paper: [1-eps, 1+eps]).")
    ratio: str = setting("token", "Importance ratio: token (Eq. 5), turn, trajectory, none (RLOO).",
                         choices=["token", "turn", "trajectory", "none"])
    normalize_rewards: bool = setting(False, "Divide each A by its group's std (RwNorm, not LOOP).")
    min_abs_advantage: float = setting(0.01, "Rollouts with |A| below this are dropped: no signal.",
                                       at_least=0)
    max_kl: float = setting(20.0, "Abandon an iteration at a minibatch whose |KL| is above this.")
    # rollouts
    max_turns: int = setting(40, "Turns per training episode (paper: 40).")
    eval_max_turns: int = setting(50, "Turns per evaluation episode (paper: 50).")
    max_new_tokens: int = setting(1500, "Tokens the policy may sample per turn (paper: 1500).")
    max_context: int = setting(32768, "Tokens an episode may hold: it ends at this cap.")
    max_obs_tokens: int = setting(3000, "Observations are cut at this many tokens, with a note.")
    code_timeout: float = setting(30.0, "Seconds the agent's code may run per turn (<= a day).",
                                  at_most=86400)
    temperature: float = setting(1.0, "Temperature of training rollouts, and of their scoring.")
    eval_temperature: float = setting(0.0, "Sampling temperature for evaluation (0 = greedy).",
                                      at_least=0)
    batch_episodes: int = setting(6, "Episodes played at once per rank (32B: 8.6 GB of KV each).")
    # systems: memory and GPUs
    micro_batch_size: int = setting(4, "Rollouts per forward/backward pass; gradients accumulate.")
    logprob_chunk: int = setting(512, "Positions per chunk of the update's vocabulary projection.")
    fsdp: bool = setting(False, "Shard weights, gradients and AdamW state (FSDP2, torchrun).")
    rollout_full_weights: bool = setting(False, "FSDP: keep layers gathered through a rollout.")
    bf16: bool = setting(False, "bf16 compute; weights, AdamW state stay fp32 (a LoRA base: bf16).")
    activation_checkpointing: bool = setting(False, "Recompute each decoder layer in backward.")
    lora: bool = setting(False, "Train the paper's LoRA (rank 16, alpha 32), not all the weights.")

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_CONFIG = os.path.join(HERE, "tiny_config.json")
RATIOS = Config.__dataclass_fields__["ratio"].metadata["choices"]  # LOOP, and the paper's variants
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb<0.19"}  # what to pip install
RANK, WORLD = 0, 1  # this process's rank and the number of ranks, set once by start_distributed
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # torchrun: LOCAL_RANK's

def die(message):
    """A mistake the user can fix: one line saying what to do, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)

def say(text):
    if RANK == 0:
        tqdm.write(text, file=sys.stderr)

def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

def mean(values):
    return sum(values) / len(values) if values else 0.0

def flag(name):
    return "--" + name.replace("_", "-")

def settings_parser(shown, where=""):
    """The command line; each setting's help shows its value in `shown` (after --tiny: tiny's).
    Its mistakes are one line that names `where` they were read (a config file)."""
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,  # --iteration: no
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)  # --help is read after --tiny and --config
    parser.error = lambda message: die(f"{where}{message} (see --help)")  # no usage lines
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit "
                        "(with the values the run would use: --tiny's, --config's, the flags')")
    parser.add_argument("--config", help="JSON file of settings (over --tiny's if both are given)")
    parser.add_argument("--tiny", action="store_true", help="the settings of tiny_config.json")
    for f in dataclasses.fields(Config):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {
            "type": checked(f)}
        value = shown[f.name]
        default = f" (default: {value})" if value != "" else ""
        parser.add_argument(flag(f.name), **kind, choices=f.metadata["choices"],
                            help=f.metadata["doc"] + default)
    return parser

def checked(f):
    """The type of a setting's flag: its text as the field's type, within the field's rule."""
    def convert(text):
        value = f.type(text)  # a ValueError is argparse's "invalid int value: 'x'"
        low, high = f.metadata["at_least"], f.metadata["at_most"]
        if f.type in (int, float) and low is None and not value > 0:
            raise argparse.ArgumentTypeError(f"must be {'>= 1' if f.type is int else '> 0'}, "
                                             f"got {text}")
        if low is not None and not value >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        if high is not None and not value <= high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {text}")
        if f.type is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        return value

    convert.__name__ = f.type.__name__
    return convert

def parse_config(argv):
    """Defaults <- tiny_config.json (--tiny) <- --config FILE (or the resumed run's) <- flags.
    A file's settings are read as the flags they name: one parser checks every layer."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    parser = settings_parser(defaults)
    args = parser.parse_args(argv)
    if args.resume and (args.tiny or args.config):
        die("--resume continues with the settings of the run it resumes: change them with flags")
    if args.resume and not os.path.isfile(os.path.join(args.resume, "config.json")):
        die(f"{args.resume} is not a run directory (it has no config.json): give the --out of "
            "the run to continue")
    files = [TINY_CONFIG] * args.tiny + [args.config] * bool(args.config)
    if args.resume:
        files = [os.path.join(args.resume, "config.json")]
    flags = [text for path in files for text in read_settings(path, defaults)]
    given = vars(parser.parse_args(flags + argv))  # the flags given come last: they win
    if args.help:
        shown = {k: v if given[k] is None else given[k] for k, v in defaults.items()}
        settings_parser(shown).print_help()
        sys.exit(0)
    if args.resume:
        check_resume(args, parser.parse_args(flags))
    cfg = Config(**{k: given[k] for k in Config.__annotations__ if given[k] is not None})
    check_config(cfg)
    return cfg

def check_resume(args, saved):
    """What a resume cannot change: the weights the checkpoint holds, where the run is, that it
    trains (an evaluation changes no run: --eval --model RUN/model)."""
    for key in ("model", "lora"):
        if getattr(args, key) not in (None, getattr(saved, key)):
            die(f"--{key} cannot change when resuming: {args.resume}'s checkpoint holds the "
                f"weights of {key} = {getattr(saved, key)!r}; start a new run for another")
    if args.out is not None and os.path.abspath(args.out) != os.path.abspath(args.resume):
        die(f"--out cannot change when resuming: the run goes on in {args.resume}")
    if saved.eval:
        die(f"{args.resume} is an evaluation, not a training run: there is nothing to resume")
    if args.eval:
        die(f"--eval does not resume a run: evaluate its model with --eval --model "
            f"{os.path.join(args.resume, 'model')}")

def read_settings(path, defaults):
    """A JSON object of settings as flags, each checked here, so that its mistake names the file
    and the key as written; a model directory is found beside the file."""
    try:
        values = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        die(f"cannot read config {path}: {e}")
    if not isinstance(values, dict):
        die(f"config {path} must hold one JSON object of settings")
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), str(values.get("model", "")))
    if "model" in values and os.path.isdir(beside):  # tiny_config.json's assets/tiny-model
        values["model"] = os.path.normpath(beside)
    flags = []
    for key, value in values.items():
        if key not in Config.__annotations__ or key == "resume":  # (--tiny, --config: flags)
            die(f"{key!r} in {path} is not a setting of a run (see --help)")
        if value is None:
            die(f"{key!r} in {path} is null: give it a value, or leave it out for the default")
        switch = Config.__annotations__[key] is bool
        if switch != isinstance(value, bool):  # a bool is a switch (--lora, --no-lora)
            kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
            kind = kind[Config.__annotations__[key]]
            die(f"{key!r} in {path} must be {kind}, not {json.dumps(value)}")
        text = (flag(key) if value else flag("no_" + key)) if switch else f"{flag(key)}={value}"
        settings_parser(defaults, f"{key!r} in {path}: ").parse_args([text])  # its own line
        flags.append(text)
    return flags

def check_config(cfg):
    """What no single flag's rule says, checked before any work starts."""
    environment(cfg.env)
    for name in filter(None, cfg.track.split(",")):
        if name not in TRACKERS:
            die(f"--track takes {' or '.join(TRACKERS)} or both (comma-separated), not {name!r}")
        if importlib.util.find_spec(name) is None:
            die(f"--track {name} needs its package: pip install '{TRACKERS[name]}'")

ENVS = {"tiny": TinyWorld, "appworld": AppWorldEnv}
REQUIRED = ["tasks", "messages", "step", "evaluate"]  # of an environment class: the interface

def environment(name):
    """The world class --env names: a built-in one (ENVS), or module:Class from a module that
    Python can import (a file module.py in the current directory too)."""
    if name in ENVS:
        return ENVS[name]
    module_name, _, class_name = name.partition(":")
    if not (module_name and class_name):
        die(f"--env takes {', '.join(ENVS)} or module:Class (your world), not {name!r}")
    if os.getcwd() not in sys.path:  # as `python -m` does; the workers inherit sys.path
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - not found, or its own error: one line either way
        die(f"--env {name}: cannot import {module_name}: {type(e).__name__}: {first_line(e)}")
    env = getattr(module, class_name, None)
    if not isinstance(env, type):
        die(f"--env {name}: {module_name} has no class {class_name}")
    missing = [member for member in REQUIRED if not callable(getattr(env, member, None))]
    if missing:
        die(f"--env {name}: {class_name} has no {', '.join(missing)} (the interface is in "
            "tiny_world.py's docstring)")
    return env

def tasks_of(env, split):
    """env.tasks(split), checked: a non-empty list of unique task ids, else one line."""
    name = env.__name__
    if not isinstance(inspect.getattr_static(env, "tasks"), (staticmethod, classmethod)):
        die(f"{name}.tasks(split) is called on the class: make it a @staticmethod")
    try:
        tasks = env.tasks(split)
    except ValueError as e:  # a split it does not have, a missing data root: it says which
        die(str(e))
    if not (isinstance(tasks, list) and tasks and all(isinstance(t, str) for t in tasks)):
        die(f"{name}.tasks({split!r}) must return a non-empty list of task ids (str), not "
            f"{str(tasks)[:60]}")
    if len(set(tasks)) < len(tasks):
        twice = next(t for t in tasks if tasks.count(t) > 1)
        die(f"{name}.tasks({split!r}) names task {twice!r} more than once")
    return tasks


# ============================== ALGO LOGIC: LOOP, read this first ===============================
# 2. Rollouts: the POMDP of paper §4.1. One token sequence per episode; `is_output` marks the
#    tokens the policy sampled (its actions, stop token included), the rest is context. The
#    episodes play in waves of --batch-episodes, each wave with its carried KV cache.
@dataclasses.dataclass(eq=False)
class Episode:
    task_id: str
    env: object
    ids: list = dataclasses.field(default_factory=list)
    is_output: list = dataclasses.field(default_factory=list)
    turn: list = dataclasses.field(default_factory=list)  # of each sampled token; -1: context
    transcript: list = dataclasses.field(default_factory=list)
    cap: int = sys.maxsize  # --max-context
    done: bool = False
    reward: float = 0.0
    success: bool = False
    checks: tuple = (0, 0)  # the world's tests: passed, total
    failed: bool = False  # the world died, hung or did not start: an infrastructure failure

    def add(self, ids, output=False, turn=-1):
        """ids join the episode as far as its context cap allows, the one place the cap is kept:
        an episode that reaches it is done, and no id ever lies beyond it."""
        ids = ids[:self.cap - len(self.ids)]
        self.ids += ids
        self.is_output += [output] * len(ids)
        self.turn += [turn] * len(ids)
        self.done = self.done or len(self.ids) >= self.cap

class WaveCache:
    """A wave's KV cache, carried across its turns, the one owner of what it holds: row i (its i-th
    live episode) holds the first fed[i] ids of the episode, in the columns `mask` marks (0:
    padding, tokens after a stop). A new one holds nothing: everything is fed."""

    def __init__(self):
        from transformers import DynamicCache
        self.kv = DynamicCache()
        self.mask = None
        self.fed = []
        self.episodes = []  # of its rows

    def lay_out(self, live):
        """Lay the cache out for the next turn of the `live` episodes, with no padding between an
        episode's tokens (a sliding window counts columns): each row keeps its first tokens,
        padded in front, and is fed as many ids as the widest new segment. Gone: ended episodes,
        padding, post-stop tokens, columns of others' synced passes."""
        cached, self.episodes = self.episodes, live
        if self.mask is None:  # nothing cached yet
            return
        rows = [cached.index(e) for e in live]
        lengths = [len(e.ids) for e in live]
        index = torch.tensor(rows, device=self.mask.device)
        widest = max(n - self.fed[i] for i, n in zip(rows, lengths))
        self.fed = [max(0, n - widest) for n in lengths]
        fed = torch.tensor(self.fed, device=index.device)[:, None]
        kept = self.mask[index] * (self.mask[index].cumsum(1) <= fed)  # each row's first fed
        # a stable sort puts the other columns first, then the kept ones in their order
        columns = kept.argsort(dim=1, stable=True)[:, kept.shape[1] - max(self.fed):]
        self.mask = kept.gather(1, columns)
        for layer in self.kv.layers:  # [rows, heads, columns, dim]
            layer.keys = layer.keys[index[:, None], :, columns].transpose(1, 2)
            layer.values = layer.values[index[:, None], :, columns].transpose(1, 2)

    def inputs(self, prompts, pad):
        """What generation is fed: each row's ids past the cached ones, padded in front so that all
        rows end at the last column, after the cached columns."""
        new = [p[n:] for p, n in zip(prompts, self.fed or [0] * len(prompts))]
        width = max(map(len, new))
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in new], device=DEVICE)
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in new], device=DEVICE)
        if self.mask is None:
            return ids, attn
        return torch.cat([torch.full_like(self.mask, pad), ids], 1), torch.cat([self.mask, attn], 1)

    def grew(self, attn, prompts, rows, n):
        """After generation of `n` columns (`rows`, cut at their stops): the cache holds every
        column but the last one sampled (and strays lay_out() drops)."""
        sampled = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows], device=DEVICE)
        self.mask = torch.cat([attn, sampled[:, :n - 1]], 1)
        self.fed = [len(p) + min(len(r), n - 1) for p, r in zip(prompts, rows)]

@torch.no_grad()
def generate(model, chat, prompts, temperature, max_new_tokens, cache=None):
    """Sample one turn for a batch of episodes: each one's ids, cut after the first stop token.
    Only what `cache` lacks is fed: with a wave's cache, the last token and the observation."""
    from transformers import GenerationConfig
    cache = cache or WaveCache()
    ids, attn = cache.inputs(prompts, chat.tok.pad_token_id)
    sampling = {}  # greedy at T = 0, else the plain softmax at T: what the update scores
    if temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    config = GenerationConfig(**sampling, max_new_tokens=max_new_tokens,
                              eos_token_id=chat.stop_ids, pad_token_id=chat.tok.pad_token_id)
    # synced: under FSDP a rank that is done keeps joining the others' forward passes
    out = model.generate(input_ids=ids, attention_mask=attn, generation_config=config,
                         cache=cache.kv, synced_gpus=WORLD > 1)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        stops = [i for i, t in enumerate(row) if t in chat.stop_ids]
        rows.append(row[:stops[0] + 1] if stops else row)
    cache.grew(attn, prompts, rows, out.shape[1] - ids.shape[1])
    return rows

def rollout(model, chat, envs, task_ids, cfg, temperature, max_turns, desc="rollout",
            carry_cache=True):
    """The POMDP (§4.1), a wave of batch_episodes at a time, so that one wave's KV cache and
    worlds exist at a time. Each turn, one batched generation for the wave's live episodes, then
    their code runs in their worlds; a wave that ended is scored and the next begins. Every rank
    runs as many generations as the busiest one (FSDP's collectives match), with a dummy if it
    has no episode left. carry_cache=False re-prefills every turn (a reference for tests)."""
    model.eval()
    pairs = list(zip(envs, task_ids))
    waves = [pairs[s:s + cfg.batch_episodes] for s in range(0, len(pairs), cfg.batch_episodes)]
    episodes, wave, cache, turn = [], [], WaveCache(), 0  # (a rank with no task plays dummies)
    bar = tqdm(desc=desc, leave=False, disable=True if RANK else None)
    try:
        with layers_gathered(model, cfg.rollout_full_weights):
            while True:
                while waves and all(e.done for e in wave):  # the wave ended: the next begins
                    score_wave(wave)
                    wave = start_wave(waves.pop(0), chat, cfg)
                    episodes += wave
                    cache, turn = WaveCache(), 0
                live = [e for e in wave if not e.done]
                if not all_reduce([len(live)], dist.ReduceOp.MAX)[0]:
                    break
                carried = cache if carry_cache and live else WaveCache()
                play_turn(model, chat, live, carried, temperature, turn, max_turns, cfg)
                turn += 1
                bar.update()
            score_wave(wave)
    except BaseException:  # Ctrl-C, CUDA out of memory: no world outlives the rollout
        for env in envs:
            getattr(env, "close", lambda: None)()
        raise
    bar.close()
    return episodes

def play_turn(model, chat, live, cache, temperature, turn, max_turns, cfg):
    """One turn of the live episodes: the policy acts, the worlds run its code, observations."""
    cache.lay_out(live)
    # no episode can take more than its room below the cap (add() cuts the others)
    room = max((cfg.max_context - len(e.ids) for e in live), default=1)
    prompts = [e.ids for e in live] or [[chat.eot]]  # nothing left: a dummy joins in
    outputs = generate(model, chat, prompts, temperature, min(cfg.max_new_tokens, room), cache)
    codes = [act(e, new, turn, chat) for e, new in zip(live, outputs)]
    results = concurrently([functools.partial(e.env.step, c) for e, c in zip(live, codes)])
    for e, output in zip(live, results):
        observe(e, output, turn == max_turns - 1, chat, cfg)

def start_wave(pairs, chat, cfg):
    """A wave's worlds start together (their messages()); an episode opens with the prompt."""
    wave = []
    for (env, task_id), messages in zip(pairs, concurrently([env.messages for env, _ in pairs])):
        e = Episode(task_id, env, transcript=list(messages), done=getattr(env, "done", False),
                    cap=cfg.max_context)  # (done already if its world failed to start)
        prompt = chat.prompt(messages)
        if len(prompt) >= cfg.max_context and not e.done:
            die(f"the prompt of task {task_id} is {len(prompt)} tokens, and --max-context "
                f"{cfg.max_context} leaves the agent no room to act: give a larger --max-context")
        e.add(prompt)
        wave.append(e)
    return wave

def score_wave(wave):
    """A finished wave's worlds are evaluated together: reward = tests passed / tests."""
    for e, result in zip(wave, concurrently([e.env.evaluate for e in wave])):
        e.failed = result is None  # the world broke: no reward, not even 0
        passed, total = e.checks = result or (0, 1)
        e.reward = passed / total
        e.success = passed == total

def act(e, new, turn, chat):
    """The sampled turn joins the episode as actions; returns the code in what joined."""
    start = len(e.ids)
    e.add(new, output=True, turn=turn)
    # whole turns: characters stay intact; read as the template renders it, after its <think>
    text = chat.reply_start + chat.tok.decode(e.ids[start:], skip_special_tokens=True)
    e.transcript.append({"role": "assistant", "content": text})
    return extract_code(text)

def extract_code(text):
    """All ```python / ```py blocks joined; an unterminated last block counts; no block -> "".
    A reasoning model's drafts do not run: only the text after its reasoning block counts."""
    text = text.rsplit("</think>", 1)[-1]  # (the <think> may be in the generation prompt)
    text = text.split("<think>", 1)[0]  # reasoning cut off by the token limit: no answer yet
    return "\n".join(b.rstrip() for b in re.findall(CODE_BLOCK, text, flags=re.S))

CODE_BLOCK = r"```(?:python|py)[ \t]*\n(.*?)(?:```|$)"  # a final unterminated block counts

def observe(e, output, last_turn, chat, cfg):
    """The environment's output joins the episode as context, between the template's separators."""
    observation = chat.truncate(output, cfg.max_obs_tokens)
    e.transcript.append({"role": "user", "content": observation})
    e.done = e.done or getattr(e.env, "done", False) or last_turn
    if not e.done:
        closing = [] if e.ids[-1] == chat.eot else [chat.eot]  # a turn cut at max_new_tokens
        e.add(closing + chat.observation(observation))

def concurrently(calls):
    """The calls run at once, each with its own deadline, so a hung world holds up no other; their
    threads are daemons, so an interrupt reaches the caller at once."""
    results, errors = [None] * len(calls), []

    def call(i):
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results

def stop_if_every_world_failed(episodes, what):
    """A run whose every world fails would train on nothing for hours: it stops, exit code 1, with
    the first world's own error and what to do."""
    errors = [getattr(e.env, "error", None) or "its world failed" for e in episodes if e.failed]
    counts = all_reduce([len(episodes), len(errors)])
    if not counts[0] or counts[1] < counts[0]:
        return
    if WORLD > 1:
        parts = [None] * WORLD
        dist.all_gather_object(parts, errors[:1])
        errors = [error for part in parts for error in part]
    hint = "check the world with tools/play.py --solution"
    if "worker process ended" in errors[0]:  # a forker's script reran in every worker, say
        hint = ("a script that registers a world runs loop.main() under "
                "`if __name__ == \"__main__\":`")
    raise WorldsFailed(f"every world failed in {what} ({int(counts[0])} episodes); the first: "
                       f"{errors[0]}: {hint}")

class WorldsFailed(Exception):
    """Every world of an iteration or an evaluation failed: the run stops (main says why)."""


# 3. Leave-one-out advantages (Eq. 3)
def loo_advantages(rewards, normalize=False, valid=None):
    """rewards [N, K] -> A_k = R_k - mean_{i!=k} R_i = K/(K-1) (R_k - mean R), no std division.
    `valid` [N, K] marks the rollouts whose world did not fail: a failed one leaves its group,
    whose K' others keep the exact leave-one-out advantage over themselves. NaN (no advantage)
    for a failed rollout and for every rollout of a group with fewer than 2 left."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    k = valid.sum(1, keepdim=True)
    mean = torch.where(valid, rewards, 0.0).sum(1, keepdim=True) / k.clamp(min=1)
    adv = k / (k - 1).clamp(min=1) * (rewards - mean)  # Eq. 3 over the group's K'
    if normalize:  # the paper's RwNorm ablation, as the reference code computes it; not LOOP
        variance = torch.where(valid, rewards - mean, 0.0).square().sum(1, keepdim=True)
        adv = adv / (variance / k.clamp(min=1)).sqrt().clamp(min=1e-7)  # population std
    return torch.where(valid & (k >= 2), adv, math.nan)


# 4. The clipped objective (Eq. 5) and its per-turn, per-trajectory, on-policy variants
LOG_RATIO_BOUND = 40.0  # |log r| past this: no gradient (exp(40) x 3k tokens stays finite)

def loop_loss(logp, old_logp, adv, mask, turn, ratio="token", eps=0.1):
    """Per-rollout loss (to minimise) and number of clipped (or bounded) tokens. logp, old_logp,
    mask, turn: [B, T] over target tokens; adv: [B]. Each rollout's loss is the mean over its own
    output tokens (a(x) = mask) of -min(r A, clip(r, 1/(1+eps), 1+eps) A)."""
    mask = mask.to(logp.dtype)
    n = mask.sum(1).clamp(min=1)
    a = adv[:, None]
    if ratio == "none":  # on-policy RLOO: -A * mean log p
        return -(adv * (logp * mask).sum(1) / n), torch.zeros((), device=logp.device)
    log_r = (logp - old_logp) * mask
    if ratio == "turn":  # one ratio per assistant turn, shared by that turn's tokens
        turns = int(turn.max().clamp(min=0)) + 1  # (an empty pass has no turn at all)
        onehot = F.one_hot(turn.clamp(min=0), turns) * mask[..., None]
        per_turn = torch.einsum("bt,btj->bj", log_r, onehot)
        log_r = torch.einsum("bj,btj->bt", per_turn, onehot)
    elif ratio == "trajectory":  # one ratio per rollout: prod_t r_t
        log_r = log_r.sum(1, keepdim=True).expand_as(mask)
    # log r bounded before exp (exp is inf past 88 in float32: an inf loss for A < 0, NaN for
    # A = 0 and in backward); within the bound the clip below decides, as in Eq. 5
    bounded = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    r = torch.exp(bounded)
    clipped = torch.clamp(r, 1 / (1 + eps), 1 + eps)
    objective = torch.minimum(r * a, clipped * a)  # Eq. 5
    n_clipped = (((bounded != log_r) | ((clipped * a) < (r * a))) & mask.bool()).sum()
    return -(objective * mask).sum(1) / n, n_clipped


# 5. The update: PPO epochs of minibatches on an iteration's rollouts; one LOOP iteration
def update(model, opt, episodes, advantages, cfg):
    """PPO epochs over the iteration's rollouts. Under FSDP a minibatch spans the ranks (each takes
    its share of its own rollouts), each running as many passes (empty ones) as the busiest."""
    # a rollout without a leave-one-out group (NaN: its world failed) has no advantage at all
    used = [i for i, a in enumerate(advantages.tolist())
            if not math.isnan(a) and abs(a) >= cfg.min_abs_advantage]
    counts = all_reduce([len(used) * (r == RANK) for r in range(WORLD)])  # used, per rank
    stats = {"rollouts_used": int(sum(counts)), "steps": 0, "skipped_nan": 0, "abandoned": False,
             "kl": 0.0, "clip_fraction": 0.0, "loss": 0.0, "grad_norm": 0.0}
    if not sum(counts):
        return stats
    old = old_logprobs(model, episodes, used, counts, cfg)
    model.train()
    params = [p for group in opt.param_groups for p in group["params"]]  # FSDP's sharded ones
    kls, losses, norms = [], [], []
    clipped = outputs = 0
    for _ in range(cfg.epochs):
        order = random.sample(used, len(used))
        for chunks, size in minibatches(order, counts, cfg):
            opt.zero_grad(set_to_none=True)
            loss_sum, kl_sum, n_clipped, n_outputs = minibatch_backward(
                model, episodes, chunks, old, advantages, cfg)
            kls.append(kl_sum / size)
            if abs(kls[-1]) > cfg.max_kl:  # the policy moved too far: stop using these rollouts
                opt.zero_grad(set_to_none=True)
                stats["abandoned"] = True
                break
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            if hasattr(norm, "full_tensor"):  # a DTensor under FSDP: the same on every rank
                norm = norm.full_tensor()
            # nothing not finite moves a weight (a finite loss can have a NaN gradient: 0 x inf)
            if not math.isfinite(loss_sum) or not math.isfinite(norm.item()):
                opt.zero_grad(set_to_none=True)
                stats["skipped_nan"] += 1
                continue
            norms.append(norm.item())
            opt.step()
            stats["steps"] += 1
            losses.append(loss_sum / cfg.minibatch_size)
            clipped += n_clipped
            outputs += n_outputs
        if stats["abandoned"]:
            break
    stats.update(kl=mean(kls), clip_fraction=clipped / max(outputs, 1), loss=mean(losses),
                 grad_norm=mean(norms))
    return stats

def minibatches(order, counts, cfg):
    """Each minibatch as this rank's micro-batches and the minibatch's size on all ranks. Under
    FSDP a minibatch spans the ranks, each taking its share from its own rollouts (`counts`: every
    rank's), and every rank runs as many minibatches and passes as the busiest (empty ones)."""
    share = math.ceil(cfg.minibatch_size / WORLD)
    for j in range(max(math.ceil(n / share) for n in counts)):
        sizes = [min(share, max(0, n - j * share)) for n in counts]
        mine = order[j * share:(j + 1) * share]
        yield micro_batches(mine, sizes, cfg.micro_batch_size), sum(sizes)

def micro_batches(indices, sizes, size):
    """This rank's `indices` in slices of `size`, as many as the rank with the most (`sizes`: the
    count of every rank) needs, so that all ranks run the same passes; the last may be empty."""
    n = max(math.ceil(k / size) for k in sizes)
    return [indices[j * size:(j + 1) * size] for j in range(n)]

@torch.no_grad()
def old_logprobs(model, episodes, used, counts, cfg):
    """log p_psi of each used rollout's tokens, from the model about to be updated, right before
    the update, at the sampling temperature (reference code: recompute_rollout_probs)."""
    model.eval()
    old = {}
    for chunk in micro_batches(used, counts, cfg.micro_batch_size):
        ids, attn, _, _ = pad_batch([episodes[i] for i in chunk])
        for i, logp in zip(chunk, token_logprobs(model, ids, attn, cfg.temperature)):
            old[i] = logp[:len(episodes[i].ids) - 1]
    return old

def minibatch_backward(model, episodes, chunks, old, advantages, cfg):
    """Accumulate one minibatch's gradient over its micro-batches; returns the sums over ranks
    of [loss, KL estimate, clipped tokens, output tokens]."""
    totals = [0.0, 0.0, 0, 0]
    for chunk in chunks:
        ids, attn, is_output, turn = pad_batch([episodes[i] for i in chunk])
        logp = token_logprobs(model, ids, attn, cfg.temperature)
        old_logp, adv = logp.detach(), torch.zeros(1, device=DEVICE)  # an empty pass's: no action
        if chunk:
            old_logp = torch.nn.utils.rnn.pad_sequence([old[i] for i in chunk], batch_first=True)
            adv = advantages[chunk].to(DEVICE)
        mask = is_output[:, 1:] & attn[:, 1:].bool()  # targets x_1.. that the policy sampled
        per_rollout, n_clipped = loop_loss(logp, old_logp, adv, mask, turn[:, 1:], cfg.ratio,
                                           cfg.clip_eps)
        # sum over rollouts / minibatch size; x world because FSDP averages gradients over ranks
        (per_rollout.sum() * WORLD / cfg.minibatch_size).backward()
        kl = -((logp - old_logp) * mask).sum()
        step = [per_rollout.sum().item(), kl.item(), n_clipped.item(), mask.sum().item()]
        totals = [a + b for a, b in zip(totals, step)]
    return all_reduce(totals)

NO_OUTPUT = Episode("", None, ids=[0, 0], is_output=[False, False], turn=[-1, -1])

def pad_batch(episodes):
    """ids, attention mask, is_output and turn of the episodes, right-padded to one width. None (a
    rank's empty pass, joining the others' collectives under FSDP) is a row with no action."""
    episodes = episodes or [NO_OUTPUT]
    width = max(len(e.ids) for e in episodes)

    def pad(rows, value):
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], device=DEVICE)

    return (pad([e.ids for e in episodes], 0), pad([[1] * len(e.ids) for e in episodes], 0),
            pad([e.is_output for e in episodes], False), pad([e.turn for e in episodes], -1))

def token_logprobs(model, ids, attn, temperature):
    """log p(x_t | x_<t) of each next token [B, T-1] at the sampling temperature. The model's LM
    head is section 9's log-prob head (chunked_logprob_head): while head.scoring is set,
    `.logits` holds log p(target) per position, computed in chunks: no [tokens x vocab] tensor."""
    head = model.get_output_embeddings()
    # forward would cap what the head returns, log p: the head caps the logits instead
    config = model.config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        config.final_logit_softcapping = None
    head.scoring = (ids[:, 1:], max(temperature, 1e-6), softcap)
    try:
        return model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    finally:
        head.scoring = None
        if softcap:
            config.final_logit_softcapping = softcap

def train_iteration(model, opt, chat, cfg, train_tasks, iteration):
    """N tasks x K rollouts -> leave-one-out advantages -> PPO epochs; returns the metrics row."""
    started = time.time()
    # seeded per iteration: a resumed run samples what the unbroken run would have
    seed = cfg.seed * 10**6 + iteration * 1000
    random.seed(seed + RANK)
    torch.manual_seed(seed + RANK)
    n_tasks = min(cfg.tasks_per_iteration, len(train_tasks))
    tasks = random.Random(seed).sample(train_tasks, n_tasks)[RANK::WORLD]
    k = cfg.rollouts_per_task
    task_ids = [task for task in tasks for _ in range(k)]  # a task's K rollouts share a rank
    env = environment(cfg.env)
    # the K worlds of a task save their outputs apart
    envs = [Hosted(env, task, cfg.code_timeout, f"loop-train-rollout{i % k}")
            for i, task in enumerate(task_ids)]
    episodes = rollout(model, chat, envs, task_ids, cfg, cfg.temperature, cfg.max_turns)
    stop_if_every_world_failed(episodes, f"iteration {iteration}")
    rewards = torch.tensor([e.reward for e in episodes]).view(len(tasks), k)
    valid = torch.tensor([not e.failed for e in episodes], dtype=torch.bool).view(len(tasks), k)
    advantages = loo_advantages(rewards, cfg.normalize_rewards, valid).flatten()
    stats = update(model, opt, episodes, advantages, cfg)
    sums = collections.Counter(reward=(rewards * valid).sum().item())  # this rank's, then all
    for e in episodes:
        looked, erred, recovered = habits(e, env)
        sums.update(episodes=1, failures=e.failed, success=e.success, turns=1 + max(e.turn),
                    tokens=len(e.ids), looked=looked, erred=erred, recovered=recovered)
    keys = ["episodes", "failures", "reward", "success", "turns", "tokens", "looked", "erred",
            "recovered"]
    t = dict(zip(keys, all_reduce([sums[key] for key in keys])))
    n, scored = t["episodes"], max(t["episodes"] - t["failures"], 1)  # scored: worlds held up
    # behaviour shares where the environment says what they count
    shares = {"looked_first": t["looked"] / n} if hasattr(env, "DOCS_CALL") else {}
    if hasattr(env, "ERROR_PREFIX"):
        shares.update(error_rate=t["erred"] / n, recovered=t["recovered"] / max(t["erred"], 1))
    return {"iteration": iteration, "reward_mean": t["reward"] / scored,
            "success_rate": t["success"] / scored, "turns_mean": t["turns"] / n,
            "tokens_mean": t["tokens"] / n, "env_failures": int(t["failures"]), **shares, **stats,
            "seconds": round(time.time() - started, 2)}


# 6. Evaluation: TGC = tasks whose tests all pass, SGC = scenarios all of whose tasks pass
def scenario(task_id):
    """A task's scenario: its id up to "_" (the environment interface's "<scenario>_<n>")."""
    return task_id.split("_")[0]

def goal_completion(results):
    """results: (task_id, success, reward) per task -> TGC, SGC and the mean reward."""
    by_scenario = {}
    for task_id, success, _ in results:
        by_scenario.setdefault(scenario(task_id), []).append(success)
    return {"tgc": mean([success for _, success, _ in results]),
            "sgc": mean([all(tasks) for tasks in by_scenario.values()]),
            "reward_mean": mean([reward for _, _, reward in results]),
            "tasks": len(results),
            "per_task": {task_id: success for task_id, success, _ in results}}

def evaluate(model, chat, cfg, split, iteration, run_dir):
    """One episode per task of `split`: the metrics row; 3 of the episodes to transcripts/."""
    started = time.time()
    env = environment(cfg.env)
    tasks = tasks_of(env, split)[RANK::WORLD]  # each rank plays its share; rank 0 gathers them
    experiment = f"loop-{os.path.basename(os.path.abspath(run_dir))}-{split}-iter{iteration:04d}"
    envs = [Hosted(env, t, cfg.code_timeout, experiment) for t in tasks]
    episodes = rollout(model, chat, envs, tasks, cfg, cfg.eval_temperature, cfg.eval_max_turns,
                       desc=f"eval {split}")
    stop_if_every_world_failed(episodes, f"the evaluation of {split}")
    results = [(e.task_id, e.success, e.reward) for e in episodes]
    if WORLD > 1:
        parts = [None] * WORLD
        dist.all_gather_object(parts, results)
        results = [r for part in parts for r in part]
    failures = all_reduce([sum(e.failed for e in episodes)])[0]  # counted as not completed
    row = {"iteration": iteration, "split": split, **goal_completion(results),
           "env_failures": int(failures), "seconds": round(time.time() - started, 2)}
    if cfg.env == "appworld":  # `appworld evaluate <experiment> <split>` reports the same numbers
        row["appworld_experiment"] = experiment
    if RANK == 0:  # the first episode of 3 scenarios spread over the split, the same each time
        first = {}  # (a split's first tasks may all be of a kind solved before any training)
        for e in episodes:
            first.setdefault(scenario(e.task_id), e)
        firsts = list(first.values())
        shown = [firsts[i * len(firsts) // 3] for i in range(min(3, len(firsts)))]
        os.makedirs(os.path.join(run_dir, "transcripts"), exist_ok=True)
        path = os.path.join(run_dir, "transcripts", f"{split}_iter{iteration:04d}.txt")
        pathlib.Path(path).write_text("".join(map(transcript, shown)))
    return row

def transcript(e):
    """An episode as text: its task, the checks it passed, then every message."""
    failed = " (the world failed)" if e.failed else ""
    head = f"=== {e.task_id}: {e.checks[0]} of {e.checks[1]} checks passed{failed}\n"
    return head + "".join(f"--- {m['role']}\n{m['content']}\n" for m in e.transcript) + "\n"

def habits(e, env):
    """Habits RL changes (§5), read from an episode's transcript where the environment names them:
    its first code reads the docs (env.DOCS_CALL); it met an error (env.ERROR_PREFIX); it erred and
    still succeeded."""
    replies = [m["content"] for m in e.transcript if m["role"] == "assistant"]
    observations = [b["content"] for a, b in zip(e.transcript, e.transcript[1:])
                    if a["role"] == "assistant"]
    docs, error = getattr(env, "DOCS_CALL", None), getattr(env, "ERROR_PREFIX", None)
    looked = docs is not None and bool(replies) and docs in extract_code(replies[0])
    erred = error is not None and any(text.startswith(error) for text in observations)
    return looked, erred, erred and e.success


# ================ INFRASTRUCTURE: models, GPUs, files; no need to read it for LOOP ================
# 7. Loading: a local directory or a hub id, bf16, LoRA
MODEL_FILES = {"config.json": ["config.json", "adapter_config.json"],  # (a LoRA adapter's)
               "weights (*.safetensors)": ["*.safetensors", "*.bin"],
               "tokenizer (tokenizer.json)": ["tokenizer.json", "tokenizer.model", "vocab.json"]}

def load_pretrained(cfg):
    """A local directory (a run's model/ too) or a Hugging Face id, from the cache, else the hub.
    A model that cannot load stops the run with one line that says why."""
    from huggingface_hub import errors, snapshot_download
    path = os.path.expanduser(cfg.model)
    if os.path.exists(os.path.join(path, "metrics.jsonl")):  # `--model runs/x`
        die(f"{cfg.model} is a run directory: its trained model is {os.path.join(path, 'model')}")
    missing = [what for what, patterns in MODEL_FILES.items()
               if os.path.isdir(path) and not any(glob.glob(p, root_dir=path) for p in patterns)]
    if missing:
        die(f"{cfg.model} holds no model: it has no {', no '.join(missing)}")
    try:
        if not os.path.isdir(path):  # by id, from_pretrained would ask the hub about every file
            try:
                path = snapshot_download(cfg.model, local_files_only=True)
            except errors.LocalEntryNotFoundError:  # not in the cache: download it
                path = snapshot_download(cfg.model)
        return from_pretrained(path, cfg)
    except errors.HFValidationError:  # not of the form name or owner/name
        die(f"there is no directory {cfg.model}: give a model directory or a Hugging Face id")
    except errors.RepositoryNotFoundError:
        die(f"model {cfg.model} does not exist, here or on the hub (a private one: hf auth login)")
    except errors.LocalEntryNotFoundError as e:  # offline, no DNS, a proxy: its text says which
        die(f"model {cfg.model} is not in the local Hugging Face cache, and the hub cannot be "
            f"reached ({first_line(e)}): `hf download {cfg.model}` where there is internet")
    except (OSError, ValueError) as e:  # a directory with no model, a gated or broken download
        die(f"cannot load model {cfg.model}: {first_line(e)}")

def from_pretrained(path, cfg):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import PreTrainedTokenizerFast
    # AutoTokenizer gives a qwen2 (or phi3) model that family's pre-tokenizer, whatever its
    # tokenizer.json says: one saved as TokenizersBackend (the tiny model's) loads as itself
    saved = pathlib.Path(path, "tokenizer_config.json")
    saved_class = saved.exists() and json.loads(saved.read_text()).get("tokenizer_class")
    tokenizer = PreTrainedTokenizerFast if saved_class == "TokenizersBackend" else AutoTokenizer
    tok = tokenizer.from_pretrained(path, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32  # on the host: half the memory per rank
    if cfg.fsdp and RANK > 0:  # rank 0 alone reads the weights, then sends the shards
        adapter = pathlib.Path(path, "adapter_config.json")  # a LoRA run's model/: no config.json
        base = path
        if adapter.exists():
            base = json.loads(adapter.read_text())["base_model_name_or_path"]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), dtype=dtype)
        if adapter.exists():  # rank 0's LoRA layers (their small weights are read again here)
            model.load_adapter(path)
        return model, tok
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), tok

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

def load_model_and_tokenizer(cfg):
    from transformers import GenerationConfig
    torch.manual_seed(cfg.seed)  # every rank and process initialises the same LoRA adapter
    model, tok = load_pretrained(cfg)
    eos = [model.generation_config.eos_token_id]
    if cfg.fsdp:  # a rank with a meta model read no generation_config.json
        dist.broadcast_object_list(eos)
    # only the stop ids: hub defaults (top-k, top-p, penalties) are not what the update scores
    model.generation_config = GenerationConfig(eos_token_id=eos[0])
    chunked_logprob_head(model.get_output_embeddings(), cfg.logprob_chunk)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer_names = set(model._no_split_modules)  # the decoder layer class: the unit FSDP shards by
    if cfg.lora:
        from peft import LoraConfig, get_peft_model
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
        with warnings.catch_warnings():  # peft reads a property transformers 5 deprecates
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
            model = get_peft_model(model, lora)
        # the saved adapter names its base so that it loads anywhere: the id, or an absolute path
        path = os.path.expanduser(cfg.model)
        base = os.path.abspath(path) if os.path.isdir(path) else cfg.model
        model.peft_config["default"].base_model_name_or_path = base
    if cfg.fsdp:
        shard(model, cfg, layer_names)
    model = model.to(DEVICE)
    return (model if cfg.lora else model.float()), tok

def chat_of(model, tok):
    """The model's Chat, which also stops on generation_config's eos ids; a template that cannot
    serve stops the run with one line that says why."""
    try:
        chat = Chat(tok, model.generation_config.eos_token_id)
    except ValueError as e:  # no template, or one whose turns never end
        die(str(e))
    if chat.fold_system:  # Gemma 2: "System role not supported"
        say("note: the chat template rejects a system message: its text starts the first user one")
    return chat


# 8. FSDP2: every rank holds 1/G of each tensor, and runs the same collectives
def start_distributed():
    global RANK, WORLD
    if "RANK" not in os.environ:
        die("--fsdp runs under torchrun: torchrun --nproc_per_node G loop.py --fsdp ...")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()

def all_reduce(values, op=dist.ReduceOp.SUM):
    """Sum (or max) a list of numbers over the ranks; unchanged in one process."""
    if WORLD == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op)
    return t.tolist()

def shard(model, cfg, layer_names):
    """FSDP2: each rank keeps 1/G of every tensor; a decoder layer is gathered only to compute.
    Rank 0 sends each rank its shards of the weights it read (the others are on the meta device):
    the host holds the model once, not once per rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    weights = model.state_dict() if RANK == 0 else {}
    policy = MixedPrecisionPolicy()
    if cfg.bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module, mp_policy=policy)
    # the root is the HF model inside peft's wrapper: generate() calls it without the wrapper
    fully_shard(model.get_base_model() if cfg.lora else model, mp_policy=policy)
    # memory in place: tied weights (embedding and head) stay one tensor, which loading into meta
    # parameters would split
    if RANK > 0:
        model.to_empty(device=DEVICE)
    else:
        model.to(DEVICE)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)
    for buffer in model.buffers():  # buffers in no state dict (RoPE's inv_freq): rank 0's
        dist.broadcast(buffer, src=0)

@contextlib.contextmanager
def layers_gathered(model, gathered):
    """--rollout-full-weights: FSDP's layers stay gathered from their first forward to the end of
    the rollout (no all-gather per sampled token, more memory), then are sharded for the update."""
    from torch.distributed.fsdp import FSDPModule
    layers = []  # the FSDP modules but the root, which FSDP keeps gathered after its forward
    if gathered:
        layers = [m for m in model.modules() if isinstance(m, FSDPModule)][1:]
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    yield
    for layer in layers:  # (reshard() is not recursive)
        layer.reshard()
        layer.set_reshard_after_forward(True, recurse=False)


# 9. The log-prob head that token_logprobs (section 5) turns on: log p(target) without the logits
def chunked_logprob_head(head, chunk):
    """While `head.scoring` is (targets, temperature, softcap), the LM head returns log p(target)
    per position, `chunk` positions at a time, each recomputed in backward: the [tokens x vocab]
    logits (19 GB for 32k tokens of Qwen's vocabulary) never exist. FSDP has the head gathered."""
    head.scoring = None
    head.chunk = chunk
    head.forward = types.MethodType(logprob_head_forward, head)  # a bound method survives deepcopy

def logprob_head_forward(self, hidden):
    if self.scoring is None:
        return F.linear(hidden, self.weight, self.bias)
    targets, temperature, softcap = self.scoring
    hidden = hidden[:, :targets.shape[1]].reshape(targets.numel(), -1)
    pieces = []
    for s in range(0, targets.numel(), self.chunk):
        piece = torch.utils.checkpoint.checkpoint(
            logprob_piece, hidden[s:s + self.chunk], self.weight, self.bias,
            targets.reshape(-1)[s:s + self.chunk], temperature, softcap, use_reentrant=False)
        pieces.append(piece)
    # a copy, not a view: FSDP warns that an in-place op on its root's view output skips a hook
    return torch.cat(pieces).view(targets.shape).clone()

def logprob_piece(hidden, weight, bias, targets, temperature, softcap):
    logits = F.linear(hidden, weight, bias).float()
    if softcap:  # Gemma 2's cap on the logits that generation samples from
        logits = softcap * torch.tanh(logits / softcap)
    logits.div_(temperature)  # in place: one [chunk x vocab] tensor less
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


# 10. The KV-cache pre-flight: a wave that cannot fit the GPU stops the run before it starts
def check_kv_cache(cfg, model, wave):
    """Stop before the first rollout if a wave's KV cache, every episode at the context cap, would
    not fit in the GPU's free memory: a line that says what to set, not an out-of-memory error."""
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype_bytes = 2 if cfg.bf16 else 4
    per_token = 2 * text.num_hidden_layers * heads * head_dim * dtype_bytes  # K and V
    free = torch.cuda.mem_get_info()[0]
    if cfg.rollout_full_weights:  # every layer stays gathered while sampling
        free -= sum(p.numel() for p in model.parameters()) * dtype_bytes
    fit = max(free, 0) // (per_token * cfg.max_context)
    if wave > fit:
        need = wave * per_token * cfg.max_context / 2**30
        context = max(free, 0) // (per_token * wave)  # the cap at which the whole wave fits
        room = f"--batch-episodes {fit}" if fit else f"--max-context {context}"
        die(f"a wave of {wave} episodes of up to {cfg.max_context} tokens needs {need:.1f} GiB of "
            f"KV cache per GPU and {free / 2**30:.1f} GiB are free: set {room} or lower")


# 11. Checkpoints: trainable weights (the adapter with LoRA) and optimizer state by name through
#     torch.distributed.checkpoint, one shard per rank, loadable by any number of ranks
def train_state(model, opt, optimizer):
    """Trainable weights by name, and the optimizer's state tensors by name if asked for."""
    import torch.distributed.checkpoint.state_dict as sd
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = {k: v for k, v in sd.get_model_state_dict(model).items() if k in names}
    return {"model": weights, "optim": sd.get_optimizer_state_dict(model, opt) if optimizer else {}}

def save_checkpoint(run_dir, model, opt, iteration):
    """Written under a temporary name, then renamed: a kill at any moment leaves a complete
    checkpoint of this iteration or the one before. No RNG state: iterations seed themselves."""
    import torch.distributed.checkpoint as dcp
    path = os.path.join(run_dir, "checkpoint")
    if RANK == 0:
        shutil.rmtree(path + ".tmp", ignore_errors=True)
    # a stateless AdamW (no step yet) saves none: get_state_dict would add a step 0 AdamW counts
    state = train_state(model, opt, optimizer=bool(opt.state))
    dcp.save(state | {"iteration": iteration}, checkpoint_id=path + ".tmp")  # all ranks
    if RANK == 0:  # (the next save's collectives keep the other ranks from writing before this)
        put_in_place(path)

def put_in_place(path):
    """The folder path.tmp, written whole, becomes path. Between the two renames the one before is
    path.old: a kill at any moment leaves a complete folder under one of the three names."""
    if os.path.isdir(path):
        shutil.rmtree(path + ".old", ignore_errors=True)  # what a kill may have left
        os.replace(path, path + ".old")
    os.replace(path + ".tmp", path)
    shutil.rmtree(path + ".old", ignore_errors=True)

def last_checkpoint(run_dir):
    """The newest complete checkpoint of a run and its iteration; (None, 0) if it has none."""
    import torch.distributed.checkpoint as dcp
    paths = [os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.old")]
    paths = [p for p in paths if os.path.isdir(p)]
    if not paths:
        return None, 0
    state = {"iteration": 0}
    dcp.load(state, checkpoint_id=paths[0])  # that value alone: no tensor is read
    return paths[0], state["iteration"]

def load_checkpoint(path, model, opt, cfg):
    """The trainable weights and AdamW's state from a checkpoint, which trains on with the learning
    rate and weight decay of the settings (AdamW's state brings the checkpoint's), saying so where
    they differ."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stepped = any(key.startswith("optim.") for key in saved)  # else a fresh AdamW is its state
    state = train_state(model, opt, optimizer=stepped)
    dcp.load(state, checkpoint_id=path)
    options = sd.StateDictOptions(strict=False)
    sd.set_model_state_dict(model, state["model"], options=options)
    if stepped:
        sd.set_optimizer_state_dict(model, opt, state["optim"], options=options)
    changed = [f"{flag(key)} {getattr(cfg, key):g} (the checkpoint's: {opt.param_groups[0][key]:g})"
               for key in ("lr", "weight_decay") if opt.param_groups[0][key] != getattr(cfg, key)]
    for group in opt.param_groups:
        group.update(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if changed:
        say(f"resuming with {' and '.join(changed)}")

def save_model(run_dir, model, tok, iteration):
    """The full weights (or the LoRA adapter) and the tokenizer, loadable with from_pretrained,
    and trained.json: the iterations they were trained for, which --eval of them reports. Written
    to model.tmp and renamed, as a checkpoint is: model/ is complete or absent (32B: minutes)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # every rank: it gathers the shards
    if RANK == 0:
        path = os.path.join(run_dir, "model")
        shutil.rmtree(path + ".tmp", ignore_errors=True)  # what a kill may have left
        model.save_pretrained(path + ".tmp", state_dict=state)
        tok.save_pretrained(path + ".tmp")
        trained = json.dumps({"run": os.path.abspath(run_dir), "iteration": iteration})
        pathlib.Path(path + ".tmp", "trained.json").write_text(trained)
        put_in_place(path)  # (a model/ there is of a finish before this resume)

def trained_to(model_dir):
    """The iterations a run's model/ was trained for; None for any other directory."""
    path = pathlib.Path(os.path.expanduser(model_dir), "trained.json")
    return json.loads(path.read_text())["iteration"] if path.exists() else None

def write_atomically(path, text):
    """A kill while this writes leaves the old file or the new one, never part of one."""
    pathlib.Path(path + ".tmp").write_text(text)
    os.replace(path + ".tmp", path)


# 12. The log: metrics.jsonl, the console, TensorBoard and wandb
def read_metrics(path):
    """The rows of a metrics.jsonl; a line cut short by a kill while it was written is dropped."""
    rows = []
    for line in pathlib.Path(path).read_text().splitlines() if os.path.exists(path) else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows

class Log:
    """Rank 0's record of a run: each metrics row to metrics.jsonl and as a short line to the
    console; with --track every number to TensorBoard and/or wandb (imported only then), under
    train/ or the split evaluated, with the iteration as the step. A resumed run's trackers go on
    from `redone`, the first iteration it logs again: each iteration is in them once."""

    def __init__(self, cfg, run_dir, redone=0):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        names = cfg.track.split(",")
        self.tensorboard = self.wandb = None
        if "tensorboard" in names:  # purge_step: what an interrupted run logged from it is hidden
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                             purge_step=redone if cfg.resume else None)
        if "wandb" in names:
            import wandb
            configured = os.environ.get("WANDB_MODE") or wandb.api.api_key  # else offline
            self.wandb = wandb.init(project="loop", dir=run_dir, config=dataclasses.asdict(cfg),
                                    name=os.path.basename(os.path.abspath(run_dir)),
                                    id=wandb_id(run_dir), resume="allow",
                                    mode=None if configured else "offline")

    def __call__(self, row):
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        tqdm.write(summary(row))
        group = row.get("split", "train")
        scalars = {f"{group}/{key}": float(value) for key, value in row.items()
                   if isinstance(value, (int, float)) and key != "iteration"}
        if self.tensorboard:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, row["iteration"])
            self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(scalars, step=row["iteration"])

def wandb_id(run_dir):
    """The wandb run of a run directory, kept in it: a resume continues that run."""
    path = os.path.join(run_dir, "wandb_id")
    if not os.path.exists(path):
        write_atomically(path, os.urandom(8).hex())
    return pathlib.Path(path).read_text()

def summary(row):
    """The console's line for a metrics row: the numbers to watch (metrics.jsonl has them all)."""
    failed = f", {row['env_failures']} worlds failed" if row["env_failures"] else ""
    if "split" in row:
        return (f"iteration {row['iteration']}: {row['split']} TGC {100 * row['tgc']:.1f}% "
                f"SGC {100 * row['sgc']:.1f}% of {row['tasks']} tasks{failed}, "
                f"{row['seconds']:.0f} s")
    return (f"iteration {row['iteration']}: reward {row['reward_mean']:.3f} success "
            f"{100 * row['success_rate']:.1f}% kl {row['kl']:.3f} clip "
            f"{row['clip_fraction']:.3f}{failed}, {row['seconds']:.0f} s")


# 13. Main: a run claims its directory, starts, then iterates rollouts -> advantages -> update
def main(argv=None):
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return  # a world's worker runs the main script again as it starts: no run of its own
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # 1-process DCP
    if cfg.fsdp:
        start_distributed()
    run_dir, made = (cfg.resume, []) if cfg.resume else claim(cfg)
    failed = None
    try:
        run(cfg, run_dir, made)
    except WorldsFailed as e:  # said once the run's frames are gone, after its progress bars
        failed = str(e)
    except KeyboardInterrupt:  # Ctrl-C: one line that says how to go on, not a traceback
        sys.unraisablehook = lambda unraisable: None  # nor a cut-short progress bar's at exit
        started = os.path.exists(os.path.join(run_dir, "config.json"))
        launcher = ["torchrun", "--nproc_per_node", "G"] if cfg.fsdp else ["python"]
        say(f"\ninterrupted: continue with `{shell(*launcher, sys.argv[0], '--resume', run_dir)}`"
            if started else "\ninterrupted before the run started: nothing written")
        sys.exit(130)
    if failed:
        if RANK == 0:
            print(f"error: {failed}", file=sys.stderr)
        sys.exit(1)
    if cfg.fsdp:  # not after an error: the failed rank would wait here for ranks waiting for it
        dist.barrier()  # no rank tears the group down while another still writes the model
        dist.destroy_process_group()

def claim(cfg):
    """A fresh run's directory, taken at once by writing its config.json where there is none
    (O_EXCL): two runs never share one, whenever each started. A default name (runs/<time>) takes
    the next free suffix. Rank 0 claims it for every rank; returns it and the folders made."""
    claimed = [None, [], None]  # the directory, the folders made, an error
    if RANK == 0:
        base = cfg.out or default_out(cfg)
        for n in itertools.count(1):
            run_dir = base if n == 1 else f"{base}-{n}"
            made = [path for path in itertools.accumulate(pathlib.Path(run_dir).parts,
                                                          os.path.join) if not os.path.isdir(path)]
            claimed = [run_dir, made, taken_by(run_dir, cfg.model)]
            try:
                if not claimed[2]:
                    os.makedirs(run_dir, exist_ok=True)
                    with open(os.path.join(run_dir, "config.json"), "x") as fh:
                        fh.write(settings_text(cfg, run_dir))
            except FileExistsError:  # claimed meanwhile by a run that started
                claimed[2] = taken_by(run_dir, cfg.model) or f"{run_dir} was taken meanwhile"
            except OSError as e:
                claimed[2] = f"cannot write the run directory {run_dir}: {first_line(e)}"
                break
            if cfg.out or not claimed[2]:  # a default name goes on to the next suffix
                break
    if WORLD > 1:
        dist.broadcast_object_list(claimed)
    if claimed[2]:
        die(claimed[2])
    return claimed[0], claimed[1]

def taken_by(run_dir, model):
    """Why a fresh run may not write into run_dir, or None: it writes only where nothing of the
    user's is (a new or empty folder), never over the model it starts from."""
    out, weights = os.path.realpath(run_dir), os.path.realpath(os.path.expanduser(model))
    if os.path.isdir(weights) and os.path.commonpath([out, weights]) == out:
        return f"--out {run_dir} holds the model the run starts from ({model}): give another --out"
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        return (f"{run_dir} already holds a run: continue it with --resume {shlex.quote(run_dir)}, "
                "or give another --out")
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        return f"--out {run_dir} is a file: give a new or empty folder"
    if os.path.isdir(run_dir) and os.listdir(run_dir):
        return (f"--out {run_dir} holds files and no run (no config.json): give a new or empty "
                "folder (a run never writes over what is there)")
    return None

def default_out(cfg):
    """runs/<time>; an evaluation is named after what it evaluates: RUN/eval-<split> for a run's
    model/, else runs/eval-<the model's name>-<split>."""
    if not cfg.eval:
        return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    model = os.path.normpath(os.path.expanduser(cfg.model))
    run_dir = os.path.dirname(model)
    if os.path.basename(model) == "model" and os.path.isfile(os.path.join(run_dir, "config.json")):
        return os.path.join(run_dir, f"eval-{cfg.split}")
    return os.path.join("runs", f"eval-{os.path.basename(model)}-{cfg.split}")

def unclaim(run_dir, made):
    """A start that failed leaves nothing: the claim's config.json and the folders it made."""
    if RANK == 0:
        os.remove(os.path.join(run_dir, "config.json"))
        for path in reversed(made):  # emptied, innermost first (another run's stay)
            try:
                os.rmdir(path)
            except OSError:
                break

def settings_text(cfg, run_dir):
    """config.json: a run's settings, read by --resume (`out` is its directory)."""
    settings = dataclasses.asdict(cfg) | {"out": run_dir}
    del settings["resume"]  # not a setting of the run: how it was started
    return json.dumps(settings, indent=1)

def start(cfg, run_dir, checkpoint):
    """The tasks, the model and its Chat, AdamW, the checkpoint, then config.json: a start that
    fails leaves the run directory as it was, or none."""
    env = environment(cfg.env)
    # a missing data root or an unknown split stops before the model loads
    eval_tasks = tasks_of(env, cfg.split)
    train_tasks = [] if cfg.eval else tasks_of(env, cfg.train_split)
    if len(train_tasks) < cfg.tasks_per_iteration and not cfg.eval:
        say(f"note: --tasks-per-iteration {cfg.tasks_per_iteration} is more than the "
            f"{len(train_tasks)} tasks of {cfg.train_split}: each iteration plays all of them")
    model, tok = load_model_and_tokenizer(cfg)
    chat = chat_of(model, tok)
    if DEVICE.type == "cuda":  # the most episodes a rank plays in one rollout, in waves
        n_train = math.ceil(min(cfg.tasks_per_iteration, len(train_tasks)) / WORLD)
        wave = max(math.ceil(len(eval_tasks) / WORLD), n_train * cfg.rollouts_per_task)
        check_kv_cache(cfg, model, min(cfg.batch_episodes, wave))
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable and not cfg.eval:  # a LoRA run's model/ loads its adapter frozen
        die(f"{cfg.model} has no weights to train: evaluate it with --eval, or continue the run "
            "that made it with --resume")
    opt = None
    if trainable:
        opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if checkpoint:
        load_checkpoint(checkpoint, model, opt, cfg)
    if RANK == 0:  # a resume's settings, now that it has started
        write_atomically(os.path.join(run_dir, "config.json"), settings_text(cfg, run_dir))
    return model, tok, chat, opt, train_tasks

def run(cfg, run_dir, made):
    """The iteration-0 evaluation, then LOOP's iterations, all written to run_dir."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    checkpoint, begin = last_checkpoint(run_dir) if cfg.resume else (None, 0)
    if begin >= cfg.iterations and trained_to(os.path.join(run_dir, "model")) == begin:
        say(f"{run_dir} is finished ({begin} iterations): nothing to do")
        return
    try:
        model, tok, chat, opt, train_tasks = start(cfg, run_dir, checkpoint)
    except BaseException:  # an error, die() or Ctrl-C: a failed start changes nothing on disk
        if not cfg.resume:
            unclaim(run_dir, made)
        raise
    if cfg.resume:
        say(f"resuming {run_dir} from iteration {begin}" if checkpoint else
            f"starting {run_dir} again from iteration 0 (no checkpoint yet)")
    else:
        say(f"writing to {run_dir}")
    rows = []
    if cfg.resume and RANK == 0:  # the rows up to the checkpoint: none twice, no cut line
        rows = [r for r in read_metrics(metrics) if r["iteration"] <= begin]
        write_atomically(metrics, "".join(json.dumps(r) + "\n" for r in rows))
    # trackers hide what an interrupted run logged past the rows kept
    redone = 1 + max((r["iteration"] for r in rows), default=-1)
    log = Log(cfg, run_dir, redone) if RANK == 0 else lambda row: None  # rows reduced over ranks
    # FSDP casts by its own mixed-precision policy
    with torch.autocast(DEVICE.type, torch.bfloat16, enabled=cfg.bf16 and not cfg.fsdp):
        if cfg.eval:  # a run's trained model/ reports the iteration it was trained to
            log(evaluate(model, chat, cfg, cfg.split, trained_to(cfg.model) or 0, run_dir))
            say(f"evaluated: {metrics}")
            return
        # a run killed before its first checkpoint keeps its iteration-0 evaluation, if logged
        if not begin and not all_reduce([any("split" in r for r in rows)], dist.ReduceOp.MAX)[0]:
            log(evaluate(model, chat, cfg, cfg.split, 0, run_dir))
        for it in tqdm(range(begin + 1, cfg.iterations + 1), desc="LOOP", disable=RANK != 0):
            log(train_iteration(model, opt, chat, cfg, train_tasks, it))
            if it % cfg.eval_every == 0 or it == cfg.iterations:
                log(evaluate(model, chat, cfg, cfg.split, it, run_dir))
            save_checkpoint(run_dir, model, opt, it)
    if max(begin, cfg.iterations) == 0:  # evaluated only: the model is the one it started from
        say(f"finished: {run_dir} holds metrics.jsonl and transcripts/ (no iterations, so no "
            "model/)")
        return
    save_model(run_dir, model, tok, max(begin, cfg.iterations))
    say(f"finished: {run_dir} holds metrics.jsonl, transcripts/ and the trained model/. Next: "
        f"its figures, its model's evaluation, the model playing a task:\n"
        f"{next_steps(cfg, run_dir)}")

def next_steps(cfg, run_dir):
    """The commands that look at a finished run, as a shell reads them: its figures, its model's
    evaluation, the model playing a task. The tools import a world a script registered by its
    module:Class (one the script itself defines they cannot: no play line)."""
    model, world = os.path.join(run_dir, "model"), environment(cfg.env)
    script = sys.argv[0]  # loop.py, or the script that registered the world, as it was run
    launcher = ["torchrun", "--nproc_per_node", "G", script, "--fsdp"] if cfg.fsdp else ["python",
                                                                                         script]

    def flags(env):  # the tiny world's settings are --tiny's
        split = ["--split", cfg.split] * (cfg.split != Config.split)
        return (["--tiny"] if env == "tiny" else ["--env", env] + ["--bf16"] * cfg.bf16) + split

    named = cfg.env
    if cfg.env not in ("tiny", "appworld") and ":" not in cfg.env:
        named = f"{world.__module__}:{world.__qualname__}"
    steps = [["python", tool("plot.py"), run_dir], [*launcher, *flags(cfg.env), "--eval",
                                                    "--model", model]]
    if not named.startswith("__main__:"):
        task = tasks_of(world, cfg.split)[0]
        steps.append(["python", tool("play.py"), *flags(named), "--model", model, "--task", task])
    return "\n".join("  " + shell(*step) for step in steps)

def shell(*words):
    """A command as a shell reads it back: every word quoted where it must be."""
    return " ".join(shlex.quote(str(word)) for word in words)

def tool(name):
    """tools/NAME as a path from the current directory (absolute from outside the repository)."""
    path = os.path.relpath(os.path.join(HERE, "tools", name))
    return os.path.join(HERE, "tools", name) if path.startswith("..") else path

if __name__ == "__main__":
    main()
