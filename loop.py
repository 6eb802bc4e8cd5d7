"""LOOP: Leave-One-Out PPO for LLM agents in stateful environments (arXiv 2502.01600).

The agent writes Python that calls app APIs over many turns; the whole episode is one token
sequence in which only the tokens the policy sampled are actions (the POMDP of paper §4.1).
Each iteration samples N tasks x K rollouts, scores them, turns returns into leave-one-out
advantages (Eq. 3) and takes PPO steps on a per-token clipped objective (Eq. 5): no critic, no
reference model, one copy of the LLM. This file reads top to bottom: the settings (1), the
algorithm in the paper's order (2-6, ALGO LOGIC), then main, Algorithm 1 (7). Each call into the
machinery (processes, FSDP, files) is marked infra.X: infra.py holds it. The worlds live beside
it: tiny_world.py (its docstring is their interface) and appworld_env.py.

Where it departs from the paper, as the reference code does or to survive a long run: the ratio
clip is [1/(1+eps), 1+eps], not [1-eps, 1+eps]; the gradient-norm clip is --grad-clip 1.0 (the
reference code's: 0.1); an iteration stops at a minibatch whose |KL| is above --max-kl 20, KL
being a rollout's sum over its tokens of log p_psi - log p_theta, averaged over the minibatch
(reference code); rollouts with |A| < 0.01 are dropped, all of them if none has signal (the
reference code keeps one a GPU); a rollout whose world failed (died, hung, answered what the
interface does not allow) leaves its leave-one-out group: it is not trained on, and the others'
advantages are over K-1.

    python loop.py --tiny                      # a tiny model in a tiny world, minutes on a CPU
    python loop.py --eval --split test --tiny  # TGC/SGC only
"""
import collections
import dataclasses
import functools
import math
import os
import random
import re
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import infra
from appworld_env import AppWorldEnv
from tiny_world import TinyWorld

# 1. Settings: each field of Config is a flag with its help line; the world --env names
def setting(default, doc, at_least=None, at_most=None, choices=None):
    """A field with its help and rule (a number is finite, > 0 unless at_least says otherwise)."""
    rule = {"at_least": at_least, "at_most": at_most, "choices": choices}
    return dataclasses.field(default=default, metadata={"doc": doc, **rule})

RATIOS = ["token", "turn", "trajectory", "none"]  # --ratio: LOOP (Eq. 5), Table 1's variants
@dataclasses.dataclass
class Config:
    # the run
    env: str = setting("appworld", "appworld, tiny (AppWorld in miniature), or your module:Class.")
    model: str = setting("Qwen/Qwen2.5-32B-Instruct", "Hugging Face model id or local directory.")
    seed: int = setting(0, "Seed of Python, torch, task sampling.", at_least=0, at_most=2**32 - 1)
    out: str = setting("", "Run directory of metrics, transcripts, weights (default runs/<time>).")
    resume: str = setting("", "Run directory to continue from its last complete checkpoint.")
    iterations: int = setting(200, "Training iterations (reference code: 200); 0: a run of its "
                              "iteration-0 evaluation alone, resumable with more.", at_least=0)
    train_split: str = setting("train", "Split the training tasks come from.")
    split: str = setting("test", "Split that evaluation reports TGC/SGC on.")
    eval: bool = setting(False, "Only evaluate --model on `split`: no run, nothing to resume "
                         "(a run's model/ at the iteration it was trained to).")
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
    minibatch_size: int = setting(32, "Rollouts per optimiser step, across tasks (paper: 32); "
                                  "0: all those an iteration uses.", at_least=0)
    clip_eps: float = setting(0.1, "Ratio clip [1/(1+eps), 1+eps] (paper: [1-eps, 1+eps]).")
    ratio: str = setting("token", "Importance ratio: token (Eq. 5), turn, trajectory, none (no "
                         "ratio; RLOO with --epochs 1 --minibatch-size 0).", choices=RATIOS)
    normalize_rewards: bool = setting(False, "Divide each A by its group's std (RwNorm, not LOOP).")
    min_abs_advantage: float = setting(0.01, "Rollouts with |A| below it are dropped.", at_least=0)
    max_kl: float = setting(20.0, "Abandon an iteration at a minibatch whose |KL| (a rollout's "
                            "sum over its tokens) is above this.")
    # rollouts
    max_turns: int = setting(40, "Turns per training episode (paper: 40).")
    eval_max_turns: int = setting(50, "Turns per evaluation episode (paper: 50).")
    max_new_tokens: int = setting(1500, "Tokens the policy may sample per turn (paper: 1500).")
    max_context: int = setting(32768, "Tokens an episode may hold: it ends at this cap.")
    max_obs_tokens: int = setting(3000, "Observations are cut at this many tokens, with a note.")
    code_timeout: float = setting(30.0, "Seconds agent code may run a turn.", at_most=86400)
    temperature: float = setting(1.0, "Temperature of training rollouts, and of their scoring.")
    eval_temperature: float = setting(0.0, "Evaluation's temperature (0 = greedy).", at_least=0)
    batch_episodes: int = setting(6, "Episodes played at once per rank (32B: 8.6 GB of KV each).")
    vllm: str = setting("", "Running vLLM servers' URLs (a,b) that sample rollouts (with --lora).")
    vllm_timeout: float = setting(600.0, "Seconds a vLLM server may take to answer a request.")
    # systems: memory and GPUs
    micro_batch_tokens: int = setting(16384, "Cells (rows x longest) a pass holds; longer: alone.")
    logprob_chunk: int = setting(512, "Positions per chunk of the update's vocabulary projection.")
    fsdp: bool = setting(False, "Shard weights, gradients and AdamW state (FSDP2, torchrun).")
    rollout_full_weights: bool = setting(False, "FSDP: keep layers gathered through a rollout.")
    bf16: bool = setting(False, "bf16 compute; weights, AdamW state stay fp32 (a LoRA base: bf16).")
    activation_checkpointing: bool = setting(False, "Recompute each decoder layer in backward.")
    lora: bool = setting(False, "Train the paper's LoRA (rank 16, alpha 32), not all the weights.")

ENVS = {"tiny": TinyWorld, "appworld": AppWorldEnv}  # a forker's script may add its world

def environment(name):
    """The world class --env names: one of ENVS, or module:Class from an importable module."""
    return ENVS[name] if name in ENVS else infra.import_world(name, ENVS)

def parse_config(argv):
    """The run's settings, checked (an --env that names no world too) before any work."""
    cfg = infra.parse_config(Config, argv, __doc__)
    environment(cfg.env)
    return cfg

def mean(values):
    return sum(values) / len(values) if values else 0.0

# ============================== ALGO LOGIC: LOOP, read this first ===============================
# 2. Rollouts: the POMDP of paper §4.1. One token sequence per episode; `is_output` marks the
#    tokens the policy sampled (its actions, stop token included), the rest is context. The
#    episodes play in waves of --batch-episodes, each wave with its carried KV cache.
@dataclasses.dataclass(eq=False)
class Episode:
    task_id: str
    world: object
    ids: list = dataclasses.field(default_factory=list)
    is_output: list = dataclasses.field(default_factory=list)
    turn_of: list = dataclasses.field(default_factory=list)  # each token's turn; -1: context
    transcript: list = dataclasses.field(default_factory=list)
    cap: int = sys.maxsize  # --max-context
    done: bool = False
    reward: float = 0.0
    success: bool = False
    checks: tuple = (0, 0)  # the world's tests: passed, total
    failed: bool = False  # the world died, hung or did not start: an infrastructure failure
    sampler_logp: list = dataclasses.field(default_factory=list)  # a vLLM server's log p; NaN: none

    def add(self, ids, output=False, turn=-1, logp=None):
        """ids join the episode as far as its context cap allows, the one place the cap is kept:
        an episode that reaches it is done, and no id ever lies beyond it."""
        ids = ids[:self.cap - len(self.ids)]
        self.ids += ids
        self.is_output += [output] * len(ids)
        self.turn_of += [turn] * len(ids)
        self.sampler_logp += (logp or [math.nan] * len(ids))[:len(ids)]
        self.done = self.done or len(self.ids) >= self.cap


@torch.no_grad()
def generate(model, chat, prompts, temperature, max_new_tokens, cache):
    """Sample one turn for a batch of episodes: each one's ids, cut after the first stop token.
    Only what `cache` lacks is fed: with a wave's cache, the last token and the observation."""
    from transformers import GenerationConfig
    ids, attn = cache.inputs(prompts, chat.tok.pad_token_id)
    sampling = {}  # greedy at T = 0, else the plain softmax at T: what the update scores
    if temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    config = GenerationConfig(**sampling, max_new_tokens=max_new_tokens,
                              eos_token_id=chat.stop_ids, pad_token_id=chat.tok.pad_token_id)
    # synced: under FSDP a rank that is done keeps joining the others' forward passes
    out = model.generate(input_ids=ids, attention_mask=attn, generation_config=config,
                         cache=cache.kv, synced_gpus=infra.WORLD > 1)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        stops = [i for i, t in enumerate(row) if t in chat.stop_ids]
        rows.append(row[:stops[0] + 1] if stops else row)
    cache.grew(attn, prompts, rows, out.shape[1] - ids.shape[1])
    return rows

def rollout(model, chat, worlds, task_ids, cfg, temperature, max_turns, desc="rollout",
            servers=None):
    """The POMDP (§4.1) in waves of --batch-episodes: each turn, one batched generation for the
    live episodes, then their code runs in their worlds. Every rank runs the busiest's turns (FSDP),
    with a dummy if it has none left. With vLLM servers, each episode plays on its own."""
    if servers:  # up to --batch-episodes at once, each sending its turn when its observation is in
        play = functools.partial(play_episode, chat, cfg, temperature, max_turns)
        return servers.play(play, worlds, task_ids, cfg.batch_episodes, desc)
    model.eval()
    pairs = list(zip(worlds, task_ids))
    waves = [pairs[s:s + cfg.batch_episodes] for s in range(0, len(pairs), cfg.batch_episodes)]
    episodes, wave, cache, turn = [], [], infra.WaveCache(), 0  # a rank may have no task at all
    with infra.playing(model, worlds, cfg, desc) as bar:  # FSDP; Ctrl-C closes the worlds
        while True:
            while waves and all(e.done for e in wave):  # the wave ended: the next begins
                score_wave(wave)
                wave = start_wave(waves.pop(0), chat, cfg)
                episodes += wave
                cache, turn = infra.WaveCache(), 0
            live = [e for e in wave if not e.done]
            if not infra.all_reduce([len(live)], dist.ReduceOp.MAX)[0]:
                break
            carried = cache if live else infra.WaveCache()
            play_turn(model, chat, live, carried, temperature, turn, max_turns, cfg)
            turn += 1
            bar.update()
        score_wave(wave)
    return episodes

def play_turn(model, chat, live, cache, temperature, turn, max_turns, cfg):
    """One turn of the live episodes: the policy acts, the worlds run its code, observations."""
    cache.lay_out(live)
    # no episode can take more than its room below the cap (add() cuts the others)
    room = max((cfg.max_context - len(e.ids) for e in live), default=1)
    prompts = [e.ids for e in live] or [[chat.eot]]  # nothing left: a dummy joins in
    outputs = generate(model, chat, prompts, temperature, min(cfg.max_new_tokens, room), cache)
    codes = [act(e, new, turn, chat) for e, new in zip(live, outputs)]
    results = infra.concurrently([functools.partial(e.world.step, c) for e, c in zip(live, codes)])
    for e, output in zip(live, results):
        observe(e, output, turn == max_turns - 1, chat, cfg)

def play_episode(chat, cfg, temperature, max_turns, world, task_id, sample):
    """One episode whose turns a vLLM server samples (`sample`): the turns of play_turn, alone."""
    e = start_wave([(world, task_id)], chat, cfg)[0]
    for turn in range(max_turns):
        if e.done:
            break
        room = cfg.max_context - len(e.ids)
        new, logp = sample(e.ids, temperature, min(cfg.max_new_tokens, room), chat.stop_ids)
        code = act(e, new, turn, chat, logp)
        observe(e, world.step(code), turn == max_turns - 1, chat, cfg)
    score_wave([e])
    return e

def start_wave(pairs, chat, cfg):
    """A wave's worlds start together (their messages()); an episode opens with the prompt."""
    wave = []
    opening = infra.concurrently([world.messages for world, _ in pairs])
    for (world, task_id), messages in zip(pairs, opening):
        e = Episode(task_id, world, transcript=list(messages), done=getattr(world, "done", False),
                    cap=cfg.max_context)  # (done already if its world failed to start)
        prompt = chat.prompt(messages)
        if len(prompt) >= cfg.max_context and not e.done:
            infra.die(f"the prompt of task {task_id} is {len(prompt)} tokens, and --max-context "
                      f"{cfg.max_context} leaves the agent no room to act: give a larger "
                      "--max-context")
        e.add(prompt)
        wave.append(e)
    return wave

def score_wave(wave):
    """A finished wave's worlds are evaluated together: reward = tests passed / tests. An episode
    whose world failed (None) leaves its leave-one-out group: its reward is never used."""
    for e, result in zip(wave, infra.concurrently([e.world.evaluate for e in wave])):
        e.failed = result is None
        passed, total = e.checks = result or (0, 1)
        e.reward = passed / total
        e.success = passed == total

def act(e, new, turn, chat, logp=None):
    """The sampled turn joins the episode as actions; returns the code in what joined."""
    start = len(e.ids)
    e.add(new, output=True, turn=turn, logp=logp)
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
    e.done = e.done or getattr(e.world, "done", False) or last_turn
    if not e.done:
        closing = [] if e.ids[-1] == chat.eot else [chat.eot]  # a turn cut at max_new_tokens
        e.add(closing + chat.observation(observation))

# 3. Leave-one-out advantages (Eq. 3)
def loo_advantages(rewards, normalize=False, valid=None):
    """rewards [N, K] -> A_k = R_k - mean_{i!=k} R_i = K/(K-1) (R_k - mean R), no std division.
    `valid` [N, K]: a rollout whose world failed leaves its group, whose K' others keep the exact
    leave-one-out advantage over themselves; NaN (none) for it and for a group of fewer than 2."""
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

def loop_loss(logp, old_logp, adv, mask, turn_of, ratio="token", eps=0.1):
    """Per-rollout loss (to minimise) and clipped (or bounded) tokens [B]. logp, old_logp,
    mask, turn_of: [B, T] over target tokens; adv: [B]. Each rollout's loss is the mean over its own
    output tokens (a(x) = mask) of -min(r A, clip(r, 1/(1+eps), 1+eps) A)."""
    mask = mask.to(logp.dtype)
    n = mask.sum(1).clamp(min=1)
    a = adv[:, None]
    if ratio == "none":  # RLOO's -A * mean log p: no ratio, so sound only on-policy (one step)
        return -(adv * (logp * mask).sum(1) / n), torch.zeros_like(adv)
    log_r = (logp - old_logp) * mask
    if ratio == "turn":  # one ratio per assistant turn, shared by that turn's tokens
        turns = int(turn_of.max().clamp(min=0)) + 1  # (an empty pass has no turn at all)
        onehot = F.one_hot(turn_of.clamp(min=0), turns) * mask[..., None]
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
    n_clipped = (((bounded != log_r) | ((clipped * a) < (r * a))) & mask.bool()).sum(1)
    return -(objective * mask).sum(1) / n, n_clipped

# 5. One LOOP iteration (the body of Algorithm 1), and its update: PPO epochs of minibatches
def train_iteration(model, opt, chat, cfg, train_tasks, iteration, servers=None):
    """N tasks x K rollouts -> leave-one-out advantages (Eq. 3) -> PPO epochs (Eq. 5); returns the
    metrics row."""
    started = time.time()
    # seeded per iteration: a resumed run samples what the unbroken run would have
    seed = cfg.seed * 10**6 + iteration * 1000
    random.seed(seed + infra.RANK)
    torch.manual_seed(seed + infra.RANK)
    n_tasks = min(cfg.tasks_per_iteration, len(train_tasks))
    tasks = random.Random(seed).sample(train_tasks, n_tasks)[infra.RANK::infra.WORLD]
    k = cfg.rollouts_per_task
    task_ids = [task for task in tasks for _ in range(k)]  # a task's K rollouts share a rank
    World = environment(cfg.env)
    # the K worlds of a task save their outputs apart
    worlds = [infra.Hosted(World, task, cfg.code_timeout, f"loop-train-rollout{i % k}")
              for i, task in enumerate(task_ids)]
    episodes = rollout(model, chat, worlds, task_ids, cfg, cfg.temperature, cfg.max_turns,
                       servers=servers)
    rolled = time.time()
    infra.stop_if_every_world_failed(episodes, f"iteration {iteration}")
    rewards = torch.tensor([e.reward for e in episodes]).view(len(tasks), k)
    valid = torch.tensor([not e.failed for e in episodes], dtype=torch.bool).view(len(tasks), k)
    advantages = loo_advantages(rewards, cfg.normalize_rewards, valid).flatten()
    stats = update(model, opt, episodes, advantages, cfg)
    row = rollout_metrics(episodes, World, (rewards * valid).sum().item())
    return {"iteration": iteration, **row, **stats, "rollout_seconds": round(rolled - started, 2),
            "seconds": round(time.time() - started, 2), **(servers.row if servers else {})}

def rollout_metrics(episodes, World, reward):
    """Means over all ranks' rollouts (`reward`: this rank's sum where the world held up)."""
    sums = collections.Counter(reward=reward)
    for e in episodes:
        looked, erred, recovered = habits(e, World)
        sums.update(episodes=1, failures=e.failed, success=e.success, turns=1 + max(e.turn_of),
                    tokens=len(e.ids), looked=looked, erred=erred, recovered=recovered)
    keys = "episodes failures reward success turns tokens looked erred recovered".split()
    t = dict(zip(keys, infra.all_reduce([sums[key] for key in keys])))
    n, scored = t["episodes"], max(t["episodes"] - t["failures"], 1)  # scored: worlds held up
    shares = {"looked_first": t["looked"] / n} if hasattr(World, "DOCS_CALL") else {}
    if hasattr(World, "ERROR_PREFIX"):
        shares.update(error_rate=t["erred"] / n, recovered=t["recovered"] / max(t["erred"], 1))
    return {"reward_mean": t["reward"] / scored, "success_rate": t["success"] / scored,
            "turns_mean": t["turns"] / n, "tokens_mean": t["tokens"] / n,
            "env_failures": int(t["failures"]), **shares}

def habits(e, World):
    """Habits RL changes (§5), where the world names them: its first code reads the docs
    (World.DOCS_CALL); it met an error (World.ERROR_PREFIX); it erred and still succeeded."""
    replies = [m["content"] for m in e.transcript if m["role"] == "assistant"]
    observations = [b["content"] for a, b in zip(e.transcript, e.transcript[1:])
                    if a["role"] == "assistant"]
    docs, error = getattr(World, "DOCS_CALL", None), getattr(World, "ERROR_PREFIX", None)
    looked = docs is not None and bool(replies) and docs in extract_code(replies[0])
    erred = error is not None and any(text.startswith(error) for text in observations)
    return looked, erred, erred and e.success

def update(model, opt, episodes, advantages, cfg):
    """PPO epochs over the iteration's rollouts. Under FSDP a minibatch spans the ranks (each takes
    its share of its own rollouts), each running as many passes (empty ones) as the busiest."""
    # a rollout without a leave-one-out group (NaN: its world failed) has no advantage at all
    used = [i for i, a in enumerate(advantages.tolist())
            if not math.isnan(a) and abs(a) >= cfg.min_abs_advantage]
    counts = infra.all_reduce([len(used) * (r == infra.RANK) for r in range(infra.WORLD)])
    stats = {"rollouts_used": int(sum(counts)), "steps": 0, "skipped_nan": 0, "abandoned": False,
             "kl": 0.0, "clip_fraction": 0.0, "clipped_rollouts": 0.0, "loss": 0.0,
             "grad_norm": 0.0, "padding": 0.0, "old_logprob_seconds": 0.0, "update_seconds": 0.0}
    if not sum(counts):
        return stats
    started = time.time()
    old = old_logprobs(model, episodes, used, cfg)
    stats["old_logprob_seconds"] = round(time.time() - started, 2)
    stats.update(infra.mismatch(episodes, old, used))  # the sampler's log p against old's (--vllm)
    started = time.time()  # the passes'
    model.train()
    params = [p for group in opt.param_groups for p in group["params"]]  # FSDP's sharded ones
    kls, sums = [], collections.Counter()  # sums over the steps taken (cells: over all passes)
    whole = set()  # this rank's rollouts whose every output token was clipped in a minibatch
    for _ in range(cfg.epochs):
        order = random.sample(used, len(used))
        for passes, size in minibatches(order, counts, episodes, cfg):
            opt.zero_grad(set_to_none=True)
            totals, all_clipped = minibatch_backward(model, episodes, passes, old, advantages, cfg,
                                                     size)
            sums.update(cells=totals["cells"], tokens=totals["tokens"])  # padding included: cells
            kls.append(totals["kl"] / size)
            if abs(kls[-1]) > cfg.max_kl:  # the policy moved too far: stop using these rollouts
                opt.zero_grad(set_to_none=True)
                stats["abandoned"] = True
                break
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            if hasattr(norm, "full_tensor"):  # a DTensor under FSDP: the same on every rank
                norm = norm.full_tensor()
            # nothing not finite moves a weight (a finite loss can have a NaN gradient: 0 x inf)
            if not math.isfinite(totals["loss"]) or not math.isfinite(norm.item()):
                opt.zero_grad(set_to_none=True)
                stats["skipped_nan"] += 1
                continue
            opt.step()
            stats["steps"] += 1
            sums.update(loss=totals["loss"], norm=norm.item(),
                        clipped=totals["clipped"], outputs=totals["outputs"])
            whole.update(all_clipped)
        if stats["abandoned"]:
            break
    steps = max(stats["steps"], 1)
    stats.update(kl=mean(kls), clip_fraction=sums["clipped"] / max(sums["outputs"], 1),
                 loss=sums["loss"] / steps, grad_norm=sums["norm"] / steps,
                 padding=sums["cells"] / sums["tokens"],
                 update_seconds=round(time.time() - started, 2))
    stats["clipped_rollouts"] = infra.all_reduce([len(whole)])[0] / sum(counts)
    return stats

def minibatches(order, counts, episodes, cfg):
    """Each minibatch as this rank's passes (infra.passes: similar lengths), and its size over all
    ranks: under FSDP each takes its share (size 0: all) of its own rollouts (`counts`: each's)."""
    share = math.ceil(cfg.minibatch_size / infra.WORLD) if cfg.minibatch_size else int(max(counts))
    for j in range(max(math.ceil(n / share) for n in counts)):
        size = sum(min(share, max(0, n - j * share)) for n in counts)
        mine = order[j * share:(j + 1) * share]
        yield infra.passes(episodes, mine, cfg.micro_batch_tokens), size

@torch.no_grad()
def old_logprobs(model, episodes, used, cfg):
    """log p_psi of each used rollout's tokens, from the model about to be updated, right before
    the update, at the sampling temperature (reference code: recompute_rollout_probs)."""
    model.eval()
    old = {}
    for chunk in infra.passes(episodes, used, cfg.micro_batch_tokens):
        ids, attn, _, _ = pad_batch([episodes[i] for i in chunk])
        for i, logp in zip(chunk, infra.token_logprobs(model, ids, attn, cfg.temperature)):
            old[i] = logp[:len(episodes[i].ids) - 1]
    return old

def minibatch_backward(model, episodes, chunks, old, advantages, cfg, size):
    """Accumulate one minibatch's gradient over its passes; returns the sums over ranks of loss, KL
    estimate, clipped and output tokens, cells and tokens, and this rank's rollouts all clipped."""
    divisor = cfg.minibatch_size or size  # reference code: a constant, or all the rollouts used
    totals, all_clipped = [0.0, 0.0, 0, 0, 0, 0], []
    for chunk in chunks:
        ids, attn, is_output, turn_of = pad_batch([episodes[i] for i in chunk])
        logp = infra.token_logprobs(model, ids, attn, cfg.temperature)
        # an empty pass (a rank with fewer rollouts) has no action
        old_logp, adv = logp.detach(), torch.zeros(1, device=infra.DEVICE)
        if chunk:
            old_logp = torch.nn.utils.rnn.pad_sequence([old[i] for i in chunk], batch_first=True)
            adv = advantages[chunk].to(infra.DEVICE)
        mask = is_output[:, 1:] & attn[:, 1:].bool()  # targets x_1.. that the policy sampled
        per_rollout, n_clipped = loop_loss(logp, old_logp, adv, mask, turn_of[:, 1:], cfg.ratio,
                                           cfg.clip_eps)
        loss = per_rollout.sum() / divisor
        (loss * infra.WORLD).backward()  # x world because FSDP averages gradients over ranks
        kl = -((logp - old_logp) * mask).sum()
        step = [loss.item(), kl.item(), n_clipped.sum().item(), mask.sum().item(), ids.numel(),
                attn.sum().item()]
        totals = [a + b for a, b in zip(totals, step)]
        outputs = mask.sum(1).tolist()
        all_clipped += [i for i, k, n in zip(chunk, n_clipped.tolist(), outputs) if k == n > 0]
    keys = ["loss", "kl", "clipped", "outputs", "cells", "tokens"]
    return dict(zip(keys, infra.all_reduce(totals))), all_clipped

NO_OUTPUT = Episode("", None, ids=[0, 0], is_output=[False, False], turn_of=[-1, -1])

def pad_batch(episodes):
    """ids, attention mask, is_output and turn_of, right-padded; no episode (a rank's empty pass
    under FSDP) is one row without an action: NO_OUTPUT."""
    episodes = episodes or [NO_OUTPUT]
    width = max(len(e.ids) for e in episodes)

    def pad(rows, value):
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], device=infra.DEVICE)

    return (pad([e.ids for e in episodes], 0), pad([[1] * len(e.ids) for e in episodes], 0),
            pad([e.is_output for e in episodes], False), pad([e.turn_of for e in episodes], -1))

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

def evaluate(model, chat, cfg, split, iteration, run_dir, servers=None):
    """One episode per task of `split`: the metrics row; 3 of the episodes to transcripts/."""
    started = time.time()
    World = environment(cfg.env)
    tasks = infra.tasks_of(World, split)[infra.RANK::infra.WORLD]  # rank 0 gathers the results
    experiment = f"loop-{os.path.basename(os.path.abspath(run_dir))}-{split}-iter{iteration:04d}"
    worlds = [infra.Hosted(World, t, cfg.code_timeout, experiment) for t in tasks]
    if servers:  # they sample the model evaluated
        servers.take(model, run_dir, iteration)
    episodes = rollout(model, chat, worlds, tasks, cfg, cfg.eval_temperature, cfg.eval_max_turns,
                       desc=f"eval {split}", servers=servers)
    infra.stop_if_every_world_failed(episodes, f"the evaluation of {split}")
    results = infra.gather([(e.task_id, e.success, e.reward) for e in episodes])  # every rank's
    failures = infra.all_reduce([sum(e.failed for e in episodes)])[0]  # counted as not completed
    row = {"iteration": iteration, "split": split, **goal_completion(results),
           "env_failures": int(failures), "seconds": round(time.time() - started, 2),
           **(servers.row if servers else {})}
    if cfg.env == "appworld":  # `appworld evaluate <experiment> <split>` reports the same numbers
        row["appworld_experiment"] = experiment
    infra.write_transcripts(run_dir, split, iteration, episodes, scenario)
    return row

# 7. Main: Algorithm 1. The model and AdamW, the iteration-0 evaluation, then iterations of N x K
#    rollouts -> leave-one-out advantages -> PPO epochs, evaluated every --eval-every, checkpointed
def main(argv=None):
    if infra.in_world_worker():  # a world's worker runs the main script again as it starts
        return
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    World = environment(cfg.env)
    with infra.Run(cfg, World) as run:  # FSDP's ranks; the directory, claimed or resumed; Ctrl-C
        if run.finished:
            return
        servers = run.servers  # vLLM servers that sample the rollouts (--vllm), or none
        with run.starting():  # a start that fails leaves the directory as it was, or none
            model, tok, chat, opt, train_tasks = start(cfg, World, run.checkpoint)
            if servers:  # they sample the policy: a resume's, its checkpoint's
                servers.take(model, run.dir, run.begin)
        # FSDP casts by its own mixed-precision policy
        with torch.autocast(infra.DEVICE.type, torch.bfloat16, enabled=cfg.bf16 and not cfg.fsdp):
            if cfg.eval:  # a run's model/ reports the iteration it was trained to
                trained = infra.trained_to(cfg.model) or 0
                run.log(evaluate(model, chat, cfg, cfg.split, trained, run.dir, servers))
            else:
                if not run.begin and not run.evaluated_at_0:  # (a killed run's is kept)
                    run.log(evaluate(model, chat, cfg, cfg.split, 0, run.dir, servers))
                for iteration in run.progress(range(run.begin + 1, cfg.iterations + 1)):
                    if servers:  # theta_old <- theta: the servers sample the policy being updated
                        servers.take(model, run.dir, iteration - 1)
                    run.log(train_iteration(model, opt, chat, cfg, train_tasks, iteration, servers))
                    if iteration % cfg.eval_every == 0 or iteration == cfg.iterations:
                        run.log(evaluate(model, chat, cfg, cfg.split, iteration, run.dir, servers))
                    infra.save_checkpoint(run.dir, model, opt, iteration, cfg)
        run.finish(model, tok)  # model/ (none after an evaluation or 0 iterations), what next

def start(cfg, World, checkpoint):
    """The tasks, the model and its Chat, AdamW on the trainable weights, a resume's state."""
    eval_tasks, train_tasks = infra.splits(World, cfg)  # an unknown split stops before loading
    model, tok = infra.load_model_and_tokenizer(cfg)
    chat = infra.chat_of(model, tok)
    if infra.DEVICE.type == "cuda":  # a wave whose KV cache cannot fit stops the run here
        infra.check_kv_cache(cfg, model, infra.wave_size(cfg, eval_tasks, train_tasks))
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable and not cfg.eval:  # a LoRA run's model/ loads its adapter frozen
        infra.die(f"{cfg.model} has no weights to train: evaluate it with --eval, or continue "
                  "the run that made it with --resume")
    opt = None
    if trainable:
        opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if checkpoint:
        infra.load_checkpoint(checkpoint, model, opt, cfg)
    return model, tok, chat, opt, train_tasks

if __name__ == "__main__":
    main()
