"""LOOP: Leave-One-Out PPO for LLM agents in stateful environments (arXiv 2502.01600), in one file.

The agent writes Python that calls app APIs over many turns; the whole episode is one token
sequence in which only the tokens the policy sampled are actions (the POMDP of paper §4.1).
Each iteration samples N tasks x K rollouts, scores them, turns returns into leave-one-out
advantages (Eq. 3) and takes PPO steps on a per-token clipped objective (Eq. 5): no critic,
no reference model, one copy of the LLM.

    python loop.py --tiny                      # tiny model in a tiny world, offline, minutes on a CPU
    python loop.py --eval --split test --tiny  # TGC/SGC only
"""
import atexit
import builtins
import dataclasses
import json
import math
import os
import random
import re
import sys
import time
import types
import typing
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm


# ----------------------------------------------------------------------------------------------
# 1. Settings
@dataclass
class Config:
    env: str = "appworld"
    """Environment: appworld (the real AppWorld) or tiny (an offline miniature of it)."""
    model: str = "Qwen/Qwen2.5-32B-Instruct"
    """Hugging Face model id or local path; "tiny" builds a random model from `tiny_model`."""
    tiny_model: dict = field(default_factory=dict)
    """Qwen2Config fields of the tiny model (used when model == "tiny")."""
    seed: int = 0
    """Seed for Python, torch and task sampling."""
    out: str = ""
    """Run directory for metrics.jsonl, transcripts and weights (default runs/<time>)."""
    iterations: int = 200
    """Training iterations (reference code: 200)."""
    tasks_per_iteration: int = 40
    """N: tasks sampled per iteration (paper: 40)."""
    rollouts_per_task: int = 6
    """K: rollouts per task, the leave-one-out group (paper: 6)."""
    train_split: str = "train"
    """Split the training tasks come from."""
    split: str = "test"
    """Split that evaluation reports TGC/SGC on."""
    max_turns: int = 40
    """Turns per training episode (paper: 40)."""
    eval_max_turns: int = 50
    """Turns per evaluation episode (paper: 50)."""
    max_new_tokens: int = 1500
    """Tokens the policy may sample per turn (paper: 1500)."""
    max_context: int = 32768
    """Episode length cap in tokens; the episode ends when the next turn would not fit."""
    max_obs_tokens: int = 3000
    """Environment outputs longer than this are cut, with a note saying so."""
    code_timeout: float = 30.0
    """Seconds the agent's code may run per turn before it is stopped."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts; log-probs are scored at the same one."""
    eval_temperature: float = 0.0
    """Sampling temperature for evaluation (0 = greedy)."""
    lr: float = 5e-5
    """AdamW learning rate, constant (paper: 5e-5)."""
    weight_decay: float = 0.01
    """AdamW weight decay (reference code: 0.01)."""
    grad_clip: float = 1.0
    """Gradient-norm clip (paper: 1.0; reference code: 0.1)."""
    epochs: int = 2
    """Passes over an iteration's rollouts (paper: 2)."""
    minibatch_size: int = 32
    """Rollouts per optimiser step, mixed across tasks (paper: 32)."""
    micro_batch_size: int = 4
    """Rollouts per forward/backward pass; gradients accumulate up to the minibatch."""
    clip_eps: float = 0.1
    """Ratio clipped to [1/(1+eps), 1+eps] as in the reference code (paper: [1-eps, 1+eps])."""
    ratio: str = "token"
    """Importance ratio: token (LOOP, Eq. 5), turn, trajectory, or none (on-policy RLOO)."""
    normalize_rewards: bool = False
    """Divide advantages by the group's reward std (the paper's RwNorm variant; off in LOOP)."""
    min_abs_advantage: float = 0.01
    """Rollouts with |A| below this carry no signal and are dropped."""
    max_kl: float = 20.0
    """Abandon the rest of an iteration when |KL estimate| of a minibatch exceeds this."""
    eval_every: int = 10
    """Evaluate every this many iterations (and before the first and after the last)."""
    eval: bool = False
    """Only evaluate `split`, no training."""
    warmup_steps: int = 0
    """Supervised steps on format-only demonstrations before RL (tiny model only)."""
    warmup_lr: float = 1e-3
    """Peak learning rate of the format warm-up (decays linearly to zero)."""
    batch_episodes: int = 256
    """Episodes generated together in one batch (per rank); bounds the KV cache."""
    logprob_chunk: int = 512
    """Positions per chunk of the vocabulary projection in the update, so [tokens x vocab] logits never exist."""
    fsdp: bool = False
    """Shard weights, gradients and optimizer state over the ranks with FSDP2 (launch with torchrun)."""
    bf16: bool = False
    """bf16 compute; weights, gradients and optimizer state stay fp32 (a LoRA base stays bf16)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: long episodes fit in less memory."""
    lora: bool = False
    """Train a LoRA adapter (the paper's: rank 16, alpha 32, dropout 0, all projections), not all weights."""
    resume: str = ""
    """Run directory to continue from its last complete checkpoint (its config.json is the base)."""
    bench: bool = False
    """Measure the update's memory and time against fine-tuning, chunked log-probs and batched rollouts."""
    report: str = ""
    """Directory of finished runs: print their table by variant (ratio, reward normalisation), draw ablation.png."""


def die(message):
    """A mistake the user can fix: one line saying what to do, exit code 2, no traceback."""
    sys.exit(print(f"error: {message}", file=sys.stderr) or 2)


def parse_config(argv):
    """Defaults <- --config / --tiny JSON file <- flags. User mistakes exit 2 with one message."""
    import argparse
    fields = {f.name: f for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="JSON file of settings")
    p.add_argument("--tiny", action="store_true", help="same as --config tiny_config.json")
    for name, f in fields.items():
        flag, t = "--" + name.replace("_", "-"), hints[name]
        if t is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f.__doc__)
        else:
            p.add_argument(flag, type=json.loads if t is dict else t, default=None, help=f.__doc__)
    args = p.parse_args(argv)
    tiny = args.tiny or (args.bench and not args.config)  # the benchmark's default model is the tiny one
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_config.json") if tiny else args.config
    path = path or (args.resume and os.path.join(args.resume, "config.json"))
    values = {}
    if path:
        try:
            with open(path) as fh:
                values = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            die(f"cannot read config {path}: {e}")
        for k, v in values.items():
            if k not in fields:
                die(f"unknown key {k!r} in {path}; valid keys: {', '.join(fields)}")
            t = hints[k]  # JSON has no float/int split; bool is an int to Python but not here
            if isinstance(v, bool) != (t is bool) or not isinstance(v, (int, float) if t is float else t):
                die(f"{k!r} in {path} must be {t.__name__}, got {v!r}")
    values.update({k: v for k, v in vars(args).items() if k in fields and v is not None})
    cfg = Config(**values)
    if cfg.env not in ENVS:
        die(f"--env must be one of {', '.join(ENVS)}, got {cfg.env!r}")
    if cfg.ratio not in ("token", "turn", "trajectory", "none"):
        die(f"--ratio must be token, turn, trajectory or none, got {cfg.ratio!r}")
    if cfg.rollouts_per_task < 2:
        die("--rollouts-per-task must be >= 2 for leave-one-out advantages")
    return cfg


# ----------------------------------------------------------------------------------------------
# 2. Model and tokenizer
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_tokenizer(corpus, vocab_size=1024):
    """Byte-level BPE trained in code on the world's own text: exact for any text, no download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    # Quoted strings, numbers and words stand alone; runs of code between them may merge whole.
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r'"[^"\n]{0,16}"|\d+| ?[A-Za-z]+(?=[ .?,])'), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|pad|>",
                                  padding_side="left", clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_model_and_tokenizer(cfg, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config
    torch.manual_seed(cfg.seed)  # every rank and every process initialises the same weights (tiny model, LoRA)
    if cfg.model == "tiny":
        tok = build_tiny_tokenizer(TinyWorld.corpus())
        mcfg = Qwen2Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                           bos_token_id=None, **cfg.tiny_model)
        model = AutoModelForCausalLM.from_config(mcfg)
    else:
        looks_local = cfg.model.startswith(("/", ".", "~")) or cfg.model.count("/") > 1
        if looks_local and not os.path.isdir(os.path.expanduser(cfg.model)):
            die(f"model path {cfg.model} does not exist; give a local directory or a "
                "Hugging Face id such as Qwen/Qwen2.5-7B-Instruct")
        path = os.path.expanduser(cfg.model)
        # A saved tiny tokenizer says so; AutoTokenizer would give it Qwen2's pre-tokenizer (model_type qwen2)
        saved = os.path.join(path, "tokenizer_config.json")
        tiny = os.path.exists(saved) and json.load(open(saved)).get("tokenizer_class") == "TokenizersBackend"
        try:  # bf16 on the host halves its memory per rank; full fine-tuning upcasts after sharding
            tok = (PreTrainedTokenizerFast if tiny else AutoTokenizer).from_pretrained(path, padding_side="left")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if cfg.bf16 else torch.float32)
        except OSError as e:
            die(f"cannot load model {cfg.model!r} (not a local directory, and not in the "
                f"Hugging Face cache or reachable): {e}")
        tok.pad_token = tok.pad_token or tok.eos_token
    # Hub defaults (top-k, top-p, repetition penalty) would make sampling differ from the plain
    # softmax at temperature T that the update scores: start from an empty generation config.
    model.generation_config = GenerationConfig()
    chunked_logprob_head(model.get_output_embeddings(), cfg.logprob_chunk)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer_names = set(model._no_split_modules)  # the decoder layer class: the unit FSDP shards by
    if cfg.lora:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            die("--lora needs peft: pip install peft")
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if cfg.fsdp:  # each rank keeps 1/G of every tensor; layers are gathered one at a time to compute
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if cfg.bf16 else MixedPrecisionPolicy()
        for m in model.modules():
            if type(m).__name__ in layer_names:
                fully_shard(m, mp_policy=mp)
        # the root is the HF model inside peft's wrapper: generate() calls it without the wrapper
        fully_shard(model.get_base_model() if cfg.lora else model, mp_policy=mp)  # moves shards to the device
    model = model.to(device)
    return (model if cfg.lora else model.float()), tok


def chunked_logprob_head(head, chunk):
    """While `head.targets` is set, the LM head returns log p(target) per position instead of
    logits, projecting `chunk` positions at a time and recomputing each chunk in backward: the
    [tokens x vocab] logits (19 GB for 32k tokens of Qwen's 152k vocabulary) never exist at once.
    It runs inside the model's forward so that FSDP has the head's weights gathered."""
    head.targets, head.temperature, head.chunk = None, 1.0, chunk
    head.forward = types.MethodType(_logprob_head_forward, head)  # a bound method survives deepcopy


def _logprob_head_forward(self, h):
    if self.targets is None:
        return F.linear(h, self.weight, self.bias)
    y, c = self.targets.reshape(-1), self.chunk
    h = h[:, :self.targets.shape[1]].reshape(len(y), -1)
    return torch.cat([torch.utils.checkpoint.checkpoint(_logprob_piece, h[s:s + c], self.weight, self.bias, y[s:s + c],
                                                        self.temperature, use_reentrant=False)
                      for s in range(0, len(y), c)]).view(self.targets.shape)


def _logprob_piece(h, weight, bias, y, temperature):
    logits = F.linear(h, weight, bias).float().div_(temperature)  # in place: one [chunk x vocab] tensor less
    return logits.gather(-1, y[:, None]).squeeze(-1) - logits.logsumexp(-1)


def rank_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def all_reduce(values, op="sum"):
    """Sum (or max) a list of numbers over the ranks; unchanged in one process."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


class Chat:
    """Token bookkeeping for one chat template. Templates are not append-only (default system
    prompts, the newline after the end-of-turn token), so an episode is never re-templated: it is
    the prompt, then the ids actually sampled, then each environment message's own tokens."""

    def __init__(self, tok):
        self.tok = tok
        self.eot = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
        self.stop_ids = sorted({self.eot, tok.eos_token_id} | {tok.convert_tokens_to_ids(t) for t in
                               ("<|endoftext|>", "<|im_start|>") if t in tok.get_vocab()})
        # What the template puts between the end of an assistant turn and the next generation:
        # render a probe conversation with and without a user message and take the difference.
        a, b, obs = "\x00ASSISTANT\x00", "\x00OBSERVATION\x00", [{"role": "user", "content": "task"}]
        probe = obs + [{"role": "assistant", "content": a}]
        before = tok.apply_chat_template(probe, tokenize=False)
        after = tok.apply_chat_template(probe + [{"role": "user", "content": b}], tokenize=False,
                                        add_generation_prompt=True)
        eot_text = tok.convert_ids_to_tokens(self.eot)
        cut = before.index(a + eot_text) + len(a + eot_text)
        assert after[:cut] == before[:cut], "chat template renders earlier turns differently"
        pre, post = after[cut:].split(b)
        self.pre, self.post = self.encode(pre), self.encode(post)

    def encode(self, text, literal=False):
        """Template text keeps its special tokens; environment text (literal) never can end a turn."""
        return self.tok(text, add_special_tokens=False, split_special_tokens=literal)["input_ids"]

    def prompt(self, messages):
        return self.encode(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def truncate(self, text, max_tokens):
        ids = self.encode(text, literal=True)
        if len(ids) <= max_tokens:
            return text
        head = self.tok.decode(ids[:max_tokens])
        cut = max(head.rfind("\n"), head.rfind(" "))
        return (head[:cut] if cut > 0 else head) + f"\n[output truncated: {len(ids)} tokens, showing the first {max_tokens}]"


# ----------------------------------------------------------------------------------------------
# 3. Environments. Fork here for a new environment: a class made as Env(task_id, timeout, experiment)
#    with tasks(split) -> ids "<scenario>_<n>", messages(), step(code) -> observation, done, and
#    evaluate() -> (tests passed, tests total).
def extract_code(text):
    """All ```python / ```py blocks joined; an unterminated last block counts; no block -> ""."""
    blocks = re.findall(r"```(?:python|py)[ \t]*\n(.*?)(?:```|$)", text, flags=re.S)
    return "\n".join(b.rstrip() for b in blocks)


class CodeLimit(BaseException):  # not an Exception: the agent's `except Exception` cannot swallow it
    pass


SAFE_BUILTINS = {n: getattr(builtins, n) for n in (
    "abs all any bool dict enumerate filter float int isinstance len list map max min print range repr "
    "reversed round set sorted str sum tuple zip Exception KeyError ValueError TypeError").split()}


def run_code(code, namespace, timeout, max_chars=20000):
    """Run agent code in a persistent namespace with restricted builtins and a deadline. Whatever
    happens (exception, syntax error, endless loop, flood of output) comes back as text."""
    out, size = [], [0]

    def _print(*args, sep=" ", end="\n", **_):
        s = sep.join(map(str, args)) + end
        size[0] += len(s)
        if size[0] > max_chars:
            raise CodeLimit(f"output exceeded {max_chars} characters")
        out.append(s)

    deadline = time.monotonic() + timeout

    def tracer(frame, event, arg):  # a line-level deadline works in any thread, unlike signals
        if time.monotonic() > deadline:
            raise CodeLimit(f"code ran longer than {timeout} s")
        return tracer

    namespace["__builtins__"] = dict(SAFE_BUILTINS, print=_print)
    old, status = sys.gettrace(), ""
    try:
        sys.settrace(tracer)
        exec(compile(code, "<agent>", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 - the agent's failure is an observation, never a crash
        if isinstance(e, KeyboardInterrupt):
            raise
        status = f"Execution failed. {type(e).__name__}: {e}"
    finally:
        sys.settrace(old)
    return ("".join(out) + status).strip() or "Execution successful."


NAMES = ["alice", "bob", "carol", "dave", "erin", "frank"]
TOPICS = ["milk", "books", "rent", "trip", "gym", "lunch"]
DEMO_REQUESTS = [  # warm-up request families that no split contains: call, pin, ask, say
    ['Call "{name}".', 'Give "{name}" a call.', 'Ring "{name}" please.', '"{name}" is waiting for your call.'],
    ['Pin the note "{topic}".', 'Pin "{topic}" to the top.', 'Keep the note "{topic}" pinned.', 'The note "{topic}" should be pinned.'],
    ['Ask "{name}" for {n} dollars.', 'Request {n} dollars from "{name}".', '"{name}" owes me {n} dollars; ask for them.',
     'Get {n} dollars back from "{name}".'],
    ["Say {value}.", "Reply with {value}.", "Answer {value} and finish.", "My answer is {value}; give it."]]


class TinyWorld:
    """A miniature AppWorld: three stateful apps (contacts, bank, notes) behind `apis`, a
    supervisor who receives the answer, and unit-test-like checks on the end state. Tasks come in
    scenarios of three (same template, different values); train and test hold different scenarios."""

    FAMILIES = {"pay": 'Send {amount} dollars to "{name}".',
                "phone": 'What is the phone number of "{name}"?',
                "note": 'Create a note titled "{topic}".'}
    SYSTEM = ("You act for your supervisor. Write Python in ```python blocks; it runs in a REPL with "
              "`apis`: contacts.phone(name), contacts.call(name), bank.balance(), bank.send(to, amount), "
              "bank.request(name, amount), notes.create(title), notes.pin(title), supervisor.complete_task(answer=None).")

    @staticmethod
    def tasks(split):
        ids = [f"{fam}{i:02d}_{n}" for fam in TinyWorld.FAMILIES for i in range(12) for n in (1, 2, 3)]
        scenarios = sorted({t.split("_")[0] for t in ids})
        random.Random(1234).shuffle(scenarios)
        chosen = {"train": scenarios[9:], "test": scenarios[:9]}.get(split) or die(
            f"the tiny world's splits are train and test, not {split!r}")
        return [t for t in ids if t.split("_")[0] in chosen]

    def __init__(self, task_id, timeout=5.0, experiment=None):
        self.task_id, self.timeout = task_id, timeout
        family, i = task_id[:-4], int(task_id[-4:-2])  # "<family><ii>_<n>"
        rng = random.Random(task_id)
        self.family, self.instruction = family, self.FAMILIES[family]
        self.params = {"name": NAMES[i % len(NAMES)], "topic": TOPICS[i % len(TOPICS)], "amount": rng.randint(1, 5)}
        self.phones = {n: f"555-{rng.randint(1000, 9999)}" for n in NAMES}
        self.balance, self.transfers, self.notes = rng.randint(20, 99), [], []
        self.answer, self.done = None, False
        self.namespace = {"apis": self._apis()}

    def _apis(self):
        w, ns = self, lambda **kw: type("App", (), {k: staticmethod(v) for k, v in kw.items()})

        def phone(name):
            if name not in w.phones:
                raise KeyError(f"no contact named {name!r}")
            return w.phones[name]

        def send(to, amount):
            if to not in w.phones:
                raise KeyError(f"no contact named {to!r}")
            if not isinstance(amount, int) or not 0 < amount <= w.balance:
                raise ValueError(f"invalid amount {amount!r}; balance is {w.balance}")
            w.balance -= amount
            w.transfers.append((to, amount))
            return "sent"

        def create(title):
            w.notes.append(str(title))
            return len(w.notes)

        def complete_task(answer=None):
            w.answer, w.done = answer, True
            return "task completed"

        # call, request and pin serve only the warm-up's request families; no check reads them
        return ns(contacts=ns(phone=phone, call=lambda name: f"calling {phone(name)}"),
                  bank=ns(balance=lambda: w.balance, send=send, request=lambda name, amount: phone(name) and "requested"),
                  notes=ns(create=create, pin=lambda title: f"pinned {title}"),
                  supervisor=ns(complete_task=complete_task))

    def messages(self):
        return [{"role": "system", "content": self.SYSTEM},
                {"role": "user", "content": self.instruction.format(**self.params)}]

    def step(self, code):
        return run_code(code, self.namespace, self.timeout)

    def evaluate(self):
        """Checks on the end state; partial credit always points at the full solution."""
        p, t = self.params, self.transfers
        if self.family == "pay":
            checks = [len(t) == 1, bool(t) and all(to == p["name"] for to, _ in t),
                      bool(t) and all(a == p["amount"] for _, a in t), self.done]
        elif self.family == "phone":
            checks = [self.answer in self.phones.values(), self.answer == self.phones[p["name"]], self.done]
        else:
            checks = [len(self.notes) == 1, self.notes == [p["topic"]], self.done]
        return sum(checks), len(checks)

    @staticmethod
    def demo(rng):
        """A warm-up demonstration that solves no train or test task: a request of a family in no
        split (call, pin, ask, say: each copies the request's quoted values into the arguments of
        an API no task needs), or random calls with random arguments under a neutral request."""
        name, topic, n = rng.choice(NAMES), rng.choice(TOPICS), rng.randint(1, 5)
        value = rng.choice([f'"{name}"', f'"{topic}"', str(n)])
        done = "\napis.supervisor.complete_task()"
        r = rng.randrange(5)
        if r < 4:  # many phrasings of each request, so that what carries over is "quoted values become arguments"
            request = rng.choice(DEMO_REQUESTS[r]).format(name=name, topic=topic, n=n, value=value)
            code = [f'apis.contacts.call(name="{name}"){done}', f'apis.notes.pin(title="{topic}"){done}',
                    f'apis.bank.request(name="{name}", amount={n}){done}', f"apis.supervisor.complete_task(answer={value})"][r]
            return rng.choice(["", "Hello. ", "Next: "]) + request, [f"```python\n{code}\n```"]
        looks = ["print(apis.bank.balance())", f'print(apis.contacts.phone(name="{rng.choice(NAMES)}"))']
        acts = [f'apis.bank.send(to="{rng.choice(NAMES)}", amount={rng.randint(1, 5)}){done}',
                f'apis.supervisor.complete_task(answer=apis.contacts.phone(name="{rng.choice(NAMES)}"))',
                f'apis.notes.create(title="{rng.choice(TOPICS)}"){done}']
        turns = ([rng.choice(looks)] if rng.random() < 0.3 else []) + [rng.choice(acts)]
        return "Try the apis.", [f"```python\n{c}\n```" for c in turns]

    @staticmethod
    def corpus():
        rng, world = random.Random(0), TinyWorld("pay00_1")
        text = [world.SYSTEM] * 20 + [TinyWorld(t).messages()[1]["content"] for s in ("train", "test") for t in TinyWorld.tasks(s)]
        text += [d for _ in range(2000) for d in (lambda q, turns: [q, *turns])(*TinyWorld.demo(rng))]
        text += list(world.phones.values())
        return text + ["system user assistant", "Execution successful.", "Execution failed. KeyError: ValueError: task completed"]


APPWORLD_PROMPT = """You are an AI assistant who acts for your supervisor by operating their apps. You \
work in a Python REPL: every reply of yours is code in ```python blocks, which runs, and its output \
comes back to you. The apps are reached through `apis.<app_name>.<api_name>(...)`.
- Discover what exists with apis.api_docs.show_app_descriptions(), \
apis.api_docs.show_api_descriptions(app_name=...) and apis.api_docs.show_api_doc(app_name=..., api_name=...).
- Account credentials: apis.supervisor.show_account_passwords(); the supervisor's details: \
apis.supervisor.show_profile().
- Print what you need to see; look before you act; do one small step per reply.
- When the task is done, call apis.supervisor.complete_task(answer=...) with the answer if the task \
asks a question, else apis.supervisor.complete_task().

Example. Task: How many notes do I have in Simple Note?
```python
print(apis.api_docs.show_api_descriptions(app_name="simple_note"))
```
Output: [{"name": "login", ...}, {"name": "search_notes", ...}, ...]
```python
passwords = {p["account_name"]: p["password"] for p in apis.supervisor.show_account_passwords()}
token = apis.simple_note.login(username=apis.supervisor.show_profile()["email"], password=passwords["simple_note"])["access_token"]
notes, page = [], 0
while batch := apis.simple_note.search_notes(access_token=token, page_index=page):
    notes, page = notes + batch, page + 1
apis.supervisor.complete_task(answer=len(notes))
```"""


def _appworld_worker(conn, task_id, experiment, timeout):
    """One AppWorld world in its own process (AppWorld allows one world per process)."""
    import warnings
    warnings.filterwarnings("ignore")
    from appworld import AppWorld
    world = AppWorld(task_id=task_id, experiment_name=experiment, timeout_seconds=int(max(1, timeout)))
    s = world.task.supervisor
    conn.send((world.task.instruction, f"{s.first_name} {s.last_name}", s.email, s.phone_number, str(world.task.datetime)))
    while True:
        command, code = conn.recv()
        if command == "execute":
            conn.send((world.execute(code), world.task_completed()))
        else:
            tracker = world.evaluate()
            world.close()
            conn.send((tracker.pass_count, tracker.num_tests))
            return


class AppWorldEnv:
    """The real AppWorld (appworld package). Each episode's world lives in a worker process; one
    that dies or hangs ends its episode as failed (reward 0) and training goes on."""

    @staticmethod
    def tasks(split):
        """Task ids of an AppWorld split, or train_paper: the paper's training set."""
        try:
            import appworld
        except ImportError:
            die("the appworld package is missing: pip install -r requirements.txt")
        if not os.path.isdir(os.path.join(os.path.dirname(appworld.__file__), "apps", "supervisor")):
            from appworld.install import install_package
            install_package()  # `appworld install`: unpacks the apps shipped in the wheel, offline
        root = os.environ.get("APPWORLD_ROOT", os.getcwd())
        name = "train" if split == "train_paper" else split
        if not os.path.exists(os.path.join(root, "data", "datasets", f"{name}.txt")):
            die(f"no AppWorld data for split {name!r} under {root}/data: run `appworld download data` "
                "once (it needs the internet), or set APPWORLD_ROOT to the folder that holds data/")
        from appworld import load_task_ids
        if split == "train_paper":  # the paper's training set: train tasks of difficulty 1 and 2
            return load_task_ids("train", difficulty=1) + load_task_ids("train", difficulty=2)
        return load_task_ids(split)

    def __init__(self, task_id, timeout=5.0, experiment="loop"):
        import multiprocessing as mp
        self.task_id, self.timeout, self.done, self.failed, self._info = task_id, timeout, False, False, None
        ctx = mp.get_context("fork")  # the world's process needs none of the model's state
        self.conn, child = ctx.Pipe()
        self.worker = ctx.Process(target=_appworld_worker, args=(child, task_id, experiment, timeout), daemon=True)
        self.worker.start()
        child.close()  # so that a dead worker reads as EOF here

    def _call(self, message, wait):
        try:
            if message is not None:
                self.conn.send(message)
            if self.conn.poll(wait):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        self.worker.kill()
        self.failed = self.done = True
        return None

    def messages(self):  # waits for the world, so that all of an iteration's worlds start at once
        self._info = self._info or self._call(None, wait=300) or ("(the environment failed to start)",) + ("",) * 4
        instruction, name, email, phone, date = self._info
        return [{"role": "system", "content": APPWORLD_PROMPT},
                {"role": "user", "content": f"Date: {date}\nMy name is {name}, email {email}, phone {phone}.\nTask: {instruction}"}]

    def step(self, code):
        reply = None if self.failed else self._call(("execute", code), wait=self.timeout + 60)
        if reply is None:
            return "Environment failed: the world stopped answering."
        output, self.done = reply
        return output

    def evaluate(self):
        result = None if self.failed else self._call(("evaluate", None), wait=120)
        self.worker.join(timeout=5)
        return result if result is not None else (0, 1)


ENVS = {"tiny": TinyWorld, "appworld": AppWorldEnv}


# ----------------------------------------------------------------------------------------------
# 4. Rollouts: the POMDP of paper §4.1. One token sequence per episode; `is_output` marks the
#    tokens the policy sampled (its actions, stop token included), everything else is context.
@dataclass(eq=False)
class Episode:
    task_id: str
    env: typing.Any
    ids: list
    is_output: list
    turn: list  # turn index of each sampled token, -1 for context tokens
    transcript: list
    done: bool = False
    reward: float = 0.0
    success: bool = False

    def add(self, ids, output=False, turn=-1):
        self.ids += ids
        self.is_output += [output] * len(ids)
        self.turn += [turn] * len(ids)


def new_episode(env, task_id, chat):
    messages = env.messages()
    e = Episode(task_id, env, [], [], [], list(messages))
    e.add(chat.prompt(messages))
    return e


@torch.no_grad()
def generate(model, chat, prompts, temperature, max_new_tokens):
    """Sample one turn for a batch of episodes; returns each one's sampled ids, cut after the
    first stop token. The update rescores them, so no per-step logits are kept here."""
    from transformers import GenerationConfig
    tok, device = chat.tok, next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = dict(do_sample=False) if temperature <= 0 else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    gc = GenerationConfig(**sampling, max_new_tokens=max_new_tokens, eos_token_id=chat.stop_ids, pad_token_id=tok.pad_token_id)
    # synced: under FSDP a rank that is done keeps joining the others' forward passes
    out = model.generate(input_ids=ids, attention_mask=attn, generation_config=gc, synced_gpus=dist.is_initialized())
    rows = out[:, width:].tolist()
    return [row[:next((i + 1 for i, t in enumerate(row) if t in chat.stop_ids), len(row))] for row in rows]


def rollout(model, chat, envs, task_ids, cfg, temperature, max_turns, desc="rollout"):
    """Play all episodes to the end, one batched generation per turn for every live episode."""
    model.eval()
    episodes = [new_episode(env, t, chat) for env, t in zip(envs, task_ids)]
    for turn in tqdm(range(max_turns), desc=desc, leave=False, disable=None if rank_world()[0] == 0 else True):
        for e in episodes:
            e.done = e.done or len(e.ids) >= cfg.max_context
        live = [e for e in episodes if not e.done]
        # Every rank runs as many generations as the busiest one (FSDP's collectives must match)
        n_batches = int(all_reduce([math.ceil(len(live) / cfg.batch_episodes)], "max")[0])
        if not n_batches:
            break
        room = max((cfg.max_context - len(e.ids) for e in live), default=1)
        for s in range(0, n_batches * cfg.batch_episodes, cfg.batch_episodes):
            batch = live[s:s + cfg.batch_episodes]
            outs = generate(model, chat, [e.ids for e in batch] or [[chat.eot]], temperature, min(cfg.max_new_tokens, room))
            for e, new in zip(batch, outs):
                new = new[:cfg.max_context - len(e.ids)]
                e.add(new, output=True, turn=turn)
                text = chat.tok.decode(new, skip_special_tokens=True)  # whole turns only: bytes stay intact
                obs = chat.truncate(e.env.step(extract_code(text)), cfg.max_obs_tokens)
                e.transcript += [{"role": "assistant", "content": text}, {"role": "user", "content": obs}]
                e.done = e.env.done or turn == max_turns - 1 or len(e.ids) >= cfg.max_context
                if not e.done:  # the environment's reply, then the cue for the next turn
                    e.add(([] if new and new[-1] == chat.eot else [chat.eot]) + chat.pre
                          + chat.encode(obs, literal=True) + chat.post)
    for e in episodes:
        passed, total = e.env.evaluate()
        e.reward, e.success = passed / total, passed == total
    return episodes


# ----------------------------------------------------------------------------------------------
# 5. Leave-one-out advantages (Eq. 3)
def loo_advantages(rewards, normalize=False):
    """rewards [N, K] -> A_k = R_k - mean_{i!=k} R_i = K/(K-1) (R_k - mean R), no std division."""
    k = rewards.shape[1]
    adv = k / (k - 1) * (rewards - rewards.mean(1, keepdim=True))  # Eq. 3
    if normalize:  # the paper's RwNorm ablation, not LOOP
        adv = adv / (rewards.std(1, keepdim=True) + 1e-6)
    return adv


# ----------------------------------------------------------------------------------------------
# 6. The clipped objective (Eq. 5) and its per-turn / per-trajectory / on-policy variants
def loop_loss(logp, old_logp, adv, mask, turn, ratio="token", eps=0.1):
    """Per-rollout loss (to minimise) and number of clipped tokens.

    logp, old_logp, mask, turn: [B, T] over target tokens; adv: [B]. Each rollout's loss is the
    mean over its own output tokens (a(x) = mask) of -min(r A, clip(r, 1/(1+eps), 1+eps) A)."""
    mask = mask.float()
    n = mask.sum(1).clamp(min=1)
    a = adv[:, None]
    if ratio == "none":  # on-policy RLOO: -A * mean log p
        return -(adv * (logp * mask).sum(1) / n), torch.zeros((), device=logp.device)
    log_r = (logp - old_logp) * mask
    if ratio == "turn":  # one ratio per assistant turn, shared by that turn's tokens
        onehot = F.one_hot(turn.clamp(min=0), int(turn.max()) + 1) * mask[..., None]
        log_r = torch.einsum("bj,btj->bt", torch.einsum("bt,btj->bj", log_r, onehot), onehot)
    elif ratio == "trajectory":  # one ratio per rollout: prod_t r_t
        log_r = log_r.sum(1, keepdim=True).expand_as(mask)
    r = torch.exp(log_r)
    clipped = torch.clamp(r, 1 / (1 + eps), 1 + eps)
    obj = torch.minimum(r * a, clipped * a)  # Eq. 5
    n_clipped = (((clipped * a) < (r * a)) & mask.bool()).sum()
    return -(obj * mask).sum(1) / n, n_clipped


# ----------------------------------------------------------------------------------------------
# 7. The training step
def pad_batch(episodes, device):
    width = max(len(e.ids) for e in episodes)
    pad = lambda rows, v: torch.tensor([r + [v] * (width - len(r)) for r in rows], device=device)  # noqa: E731
    return (pad([e.ids for e in episodes], 0), pad([[1] * len(e.ids) for e in episodes], 0),
            pad([e.is_output for e in episodes], False), pad([e.turn for e in episodes], -1))


def token_logprobs(model, ids, attn, temperature):
    """log p(x_t | x_<t) of each next token [B, T-1] at the sampling temperature, in chunks."""
    head = model.get_output_embeddings()
    head.targets, head.temperature = ids[:, 1:], max(temperature, 1e-6)
    try:
        return model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    finally:
        head.targets = None


def update(model, opt, episodes, advantages, cfg):
    """PPO epochs over the iteration's rollouts with the per-token clipped objective. Under FSDP a
    minibatch spans the ranks (each takes its share of its own rollouts) and every rank runs the
    same number of passes, an empty one where it has run out, so that collectives always match."""
    rank, world = rank_world()
    device = next(model.parameters()).device
    keep = [i for i, a in enumerate(advantages.tolist()) if abs(a) >= cfg.min_abs_advantage]
    counts = all_reduce([len(keep) * (r == rank) for r in range(world)])  # rollouts kept per rank
    stats = {"rollouts_used": int(sum(counts)), "steps": 0, "skipped_nan": 0, "abandoned": False,
             "kl": 0.0, "clip_fraction": 0.0, "loss": 0.0, "grad_norm": 0.0}
    if not sum(counts):
        return stats
    share = math.ceil(cfg.minibatch_size / world)  # this rank's part of a minibatch
    passes = lambda sizes: max(math.ceil(n / cfg.micro_batch_size) for n in sizes)  # noqa: E731
    micro = lambda idx, n: [idx[j * cfg.micro_batch_size:(j + 1) * cfg.micro_batch_size] for j in range(n)]  # noqa: E731
    filler = Episode("", None, [0, 0], [False, False], [-1, -1], [])  # no output tokens: zero loss
    batch = lambda chunk: pad_batch([episodes[i] for i in chunk] or [filler], device)  # noqa: E731
    model.eval()  # psi: old log-probs from the same model, right before the update, same temperature
    old = {}
    with torch.no_grad():
        for chunk in micro(keep, passes(counts)):
            for i, lp in zip(chunk, token_logprobs(model, *batch(chunk)[:2], cfg.temperature)):
                old[i] = lp[:len(episodes[i].ids) - 1]
    model.train()
    params = [p for group in opt.param_groups for p in group["params"]]  # FSDP's sharded ones, not its gathered views
    kls, clipped, outputs, losses, norms = [], 0, 0, [], []
    for _ in range(cfg.epochs):
        order = random.sample(keep, len(keep))
        for j in range(max(math.ceil(n / share) for n in counts)):
            sizes = [min(share, max(0, n - j * share)) for n in counts]  # every rank's part of this minibatch
            opt.zero_grad(set_to_none=True)
            mb = [0.0, 0.0, 0, 0]  # loss sum, KL sum, clipped tokens, output tokens
            for chunk in micro(order[j * share:(j + 1) * share], passes(sizes)):
                ids, attn, is_out, turn = batch(chunk)
                logp = token_logprobs(model, ids, attn, cfg.temperature)
                old_lp = torch.nn.utils.rnn.pad_sequence([old[i] for i in chunk], batch_first=True) if chunk else logp.detach()
                mask = is_out[:, 1:] & attn[:, 1:].bool()
                adv = advantages[chunk].to(device) if chunk else torch.zeros(1, device=device)
                per_rollout, n_clip = loop_loss(logp, old_lp, adv, mask, turn[:, 1:], cfg.ratio, cfg.clip_eps)
                # sum over rollouts / minibatch size; x world because FSDP averages gradients over ranks
                (per_rollout.sum() * world / cfg.minibatch_size).backward()
                mb = [a + b for a, b in zip(mb, [per_rollout.sum().item(), -((logp - old_lp) * mask).sum().item(),
                                                  n_clip.item(), mask.sum().item()])]
            loss_sum, kl_sum, mb_clipped, mb_out = all_reduce(mb)
            kl = kl_sum / sum(sizes)
            kls.append(kl)
            if abs(kl) > cfg.max_kl:  # the policy moved too far: stop using these rollouts
                opt.zero_grad(set_to_none=True)
                stats["abandoned"] = True
                break
            if not math.isfinite(loss_sum):
                opt.zero_grad(set_to_none=True)
                stats["skipped_nan"] += 1
                continue
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
            opt.step()
            stats["steps"] += 1
            losses.append(loss_sum / cfg.minibatch_size)
            clipped, outputs = clipped + mb_clipped, outputs + mb_out
        if stats["abandoned"]:
            break
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    stats.update(kl=mean(kls), clip_fraction=clipped / max(outputs, 1), loss=mean(losses), grad_norm=mean(norms))
    return stats


# ----------------------------------------------------------------------------------------------
# 8. Evaluation: TGC = tasks whose tests all pass, SGC = scenarios all of whose tasks pass
def evaluate(model, chat, cfg, split, iteration, run_dir):
    env = ENVS[cfg.env]
    rank, world = rank_world()
    tasks = env.tasks(split)[rank::world]  # each rank plays its share; rank 0 gathers the results
    experiment = f"loop-{os.path.basename(os.path.abspath(run_dir))}-{split}-iter{iteration:04d}"
    episodes = rollout(model, chat, [env(t, cfg.code_timeout, experiment) for t in tasks], tasks, cfg,
                       cfg.eval_temperature, cfg.eval_max_turns, desc=f"eval {split}")
    results = [(e.task_id, e.success, e.reward) for e in episodes]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, results)
        results = [r for part in parts for r in part]
    by_scenario = {}
    for task_id, success, _ in results:
        by_scenario.setdefault(task_id.split("_")[0], []).append(success)
    result = {"iteration": iteration, "split": split, "tgc": sum(r[1] for r in results) / len(results),
              "sgc": sum(all(v) for v in by_scenario.values()) / len(by_scenario),
              "reward_mean": sum(r[2] for r in results) / len(results), "tasks": len(results),
              "per_task": {task_id: success for task_id, success, _ in results}}
    if cfg.env == "appworld":  # `appworld evaluate <experiment> <split>` reports the same numbers
        result["appworld_experiment"] = experiment
    if run_dir and rank == 0:
        os.makedirs(os.path.join(run_dir, "transcripts"), exist_ok=True)
        with open(os.path.join(run_dir, "transcripts", f"{split}_iter{iteration:04d}.txt"), "w") as fh:
            for e in episodes[:3]:
                fh.write(f"=== {e.task_id} reward={e.reward:.2f} success={e.success}\n")
                fh.write("".join(f"--- {m['role']}\n{m['content']}\n" for m in e.transcript) + "\n")
    return result


# ----------------------------------------------------------------------------------------------
# 9. Checkpoints: trainable weights (the adapter with LoRA) and optimizer state by name through
#    torch.distributed.checkpoint, one shard per rank, loadable by any number of ranks
def _train_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {"model": {k: v for k, v in model_sd.items() if k in names}, "optim": optim_sd}


def save_checkpoint(run_dir, model, opt, iteration):
    """Written under a temporary name, then renamed: a killed run leaves the last complete one.
    No RNG state: every iteration seeds itself from (seed, iteration, rank)."""
    import shutil
    import torch.distributed.checkpoint as dcp
    rank, path, tmp = rank_world()[0], os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "checkpoint.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dcp.save(_train_state(model, opt) | {"iteration": iteration}, checkpoint_id=tmp)  # all ranks; returns when written
    if rank == 0:  # (the next save's collectives keep the other ranks from writing before this is done)
        if os.path.isdir(path):
            os.replace(path, path + ".old")  # between the two renames, checkpoint.old is the complete one
        os.replace(tmp, path)
        shutil.rmtree(path + ".old", ignore_errors=True)


def load_checkpoint(run_dir, model, opt):
    """Restore weights and optimizer; returns the iteration the checkpoint finished."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    path = next((p for p in (os.path.join(run_dir, n) for n in ("checkpoint", "checkpoint.old")) if os.path.isdir(p)), None)
    if path is None:
        die(f"no checkpoint in {run_dir} to resume from")
    state = _train_state(model, opt) | {"iteration": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    return state["iteration"]


# ----------------------------------------------------------------------------------------------
# 10. Main: format warm-up (tiny only), then iterations of rollouts -> advantages -> update
def warmup(model, chat, cfg):
    """Teach a random model the action format, a stand-in for instruction tuning, on
    demonstrations that solve no train or test task (TinyWorld.demo)."""
    rng, opt = random.Random(cfg.seed), torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr)
    model.train()
    for step in tqdm(range(cfg.warmup_steps), desc="format warm-up", disable=None):
        # the learning rate decays to zero: the last few random batches do not decide the start of RL
        opt.param_groups[0]["lr"] = cfg.warmup_lr * (1 - step / cfg.warmup_steps)
        batch = []
        for _ in range(16):
            env = TinyWorld("pay00_1", timeout=cfg.code_timeout)
            env.instruction, turns = TinyWorld.demo(rng)
            e = new_episode(env, env.task_id, chat)
            for i, msg in enumerate(turns):
                if i:
                    e.add(chat.pre + chat.encode(obs, literal=True) + chat.post)
                e.add(chat.encode(msg) + [chat.eot], output=True, turn=i)
                obs = env.step(extract_code(msg))
            batch.append(e)
        sft_step(model, opt, batch, grad_clip=None)


def sft_step(model, opt, episodes, grad_clip):
    """One supervised step: the mean log-likelihood of the output tokens (the warm-up, and the
    fine-tuning baseline that --bench holds the LOOP update against)."""
    ids, attn, is_out, _ = pad_batch(episodes, next(model.parameters()).device)
    mask = (is_out[:, 1:] & attn[:, 1:].bool()).float()
    opt.zero_grad(set_to_none=True)
    (-(token_logprobs(model, ids, attn, 1.0) * mask).sum() / mask.sum()).backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()


def main(argv=None):
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    import warnings
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one-process checkpoints are fine
    if cfg.bench:
        return print(json.dumps(bench(cfg), indent=1))
    if cfg.report:
        return report(cfg.report)
    if cfg.fsdp:
        if "RANK" not in os.environ:
            die("--fsdp runs under torchrun: torchrun --nproc_per_node G loop.py --fsdp ...")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        atexit.register(dist.destroy_process_group)
    rank, world = rank_world()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    run_dir = [cfg.resume or cfg.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))]
    if world > 1:
        dist.broadcast_object_list(run_dir)  # ranks that started a second apart share rank 0's directory
    run_dir = run_dir[0]
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as fh:
            json.dump(dataclasses.asdict(cfg) | {"resume": ""}, fh, indent=1)

    def log(row):  # rank 0 only; the numbers are already reduced over ranks
        if rank == 0:
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
            tqdm.write(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "per_task"}))

    t0 = time.time()
    ENVS[cfg.env].tasks(cfg.split)  # a missing data root stops here, before a model is loaded
    model, tok = load_model_and_tokenizer(cfg, device)
    chat = Chat(tok)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    with torch.autocast(device.type, torch.bfloat16, enabled=cfg.bf16 and not cfg.fsdp):  # FSDP: its own policy
        if cfg.resume:
            start = load_checkpoint(run_dir, model, opt)
            if rank == 0:  # rows of the unfinished iteration would be logged twice
                path = os.path.join(run_dir, "metrics.jsonl")
                rows = [line for line in open(path) if json.loads(line)["iteration"] <= start]
                open(path, "w").writelines(rows)
        else:
            start = 0
            if cfg.warmup_steps and cfg.model == "tiny":  # a loaded model (a finished tiny run's too) has its format
                warmup(model, chat, cfg)
            log(evaluate(model, chat, cfg, cfg.split, 0, run_dir) | {"seconds": round(time.time() - t0, 1)})
            if cfg.eval:
                return
        train_tasks = ENVS[cfg.env].tasks(cfg.train_split)
        for it in tqdm(range(start + 1, cfg.iterations + 1), desc="LOOP", disable=rank != 0):
            t, seed = time.time(), cfg.seed * 10**6 + it * 1000
            random.seed(seed + rank)  # seeded per iteration: a resumed run samples what the unbroken run would have
            torch.manual_seed(seed + rank)
            tasks = random.Random(seed).sample(train_tasks, min(cfg.tasks_per_iteration, len(train_tasks)))[rank::world]
            task_ids = [task for task in tasks for _ in range(cfg.rollouts_per_task)]  # a task's K rollouts share a rank
            envs = [ENVS[cfg.env](task, cfg.code_timeout, f"loop-train-rollout{i % cfg.rollouts_per_task}")
                    for i, task in enumerate(task_ids)]  # the K worlds of a task save their outputs apart
            episodes = rollout(model, chat, envs, task_ids, cfg, cfg.temperature, cfg.max_turns)
            rewards = torch.tensor([e.reward for e in episodes]).view(len(tasks), cfg.rollouts_per_task)
            advantages = loo_advantages(rewards, cfg.normalize_rewards).flatten()
            stats = update(model, opt, episodes, advantages, cfg)
            n, reward, success, turns, tokens = all_reduce([len(episodes), rewards.sum().item(), sum(e.success for e in episodes),
                                                            sum(1 + max(e.turn) for e in episodes), sum(len(e.ids) for e in episodes)])
            log({"iteration": it, "reward_mean": reward / n, "success_rate": success / n, "turns_mean": turns / n,
                 "tokens_mean": tokens / n, **stats, "seconds": round(time.time() - t, 2)})
            if it % cfg.eval_every == 0 or it == cfg.iterations:
                log(evaluate(model, chat, cfg, cfg.split, it, run_dir) | {"seconds": round(time.time() - t0, 1)})
            save_checkpoint(run_dir, model, opt, it)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # the full weights (or the LoRA adapter), loadable with from_pretrained
        model.save_pretrained(os.path.join(run_dir, "model"), state_dict=state)
        tok.save_pretrained(os.path.join(run_dir, "model"))


# ----------------------------------------------------------------------------------------------
# 11. Benchmark: each figure is measured in a fresh process (CPU: peak RSS; CUDA: allocator peaks)
def _measure(name, cfg):
    """In a fresh process: "speed" -> median seconds of a LOOP update and of a fine-tuning step and
    the speedup of batched generation; any other workload -> peak extra memory (bytes) of one run."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def seconds(f):
        sync()
        t = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - t
    if name in ("chunked", "full"):  # log-probs of 8192 tokens under a 151,936-token vocabulary, forward and backward
        head = torch.nn.Linear(64, 151936, bias=False, device=device)
        chunked_logprob_head(head, cfg.logprob_chunk if name == "chunked" else 8192)
        h, head.targets = torch.randn(1, 8192, 64, device=device, requires_grad=True), torch.randint(0, 151936, (1, 8192), device=device)
        work = lambda: head(h).sum().backward()  # noqa: E731
    else:
        model, tok = load_model_and_tokenizer(cfg, device)
        chat, opt = Chat(tok), torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        out = [t % 128 >= 64 for t in range(512)]  # 4 turns: 64 context tokens, then 64 sampled ones
        episodes = [Episode("", None, torch.randint(0, len(tok), (512,)).tolist(), out,
                            [t // 128 if o else -1 for t, o in enumerate(out)], []) for _ in range(8)]
        loop_step = lambda: update(model, opt, episodes, torch.tensor([1.0, -1.0] * 4), cfg)  # noqa: E731
        sft = lambda: sft_step(model, opt, episodes, 1.0)  # plain fine-tuning on the same tokens  # noqa: E731
        work = {"loop": loop_step, "sft": sft, "speed": None}[name]  # "speed" returns below
        loop_step(), sft()  # warm: optimizer state and caches exist before the measurement
        if name == "speed":
            median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            pairs = [(seconds(loop_step), seconds(sft)) for _ in range(5)]  # alternating: a noisy CPU drifts
            prompts = [chat.prompt(TinyWorld(t).messages()) for t in TinyWorld.tasks("test")[:8]]
            chat.stop_ids = [len(tok)]  # no id stops a turn: every episode samples 64 tokens, batched or not
            speedups = [seconds(lambda: [generate(model, chat, [p], 1.0, 64) for p in prompts])
                        / seconds(lambda: generate(model, chat, prompts, 1.0, 64)) for _ in range(3)]
            return median([a for a, _ in pairs]), median([b for _, b in pairs]), median(speedups)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        peak, base = torch.cuda.max_memory_allocated, torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets the peak resident set size
        peak = lambda key="VmHWM": int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith(key))) * 1024  # noqa: E731
        base = peak("VmRSS")
    seconds(work)
    return peak() - base


def bench(cfg):
    import multiprocessing as mp
    cfg = dataclasses.replace(cfg, epochs=2, minibatch_size=8, micro_batch_size=8, warmup_steps=0)
    run = lambda name: mp.get_context("spawn").Pool(1).apply(_measure, (name, cfg))  # noqa: E731
    loop_s, sft_s, speedup = run("speed")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # CPU memory: freed tensors leave the resident set at once
    loop_mem, sft_mem, chunk_mem, full_mem = map(run, ("loop", "sft", "chunked", "full"))
    mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}",
            "update_peak_mem_ratio": round(loop_mem / sft_mem, 3),  # 8 rollouts x 512 tokens, same model
            "update_time_ratio": round(loop_s / (cfg.epochs * sft_s), 3),  # per optimizer step, incl. old log-probs
            "logprob_chunked_mem_ratio": round(chunk_mem / full_mem, 3),  # 8192 tokens x 151,936 vocabulary
            "rollout_batch_speedup": round(speedup, 2),  # tokens/s, 8 episodes in one batch vs one at a time
            "update_peak_mem_mb": mb(loop_mem), "sft_peak_mem_mb": mb(sft_mem), "update_seconds": round(loop_s, 3),
            "sft_step_seconds": round(sft_s, 3), "logprob_chunked_mem_mb": mb(chunk_mem), "logprob_full_mem_mb": mb(full_mem)}


# ----------------------------------------------------------------------------------------------
# 12. The paper's ablation (Table 1) in miniature: finished runs compared by variant
VARIANTS = {("token", False): "per-token (LOOP)", ("turn", False): "per-turn", ("trajectory", False): "per-trajectory",
            ("none", False): "RLOO, on-policy", ("token", True): "per-token + RwNorm"}


def report(root):
    """Held-out TGC/SGC at the last iteration (mean, min-max over seeds), the first evaluation at
    which the mean TGC reaches half of LOOP's final one, the update's clip fraction and wall time."""
    if not os.path.isdir(root):
        die(f"--report: no directory {root}")
    runs = {}
    for d in sorted(os.listdir(root)):
        try:
            cfg = json.load(open(os.path.join(root, d, "config.json")))
            rows = [json.loads(line) for line in open(os.path.join(root, d, "metrics.jsonl"))]
        except (OSError, ValueError):  # not a run directory, or a run killed while writing its first row
            continue
        curve = {r["iteration"]: r for r in rows if "split" in r}
        if cfg["iterations"] and max(curve, default=-1) == cfg["iterations"]:  # finished; not a warm-up-only run
            key = (cfg["ratio"], cfg["normalize_rewards"])
            runs.setdefault(key, []).append((curve, [r for r in rows if "split" not in r]))
    if not runs:
        die(f"--report: no finished runs (config.json and metrics.jsonl) under {root}")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    pct = lambda xs: f"{100 * mean(xs):.1f} ({100 * min(xs):.1f}-{100 * max(xs):.1f})"  # noqa: E731
    last = lambda curve: curve[max(curve)]  # a run's final evaluation  # noqa: E731
    # each variant's TGC per seed at the evaluations all its seeds share: the table's and the figure's data
    curves = {k: {i: [c[i]["tgc"] for c, _ in v] for i in sorted(set.intersection(*(set(c) for c, _ in v)))}
              for k, v in runs.items()}
    loop_curve = curves.get(("token", False))
    half = 0.5 * mean(last(loop_curve)) if loop_curve else 0.0
    lines = ["| variant | seeds | final TGC % | final SGC % | iterations to half LOOP's TGC | clip fraction | wall s |",
             "|---|---|---|---|---|---|---|"]
    order = sorted(runs, key=lambda k: list(VARIANTS).index(k) if k in VARIANTS else len(VARIANTS))
    for key in order:
        v = runs[key]
        reach = next((i for i, tgc in curves[key].items() if mean(tgc) >= half), None) if half > 0 else None
        lines.append(f"| {VARIANTS.get(key, key)} | {len(v)} | {pct([last(c)['tgc'] for c, _ in v])} | "
                     f"{pct([last(c)['sgc'] for c, _ in v])} | {'-' if reach is None else reach} | "
                     f"{mean([mean([r['clip_fraction'] for r in t]) for _, t in v]):.3f} | "
                     f"{mean([last(c)['seconds'] for c, _ in v]):.0f} |")
    table = "\n".join(lines)
    print(table)
    open(os.path.join(root, "ablation.md"), "w").write(table + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("pip install matplotlib to draw the learning curves", file=sys.stderr)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key in order:
        its, per_seed = list(curves[key]), [[100 * tgc for tgc in seeds] for seeds in curves[key].values()]
        ax.plot(its, [mean(s) for s in per_seed], label=f"{VARIANTS.get(key, key)}, {len(runs[key])} seeds",
                lw=2.5 if key == ("token", False) else 1.5)
        ax.fill_between(its, [min(s) for s in per_seed], [max(s) for s in per_seed], alpha=0.12)
    ax.set(xlabel="iteration", ylabel="held-out TGC %", ylim=(0, 100), title="mean over seeds; band: lowest to highest seed")
    ax.legend(loc="upper left", ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(os.path.join(root, "ablation.png"), dpi=120)


if __name__ == "__main__":
    main()
