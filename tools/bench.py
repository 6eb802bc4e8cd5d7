"""Memory and speed of loop.py's update and rollouts, each figure from a fresh process.

    python tools/bench.py                      # the tiny model (tiny_config.json)
    python tools/bench.py --config my.json     # any model loop.py can load; loop.py's flags apply

Memory is the peak growth of a fresh process's resident set (CUDA: the allocator's peak) during
one run of a workload after an untimed warm-up run; timings are medians of alternating runs.
Rollouts: 8 episodes of 6 turns in a scripted world, with the KV cache carried across turns and
re-prefilled every turn, and 8 of unequal lengths for the cache's size; environment steps: 4 of
1 s of CPU each in processes of their own. The update's passes: a minibatch of one rollout of
2,000 tokens and 15 of 120-400, in infra.passes (similar lengths, at most 2,048 cells) and in
slices of 4 rollouts (the layout before it): padded cells / tokens, seconds, peak memory.
"""
import dataclasses
import functools
import json
import multiprocessing
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import infra  # noqa: E402
import loop  # noqa: E402
from chat import Chat  # noqa: E402
import tiny_world  # noqa: E402
from make_tiny_model import sft_step  # noqa: E402

VOCAB = 151936  # Qwen2.5's vocabulary: the log-prob workloads project onto it
TOKENS = 8192


def seconds(work, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median(values):
    return sorted(values)[len(values) // 2]


def peak_memory(work, device):
    """Bytes the process grows by at its peak while `work` runs."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds(work, device)
        return torch.cuda.max_memory_allocated() - base
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets the peak resident set size (VmHWM) to the current one
    base = proc_status("VmRSS")
    work()
    return proc_status("VmHWM") - base


def proc_status(key):
    with open("/proc/self/status") as fh:
        line = next(line for line in fh if line.startswith(key))
    return int(line.split()[1]) * 1024


def logprob_workload(chunk, device):
    """Log-probs of 8192 tokens under a 151,936-token vocabulary, forward and backward."""
    head = torch.nn.Linear(64, VOCAB, bias=False, device=device)
    infra.chunked_logprob_head(head, chunk)
    hidden = torch.randn(1, TOKENS, 64, device=device, requires_grad=True)
    head.scoring = (torch.randint(0, VOCAB, (1, TOKENS), device=device), 1.0, None)

    def work():
        head(hidden).sum().backward()
    return work


def training_workloads(cfg, device):
    """A LOOP update and a plain fine-tuning step on the same 8 rollouts of 512 tokens (4 turns:
    64 context tokens, then 64 sampled ones), and the model and chat they use."""
    model, tok = infra.load_model_and_tokenizer(cfg)
    chat = Chat(tok, model.generation_config.eos_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    is_output = [t % 128 >= 64 for t in range(512)]
    turn = [t // 128 if o else -1 for t, o in enumerate(is_output)]
    episodes = [loop.Episode("", None, torch.randint(0, len(tok), (512,)).tolist(), is_output,
                             turn, []) for _ in range(8)]
    advantages = torch.tensor([1.0, -1.0] * 4)

    def loop_update():
        loop.update(model, opt, episodes, advantages, cfg)

    def sft():
        sft_step(model, opt, episodes, 1.0)
    loop_update()  # warm: optimizer state and caches exist before anything is measured
    sft()
    return model, chat, loop_update, sft


def uneven_minibatch(model, chat, cfg, budget=2048):
    """One rollout of 2,000 tokens and 15 of 120-400 (every other token sampled), their old
    log-probs and advantages, and the two layouts: infra.passes at `budget` cells (the outlier's
    own) and slices of 4 rollouts (the outlier with 3 others)."""
    g = random.Random(0)
    lengths = [2000] + [g.randint(120, 400) for _ in range(15)]
    episodes = [loop.Episode("", None, [g.randrange(4, len(chat.tok)) for _ in range(n)],
                             [k % 2 == 1 for k in range(n)], [0] * n) for n in lengths]
    used = list(range(len(episodes)))
    old = loop.old_logprobs(model, episodes, used, cfg)
    advantages = torch.tensor([1.0, -1.0] * 8)
    layouts = {"passes": infra.passes(episodes, used, budget),
               "slices": [used[k:k + 4] for k in range(0, len(used), 4)]}

    def backward(layout):
        model.zero_grad(set_to_none=True)
        loop.minibatch_backward(model, episodes, layouts[layout], old, advantages, cfg,
                                cfg.minibatch_size)
    return episodes, layouts, backward


def padding(episodes, layout):
    """Cells the passes compute (rows x their longest) / the rollouts' tokens."""
    cells = sum(len(p) * max(len(episodes[i].ids) for i in p) for p in layout if p)
    return cells / sum(len(e.ids) for e in episodes)


class FixedWorld:
    """Six turns, whatever the agent writes, each observation of the same length."""

    def __init__(self):
        self.turns = 0
        self.done = False

    def messages(self):
        return [{"role": "user", "content": "Reply six times."}]

    def step(self, code):
        self.turns += 1
        self.done = self.turns == 6
        return "ok " * 16

    def evaluate(self):
        return 0, 1


def rollout_figures(model, chat, cfg):
    """8 episodes of 6 turns, 32 sampled tokens a turn: (tokens fed through the model / tokens in
    the finished episodes, with the carried KV cache and re-prefilling; the carry's speedup)."""
    cfg = dataclasses.replace(cfg, batch_episodes=8, max_new_tokens=32, max_context=4096)
    fed, forward, play_turn = [0], model.forward, loop.play_turn

    def prefilled(model_, chat_, live, cache, *rest):
        return play_turn(model_, chat_, live, infra.WaveCache(), *rest)

    def counting(*args, **kwargs):
        fed[0] += kwargs["input_ids"].numel()  # the prompts are equal: no padding is fed
        return forward(*args, **kwargs)
    model.forward = counting
    ratios, times = {}, {True: [], False: []}
    for _ in range(3):  # alternating: a noisy CPU drifts
        for carry_cache in (True, False):
            fed[0] = 0
            start = time.perf_counter()
            loop.play_turn = play_turn if carry_cache else prefilled  # else: every turn anew
            episodes = loop.rollout(model, chat, [FixedWorld() for _ in range(8)], ["x"] * 8,
                                    cfg, 1.0, 6)
            times[carry_cache].append(time.perf_counter() - start)
            ratios[carry_cache] = fed[0] / sum(len(e.ids) for e in episodes)
    model.forward = forward
    loop.play_turn = play_turn
    return ratios[True], ratios[False], median(times[False]) / median(times[True])


class UnevenWorld:
    """Six turns; the prompt and the observations are as long as `words` says and change length
    from turn to turn, so that the rows of a wave differ in length at every turn."""

    def __init__(self, words):
        self.words = words
        self.turns = 0
        self.done = False

    def messages(self):
        return [{"role": "user", "content": "Reply six times. " + "wait " * self.words}]

    def step(self, code):
        self.turns += 1
        self.done = self.turns == 6
        return "ok " * (self.words * (1 + self.turns % 3))

    def evaluate(self):
        return 0, 1


def cache_figures(model, chat, cfg):
    """8 episodes of unequal lengths at T = 1, replies stopping where the model stops them: the
    peak over turns of (KV cache columns / the longest row's cached tokens), (tokens prefilled
    for real + tokens sampled) / tokens in the finished episodes, and the rollout's seconds."""
    cfg = dataclasses.replace(cfg, batch_episodes=8, max_new_tokens=32, max_context=4096)
    peaks, prefilled, generate, forward = [], [0], loop.generate, model.forward
    first = [False]

    def recording(model_, chat_, prompts, temperature, max_new_tokens, carry=None):
        first[0] = True
        out = generate(model_, chat_, prompts, temperature, max_new_tokens, carry)
        peaks.append(carry.kv.get_seq_length() / max(carry.fed))
        return out

    def counting(*args, **kwargs):
        if first[0]:  # a turn's prefill: the ids fed that are not padding
            prefilled[0] += kwargs["attention_mask"][:, -kwargs["input_ids"].shape[1]:].sum().item()
            first[0] = False
        return forward(*args, **kwargs)
    loop.generate, model.forward = recording, counting
    torch.manual_seed(0)
    start = time.perf_counter()
    episodes = loop.rollout(model, chat, [UnevenWorld(w) for w in (1, 9, 3, 14, 2, 6, 11, 4)],
                            ["x"] * 8, cfg, 1.0, 6)
    seconds = time.perf_counter() - start
    loop.generate, model.forward = generate, forward
    tokens = sum(len(e.ids) for e in episodes)
    sampled = sum(sum(e.is_output) for e in episodes)
    return max(peaks), (prefilled[0] + sampled) / tokens, seconds


def busy(seconds):
    """About `seconds` of CPU, as code running in an AppWorld worker takes."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return "done"


class BusyWorld:
    """A world whose code runs in a process of its own, as AppWorld's does, for 1 s of CPU."""

    def __init__(self, pool):
        self.pool = pool

    def step(self, code):
        return self.pool.apply(busy, (1.0,))


def env_parallel_speedup():
    """4 episodes' steps of 1 s of CPU each: one after another / together (infra.concurrently)."""
    pool = multiprocessing.get_context("spawn").Pool(4)
    worlds = [BusyWorld(pool) for _ in range(4)]
    pool.map(busy, [0.1] * 4)  # the processes are up before anything is timed
    ratios = []
    for _ in range(3):
        start = time.perf_counter()
        for world in worlds:
            world.step("")
        one_by_one = time.perf_counter() - start
        start = time.perf_counter()
        infra.concurrently([functools.partial(world.step, "") for world in worlds])
        ratios.append(one_by_one / (time.perf_counter() - start))
    pool.close()
    pool.join()
    return median(ratios)


def measure(name, cfg):
    """In a fresh process: "speed" -> median seconds of a LOOP update and of a fine-tuning step,
    the speedups of batched generation and of the carried cache, and prefill ratios; any other
    workload -> its peak memory in bytes."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "chunked":
        return peak_memory(logprob_workload(cfg.logprob_chunk, device), device)
    if name == "full":
        return peak_memory(logprob_workload(TOKENS, device), device)
    model, chat, loop_update, sft = training_workloads(cfg, device)
    if name in ("passes", "slices"):  # one minibatch with a long outlier, in either layout
        _, _, backward = uneven_minibatch(model, chat, cfg)
        backward(name)  # warm
        return peak_memory(functools.partial(backward, name), device)
    if name == "loop":
        return peak_memory(loop_update, device)
    if name == "sft":
        return peak_memory(sft, device)
    pairs = [(seconds(loop_update, device), seconds(sft, device)) for _ in range(5)]  # alternating
    cache_ratio, uneven_prefill_ratio, uneven_seconds = cache_figures(model, chat, cfg)
    prompts = [chat.prompt(tiny_world.TinyWorld(t).messages()) for t in tiny_world.TinyWorld.tasks("test")[:8]]
    chat.stop_ids = [len(chat.tok)]  # no id stops a turn: 64 tokens each, batched or not

    def one_at_a_time():
        for prompt in prompts:
            loop.generate(model, chat, [prompt], 1.0, 64, infra.WaveCache())

    def batched():
        loop.generate(model, chat, prompts, 1.0, 64, infra.WaveCache())
    speedups = [seconds(one_at_a_time, device) / seconds(batched, device) for _ in range(3)]
    carried, reprefilled, carry_speedup = rollout_figures(model, chat, cfg)
    episodes, layouts, backward = uneven_minibatch(model, chat, cfg)
    backward("passes")  # warm
    layout_s = {name: [] for name in layouts}
    for _ in range(3):  # alternating
        for name in layouts:
            layout_s[name].append(seconds(functools.partial(backward, name), device))
    return {"passes_padding": padding(episodes, layouts["passes"]),
            "slices_padding": padding(episodes, layouts["slices"]),
            "passes_speedup": median(layout_s["slices"]) / median(layout_s["passes"]),"loop_s": median([a for a, _ in pairs]), "sft_s": median([b for _, b in pairs]),
            "batch_speedup": median(speedups), "prefill_ratio": carried,
            "reprefill_ratio": reprefilled, "carry_speedup": carry_speedup,
            "cache_ratio": cache_ratio, "uneven_prefill_ratio": uneven_prefill_ratio,
            "uneven_rollout_s": uneven_seconds}


def in_fresh_process(name, cfg):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (name, cfg))


def bench(cfg):
    cfg = dataclasses.replace(cfg, epochs=2, minibatch_size=8, micro_batch_tokens=4096)
    speed = in_fresh_process("speed", cfg)
    loop_s, sft_s = speed["loop_s"], speed["sft_s"]
    env_speedup = env_parallel_speedup()
    # CPU memory: a freed tensor leaves the resident set at once, in the processes started below
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    loop_mem, sft_mem, chunk_mem, full_mem, passes_mem, slices_mem = [
        in_fresh_process(name, cfg) for name in ("loop", "sft", "chunked", "full", "passes", "slices")]
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu x{torch.get_num_threads()}"
    return {"device": device,
            "update_peak_mem_ratio": round(loop_mem / sft_mem, 3),  # 8 rollouts x 512 tokens
            "update_time_ratio": round(loop_s / (cfg.epochs * sft_s), 3),  # per optimizer step
            "logprob_chunked_mem_ratio": round(chunk_mem / full_mem, 3),  # 8192 tokens x 151,936
            "rollout_batch_speedup": round(speed["batch_speedup"], 2),  # 8 batched / 1 by 1
            "prefill_ratio": round(speed["prefill_ratio"], 3),  # tokens fed / episode tokens
            "rollout_speedup": round(speed["carry_speedup"], 2),  # tokens/s, carried / re-prefill
            "cache_ratio": round(speed["cache_ratio"], 3),  # peak KV columns / longest row's tokens
            "uneven_prefill_ratio": round(speed["uneven_prefill_ratio"], 3),  # uneven rows
            "uneven_rollout_seconds": round(speed["uneven_rollout_s"], 2),  # 8 x 6 turns, uneven
            "env_parallel_speedup": round(env_speedup, 2),  # 4 steps of 1 s: one by one / together
            # one minibatch of a rollout of 2,000 tokens and 15 of 120-400:
            "passes_padding": round(speed["passes_padding"], 3),  # infra.passes: cells / tokens
            "slices_padding": round(speed["slices_padding"], 3),  # slices of 4 rollouts (before)
            "passes_speedup": round(speed["passes_speedup"], 2),  # backward seconds, slices / passes
            "passes_peak_mem_mb": round(passes_mem / 2**20, 1),
            "slices_peak_mem_mb": round(slices_mem / 2**20, 1),
            "update_peak_mem_mb": round(loop_mem / 2**20, 1),
            "sft_peak_mem_mb": round(sft_mem / 2**20, 1),
            "update_seconds": round(loop_s, 3),
            "sft_step_seconds": round(sft_s, 3),
            "logprob_chunked_mem_mb": round(chunk_mem / 2**20, 1),
            "logprob_full_mem_mb": round(full_mem / 2**20, 1),
            "reprefill_ratio": round(speed["reprefill_ratio"], 3)}


def main(argv):
    if "--config" not in argv and "--tiny" not in argv:
        argv = ["--tiny", *argv]  # the benchmark's default model is the tiny one
    print(json.dumps(bench(loop.parse_config(argv)), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
