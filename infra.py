"""The machinery loop.py calls as `infra.X`, what a run needs that the paper does not say, in the
order of its sections below. It never imports loop (Config and the World are passed in)."""
import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import faulthandler
import fcntl
import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import math
import multiprocessing
import multiprocessing.forkserver
import os
import pathlib
import queue
import random
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import unittest.mock
import urllib.error
import urllib.parse
import urllib.request
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as sd
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from chat import Chat

# Process state: this process's rank, the number of ranks, its device; one-line errors
HERE = os.path.dirname(os.path.abspath(__file__))
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb<0.19"}  # what to pip install
RANK, WORLD = 0, 1  # this process's rank and the number of ranks, set once by start_distributed
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # torchrun: LOCAL_RANK's

def die(message):
    """A mistake the user can fix: one line saying what to do, exit code 2, no traceback."""
    sys.stderr = Console(sys.stderr)  # (stderr may be full, or closed: exit code 2 all the same)
    print(f"error: {message}", file=sys.stderr)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's report: the root cause
        error = {"message": f"error: {message}", "timestamp": int(time.time())}
        pathlib.Path(path).write_text(json.dumps(error))
    sys.exit(2)

def say(text):
    if RANK == 0 and os.environ.get("RANK", "0") == "0":  # (torchrun's ranks, before they start)
        tqdm.write(text, file=sys.stderr)

class Console:
    """stdout or stderr, whose reader went away (| head, a closed terminal) or never was (>&-)."""

    def __init__(self, stream):  # (None: closed from the start)
        stream = stream.stream if isinstance(stream, Console) else stream
        self.stream = stream or open(os.devnull, "w")

    def __getattr__(self, name):  # write and flush guarded, the rest the stream's
        value = getattr(self.stream, name)
        return functools.partial(self.guarded, value) if name in ("write", "flush") else value

    def guarded(self, method, *args):
        try:
            return method(*args)
        except OSError:  # EPIPE, EIO
            with contextlib.suppress(OSError, ValueError):  # (a stream without a file)
                os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            return 0

def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

def flag(name):
    return "--" + name.replace("_", "-")

# The settings: the command line, config files laid over each other, what a resume may change
def parse_config(Config, argv, description):
    """Config: defaults <- tiny_config.json (--tiny) <- --config FILE (a resumed run's) <- flags."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    parser = settings_parser(Config, defaults)
    args = parser.parse_args(argv)
    if args.resume and (args.tiny or args.config):
        die("--resume continues with the settings of the run it resumes: change them with flags")
    if args.resume and not os.path.isfile(os.path.join(args.resume, "config.json")):
        die(f"{args.resume} is not a run directory (it has no config.json): give the --out of "
            "the run to continue")
    files = [os.path.join(HERE, "tiny_config.json")] * args.tiny + [args.config] * bool(args.config)
    files = [os.path.join(args.resume, "config.json")] if args.resume else files
    flags = [text for path in files for text in read_settings(path, Config, args.resume)]
    given = vars(parser.parse_args(flags + argv))  # the flags given come last: they win
    if args.help:
        shown = {k: v if given[k] is None else given[k] for k, v in defaults.items()}
        settings_parser(Config, shown, description=description).print_help()
        sys.exit(0)
    saved = parser.parse_args(flags)  # what a resume cannot change: where, that it trains
    if args.resume and args.out is not None and not same("out", args.resume, args.out):
        die(f"--out cannot change when resuming: the run goes on in {args.resume}")
    if args.resume and saved.eval:
        die(f"{args.resume} is an evaluation, not a training run: there is nothing to resume")
    if args.resume and args.eval:
        die(f"--eval does not resume a run: evaluate its model with --eval --model "
            f"{os.path.join(args.resume, 'model')}")
    cfg = Config(**{k: given[k] for k in defaults if given[k] is not None})
    for name in filter(None, cfg.track.split(",")):
        if name not in TRACKERS:
            die(f"--track takes {' or '.join(TRACKERS)} or both (comma-separated), not {name!r}")
        if importlib.util.find_spec(name) is None:
            die(f"--track {name} needs its package: pip install '{TRACKERS[name]}'")
    return cfg

def settings_parser(Config, shown=None, where="", description=None):
    """The command line: --help shows the values in `shown`; a mistake: one line after `where`."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,  # --iteration
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)  # --help is read after --tiny and --config
    parser.error = lambda message: die(f"{where}{message} (see --help)")  # no usage lines
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit "
                        "(with the values the run would use: --tiny's, --config's, the flags')")
    parser.add_argument("--config", type=os.path.expanduser,
                        help="JSON file of settings (over --tiny's if both are given)")
    parser.add_argument("--tiny", action="store_true", help="the settings of tiny_config.json")
    for f in dataclasses.fields(Config):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {
            "type": checked(f)}
        value = (shown or {}).get(f.name, "")
        default = f" (default: {value})" if value != "" else ""
        parser.add_argument(flag(f.name), **kind, choices=f.metadata["choices"],
                            help=f.metadata["doc"] + default)
    return parser

def checked(f):
    """The type of a setting's flag: its text as the field's type, within the field's rule."""
    low, high = f.metadata["at_least"], f.metadata["at_most"]

    def convert(text):
        value = f.type(text)  # a ValueError is argparse's "invalid int value: 'x'"
        if f.type is str and f.name == "model" and not text:
            raise argparse.ArgumentTypeError("must name a model directory or a Hugging Face id")
        if f.type is str:  # a path: ~ expanded; a local model absolute (a resume from anywhere)
            path = os.path.expanduser(value) if f.name in ("model", "out", "resume") else value
            return os.path.abspath(path) if f.name == "model" and os.path.isdir(path) else path
        rules = [(value >= low if low is not None else value > 0,
                  f">= {low}" if low is not None else ">= 1" if f.type is int else "> 0"),
                 (high is None or value <= high, f"at most {high}"),
                 (f.type is int or math.isfinite(value), "finite")]
        for holds, rule in rules:
            if not holds:
                raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    convert.__name__ = f.type.__name__
    return convert

def same(key, value, given, folder=None):
    """Whether `given` is the run's `value`: a folder is the same by any path to it (a link), a
    model's also where it was moved to (`folder`: its inode, as the checkpoint records it)."""
    if key in ("model", "out") and os.path.exists(value) and os.path.exists(given):
        return os.path.samefile(value, given)
    return value == given or key == "model" and folder is not None and folder == inode(given)

def inode(folder):
    """A model folder's device and inode, which a move keeps (a copy does not); a hub id: None."""
    return [os.stat(folder).st_dev, os.stat(folder).st_ino] if os.path.isdir(folder) else None

RETIRED = {"micro_batch_size": "--micro-batch-tokens bounds the update's passes"}  # older runs'

def read_settings(path, Config, run=""):
    """A JSON object of settings as flags, each checked here (a mistake names the file and key);
    `run`: the run directory whose config.json it is."""
    values, why = read_json(path, run)
    if why:
        die(why)
    if not isinstance(values, dict):
        die(f"config {path} must hold one JSON object of settings")
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), str(values.get("model", "")))
    if values.get("model") and os.path.isdir(beside):  # tiny_config.json's assets/tiny-model
        values["model"] = os.path.normpath(beside)
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    flags = []
    for key, value in values.items():
        if key in RETIRED and run:  # an older run's: left out (Run says so once it resumes)
            continue
        if key not in Config.__annotations__ or key == "resume":  # (--tiny, --config: flags)
            die(f"{key!r} in {path} is not a setting of a run (see --help)")
        if value is None:
            die(f"{key!r} in {path} is null: give it a value, or leave it out for the default")
        switch = Config.__annotations__[key] is bool
        if switch != isinstance(value, bool):  # a bool is a switch (--lora, --no-lora)
            die(f"{key!r} in {path} must be {kinds[Config.__annotations__[key]]}, not "
                f"{json.dumps(value)}")
        text = as_flag(key, value)
        settings_parser(Config, where=f"{key!r} in {path}: ").parse_args([text])  # its own line
        flags.append(text)
    return flags

def read_json(path, run=""):
    """A settings file's JSON and None, or None and why it cannot be read (`run`: whose it is)."""
    try:
        return json.loads(pathlib.Path(path).read_text()), None
    except (OSError, ValueError) as e:  # (JSON's errors and UnicodeDecodeError are ValueErrors)
        empty = isinstance(e, json.JSONDecodeError) and not e.doc.strip()
        why = f"config {path} is empty" if empty else f"cannot read config {path}: {first_line(e)}"
    lost = (f": the settings of the run in {run} are lost (its start failed, a full disk, say): "
            f"mend the file, or delete {run} and start the run again")
    return None, why + (lost if run else "")

# Worlds: a forker's module:Class, its tasks
def import_world(name, builtin):
    """The World of --env module:Class (module.py in the current directory too), else one line."""
    module_name, _, class_name = name.partition(":")
    if not (module_name and class_name):
        die(f"--env takes {', '.join(builtin)} or module:Class (your world), not {name!r}")
    if os.getcwd() not in sys.path:  # as `python -m` does; the workers inherit sys.path
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - not found, or its own error: one line either way
        die(f"--env {name}: cannot import {module_name}: {type(e).__name__}: {first_line(e)}")
    World = getattr(module, class_name, None)
    if not isinstance(World, type):
        die(f"--env {name}: {module_name} has no class {class_name}")
    missing = [member for member in ("tasks", "messages", "step", "evaluate")
               if not callable(getattr(World, member, None))]
    if missing:
        die(f"--env {name}: {class_name} has no {', '.join(missing)} (the interface is in "
            "tiny_world.py's docstring)")
    return World

def tasks_of(World, split):
    """World.tasks(split), checked: a non-empty list of unique task ids, else one line."""
    name = World.__name__
    if not isinstance(inspect.getattr_static(World, "tasks"), (staticmethod, classmethod)):
        die(f"{name}.tasks(split) is called on the class: make it a @staticmethod")
    try:
        tasks = World.tasks(split)
    except ValueError as e:  # a split it does not have, a missing data root: it says which
        die(str(e))
    if not (isinstance(tasks, list) and tasks and all(isinstance(t, str) for t in tasks)):
        die(f"{name}.tasks({split!r}) must return a non-empty list of task ids (str), not "
            f"{str(tasks)[:60]}")
    if twice := [t for t, n in collections.Counter(tasks).items() if n > 1]:
        die(f"{name}.tasks({split!r}) names task {twice[0]!r} more than once")
    return tasks

def splits(World, cfg):
    """The tasks of the evaluation's split and of the training's, checked before the model loads."""
    preloads(World)  # (its worker processes start at the first wave)
    eval_tasks = tasks_of(World, cfg.split)
    train_tasks = [] if cfg.eval else tasks_of(World, cfg.train_split)
    if len(train_tasks) < cfg.tasks_per_iteration and not cfg.eval:
        say(f"note: --tasks-per-iteration {cfg.tasks_per_iteration} is more than the "
            f"{len(train_tasks)} tasks of {cfg.train_split}: each iteration plays all of them")
    return eval_tasks, train_tasks

# How a run plays worlds of any environment: each in a worker process of its own. Agent code that
# cannot be stopped from inside (a bare `except:` around an endless loop, a long C call such as
# sum(range(10**12))) is stopped by killing its process; AppWorld also allows one world a process.
def in_world_worker():
    """True in a world's worker as it runs the main script again (as __mp_main__): no run there."""
    return getattr(multiprocessing.current_process(), "_inheriting", False)

class Refused(Exception):
    """A value the interface does not allow, from a world's method: its episode fails."""

def serve(conn):
    """A worker: one world at a time, each call answered ("ok", its value checked), "refused" (the
    world closed, the next served) or "raised" (the process ends): its episode fails."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the trainer's to handle
    quiet = open(os.devnull, "w")
    world = None
    while True:
        try:
            method, arg, wait = conn.recv()
        except EOFError:  # the trainer is gone
            return
        # the trainer's deadline on a C thread too (agent code may hold the GIL): a killed trainer's
        faulthandler.dump_traceback_later(wait, exit=True, file=quiet)  # workers end by then
        member = {"start": "__init__", "step": "step"}.get(method, "evaluate")
        try:
            if method == "start":
                World, task_id, timeout, experiment, environ = arg
                os.environ.update(environ)  # the trainer's now (APPWORLD_ROOT), not at the fork
                world = World(task_id, timeout, experiment)
                member = "messages"
                reply = checked_messages(world, world.messages())
            elif method == "step":
                output = world.step(arg)
                if not isinstance(output, str):
                    refuse(world, "step(code)", output, "the observation, a str")
                member = "done"
                reply = valid_text(output), checked_done(world)
            else:  # "evaluate", a world's last call
                reply = checked_result(world, world.evaluate())
                member, closing, world = "close", world, None
                getattr(closing, "close", lambda: None)()
            conn.send(("ok", reply))
        except Refused as e:
            getattr(world, "close", lambda: None)()
            world = None
            conn.send(("refused", (member, str(e))))
        except Exception as e:  # noqa: BLE001 - the world's own error: its last traceback line
            error = f"{World.__name__}.{member} raised {type(e).__name__}: {e}"
            # a close() that fails after a valid evaluate() keeps the score; the process ends
            conn.send(("unclosed", (reply, error)) if member == "close" else
                      ("raised", (member, error)))
            return
        finally:
            faulthandler.cancel_dump_traceback_later()

def refuse(world, member, value, rule):
    shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
    raise Refused(f"{type(world).__name__}.{member} returned {shown}: it must return {rule}")

def checked_messages(world, messages):
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages)):
        refuse(world, "messages()", messages, "a non-empty list of {'role': str, 'content': str}")
    return [{"role": m["role"], "content": valid_text(m["content"])} for m in messages]

def valid_text(text):
    """Valid text: a surrogate pair (print("\\ud83d\\ude00")) joined, a lone one replaced."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")

def checked_done(world):
    done = getattr(world, "done", False)
    done = done() if callable(done) else done  # AppWorld spells it task_completed()
    if done not in (True, False):
        refuse(world, "done", done, "True or False (an attribute, a property or a method)")
    return bool(done)

def checked_result(world, result):
    if result is None:  # the world says it failed
        return None
    pair = isinstance(result, (tuple, list)) and len(result) == 2
    counts = [number(x) for x in result] if pair else [None]
    if None in counts or not 0 <= counts[0] <= counts[1] or counts[1] <= 0:
        refuse(world, "evaluate()", result, "(tests passed, tests total), 0 <= passed <= total, "
               "total > 0; or None if the world failed")
    return tuple(counts)

def number(x):
    """A finite number of whatever type a world counts in (bool, numpy's, Decimal, a 0-d tensor):
    an int where it is whole (2.0 of a float: a float), else None."""
    with contextlib.suppress(Exception):  # a list, an array of many, a complex: no number
        value = math.nan if isinstance(x, (str, bytes)) else float(x)
        if math.isfinite(value):
            return int(value) if value.is_integer() and not isinstance(x, float) else value
    return None

def preloads(World):
    """World.preload(), checked at the start: a list of module names, else one line why not."""
    try:
        names = getattr(World, "preload", list)()
    except Exception as e:  # noqa: BLE001 - the world's own error
        die(f"{World.__name__}.preload() raised {type(e).__name__}: {first_line(e)}")
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        die(f"{World.__name__}.preload() returned {names!r:.60}: it must return a list of the "
            "modules every worker imports (names, str)")
    return names

class Hosted:
    """A World in a worker process, its methods with deadlines: one that dies, hangs (killed) or
    answers what the interface does not allow fails its episode (`error` says why)."""

    WORLD_TIMEOUT = 300  # seconds a world may take to start or to be evaluated (AppWorld: ~4, ~0.1)
    MARGIN = 5  # seconds a step may take beyond the agent's time limit before its world is killed
    idle = []  # workers waiting for a world
    idle_lock = threading.Lock()  # a wave's worlds take and give back workers from its threads
    said = set()  # the failures of worlds said so far, a line each: (class, member, kind)

    def __init__(self, World, task_id, timeout, experiment):
        self.World, self.task_id, self.timeout = World, task_id, timeout
        self.experiment, self.done, self.failed = experiment, False, False
        self.opening = self.worker = self.error = None

    def take_worker(self):
        with Hosted.idle_lock:
            while Hosted.idle:
                worker, conn = Hosted.idle.pop()
                if worker.is_alive():  # else it died while it waited
                    return worker, conn
        return self.start_worker()

    def give_back(self):
        with Hosted.idle_lock:
            Hosted.idle.append((self.worker, self.conn))

    def start_worker(self):
        """From the forkserver (not a fork of the trainer's CUDA state and locks), which imported
        loop (whose script a worker runs again), the World's module and its preload() once."""
        ctx = multiprocessing.get_context("forkserver")
        with Hosted.idle_lock:  # the first world's thread starts the forkserver for all
            ctx.set_forkserver_preload(["loop", self.World.__module__, *preloads(self.World)])
            path = os.pathsep.join(filter(None, sys.path))  # it imports them on our sys.path
            with unittest.mock.patch.dict(os.environ, PYTHONPATH=path):
                multiprocessing.forkserver.ensure_running()  # (once: then it runs)
        conn, child = ctx.Pipe()
        worker = ctx.Process(target=serve, args=(child,), daemon=True)
        worker.start()
        child.close()  # so that a dead worker reads as EOF here
        return worker, conn

    def call(self, message, wait):
        """The world's answer within `wait` s, or None: it failed (`error` says why; said once)."""
        (method, _), status, value = message, "died", None
        try:
            self.conn.send((*message, wait))
            status, value = self.conn.recv() if self.conn.poll(wait) else ("hung", None)
        except (EOFError, OSError):
            pass
        if status == "ok":
            return value
        if status == "unclosed":  # its worker ended: no world of the next wave gets it
            self.worker.kill()
            self.worker.join()
            if (self.World, "close") not in Hosted.said:
                Hosted.said.add((self.World, "close"))
                tqdm.write(f"note: {value[1]}: the score it gave is kept (said once)",
                           file=sys.stderr)
            return value[0]
        self.failed = self.done = True
        if value:  # "refused": its worker closed the world; "raised": it ended
            member, self.error = value
        elif status == "hung":
            self.error = f"{self.World.__name__} did not answer its {method} within {wait:g} s"
        else:
            self.worker.join(1)
            self.error = (f"{self.World.__name__}'s worker process ended (exit code "
                          f"{self.worker.exitcode}) before it answered its {method}")
        if status == "refused":
            self.give_back()
        else:
            self.worker.kill()
        if value and (self.World, member, status) not in Hosted.said:
            Hosted.said.add((self.World, member, status))
            tqdm.write(f"note: {self.error}: its episode fails as the world's (said once)",
                       file=sys.stderr)
        return None

    def messages(self):  # the world starts: its episode's wave begins
        if self.opening is None:
            self.worker, self.conn = self.take_worker()
            if self.failed:  # closed while it was taken (close() sets failed, then reads worker)
                self.worker.kill()
            start = (self.World, self.task_id, self.timeout, self.experiment, dict(os.environ))
            failed = [{"role": "user", "content": "(the world failed to start)"}]
            self.opening = self.call(("start", start), self.WORLD_TIMEOUT) or failed
        return self.opening

    def step(self, code):
        reply = None if self.failed else self.call(("step", code), self.timeout + self.MARGIN)
        if reply is None:
            return f"Environment failed: {self.error}: stopped."
        output, self.done = reply
        return output

    def evaluate(self):
        result = None if self.failed else self.call(("evaluate", None), self.WORLD_TIMEOUT)
        if not self.failed:  # it answered: its worker serves a world of the next wave
            self.give_back()
            if result is None:
                self.failed = self.done = True
                self.error = f"{self.World.__name__}.evaluate() returned None: the world failed"
        return result

    def close(self):
        """Kill the world's worker now: the rollout was interrupted, nothing may wait for it."""
        self.failed = self.done = True
        if self.worker is not None:
            self.worker.kill()

def concurrently(calls):
    """The calls at once, a thread each: a hung world holds up no other, nor Ctrl-C."""
    pool = concurrent.futures.ThreadPoolExecutor(max(len(calls), 1))
    try:
        return list(pool.map(lambda call: call(), calls))
    finally:
        pool.shutdown(wait=False)

def stop_if_every_world_failed(episodes, what):
    """A run whose every world fails would train on nothing for hours: it stops (exit code 1)."""
    errors = [getattr(e.world, "error", None) or "its world failed" for e in episodes if e.failed]
    counts = all_reduce([len(episodes), len(errors)])
    if not counts[0] or counts[1] < counts[0]:
        return
    errors = gather(errors[:1])
    hint = "check the world with tools/play.py --solution"
    if "worker process ended" in errors[0]:  # a forker's script that reran in every worker, say
        hint = "a script that registers a world runs loop.main() under if __name__ == '__main__'"
    raise WorldsFailed(f"every world failed in {what} ({int(counts[0])} episodes); the first: "
                       f"{errors[0]}: {hint}")

class WorldsFailed(Exception):
    """Every world of an iteration or an evaluation failed: the run stops (Run says why)."""

# The carried KV cache of a wave of episodes
class WaveCache:
    """A wave's KV cache, carried across its turns: row i (its i-th live episode) holds the first
    fed[i] ids of the episode, in the columns `mask` marks (0: padding, tokens after a stop)."""

    def __init__(self):
        from transformers import DynamicCache
        self.kv, self.mask, self.fed, self.episodes = DynamicCache(), None, [], []  # rows' episodes

    def lay_out(self, live):
        """The `live` episodes' next turn, no padding between an episode's tokens (a sliding window
        counts columns): each row's first tokens, padded in front, fed as many ids as the widest new
        segment. Gone: ended episodes, padding, post-stop tokens, others' synced passes' columns."""
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
        """What generation is fed: each row's ids past the cached ones, padded in front."""
        new = [p[n:] for p, n in zip(prompts, self.fed or [0] * len(prompts))]
        width = max(map(len, new))
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in new], device=DEVICE)
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in new], device=DEVICE)
        if self.mask is None:
            return ids, attn
        return torch.cat([torch.full_like(self.mask, pad), ids], 1), torch.cat([self.mask, attn], 1)

    def grew(self, attn, prompts, rows, n):
        """After `n` columns were generated (`rows`, cut at stops): all but the last are cached."""
        sampled = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows], device=DEVICE)
        self.mask = torch.cat([attn, sampled[:, :n - 1]], 1)
        self.fed = [len(p) + min(len(r), n - 1) for p, r in zip(prompts, rows)]

# Rollouts on vLLM servers (--vllm), as the reference code samples: token ids in, ids and log-probs
# out; the policy's LoRA adapter loaded into every server after each update
class ServerFailed(Exception):
    """A server died, hung or answered what the protocol does not allow: the run stops (Run)."""

class Servers:
    """The running vLLM servers --vllm names, checked at start: each serves the run's base model
    with room for --max-context. An episode keeps its server, whose prefix cache holds its turns."""

    def __init__(self, cfg):
        if not (cfg.lora or cfg.eval):  # a running server loads adapters, not new full weights
            die("--vllm trains the LoRA adapter it loads into the servers: add --lora")
        self.urls = [url.rstrip("/") for url in cfg.vllm.split(",")]
        self.timeout, self.stopped, self.row, self.lora = cfg.vllm_timeout, False, {}, cfg.lora
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # (localhost)
        adapter = pathlib.Path(os.path.expanduser(cfg.model), "adapter_config.json")
        base = json.loads(adapter.read_text())["base_model_name_or_path"] if adapter.exists() \
            else cfg.model  # (--eval of a LoRA run's model/)
        self.evaluated_adapter = str(adapter.parent) if adapter.exists() else None
        for url in self.urls:
            try:
                models = self.call(url, "/v1/models")["data"]
            except (ServerFailed, KeyError, TypeError) as e:
                die(f"{first_line(e)}: start it (docs/vllm.md), or give --vllm a running one's URL")
            served = [m for m in models if base in (m["id"], m["root"])
                      or os.path.exists(base) and same("model", m["root"], base)]
            if not served:
                die(f"the vLLM server at {url} serves {models[0]['id']}, not {base}: start it "
                    f"with --model {base} (or --served-model-name {base})")
            if (room := served[0]["max_model_len"]) < cfg.max_context:
                die(f"the vLLM server at {url} holds {room} tokens, not --max-context "
                    f"{cfg.max_context}: start it with --max-model-len {cfg.max_context}")
        self.adapter = served[0]["id"]  # (the base model, until a LoRA adapter is taken)

    def call(self, url, path, body=None):
        """The server's answer (JSON, else its text) within --vllm-timeout, or ServerFailed."""
        if self.stopped and path == "/v1/completions":  # the episodes' rollout ended (Ctrl-C, an
            raise ServerFailed("the rollout was stopped")  # episode's failure): they end here
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
        try:
            with self.opener.open(request, timeout=self.timeout) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as e:
            raise ServerFailed(f"the vLLM server at {url} refused {path}: "
                               f"{first_line(e.read().decode() or e)}") from None
        except (OSError, ValueError) as e:  # refused, reset, timed out
            late = isinstance(getattr(e, "reason", e), TimeoutError)
            why = f"within --vllm-timeout {self.timeout:g} s" if late else f"({first_line(e)})"
            raise ServerFailed(f"the vLLM server at {url} did not answer {path} {why}") from None
        return json.loads(text) if path in ("/v1/models", "/v1/completions") else text

    def sample(self, url, ids, temperature, max_tokens, stop_ids, seed=0):
        """One turn after `ids`, as generate() samples it: the plain softmax at the temperature (no
        top-k, top-p or penalties), only the chat's stop ids, seeded. The ids and their log p."""
        body = {"model": self.adapter, "prompt": ids, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                "repetition_penalty": 1.0, "ignore_eos": True, "stop_token_ids": stop_ids,
                "logprobs": 0, "return_token_ids": True, "seed": seed + len(ids)}
        choice = (self.call(url, "/v1/completions", body).get("choices") or [{}])[0]
        new, logp = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
        if not (isinstance(new, list) and isinstance(logp, list) and 0 < len(new) == len(logp)
                <= max_tokens and {*map(type, new)} == {int} and {*map(type, logp)} == {float}):
            raise ServerFailed(f"the vLLM server at {url} answered a completion without its "
                               "token ids and their log-probs (vLLM >= 0.10 returns them)")
        return new, logp

    def play(self, play, worlds, task_ids, at_once, desc):
        """play(world, task_id, sample) for each episode in a thread, `at_once` at most (so many
        worlds' workers); none waits for another. The row: its adapter, its prefix-cache hits."""
        self.stopped, started, seeds = False, 0, [random.getrandbits(62) for _ in worlds]
        before, results, episodes = self.prefix_cache(), queue.Queue(), [None] * len(worlds)

        def episode(i):  # (seeded as the iteration is: a resumed run samples what it would have)
            sample = functools.partial(self.sample, self.urls[i % len(self.urls)], seed=seeds[i])
            try:
                results.put((i, play(worlds[i], task_ids[i], sample)))
            except BaseException as e:  # noqa: BLE001 - the rollout's thread re-raises it
                results.put((i, e))

        with tqdm(total=len(worlds), desc=desc, leave=False, disable=True if RANK else None) as bar:
            try:
                for done in range(len(worlds)):
                    while started < len(worlds) and started - done < at_once:
                        threading.Thread(target=episode, args=(started,), daemon=True).start()
                        started += 1
                    i, episodes[i] = results.get()
                    if isinstance(episodes[i], BaseException):
                        raise episodes[i]
                    bar.update()
            except BaseException:
                self.stopped = True  # the threads still in flight end at their next request
                for world in worlds:
                    getattr(world, "close", lambda: None)()
                raise
        hits, queries = (after - first for after, first in zip(self.prefix_cache(), before))
        self.row = {"adapter": self.adapter, "prefix_cache_hit_rate": hits / max(queries, 1)}
        return episodes

    def prefix_cache(self):  # the servers' prefix-cache hits and queries (tokens) so far
        lines = "".join(self.call(url, "/metrics") for url in self.urls).splitlines()
        return [sum(float(line.split()[-1]) for line in lines if line.startswith(
            f"vllm:prefix_cache_{kind}_total{{")) for kind in ("hits", "queries")]

    def take(self, model, run_dir, iteration):
        """The servers sample the policy from now on: its LoRA adapter (every rank gathers it, rank
        0 writes it to RUN/sampler, loads it into each, unloads the run's others); else the base."""
        if not (self.lora or self.evaluated_adapter):
            return
        folder = os.path.join(run_dir, "sampler")
        path = self.evaluated_adapter or os.path.join(folder, str(iteration))
        digest = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:8]
        self.prefix, refused = f"loop-{digest}-", [None]  # (rank 0's reason, sent to all)
        name = self.prefix + ("model" if self.evaluated_adapter else str(iteration))
        if self.adapter == name:  # taken already (by the evaluation; --eval's at the start)
            return
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                   for n, p in model.named_parameters() if p.requires_grad}  # the adapter alone
        if RANK == 0:
            if not self.evaluated_adapter:
                model.save_pretrained(path, state_dict=weights, save_embedding_layers=False)
            try:
                self.release()  # the previous one, or those of this run's killed trainer
                for url in self.urls:
                    self.call(url, "/v1/load_lora_adapter",
                              {"lora_name": name, "lora_path": os.path.abspath(path)})
            except ServerFailed as e:  # a refusal: a server started without runtime LoRA, say
                hint = ": start it with --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
                refused[0] = f"{e}{hint * (' refused ' in str(e))}"
            for old in set(os.listdir(folder) if os.path.isdir(folder) else []) - {str(iteration)}:
                shutil.rmtree(os.path.join(folder, old))  # unloaded: the servers read it no more
        if WORLD > 1:  # no rank samples from it before every server has it
            dist.broadcast_object_list(refused)
        if refused[0]:
            raise ServerFailed(refused[0])
        self.adapter = name

    def release(self):  # the run's adapters unloaded from its servers (shared: at its end too)
        for url in self.urls * (RANK == 0 and hasattr(self, "prefix")):
            for model in self.call(url, "/v1/models")["data"]:
                if model["id"].startswith(self.prefix):
                    self.call(url, "/v1/unload_lora_adapter", {"lora_name": model["id"]})

def mismatch(episodes, old, used):
    """How far the sampler's log p of the sampled tokens is from the learner's (--vllm), over the
    rollouts the update uses: mean and max |delta| (the training-inference mismatch)."""
    deltas = [(torch.tensor(episodes[i].sampler_logp[1:]) - old[i].cpu()).abs() for i in used]
    deltas = torch.cat(deltas or [torch.zeros(0)])
    deltas = deltas[~deltas.isnan()]  # the sampled tokens (a context token's sampler log p: NaN)
    total, count = all_reduce([deltas.sum().item(), deltas.numel()])
    worst = all_reduce([deltas.max().item() if deltas.numel() else 0.0], dist.ReduceOp.MAX)[0]
    return {"mismatch_mean": total / count, "mismatch_max": worst} if count else {}

# Loading: a local directory or a hub id, bf16, LoRA
MODEL_FILES = {"config.json": ["config.json", "adapter_config.json"],  # (a LoRA adapter's)
               "weights (*.safetensors)": ["*.safetensors", "*.bin"],
               "tokenizer (tokenizer.json)": ["tokenizer.json", "tokenizer.model", "vocab.json"]}
def load_pretrained(cfg):
    """A local directory or a hub id (from the cache, else the hub), or one line why not."""
    from huggingface_hub import errors, snapshot_download
    path = os.path.expanduser(cfg.model)
    if os.path.exists(os.path.join(path, "metrics.jsonl")):  # `--model runs/x`
        die(f"{cfg.model} is a run directory: its trained model is {os.path.join(path, 'model')}")
    missing = [what for what, patterns in MODEL_FILES.items() if os.path.isdir(path)
               and not any(any(pathlib.Path(path).glob(p)) for p in patterns)]
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
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # no model, a broken one
        die(f"cannot load model {cfg.model}: {damaged_weights(path) or first_line(e)}")

def damaged_weights(path):
    """Which weights file (or LoRA adapter) of a model directory is cut short or damaged."""
    for name in sorted(pathlib.Path(path).glob("*.safetensors")) if os.path.isdir(path) else []:
        try:
            safe_open(name, "pt").keys()
        except (OSError, SafetensorError) as e:
            return f"{name} is damaged ({first_line(e)}): copy or download it again"
    return None

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
        config = json.loads(adapter.read_text()) if adapter.exists() else {}
        base = config.get("base_model_name_or_path", path)
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
        model.peft_config["default"].base_model_name_or_path = cfg.model  # (parse_config's)
    if cfg.fsdp:
        shard(model, cfg, layer_names)
    model = model.to(DEVICE)
    return (model if cfg.lora else model.float()), tok

def chat_of(model, tok):
    """The model's Chat, stopping on generation_config's eos ids too, or one line why not."""
    try:
        chat = Chat(tok, model.generation_config.eos_token_id)
    except ValueError as e:  # no template, or one whose turns never end
        die(str(e))
    if chat.fold_system:  # Gemma 2: "System role not supported"
        say("note: the chat template rejects a system message: its text starts the first user one")
    return chat

# FSDP2: every rank holds 1/G of each tensor, and runs the same collectives
def start_distributed():
    global RANK, WORLD
    if "RANK" not in os.environ:
        die("--fsdp runs under torchrun: torchrun --nproc_per_node G loop.py --fsdp ...")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()

def gather(items):
    """Every rank's items, in rank order; this process's alone in one process."""
    if WORLD == 1:
        return items
    parts = [None] * WORLD
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]

def all_reduce(values, op=dist.ReduceOp.SUM):
    """Sum (or max) a list of numbers over the ranks; unchanged in one process."""
    if WORLD == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op)
    return t.tolist()

def shard(model, cfg, layer_names):
    """FSDP2: each rank keeps 1/G of every tensor, sent by rank 0 (the others' are on meta)."""
    weights = model.state_dict() if RANK == 0 else {}
    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if cfg.bf16 else {}
    policy = MixedPrecisionPolicy(**bf16)
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module, mp_policy=policy)
    # the root is the HF model inside peft's wrapper: generate() calls it without the wrapper
    fully_shard(model.get_base_model() if cfg.lora else model, mp_policy=policy)
    # memory in place: tied weights (embedding and head) stay one tensor (meta would split them)
    if RANK > 0:
        model.to_empty(device=DEVICE)
    else:
        model.to(DEVICE)
    options = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd.set_model_state_dict(model, weights, options=options)
    for buffer in model.buffers():  # buffers in no state dict (RoPE's inv_freq): rank 0's
        dist.broadcast(buffer, src=0)

@contextlib.contextmanager
def playing(model, worlds, cfg, desc):
    """A rollout's bar; with --rollout-full-weights FSDP's layers gathered to its end (no all-gather
    per token, more memory); on an error (Ctrl-C, out of memory) its worlds closed."""
    bar = tqdm(desc=desc, leave=False, disable=True if RANK else None)
    # the FSDP modules but the root, which FSDP keeps gathered after its forward
    layers = [m for m in model.modules() if isinstance(m, FSDPModule)][1:]
    layers *= cfg.rollout_full_weights
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        yield bar
    except BaseException:
        for world in worlds:
            getattr(world, "close", lambda: None)()
        raise
    for layer in layers:  # sharded again for the update (reshard() is not recursive)
        layer.reshard()
        layer.set_reshard_after_forward(True, recurse=False)
    bar.close()

# The update's passes; its log-probs: log p(target) per position, no [tokens x vocab] logits
def passes(episodes, indices, budget):
    """episodes[indices] as forward/backward passes, longest first: a pass takes the next while it
    holds at most `budget` cells (rows x its longest) and pads at most 10%; a longer one runs alone.
    All ranks run as many as the busiest (the others' last ones empty)."""
    groups = []
    for i in sorted(indices, key=lambda i: -len(episodes[i].ids)):
        lengths = [len(episodes[j].ids) for j in [*groups[-1], i]] if groups else []  # 0: widest
        if lengths and len(lengths) * lengths[0] <= min(budget, 1.1 * sum(lengths)):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups + [[]] * int(all_reduce([len(groups)], dist.ReduceOp.MAX)[0] - len(groups))

def token_logprobs(model, ids, attn, temperature):
    """log p(x_t | x_<t) [B, T-1] at the temperature: `.logits`, while the head is `scoring`."""
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

def chunked_logprob_head(head, chunk):
    """While `head.scoring` is (targets, temperature, softcap), the head returns log p(target),
    `chunk` positions at a time, recomputed in backward: no [tokens x vocab] logits (32k: 19 GB)."""
    head.scoring = None
    head.chunk = chunk
    head.forward = logprob_head_forward.__get__(head)  # a bound method survives deepcopy

def logprob_head_forward(self, hidden):
    if self.scoring is None:
        return F.linear(hidden, self.weight, self.bias)
    targets, temperature, softcap = self.scoring
    hidden = hidden[:, :targets.shape[1]].reshape(targets.numel(), -1)
    pieces = [torch.utils.checkpoint.checkpoint(
        logprob_piece, hidden[s:s + self.chunk], self.weight, self.bias,
        targets.reshape(-1)[s:s + self.chunk], temperature, softcap, use_reentrant=False)
        for s in range(0, targets.numel(), self.chunk)]
    # a copy, not a view: FSDP warns that an in-place op on its root's view output skips a hook
    return torch.cat(pieces).view(targets.shape).clone()

def logprob_piece(hidden, weight, bias, targets, temperature, softcap):
    logits = F.linear(hidden, weight, bias).float()
    if softcap:  # Gemma 2's cap on the logits that generation samples from
        logits = softcap * torch.tanh(logits / softcap)
    logits.div_(temperature)  # in place: one [chunk x vocab] tensor less
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)

# The KV-cache pre-flight: a wave that cannot fit the GPU stops the run before it starts
def wave_size(cfg, eval_tasks, train_tasks):
    """The most episodes a rank plays at once: its share of a rollout, at most --batch-episodes."""
    n_train = math.ceil(min(cfg.tasks_per_iteration, len(train_tasks)) / WORLD)
    wave = max(math.ceil(len(eval_tasks) / WORLD), n_train * cfg.rollouts_per_task)
    return min(cfg.batch_episodes, wave)

def check_kv_cache(cfg, model, wave):
    """A wave's KV cache (each episode at the cap) that cannot fit the GPU: one line to say so."""
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

# Checkpoints: trainable weights (the adapter with LoRA) and optimizer state by name through
# torch.distributed.checkpoint, one shard per rank, loadable by any number of ranks; the final model
def train_state(model, opt, optimizer):
    """Trainable weights by name, and the optimizer's state tensors by name if asked for."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = {k: v for k, v in sd.get_model_state_dict(model).items() if k in names}
    return {"model": weights, "optim": sd.get_optimizer_state_dict(model, opt) if optimizer else {}}

OBJECTIVE = ("model", "lora", "ratio", "normalize_rewards")  # a checkpoint's: a resume keeps them

def save_checkpoint(run_dir, model, opt, iteration, cfg):
    """Written to checkpoint.tmp, then put in place. No RNG state: iterations seed themselves."""
    path = os.path.join(run_dir, "checkpoint")
    if RANK == 0:
        shutil.rmtree(path + ".tmp", ignore_errors=True)
    # a stateless AdamW (no step yet) saves none: get_state_dict would add a step 0 AdamW counts
    state = train_state(model, opt, optimizer=bool(opt.state))
    objective = json.dumps({k: getattr(cfg, k) for k in OBJECTIVE} | {"inode": inode(cfg.model)})
    dcp.save(state | {"iteration": iteration, "objective": objective}, checkpoint_id=path + ".tmp")
    if RANK == 0:  # (the next save's collectives keep the other ranks from writing before this)
        put_in_place(path)

def put_in_place(path):
    """path.tmp, written whole, becomes path (the one before is path.old between the renames): a
    kill at any moment leaves a complete folder under one of the three names."""
    if os.path.isdir(path):
        shutil.rmtree(path + ".old", ignore_errors=True)  # what a kill may have left
        os.replace(path, path + ".old")
    os.replace(path + ".tmp", path)
    shutil.rmtree(path + ".old", ignore_errors=True)

def last_checkpoint(run_dir, cfg):
    """The newest complete checkpoint of a run and its iteration, (None, 0) if none; checked."""
    paths = [os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.old")]
    paths = [p for p in paths if os.path.isdir(p)] + [None]
    state = {"iteration": 0, "objective": "{}"}
    if paths[0]:
        with reading_checkpoint(paths[0], cfg.model):
            # the metadata first: a damaged checkpoint stops here, not in DCP's tracebacks
            saved = dcp.FileSystemReader(paths[0]).read_metadata().state_dict_metadata
            state = {key: value for key, value in state.items() if key in saved}  # (older: none)
            dcp.load(state, checkpoint_id=paths[0])  # those values alone: no tensor is read
    record = json.loads(state.get("objective", "{}"))  # an older checkpoint's: config.json's
    config = read_json(os.path.join(run_dir, "config.json"))[0] if cfg.resume else {}
    for key in OBJECTIVE:
        value = record.get(key, config.get(key))
        if value is not None and not same(key, value, getattr(cfg, key), record.get("inode")):
            die(f"{flag(key)} cannot change when resuming: {run_dir} was trained with {key} = "
                f"{value!r}: start a new run for another")
    return paths[0], state["iteration"]

@contextlib.contextmanager
def reading_checkpoint(path, model):
    """A checkpoint that cannot be read: one line naming its damaged file (.metadata, or a shard
    shorter than it says), or else DCP's reason."""
    try:
        yield
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - (DCP's: BaseException)
        damaged = [f"{os.path.join(path, '.metadata')} is damaged ({first_line(e)})"]
        with contextlib.suppress(Exception):  # (a cut pickle: the .metadata it is)
            stored = dcp.FileSystemReader(path).read_metadata().storage_data.values()
            ends = {os.path.join(path, item.relative_path): item.offset + item.length
                    for item in stored}
            damaged = [f"{shard} is missing or cut short" for shard, end in ends.items()
                       if not os.path.isfile(shard) or os.path.getsize(shard) < end]
        if damaged:
            die(f"{damaged[0]}: restore it, or delete {path} and --resume starts the run again "
                "from iteration 0")
        cause = next(iter(getattr(e, "failures", {}).values()), [e])[0]  # DCP's: each rank's
        die(f"checkpoint {path} cannot be read into model {model} ({first_line(cause)}): its files "
            "are whole; resume with the model the run began from")

def load_checkpoint(path, model, opt, cfg):
    """Trainable weights and AdamW's state, then the settings' lr and weight decay (said if new)."""
    with reading_checkpoint(path, cfg.model):
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
    """The weights (or the LoRA adapter, no embeddings: else peft asks the hub), the tokenizer and
    trained.json (the iterations, for --eval), to model.tmp, renamed: model/ is whole or absent."""
    options = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = sd.get_model_state_dict(model, options=options)  # every rank: it gathers the shards
    if RANK == 0:
        path = os.path.join(run_dir, "model")
        shutil.rmtree(path + ".tmp", ignore_errors=True)  # what a kill may have left
        model.save_pretrained(path + ".tmp", state_dict=state, save_embedding_layers=False)
        tok.save_pretrained(path + ".tmp")
        trained = json.dumps({"run": os.path.abspath(run_dir), "iteration": iteration})
        pathlib.Path(path + ".tmp", "trained.json").write_text(trained)
        put_in_place(path)  # (a model/ there is of a finish before this resume)

def trained_to(model_dir):
    """The iterations a run's model/ was trained for; None for any other directory."""
    path = pathlib.Path(os.path.expanduser(model_dir), "trained.json")
    return json.loads(path.read_text())["iteration"] if path.exists() else None

def write_atomically(path, text):
    """A kill or an error (a full disk) while this writes leaves the old file, never part of one."""
    try:
        pathlib.Path(path + ".tmp").write_text(text)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise
    os.replace(path + ".tmp", path)

# The log: metrics.jsonl, the console, TensorBoard and wandb; transcripts
def read_metrics(path):
    """A metrics.jsonl's rows; a last line a kill cut is dropped, any other that is no row said."""
    text = pathlib.Path(path).read_text(errors="replace") if os.path.exists(path) else ""
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():  # an editor's blank line
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and not text.endswith("\n"):  # (a row is written with its \n)
                break
            row = None
        iteration = row.get("iteration") if isinstance(row, dict) else None
        if type(iteration) is not int:
            die(f"line {n} of {path} is not a metrics row (a JSON object with an integer "
                f"iteration): {line[:60]!r}; mend or delete the line")
        rows.append(row)
    return rows

class Log:
    """Rank 0's record: each row to metrics.jsonl, a short line to the console; with --track every
    number to TensorBoard, wandb or both (train/ or the split; a resume's from `redone` on)."""

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
            kept = os.path.join(run_dir, "wandb_id")  # the run's wandb run: a resume continues it
            if not os.path.exists(kept):
                write_atomically(kept, os.urandom(8).hex())
            self.wandb = wandb.init(project="loop", dir=run_dir, config=dataclasses.asdict(cfg),
                                    name=os.path.basename(os.path.abspath(run_dir)),
                                    id=pathlib.Path(kept).read_text(), resume="allow",
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

def summary(row):
    """The console's line for a metrics row: the numbers to watch (metrics.jsonl has them all)."""
    failed = f", {row['env_failures']} worlds failed" if row["env_failures"] else ""
    if "split" in row:
        return (f"iteration {row['iteration']}: {row['split']} TGC {100 * row['tgc']:.1f}% SGC "
                f"{100 * row['sgc']:.1f}% of {row['tasks']} tasks{failed}, {row['seconds']:.0f} s")
    return (f"iteration {row['iteration']}: reward {row['reward_mean']:.3f} success "
            f"{100 * row['success_rate']:.1f}% kl {row['kl']:.3f} clip {row['clip_fraction']:.3f}"
            f"{failed}, {row['seconds']:.0f} s")

def write_transcripts(run_dir, split, iteration, episodes, scenario):
    """Rank 0's: the first episode of 3 scenarios spread over the split, the same each time."""
    if RANK > 0:
        return
    first = {}
    for e in episodes:
        first.setdefault(scenario(e.task_id), e)
    firsts = list(first.values())
    shown = [firsts[i * len(firsts) // 3] for i in range(min(3, len(firsts)))]
    os.makedirs(os.path.join(run_dir, "transcripts"), exist_ok=True)
    name = urllib.parse.quote(split, safe="")  # one file's name, whatever it holds (v2%2Fhard)
    path = os.path.join(run_dir, "transcripts", f"{name}_iter{iteration:04d}.txt")
    pathlib.Path(path).write_text("".join(map(transcript, shown)))

def transcript(e):
    """An episode as text: its task, the checks it passed, then every message."""
    failed = " (the world failed)" if e.failed else ""
    head = f"=== {e.task_id}: {e.checks[0]} of {e.checks[1]} checks passed{failed}\n"
    return head + "".join(f"--- {m['role']}\n{m['content']}\n" for m in e.transcript) + "\n"

# The run directory: claimed, named, resumed, finished
class Run:
    """A run as one `with`: FSDP's group, the directory claimed or resumed; on the way out Ctrl-C's
    line (exit code 130), that of a run whose worlds all failed (exit code 1), the teardown."""

    def __init__(self, cfg, World):
        self.cfg, self.World, self.bar = cfg, World, tqdm(disable=True)  # (progress's, if it comes)

    def __enter__(self):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # 1-process DCP
        if self.cfg.fsdp:
            start_distributed()
        self.servers = Servers(self.cfg) if self.cfg.vllm else None  # checked before any writing
        self.dir, self.made = (self.cfg.resume, []) if self.cfg.resume else claim(self.cfg)
        self.checkpoint, self.begin = last_checkpoint(self.dir, self.cfg)  # (a fresh run: none)
        rows = read_metrics(os.path.join(self.dir, "metrics.jsonl"))  # a resume's, before any work
        self.rows = [row for row in rows if row["iteration"] <= self.begin]  # (a fresh run: none)
        # a console that goes away (| head, a closed terminal) drops its lines; the run goes on
        sys.stdout, sys.stderr = Console(sys.stdout), Console(sys.stderr)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        model = os.path.join(self.dir, "model")
        self.finished = self.begin >= self.cfg.iterations and trained_to(model) == self.begin
        if self.finished:
            say(f"{self.dir} is finished ({self.begin} iterations): nothing to do")
        elif self.cfg.resume:  # held only now, before any loading: a refusal touched nothing
            if why := hold(self.dir):
                die(why)
            config = os.path.join(self.dir, "config.json")
            for key in RETIRED.keys() & read_json(config)[0].keys():
                say(f"note: {key} in {config} is no longer a setting ({RETIRED[key]}): left out")
        return self

    @contextlib.contextmanager
    def starting(self):
        """A start that fails (an error, die(), Ctrl-C) leaves the directory as it was, or none."""
        try:
            yield
        except BaseException:  # a fresh run's config.json, the lock, its folders: gone
            if RANK == 0 and not self.cfg.resume:  # (and the adapter that --vllm wrote)
                os.remove(os.path.join(self.dir, "config.json"))
                shutil.rmtree(os.path.join(self.dir, "sampler"), ignore_errors=True)
            release(self.dir)
            remove_empty(self.made)
            raise
        cfg, metrics, rows = self.cfg, os.path.join(self.dir, "metrics.jsonl"), self.rows
        if RANK == 0:  # a resume's rows up to the checkpoint: none twice, no cut line
            write_atomically(os.path.join(self.dir, "config.json"), settings_text(cfg, self.dir))
            write_atomically(metrics, "".join(json.dumps(r) + "\n" for r in rows))
        if cfg.resume:
            say(f"resuming {self.dir} from iteration {self.begin}" if self.checkpoint else
                f"starting {self.dir} again from iteration 0 (no checkpoint yet)")
        else:
            say(f"writing to {self.dir}")
        # a run killed before its first checkpoint keeps its iteration-0 evaluation, if logged
        self.evaluated_at_0 = all_reduce([any("split" in r for r in rows)], dist.ReduceOp.MAX)[0]
        redone = 1 + max((r["iteration"] for r in rows), default=-1)  # trackers redo what follows
        self.log = Log(cfg, self.dir, redone) if RANK == 0 else lambda row: None  # rows: all ranks'

    def progress(self, iterations):
        """The training's progress bar, closed before the run's last line."""
        self.bar = tqdm(iterations, desc="LOOP", disable=RANK != 0)
        return self.bar

    def finish(self, model, tok):
        """The trained model/ (none after an evaluation or 0 iterations) and what to run next."""
        iterations = max(self.begin, self.cfg.iterations)
        if self.cfg.eval:
            say(f"evaluated: {os.path.join(self.dir, 'metrics.jsonl')}")
        elif not iterations:  # the model is the one it started from
            say(f"finished: {self.dir} holds metrics.jsonl and transcripts/ (no iterations, so no "
                "model/)")
        else:
            save_model(self.dir, model, tok, iterations)
            say(f"finished: {self.dir} holds metrics.jsonl, transcripts/ and the trained model/. "
                f"Next: its figures, its model's evaluation, the model playing a task:\n"
                f"{next_steps(self.cfg, self.World, self.dir)}")

    def __exit__(self, kind, error, traceback):
        release(self.dir)  # (under FSDP the others wait for rank 0 below)
        if self.servers and kind is not ServerFailed:  # (a server that failed: no more waiting)
            with contextlib.suppress(ServerFailed):
                self.servers.release()
        self.bar.close()
        started = os.path.exists(os.path.join(self.dir, "config.json"))
        resume = shell(*launcher(self.cfg), "--resume", self.dir)
        if kind is KeyboardInterrupt:  # Ctrl-C: one line that says how to go on, not a traceback
            sys.unraisablehook = lambda unraisable: None  # nor a cut-short progress bar's at exit
            say(f"\ninterrupted: continue with `{resume}`" if started else
                "\ninterrupted before the run started: nothing written")
            sys.exit(130)
        if kind is WorldsFailed:
            say(f"error: {error}")
            sys.exit(1)
        if kind is ServerFailed:  # (at the start: the directory is as it was, or none)
            if not started or self.cfg.eval:
                die(str(error))
            say(f"error: {error}: the finished iterations are kept; once it serves again, "
                f"continue with `{resume}`")
            sys.exit(1)
        if kind is None and self.cfg.fsdp:  # not after an error: the failed rank would wait here
            dist.barrier()  # no rank tears the group down while another still writes the model
            dist.destroy_process_group()

def claim(cfg):
    """A fresh run's directory, locked and its config.json written: two runs never share one; a
    default name takes the next free suffix. Returns it and the folders made (rank 0's)."""
    claimed = [None, [], None]  # the directory, the folders made, an error
    if RANK == 0:
        base = cfg.out or default_out(cfg)
        for n in itertools.count(1):
            run_dir = base if n == 1 else f"{base}-{n}"
            made = [path for path in itertools.accumulate(pathlib.Path(run_dir).parts,
                                                          os.path.join) if not os.path.isdir(path)]
            claimed = [run_dir, made, taken_by(run_dir, cfg.model)]
            try:
                claimed[2] = claimed[2] or take(cfg, run_dir, made)
            except OSError as e:  # a full disk, no permission: it left the folder as it was
                claimed[2] = f"cannot write the run directory {run_dir}: {first_line(e)}"
                break
            if cfg.out or not claimed[2]:  # a default name goes on to the next suffix
                break
    if WORLD > 1:
        dist.broadcast_object_list(claimed)
    if claimed[2]:
        die(claimed[2])
    return claimed[0], claimed[1]

def take(cfg, run_dir, made):
    """Lock a free run_dir and write its config.json; else why not. A failure leaves nothing."""
    done = False
    try:
        os.makedirs(run_dir, exist_ok=True)
        why = hold(run_dir) or taken_by(run_dir, cfg.model)  # (claimed meanwhile by a run)
        if not why:
            write_atomically(os.path.join(run_dir, "config.json"), settings_text(cfg, run_dir))
        done = not why
        return why
    finally:
        if not done:
            release(run_dir)
            remove_empty(made)

def taken_by(run_dir, model):
    """Why a fresh run may not write into run_dir (only a new or empty folder), or None."""
    out, weights = os.path.realpath(run_dir), os.path.realpath(os.path.expanduser(model))
    if os.path.isdir(weights) and os.path.commonpath([out, weights]) == out:
        return f"--out {run_dir} holds the model the run starts from ({model}): give another --out"
    config = os.path.join(run_dir, "config.json")
    settings, why = read_json(config, run_dir) if os.path.isfile(config) else (None, None)
    if why or os.path.isfile(config) and (why := in_use(run_dir)):
        return why
    if isinstance(settings, dict) and settings.get("eval"):  # (nothing to resume)
        return f"{run_dir} already holds an evaluation: give another --out, or delete it first"
    if os.path.isfile(config):
        return (f"{run_dir} already holds a run: continue it with --resume {shlex.quote(run_dir)}, "
                "or give another --out")
    if os.path.islink(run_dir) and not os.path.exists(run_dir):
        return (f"--out {run_dir} is a link to {os.readlink(run_dir)}, which does not exist: make "
                "that folder, or give another --out")
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        return f"--out {run_dir} is a file: give a new or empty folder"
    if os.path.isdir(run_dir) and set(os.listdir(run_dir)) - {"trainer"}:
        return (f"--out {run_dir} holds files and no run (no config.json): give a new or empty "
                "folder (a run never writes over what is there)")
    return None

# One trainer a run directory, for its whole life: a lock on the folder itself (no file in it, that
# a user could delete), which the system lets go at any death. RUN/trainer says who holds it.
HELD = {}  # the run directories this process holds: real path -> the folder, open

def hold(run_dir):
    """Lock run_dir for this process (rank 0, for all ranks) until release(); else why not."""
    key = os.path.realpath(run_dir)
    while key not in HELD and os.environ.get("RANK", "0") == "0":
        try:
            fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:  # removed meanwhile by a fresh start that failed, say
            return f"cannot lock the run directory {run_dir}: {first_line(e)}"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return in_use(run_dir) or hold(run_dir)  # (none: it has just ended)
        except OSError as e:  # a file system without locks (some network ones)
            say(f"note: cannot lock {run_dir} ({e.strerror}): see that no other trainer uses it")
        HELD[key] = fd
        try:  # who holds it, for in_use() to say: a run's first write (chattr +i: before loading)
            holder = f"process {os.getpid()} on {socket.gethostname()}"
            pathlib.Path(run_dir, "trainer").write_text(holder)
        except OSError as e:  # a read-only mount, chattr +i
            release(run_dir)
            return f"cannot write the run directory {run_dir}: {first_line(e)}"
        if not os.fstat(fd).st_nlink:  # removed meanwhile (a fresh start that failed): again
            release(run_dir)
    return None

def in_use(run_dir):
    """Which trainer holds run_dir, in one line; None if none does (nothing is changed)."""
    with contextlib.suppress(OSError):
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # let go of as it closes
        except BlockingIOError:
            holder = "another process"
            with contextlib.suppress(OSError):
                holder = pathlib.Path(run_dir, "trainer").read_text()[:200] or holder
            return (f"{run_dir} is in use by {holder}, a trainer of "
                    "this run: wait for it to end, or stop it first (one trainer a run)")
        finally:
            os.close(fd)
    return None

def release(run_dir):
    """Let go of run_dir's lock, if this process holds it, and RUN/trainer with it."""
    if os.path.realpath(run_dir) in HELD:
        pathlib.Path(run_dir, "trainer").unlink(missing_ok=True)
        os.close(HELD.pop(os.path.realpath(run_dir)))

def default_out(cfg):
    """runs/<time>; an evaluation: RUN/eval-<split> (of RUN/model) or runs/eval-<model>-<split>."""
    if not cfg.eval:
        return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    model, split = os.path.normpath(cfg.model), urllib.parse.quote(cfg.split, safe="")  # v2%2Fhard
    run_dir = os.path.dirname(model)
    if os.path.basename(model) == "model" and os.path.isfile(os.path.join(run_dir, "config.json")):
        return os.path.join(run_dir, f"eval-{split}")
    return os.path.join("runs", f"eval-{os.path.basename(model)}-{split}")

def remove_empty(folders):
    """The folders made, innermost first, as far as they are empty (another run's stay)."""
    for path in reversed(folders):
        try:
            os.rmdir(path)
        except OSError:
            break

def settings_text(cfg, run_dir):
    """config.json: the settings --resume reads (`out`: the run's directory; `resume` is none)."""
    settings = {key: value for key, value in dataclasses.asdict(cfg).items() if key != "resume"}
    return json.dumps(settings | {"out": run_dir}, indent=1)

EVALUATION = ["split", "eval_max_turns", "eval_temperature", "max_new_tokens", "max_context",
              "max_obs_tokens", "code_timeout", "batch_episodes", "bf16"]  # what it depends on

def next_steps(cfg, World, run_dir):
    """The commands that look at a finished run, evaluating as it did (its settings, where they are
    not the command's own); the tools name a registered world module:Class."""
    model = os.path.join(run_dir, "model")

    def flags(env):  # the tiny world's settings are --tiny's
        base = ["--tiny"] if env == "tiny" else ["--env", env]
        own = parse_config(type(cfg), base + ["--eval", "--model", model], None)
        return base + [as_flag(key, getattr(cfg, key)) for key in EVALUATION
                       if getattr(cfg, key) != getattr(own, key)]

    named = f"{World.__module__}:{World.__qualname__}" if registered(cfg) else cfg.env
    steps = [["python", ours("tools/plot.py"), run_dir],
             [*launcher(cfg), *["--fsdp"] * cfg.fsdp, *flags(cfg.env), "--eval", "--model", model]]
    if not named.startswith("__main__:"):
        task = tasks_of(World, cfg.split)[0]
        steps.append(["python", ours("tools/play.py"), *flags(named), "--model", model, "--task",
                      task])
    return "\n".join("  " + shell(*step) for step in steps)

def as_flag(key, value):
    """A setting as its flag's one word (--lr=-1: a value, not a flag)."""
    switch = flag(key) if value else flag("no_" + key)  # a bool: --lora, --no-lora
    return switch if isinstance(value, bool) else f"{flag(key)}={value}"

def launcher(cfg):
    """How a printed command starts a run: loop.py (whichever script called main), or the script
    that registered the run's world (only it knows --env NAME), as it was run; torchrun's too."""
    script = sys.argv[0]
    if not registered(cfg) and os.path.realpath(script) != os.path.realpath(ours("loop.py")):
        script = ours("loop.py")
    return ["torchrun", "--nproc_per_node", "G", script] if cfg.fsdp else ["python", script]

def registered(cfg):
    """Whether the run's world is one that only the script which registered it knows."""
    return cfg.env not in ("tiny", "appworld") and ":" not in cfg.env

def shell(*words):
    """A command as a shell reads it back: every word quoted where it must be."""
    return " ".join(shlex.quote(str(word)) for word in words)

def ours(name):
    """A file of this repository as a path from the current directory (absolute from outside)."""
    path = os.path.relpath(os.path.join(HERE, name))
    return os.path.join(HERE, name) if path.startswith("..") else path
