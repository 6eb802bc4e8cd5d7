"""Tests for loop.py: hand-computed advantages and objectives, masks, token bookkeeping, the tiny
world, config errors and an end-to-end smoke run. All offline; run with `python -m pytest -q`."""
import json
import math
import os
import random
import subprocess
import sys
import time

import pytest
import torch

import loop

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- leave-one-out advantages (Eq. 3)
def test_loo_advantages_k2():
    adv = loop.loo_advantages(torch.tensor([[1.0, 0.0], [0.25, 0.75]]))
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0], [-0.5, 0.5]]))


def test_loo_advantages_k6_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.5, 0.5, 0.25, 0.75]])
    # A_0 = 1 - (0 + .5 + .5 + .25 + .75)/5 = 0.6; A_1 = 0 - 3/5 = -0.6; A_4 = .25 - 2.75/5 = -0.3
    expected = torch.tensor([[0.6, -0.6, 0.0, 0.0, -0.3, 0.3]])
    assert torch.allclose(loop.loo_advantages(r), expected, atol=1e-6)


def test_loo_advantages_equal_returns_are_zero():
    assert torch.equal(loop.loo_advantages(torch.full((3, 6), 0.7)), torch.zeros(3, 6))


def test_reward_normalisation_divides_by_group_std():
    r = torch.tensor([[1.0, 0.0]])  # std (unbiased) = 0.7071
    assert torch.allclose(loop.loo_advantages(r, normalize=True), torch.tensor([[1.0, -1.0]]) / 0.70710678, atol=1e-4)


# ---------------------------------------------------------------- clipped objective (Eq. 5)
# One rollout: tokens 0 and 4 are environment tokens, 1-2 form turn 0 and 3 forms turn 1.
# log ratios on the output tokens: log 1.5, log 0.5, log 1.05; eps = 0.1 -> clip to [1/1.1, 1.1].
MASK = torch.tensor([[False, True, True, True, False]])
TURN = torch.tensor([[-1, 0, 0, 1, -1]])
OLD = torch.tensor([[-1.0, -2.0, -1.0, -3.0, -0.5]])


def _loss(adv, ratios, ratio_kind, env_logp=(0.3, -4.0)):
    logp = OLD.clone()
    logp[0, 1:4] += torch.log(torch.tensor(ratios))
    logp[0, 0], logp[0, 4] = env_logp
    logp.requires_grad_(True)
    loss, n_clipped = loop.loop_loss(logp, OLD, torch.tensor([adv]), MASK, TURN, ratio_kind, 0.1)
    loss.sum().backward()
    return loss.item(), logp.grad[0].tolist(), int(n_clipped)


def test_per_token_objective_positive_advantage():
    loss, grad, n_clipped = _loss(2.0, [1.5, 0.5, 1.05], "token")
    # min(1.5*2, 1.1*2)=2.2 clipped; min(0.5*2, 0.909*2)=1.0; min(2.1, 2.1)=2.1 -> loss -(5.3)/3
    assert loss == pytest.approx(-5.3 / 3, abs=1e-5)
    assert grad == pytest.approx([0.0, 0.0, -1.0 / 3, -2.1 / 3, 0.0], abs=1e-5)  # zero where clipped
    assert n_clipped == 1


def test_per_token_objective_negative_advantage():
    loss, grad, n_clipped = _loss(-1.0, [1.5, 0.5, 1.05], "token")
    # min(-1.5, -1.1)=-1.5; min(-0.5, -0.909)=-0.909 clipped; -1.05 -> loss (1.5+1/1.1+1.05)/3
    assert loss == pytest.approx((1.5 + 1 / 1.1 + 1.05) / 3, abs=1e-5)
    assert grad == pytest.approx([0.0, 0.5, 0.0, 0.35, 0.0], abs=1e-5)
    assert n_clipped == 1


def test_per_turn_objective():
    loss, grad, _ = _loss(2.0, [1.5, 0.5, 1.05], "turn")
    # turn 0 ratio 0.75 (unclipped: 1.5 < 1.818), turn 1 ratio 1.05 -> per token [1.5, 1.5, 2.1]
    assert loss == pytest.approx(-5.1 / 3, abs=1e-5)
    # d/dlogp_1 = -(r0 A + r0 A)/3 = -1.0 (both tokens of turn 0 carry r0), d/dlogp_3 = -2.1/3
    assert grad == pytest.approx([0.0, -1.0, -1.0, -0.7, 0.0], abs=1e-5)


def test_per_turn_objective_clipped_turn_has_zero_gradient():
    loss, grad, _ = _loss(2.0, [1.5, 1.0, 1.0], "turn")  # turn 0 ratio 1.5 -> clipped at 1.1
    assert loss == pytest.approx(-(2.2 + 2.2 + 2.0) / 3, abs=1e-5)
    assert grad == pytest.approx([0.0, 0.0, 0.0, -2.0 / 3, 0.0], abs=1e-5)


def test_per_trajectory_objective():
    loss, grad, _ = _loss(2.0, [1.5, 0.5, 1.05], "trajectory")
    r = 1.5 * 0.5 * 1.05  # 0.7875, unclipped for A > 0
    assert loss == pytest.approx(-r * 2.0, abs=1e-5)
    assert grad == pytest.approx([0.0, -r * 2, -r * 2, -r * 2, 0.0], abs=1e-5)
    loss, grad, n_clipped = _loss(2.0, [1.5, 1.0, 1.0], "trajectory")  # ratio 1.5 -> clipped
    assert loss == pytest.approx(-2.2, abs=1e-5) and grad == pytest.approx([0.0] * 5, abs=1e-7)
    assert n_clipped == 3


def test_on_policy_rloo_objective():
    logp = torch.tensor([[-9.0, -1.0, -2.0, -3.0, 5.0]], requires_grad=True)
    loss, _ = loop.loop_loss(logp, OLD, torch.tensor([2.0]), MASK, TURN, "none", 0.1)
    loss.sum().backward()
    assert loss.item() == pytest.approx(4.0)  # -A * mean(-1, -2, -3)
    assert logp.grad[0].tolist() == pytest.approx([0.0, -2 / 3, -2 / 3, -2 / 3, 0.0])


@pytest.mark.parametrize("kind", ["token", "turn", "trajectory", "none"])
def test_environment_tokens_cannot_change_the_loss(kind):
    a = _loss(1.3, [1.2, 0.7, 1.0], kind, env_logp=(0.3, -4.0))
    b = _loss(1.3, [1.2, 0.7, 1.0], kind, env_logp=(-50.0, 7.0))
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    assert a[1][0] == a[1][4] == 0.0  # no gradient reaches a context token


# ---------------------------------------------------------------- tiny model fixtures
@pytest.fixture(scope="module")
def tiny():
    cfg = loop.parse_config(["--tiny", "--warmup-steps", "40", "--seed", "0", "--max-new-tokens", "24"])
    model, tok = loop.load_model_and_tokenizer(cfg, torch.device("cpu"))
    chat = loop.Chat(tok)
    random.seed(0)
    torch.manual_seed(0)
    loop.warmup(model, chat, cfg)
    return cfg, model, chat


@pytest.fixture(scope="module")
def episodes(tiny):
    """Four real episodes from the tiny model; every generate() call is recorded."""
    cfg, model, chat = tiny
    tasks, calls, original = ["pay00_1", "phone03_2", "note05_3", "pay07_1"], [], loop.generate

    def recording(model, chat, prompts, temperature, max_new_tokens):
        out = original(model, chat, prompts, temperature, max_new_tokens)
        calls.append(([list(p) for p in prompts], out))
        return out

    loop.generate = recording
    try:
        torch.manual_seed(1)
        eps = loop.rollout(model, chat, loop.make_envs(cfg, tasks), tasks, cfg, 1.0, 3)
    finally:
        loop.generate = original
    return eps, calls


def test_tokenizer_is_exact_and_keeps_special_text_literal(tiny):
    chat = tiny[2]
    text = 'héllo <|im_end|> wörld 🎉 \x00\n\t  "quoted" 123 apis.bank.send(to="bob", amount=3)'
    ids = chat.encode(text, literal=True)
    assert chat.tok.decode(ids) == text
    assert chat.eot not in ids  # environment text can never end a turn


def test_sampled_ids_are_kept_exactly_and_masked(episodes):
    eps, calls = episodes
    assert len(calls) >= 2  # several turns were played
    covered = {id(e): 0 for e in eps}
    for prompts, outs in calls:
        for prompt, (new, logps) in zip(prompts, outs):
            (e,) = [e for e in eps if e.ids[:len(prompt)] == prompt]
            span = slice(len(prompt), len(prompt) + len(new))
            assert e.ids[span] == new and all(e.is_output[span]) and e.sample_logp[span] == logps
            covered[id(e)] += len(new)
    for e in eps:
        assert len(e.ids) == len(e.is_output) == len(e.turn) == len(e.sample_logp)
        assert sum(e.is_output) == covered[id(e)]  # nothing else is marked as an action
        assert all((k >= 0) == o for k, o in zip(e.turn, e.is_output))


def test_decoded_sequence_is_the_transcript(tiny, episodes):
    chat = tiny[2]
    for e in episodes[0]:
        shown = e.transcript[:-1]  # the last observation ends the episode and is never fed back
        rendered = chat.tok.apply_chat_template(shown, tokenize=False)
        decoded = chat.tok.decode(e.ids)
        closing = "\n" if e.ids[-1] == chat.eot else "<|im_end|>\n"
        assert decoded + closing == rendered


def test_recomputed_logprobs_equal_sampling_logprobs(tiny, episodes):
    cfg, model, chat = tiny
    eps = episodes[0]
    ids, attn, is_out, _ = loop.pad_batch(eps, "cpu")
    with torch.no_grad():
        lp = loop.token_logprobs(model.eval(), ids, attn, 1.0)
    for e, row in zip(eps, lp):
        mask = torch.tensor(e.is_output[1:])
        assert torch.allclose(row[:len(e.ids) - 1][mask], torch.tensor(e.sample_logp[1:])[mask], atol=1e-4)


def test_loss_gradient_reaches_only_sampled_tokens(tiny, episodes):
    cfg, model, chat = tiny
    eps = episodes[0]
    ids, attn, is_out, turn = loop.pad_batch(eps, "cpu")
    logp = loop.token_logprobs(model, ids, attn, 1.0).detach().requires_grad_(True)
    loss, _ = loop.loop_loss(logp, logp.detach() - 0.05, torch.tensor([1.0, -1.0, 0.5, 2.0]),
                             is_out[:, 1:] & attn[:, 1:].bool(), turn[:, 1:])
    loss.sum().backward()
    assert (logp.grad[~is_out[:, 1:]] == 0).all()
    assert (logp.grad[is_out[:, 1:]] != 0).any()


def test_update_runs_and_moves_the_policy(tiny, episodes):
    cfg, model, chat = tiny
    import copy
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    stats = loop.update(m, opt, episodes[0], torch.tensor([1.0, -1.0, 0.005, 0.5]), cfg)
    assert stats["rollouts_used"] == 3  # |A| = 0.005 < 0.01 is dropped
    assert stats["steps"] == cfg.epochs and not stats["abandoned"]
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_high_kl_abandons_the_iteration(tiny, episodes):
    cfg, model, chat = tiny
    import copy
    import dataclasses
    m = copy.deepcopy(model)
    small = dataclasses.replace(cfg, minibatch_size=1, micro_batch_size=1, max_kl=1e-9, lr=1e-2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    stats = loop.update(m, opt, episodes[0], torch.tensor([1.0, -1.0, 1.0, -1.0]), small)
    assert stats["abandoned"] and stats["steps"] == 1  # first step ran (KL 0), the second saw KL > 0


# ---------------------------------------------------------------- the tiny world
def _run(task, *codes):
    w = loop.TinyWorld(task, timeout=0.5)
    obs = [w.step(c) for c in codes]
    return w, obs, w.evaluate()


def test_tiny_world_pay_correct_partial_wrong():
    w = loop.TinyWorld("pay03_2")
    name, amount = w.params["name"], w.params["amount"]
    good = f'apis.bank.send(to="{name}", amount={amount})\napis.supervisor.complete_task()'
    assert _run("pay03_2", good)[2] == (4, 4)
    partial = f'apis.bank.send(to="{name}", amount={amount % 9 + 1})\napis.supervisor.complete_task()'
    assert _run("pay03_2", partial)[2] == (3, 4)
    assert _run("pay03_2", "apis.supervisor.complete_task()")[2] == (1, 4)


def test_tiny_world_phone_needs_the_right_contact_and_can_take_two_turns():
    w = loop.TinyWorld("phone04_1")
    name = w.params["name"]
    world, obs, result = _run("phone04_1", f'print(apis.contacts.phone(name="{name}"))', "")
    assert obs[0] == world.phones[name] and result == (0, 3)
    world, obs, result = _run("phone04_1", f'p = apis.contacts.phone(name="{name}")', "apis.supervisor.complete_task(answer=p)")
    assert result == (3, 3) and obs[1] == "Execution successful." and world.done  # REPL state persists
    other = next(n for n in loop.NAMES if n != name)
    assert _run("phone04_1", f'apis.supervisor.complete_task(answer=apis.contacts.phone(name="{other}"))')[2] == (2, 3)


def test_tiny_world_note():
    topic = loop.TinyWorld("note02_3").params["topic"]
    assert _run("note02_3", f'apis.notes.create(title="{topic}")\napis.supervisor.complete_task()')[2] == (3, 3)
    assert _run("note02_3", 'apis.notes.create(title="x")\napis.notes.create(title="y")')[2] == (0, 3)


def test_agent_code_failures_become_observations():
    t = time.monotonic()
    w, obs, result = _run("pay01_1", "1/0", "def f(:\n  pass", "while True:\n    pass",
                          "while True: print('x' * 1000)", "open('/etc/passwd')", "import os",
                          'apis.bank.send(to="nobody", amount=1)')
    assert time.monotonic() - t < 5
    assert "ZeroDivisionError" in obs[0]
    assert "SyntaxError" in obs[1]
    assert "longer than" in obs[2]
    assert "output exceeded" in obs[3]
    assert "NameError" in obs[4] and "failed" in obs[5]
    assert "KeyError" in obs[6]
    assert result == (0, 4) and not w.done


def test_observations_are_truncated_at_a_space_with_a_note(tiny):
    chat = tiny[2]
    text = " ".join(f"word{i}" for i in range(500))
    short = chat.truncate(text, 40)
    assert short.startswith("word0 word1") and "[output truncated" in short
    head = short.split("\n[output")[0]
    assert len(chat.encode(head, literal=True)) <= 40 and text.startswith(head + " ")  # cut at a space


def test_extract_code():
    assert loop.extract_code("hi\n```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "a = 1\nb = 2"
    assert loop.extract_code("```python\nx = 3\nprint(x)") == "x = 3\nprint(x)"  # unterminated
    assert loop.extract_code("no code here") == ""


def test_splits_are_scenarios_of_three_and_disjoint():
    train, test = loop.TinyWorld.tasks("train"), loop.TinyWorld.tasks("test")
    assert not set(train) & set(test)
    scenarios = {}
    for t in train + test:
        scenarios.setdefault(loop.TinyWorld.scenario(t), []).append(t)
    assert all(len(v) == 3 for v in scenarios.values())
    assert not {loop.TinyWorld.scenario(t) for t in train} & {loop.TinyWorld.scenario(t) for t in test}


# ---------------------------------------------------------------- config and CLI
def _cli(*args, cwd=HERE):
    return subprocess.run([sys.executable, os.path.join(HERE, "loop.py"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_flags_override_config_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"iterations": 7, "lr": 1, "max_turns": 9}))
    cfg = loop.parse_config(["--config", str(path), "--iterations", "3", "--max-turns", "4", "--no-normalize-rewards"])
    assert (cfg.iterations, cfg.lr, cfg.max_turns, cfg.normalize_rewards) == (3, 1.0, 4, False)
    assert loop.parse_config(["--tiny"]).model == "tiny"


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read config"),
    ('{"iterashuns": 3}', "unknown key 'iterashuns'"),
    ('{"iterations": "3"}', "'iterations' in"),
    ('{"normalize_rewards": 1}', "must be bool"),
])
def test_config_errors_are_one_clear_message(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    r = _cli("--config", str(path))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_bad_flag_and_missing_model_path(tmp_path):
    r = _cli("--ratio", "sideways")
    assert r.returncode == 2 and "--ratio" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--tiny", "--model", str(tmp_path / "no" / "such" / "model"), "--eval")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_tiny_smoke_run_writes_metrics(tmp_path):
    out = tmp_path / "run"
    loop.main(["--tiny", "--iterations", "2", "--warmup-steps", "20", "--tasks-per-iteration", "4",
               "--eval-every", "1", "--out", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward_mean" in r and "split" not in r]
    evals = [r for r in rows if r.get("split") == "test"]
    assert [r["iteration"] for r in train] == [1, 2]
    assert [r["iteration"] for r in evals] == [0, 1, 2]
    for r in train:
        assert {"reward_mean", "success_rate", "kl", "clip_fraction", "seconds"} <= set(r)
        assert 0 <= r["reward_mean"] <= 1 and 0 <= r["clip_fraction"] <= 1 and math.isfinite(r["kl"])
    for r in evals:
        assert 0 <= r["sgc"] <= r["tgc"] <= 1  # a solved scenario is three solved tasks
        assert len(r["per_task"]) == len(loop.TinyWorld.tasks("test"))
    assert (out / "model" / "config.json").exists() and list((out / "transcripts").iterdir())
    r = _cli("--eval", "--model", str(out / "model"), "--split", "test", "--eval-max-turns", "2",
             "--max-new-tokens", "16", "--out", str(tmp_path / "ev"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ev" / "metrics.jsonl").read_text().splitlines()[0])["split"] == "test"
