"""Make the tiny instruct model that `python loop.py --tiny` starts from (assets/tiny-model).

    python tools/make_tiny_model.py --out assets/tiny-model --seed 1    # 4-6 minutes on 2 cores

The paper starts LOOP from a pretrained instruct model. This makes a small stand-in for one,
offline: a byte-level BPE tokenizer trained on the tiny world's own text, a random Qwen2-
architecture model of --shape, and a supervised warm-up in worlds whose API names and values no
task of tiny_world.TinyWorld uses:
1. docs-reading drills, what pretraining gives a real model: copying a name from the context.
   8 drills a step until the model writes 90% of 64 fresh ones exactly (at most --drills steps);
2. a careless agent's demonstrations (--demos steps, half of them of the long families): it knows
   the task families and their code, but often calls an API by the name it assumes instead of
   reading the docs, rarely recovers from the error that follows, and sometimes takes the last
   entry of a list for the first.
The result is a from_pretrained directory (weights, config, tokenizer, generation config) with
make_tiny_model.jsonl, the log of every step. The same seed gives the same model on the same CPU
setup. --drills 0 --demos 0 gives a random model of --shape (a real model's width, say).
"""
import argparse
import json
import os
import random
import re
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import infra  # noqa: E402
import loop  # noqa: E402
from chat import Chat  # noqa: E402
import tiny_world  # noqa: E402

SHAPE = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
         "tie_word_embeddings": True}
"""Qwen2Config fields of the shipped model: 1.07M parameters."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The pools' values that no task draws: no demonstration shows a name or a number of any task.
DEMO_VALUES = {key: [v for v in pool if v not in tiny_world.TASK_VALUES[key]]
               for key, pool in (("words", tiny_world.WORDS), ("numbers", tiny_world.NUMBERS))}

# The careless agent, a stand-in for an instruction-tuned model on apps it does not know. With
# probability LOOK (by family) it reads each app's docs before calling it; else it calls the first
# app's API by the name it assumes (ASSUMED: no world's API names), as a model does with an app it
# believes it knows. After the error it reads the docs from then on with probability RECOVER (by
# family), else gives up. With probability WRONG (by family) it takes the last entry of a list for
# the first. The long families' agent is careful less often and recovers less (greedy decoding
# then fails the whole chain) and slips less (sampling still finds it: docs/ablation.md).
LOOK = {"order": 0.8, "payback": 0.2, "phone": 0.2, "gift": 0.15, "repay": 0.15}
ASSUMED = {"shop": "buy", "bank": "send", "contacts": "phone", "calendar": "meetings",
           "gifts": "wishlist", "ledger": "paid"}
RECOVER = {"order": 0.25, "payback": 0.25, "phone": 0.25, "gift": 0.15, "repay": 0.15}
WRONG = {"order": 0.3, "payback": 0.3, "phone": 0.3, "gift": 0.1, "repay": 0.1}


def unseen(rng, long):
    """A world of a random long or short family whose names and values no task uses."""
    families = [family for family in tiny_world.TinyWorld.FAMILIES
                if (family in tiny_world.TinyWorld.CHAINS) == long]
    world = tiny_world.TinyWorld(f"{rng.choice(families)}00_1")
    world.task_id = "demo"
    world.populate(rng, DEMO_VALUES)
    return world


def apps(world):
    """The apps a task of `world` calls, in order: one, or a long family's chain of three."""
    return tiny_world.TinyWorld.CHAINS.get(world.family, [world.APPS.get(world.family)])


def action(world, app, api, index):
    """The line of work with `app` in `world`'s task, calling its API by the name `api`; a long
    family's look-ups keep what they found in x (a person) and y (their item or amount)."""
    last = f"apis.supervisor.payments()[{index}]"
    lines = {"order": f"apis.shop.{api}(item=apis.supervisor.wishlist()[{index}])",
             "payback": f"apis.bank.{api}(**{last})",
             "phone": f'x = apis.contacts.{api}(name={last}["name"])',
             "calendar": f"x = apis.calendar.{api}()[{index}]",
             "gifts": f"y = apis.gifts.{api}(name=x)[{index}]",
             "ledger": f"y = apis.ledger.{api}(name=x)",
             "shop": f"apis.shop.{api}(item=y)",
             "bank": f"apis.bank.{api}(name=x, amount=y)"}
    return lines[app if world.family in world.CHAINS else world.family]


def careless_agent(world, rng):
    """The careless agent's code for `world`, one string per turn."""
    index = -1 if rng.random() < WRONG[world.family] else 0
    careful = rng.random() < LOOK[world.family]
    codes = []
    for app in apps(world):
        if not careful:
            codes.append(action(world, app, ASSUMED[app], index))  # an AttributeError
            if rng.random() >= RECOVER[world.family]:
                return codes + ["apis.supervisor.complete_task()"]
            careful = True  # the error taught it to read the docs first
        codes += [f'print(apis.api_docs.show(app="{app}"))',
                  action(world, app, world.api[app], index)]
    if world.family == "phone":
        return codes + ["apis.supervisor.complete_task(answer=x)"]
    return codes + ["apis.supervisor.complete_task()"]


def demo(rng):
    """An unseen world, of a long family half the time, and the careless agent's code for it."""
    world = unseen(rng, rng.random() < 0.5)
    return world, careless_agent(world, rng)


def drill(rng, long):
    """A short exercise in reading docs: an API's doc line, then the family's action calling that
    API. A small model learns to copy a name it has never seen only from many such copies; in the
    demonstrations a name is 2 tokens of about 150."""
    world = unseen(rng, long)
    # a long family's look-ups: its shop and bank lines are the short families' doc lines, and a
    # drill's context does not tell which family's call should follow them
    app = rng.choice([app for app in apps(world) if world.family not in world.CHAINS
                      or app not in world.APPS.values()])
    return world.docs(app), action(world, app, world.api[app], 0)


def fence(code):
    return f"```python\n{code}\n```"


def corpus():
    """The text the tokenizer is trained on: the prompt and demonstrations, their names spelled
    in syllables. Had a demonstration's name become one token, it would be a different kind of
    token than the pieces of a task's name, and copying it would not carry over."""
    rng = random.Random(0)
    text = [tiny_world.TinyWorld.SYSTEM, tiny_world.TinyWorld.LONG_SYSTEM] * 20
    for _ in range(2000):
        world, codes = demo(rng)
        text.append(world.instruction)
        for code in codes:
            text += [fence(code), world.step(code)]
    pool = set(tiny_world.WORDS)

    def spell(match):
        word = match.group()
        return f"{word[:2]} {word[2:]}" if word in pool else word

    return [re.sub("[a-z]+", spell, line) for line in text] + ["system user assistant"]


def build_tokenizer(texts, vocab_size=1024):
    """Byte-level BPE trained on `texts`: exact for any text, no download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    # Words, numbers, quotes and runs of other characters stand alone: a merge never joins a name
    # to what is around it, so it tokenizes the same in an instruction, in code and in an output.
    # A dot stays with the word after it: the name after `.shop` in the docs is the name after
    # `.shop` in a call, and a model this small finds it by matching that one token.
    words = Regex(r'\.?[A-Za-z]+|\d+|"|[^A-Za-z\d"]+')
    words_apart = pre_tokenizers.Split(words, behavior="isolated")
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [words_apart, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|pad|>",
                                  padding_side="left", clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def random_model(tok, shape):
    """Random weights of `shape` (Qwen2Config fields), drawn from torch's global generator."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config
    config = Qwen2Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None, **shape)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig.from_model_config(config)  # its eos and pad ids
    return model


def drill_episode(rng, chat, exchanges=4):
    """One drill episode: after the system prompt, `exchanges` times a doc line and the call that
    uses it. Later exchanges sit where an episode's later turns do, so the copy learnt there is
    the one an episode needs."""
    e = loop.Episode("drill", None, [], [], [], [])
    long = rng.random() < 0.5  # the system prompt of the short families, or of the long ones
    system = tiny_world.TinyWorld.LONG_SYSTEM if long else tiny_world.TinyWorld.SYSTEM
    for turn in range(exchanges):
        doc, code = drill(rng, long)
        if turn == 0:
            e.add(chat.prompt([{"role": "system", "content": system},
                               {"role": "user", "content": doc}]))
        else:
            e.add(chat.observation(doc))
        e.add(chat.encode(fence(code)) + [chat.eot], output=True, turn=turn)
    return e


def demo_episode(rng, chat, cfg):
    """A careless agent's demonstration, played through the tiny world as if sampled."""
    env, codes = demo(rng)
    env.timeout = cfg.code_timeout
    e = loop.start_wave([(env, env.task_id)], chat, cfg)[0]
    for i, code in enumerate(codes):
        loop.act(e, chat.encode(fence(code)) + [chat.eot], i, chat)
        loop.observe(e, env.step(code), i == len(codes) - 1, chat, cfg)
    return e


@torch.no_grad()
def copied(model, episodes):
    """The share of episodes whose every output token is the model's greedy choice."""
    ids, attn, is_output, _ = loop.pad_batch(episodes)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    wrong = (logits.argmax(-1) != ids[:, 1:]) & is_output[:, 1:]
    return (~wrong.any(1)).float().mean().item()


def sft_step(model, opt, episodes, grad_clip):
    """One supervised step on the mean log-likelihood of the output tokens (the warm-up, and the
    fine-tuning baseline that tools/bench.py holds the LOOP update against); returns the loss."""
    ids, attn, is_output, _ = loop.pad_batch(episodes)
    mask = (is_output[:, 1:] & attn[:, 1:].bool()).float()
    opt.zero_grad(set_to_none=True)
    loss = -(infra.token_logprobs(model, ids, attn, 1.0) * mask).sum() / mask.sum()
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.item()


def warmup(model, chat, cfg, args, log, drills=8):
    """The drills until the model copies, then the demonstrations with drills mixed in; returns
    the number of drill steps. Drills: the rate rises from zero over 100 steps (at the full rate
    from Adam's first step one seed stalled for 2,000 steps). Demonstrations: it decays to zero,
    so that the last random batches do not decide where RL starts."""
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    drilled = 0
    for drilled in tqdm(range(1, args.drills + 1), desc="drills", disable=None):
        opt.param_groups[0]["lr"] = args.lr * min(1.0, drilled / 100)
        loss = sft_step(model, opt, [drill_episode(rng, chat) for _ in range(drills)], None)
        row = {"stage": "drills", "step": drilled, "lr": opt.param_groups[0]["lr"], "loss": loss}
        if drilled % 50 == 0:
            row["copied"] = copied(model, [drill_episode(rng, chat) for _ in range(64)])
        log(row)
        if row.get("copied", 0) >= 0.9:
            break
    for step in tqdm(range(args.demos), desc="demonstrations", disable=None):
        opt.param_groups[0]["lr"] = args.lr * (1 - step / args.demos)
        batch = [drill_episode(rng, chat) for _ in range(2)]
        batch += [demo_episode(rng, chat, cfg) for _ in range(8)]
        loss = sft_step(model, opt, batch, None)
        log({"stage": "demos", "step": step + 1, "lr": opt.param_groups[0]["lr"], "loss": loss})
    return drilled


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the directory to write the model to")
    parser.add_argument("--seed", type=int, default=0, help="weights and warm-up data")
    parser.add_argument("--shape", type=json.loads, default=SHAPE, help="Qwen2Config fields, JSON")
    parser.add_argument("--drills", type=int, default=2000, help="most steps of drills")
    parser.add_argument("--demos", type=int, default=600, help="steps of demonstrations")
    parser.add_argument("--lr", type=float, default=3e-3, help="the warm-up's peak learning rate")
    args = parser.parse_args(argv)
    if args.drills < 0 or args.demos < 0 or not args.lr > 0:
        infra.die("--drills and --demos must be >= 0 and --lr > 0")
    started = time.time()
    cfg = loop.parse_config(["--tiny"])  # the episodes' limits of the run the model is made for
    torch.manual_seed(args.seed)
    tok = build_tokenizer(corpus())
    model = random_model(tok, args.shape)
    infra.chunked_logprob_head(model.get_output_embeddings(), cfg.logprob_chunk)  # token_logprobs
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "make_tiny_model.jsonl"), "w") as fh:
        fh.write(json.dumps({"args": vars(args)}) + "\n")

        def log(row):
            fh.write(json.dumps(row) + "\n")

        drilled = warmup(model, Chat(tok), cfg, args, log)
        print(f"warm-up: {drilled} drill steps", flush=True)
        log({"drill_steps": drilled, "seconds": round(time.time() - started, 1)})
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
