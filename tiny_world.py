"""The tiny world: an offline miniature of AppWorld, and the template for a new environment.

Copy TinyWorld (and run_code) to train in your own environment. loop.py makes one world per
episode, each in a worker process of its own (Hosted, at the end of this file), and calls:

    Env.tasks(split)                -> task ids "<scenario>_<n>" (scenario: what SGC groups by);
                                       raise ValueError for a split it does not have
    Env(task_id, timeout, experiment)  one world per episode (experiment: a name for its outputs)
    env.messages()                  -> the chat that opens the episode (system and user)
    env.step(code)                  -> the observation: what running the agent's code printed
    env.done                        -> optional: True once the task is finished (default False:
                                       the episode runs to --max-turns)
    env.evaluate()                  -> (tests passed, tests total), or None if the world failed
    env.close()                     -> optional: free the world after its evaluation, before its
                                       worker process serves the next one
    Env.preload()                   -> optional: modules every worker needs (AppWorld: its apps),
                                       imported once for all of them
    Env.DOCS_CALL, Env.ERROR_PREFIX    optional: code text that reads documentation and the start
                                       of an error observation, for the behaviour shares

A world that raises, dies, does not answer in time (its step: `timeout` + Hosted.MARGIN s) or
returns what this interface does not allow (its worker checks) fails its episode: no reward, and
the run goes on; a run whose every world fails stops. The class must be importable by its
module's name (defined at a module's top level), since a worker process imports it. Register it
from your own script and run loop's command line (see the README):

    import loop, my_world
    loop.ENVS["mine"] = my_world.MyWorld
    if __name__ == "__main__":      # a world's worker imports this script again as it starts
        loop.main()                 # python my_script.py --env mine --model ...
"""
import builtins
import faulthandler
import math
import multiprocessing
import numbers
import os
import random
import re
import signal
import sys
import threading
import time

class CodeLimit(BaseException):
    """Not an Exception: the agent's own `except Exception` cannot swallow it."""

SAFE_BUILTINS = {name: getattr(builtins, name) for name in (
    "abs all any bool dict enumerate filter float int isinstance len list map max min print range "
    "repr reversed round set sorted str sum tuple zip Exception KeyError ValueError TypeError"
).split()}

def run_code(code, namespace, timeout, max_chars=20000):
    """Run agent code in a persistent namespace with restricted builtins and a deadline. Whatever
    happens (exception, syntax error, endless loop, flood of output) comes back as text."""
    output = []
    printed = 0
    deadline = time.monotonic() + timeout

    def limited_print(*args, sep=" ", end="\n", **_):
        nonlocal printed
        text = sep.join(map(str, args)) + end
        printed += len(text)
        if printed > max_chars:
            raise CodeLimit(f"output exceeded {max_chars} characters")
        output.append(text)

    def tracer(frame, event, arg):  # a line-level deadline works in any thread, unlike signals
        if time.monotonic() > deadline:
            raise CodeLimit(f"code ran longer than {timeout} s")
        return tracer

    # its errors read as print's, whatever the module (__main__ when run as a script)
    limited_print.__name__ = limited_print.__qualname__ = "print"
    limited_print.__module__ = None
    namespace["__builtins__"] = dict(SAFE_BUILTINS, print=limited_print)
    status = ""
    previous = sys.gettrace()
    try:
        sys.settrace(tracer)
        exec(compile(code, "<agent>", "exec"), namespace)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the agent's failure is an observation, not a crash
        status = f"Execution failed. {type(e).__name__}: {e}"
    finally:
        sys.settrace(previous)
    text = ("".join(output) + status).strip() or "Execution successful."
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # <function print at 0x7f..>: an address per run

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
WORDS = random.Random(0).sample([a + b for a in SYLLABLES for b in SYLLABLES], 560)  # kofi, lena
"""Names and product titles: two syllables each."""
NUMBERS = [str(n) for n in random.Random(1).sample(range(10, 100), 90)]
# Tasks draw from the first part of each pool; the tiny model's warm-up saw only the rest.
TASK_VALUES = {"words": WORDS[:60], "numbers": NUMBERS[:30]}

class App:
    """An app whose APIs are its attributes, called as apis.bank.kofi(name=..., amount=...)."""

    def __init__(self, name, **apis):
        for api, function in apis.items():
            if callable(function):  # its errors name it as the agent calls it, module-free
                function.__name__, function.__qualname__ = api, f"apis.{name}.{api}"
                function.__module__ = None
        self.__dict__.update(apis)
        self.app_name = name

    def __repr__(self):  # print(apis): no address, no module
        return f"<app {self.app_name}>"

    def __getattr__(self, api):  # only for names the app lacks
        raise AttributeError(f"{self.app_name} has no API named {api!r}")

class TinyWorld:
    """A miniature AppWorld: a shop, a bank and contacts behind `apis`, whose API names change
    from world to world and are in no prompt, as an AppWorld agent meets apps it does not know:
    only apis.api_docs tells them. A supervisor receives the answer; unit-test-like checks judge
    the end state. Tasks come in scenarios of three (one template, three worlds); train and test
    hold other scenarios."""

    FAMILIES = {"order": "Order the item at the top of my wishlist.",
                "payback": "Pay back the last person who paid me, the same amount.",
                "phone": "What is the phone extension of the last person who paid me?"}
    APPS = {"order": "shop", "payback": "bank", "phone": "contacts"}
    SYSTEM = ("Apps: shop, bank, contacts; see apis.api_docs.show(app). Mine: "
              "apis.supervisor.wishlist(), apis.supervisor.payments() (latest first), "
              "apis.supervisor.complete_task(answer=None)")
    DOCS_CALL, ERROR_PREFIX = "apis.api_docs.", "Execution failed"  # for the behaviour shares

    @staticmethod
    def tasks(split):
        """Per family 12 scenarios of 3 tasks: 9 scenarios train, 3 test."""
        if split not in ("train", "test"):
            raise ValueError(f"the tiny world's splits are train and test, not {split!r}")
        scenarios = range(3) if split == "test" else range(3, 12)
        return [f"{family}{i:02d}_{n}" for family in TinyWorld.FAMILIES for i in scenarios
                for n in (1, 2, 3)]

    def __init__(self, task_id, timeout=5.0, experiment=None):
        self.task_id = task_id
        self.timeout = timeout
        self.family = task_id.split("_")[0].rstrip("0123456789")
        self.populate(random.Random(task_id), TASK_VALUES)

    def populate(self, rng, values):
        """The world's state, drawn from `values` (TASK_VALUES; the warm-up's worlds: the rest)."""
        words = rng.sample(values["words"], 10)
        people = words[:4]
        # APIs named anew in each world, as AppWorld's apps are new to an agent: guesses fail
        self.api = dict(zip(self.APPS.values(), words[4:7]))
        self.wishlist = words[7:]  # top first
        self.phones = dict(zip(people, map(int, rng.sample(values["numbers"], 4))))
        amounts = map(int, rng.sample(values["numbers"], 2))
        self.payments = list(zip(people[:2], amounts))  # latest first
        self.instruction = self.FAMILIES[self.family]
        self.transfers = []
        self.orders = []
        self.answer = None
        self.done = False
        self.namespace = {"apis": self.apis()}

    def apis(self):
        def wishlist():
            return list(self.wishlist)

        def payments():
            return [{"name": who, "amount": amount} for who, amount in self.payments]

        def buy(item):
            self.orders.append(item)
            return f"ordered {item}"

        def send(name, amount):
            phone(name)  # a contact of that name
            self.transfers.append((name, amount))
            return f"sent {amount} to {name}"

        def phone(name):
            if name not in self.phones:
                raise KeyError(f"no contact named {name!r}")
            return self.phones[name]

        def complete_task(answer=None):
            self.answer = answer
            self.done = True
            return "task completed"

        def show(app):
            return self.docs(app)

        supervisor = App("supervisor", wishlist=wishlist, payments=payments,
                         complete_task=complete_task)
        return App("apis", api_docs=App("api_docs", show=show), supervisor=supervisor,
                   shop=App("shop", **{self.api["shop"]: buy}),
                   bank=App("bank", **{self.api["bank"]: send}),
                   contacts=App("contacts", **{self.api["contacts"]: phone}))

    def docs(self, app):
        docs = {"shop": "(item): orders an item", "bank": "(name, amount): sends money",
                "contacts": "(name): a phone extension"}
        if app not in docs:
            raise KeyError(f"no app named {app!r}; the apps are shop, bank, contacts")
        return f"apis.{app}.{self.api[app]}{docs[app]}"

    def messages(self):
        return [{"role": "system", "content": self.SYSTEM},
                {"role": "user", "content": self.instruction}]

    def step(self, code):
        return run_code(code, self.namespace, self.timeout)

    def evaluate(self):
        """Checks on the end state; partial credit always points at the full solution."""
        last, amount = self.payments[0]
        if self.family == "order":
            checks = [len(self.orders) == 1, self.orders == self.wishlist[:1]]
        elif self.family == "payback":
            checks = [len(self.transfers) == 1, [to for to, _ in self.transfers] == [last],
                      [amount for _, amount in self.transfers] == [amount]]
        else:
            checks = [self.answer in self.phones.values(), self.answer == self.phones[last]]
        return sum(checks) + self.done, len(checks) + 1


# How loop.py runs a world of any environment: in a worker process of its own. Agent code that
# cannot be stopped from inside (a bare `except:` around an endless loop, a long C call such as
# sum(range(10**12))) is stopped by killing its process; AppWorld also allows one world a process.
class Refused(Exception):
    """A value the interface does not allow, from a world's method: its episode fails."""

def serve(conn):
    """A worker process: one world at a time, task after task, each call answered in turn with
    ("ok", its value checked), or ("refused" or "raised", (member, a line that says why)): the
    episode fails, not the run. A refused value closes the world and the worker serves the next
    one; an error of the world's own ends the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the trainer's to handle
    quiet = open(os.devnull, "w")
    world = None
    while True:
        try:
            method, arg, wait = conn.recv()
        except EOFError:  # the trainer is gone
            return
        # the trainer's deadline here too, kept by a C thread (it fires also while agent code holds
        # the GIL): a worker whose trainer was killed ends by then, whatever its world runs
        faulthandler.dump_traceback_later(wait, exit=True, file=quiet)
        member = {"start": "messages", "step": "step"}.get(method, "evaluate")
        try:
            if method == "start":
                env, task_id, timeout, experiment, environ = arg
                os.environ.update(environ)  # the trainer's now (APPWORLD_ROOT), not at the fork
                member = "__init__"
                world = env(task_id, timeout, experiment)
                member = "messages"
                reply = checked_messages(world, world.messages())
            elif method == "step":
                reply = checked_text(world, world.step(arg)), checked_done(world)
            else:  # "evaluate", a world's last call
                reply = checked_result(world, world.evaluate())
                getattr(world, "close", lambda: None)()
                world = None
            conn.send(("ok", reply))
        except Refused as e:
            getattr(world, "close", lambda: None)()
            world = None
            conn.send(("refused", (member, str(e))))
        except Exception as e:  # noqa: BLE001 - the world's own error: its last traceback line
            name = type(world).__name__ if world is not None else env.__name__
            conn.send(("raised", (member, f"{name}.{member} raised {type(e).__name__}: {e}")))
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

def checked_text(world, text):
    if not isinstance(text, str):
        refuse(world, "step(code)", text, "the observation, a str")
    return valid_text(text)

def valid_text(text):
    """Text any tokenizer and file can take: a surrogate pair (print("\\ud83d\\ude00")) joined,
    a lone surrogate replaced."""
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
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and all(isinstance(x, numbers.Real) and math.isfinite(x) for x in result)
            and 0 <= result[0] <= result[1] and result[1] > 0):
        refuse(world, "evaluate()", result, "(tests passed, tests total), 0 <= passed <= total, "
               "total > 0; or None if the world failed")
    return tuple(x if isinstance(x, int) else float(x) for x in result)

def start_forkserver():
    """Python 3.11's forkserver imports its preload modules on its own sys.path, not the trainer's
    (loop.py's directory is on neither when a run starts elsewhere): PYTHONPATH gives it that."""
    import multiprocessing.forkserver
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:  # the trainer's own environment as it was
        del os.environ["PYTHONPATH"]
        if path is not None:
            os.environ["PYTHONPATH"] = path

class Hosted:
    """A world of `env` in a worker process, with the interface's methods. Every call has a
    deadline: a world that dies or does not answer in time is killed and fails its episode (an
    infrastructure failure: no reward, not even 0), as does one whose answer the interface does
    not allow. `error` says why. The world starts with its episode's wave (messages()) and its
    worker waits idle after the evaluation, for a world of the next wave."""

    WORLD_TIMEOUT = 300  # seconds a world may take to start or to be evaluated (AppWorld: ~4, ~0.1)
    MARGIN = 5  # seconds a step may take beyond the agent's time limit before its world is killed
    idle = []  # workers waiting for a world
    idle_lock = threading.Lock()  # a wave's worlds take and give back workers from its threads
    forkserver_started = False
    said = set()  # the failures of worlds said so far, a line each: (class, member, kind)

    def __init__(self, env, task_id, timeout, experiment):
        self.env, self.task_id, self.timeout, self.experiment = env, task_id, timeout, experiment
        self.done = self.failed = False
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
        """From the forkserver, a clean process (a fork of the trainer would inherit CUDA state,
        NCCL threads and other threads' locks) that has imported, once for every worker it forks,
        loop and what it imports (torch: a worker runs the main script again as it starts, as
        Python 3.11's forkserver does not preload __main__, and finds them imported), the
        environment's module and what that names (AppWorld: its 12 apps)."""
        ctx = multiprocessing.get_context("forkserver")
        with Hosted.idle_lock:  # the first world's thread starts the forkserver for all
            if not Hosted.forkserver_started:
                preload = getattr(self.env, "preload", lambda: [])()
                ctx.set_forkserver_preload(["loop", self.env.__module__, *preload])
                start_forkserver()
                Hosted.forkserver_started = True
        conn, child = ctx.Pipe()
        worker = ctx.Process(target=serve, args=(child,), daemon=True)
        worker.start()
        child.close()  # so that a dead worker reads as EOF here
        return worker, conn

    def call(self, message, wait):
        """The world's answer within `wait` s, or None: it failed, and `error` says why. A world
        that died or hung is killed; one that raised has ended its worker; one whose answer was
        refused is closed, and its worker serves the next one. A failure of the world's own is said
        once a run (its class, method and kind), not once an episode."""
        (method, _), status, value = message, "died", None
        try:
            self.conn.send((*message, wait))
            status, value = self.conn.recv() if self.conn.poll(wait) else ("hung", None)
        except (EOFError, OSError):
            pass
        if status == "ok":
            return value
        self.failed = self.done = True
        if status == "refused":
            self.give_back()
            member, self.error = value
        elif status == "raised":
            member, self.error = value
        elif status == "hung":
            self.error = f"{self.env.__name__} did not answer its {method} within {wait:g} s"
        else:
            self.worker.join(1)
            self.error = (f"{self.env.__name__}'s worker process ended (exit code "
                          f"{self.worker.exitcode}) before it answered its {method}")
        if status != "refused":
            self.worker.kill()
        if value and (self.env, member, status) not in Hosted.said:
            Hosted.said.add((self.env, member, status))
            from tqdm import tqdm
            tqdm.write(f"note: {self.error}: its episode fails as the world's (said once)",
                       file=sys.stderr)
        return None

    def messages(self):  # the world starts: its episode's wave begins
        if self.opening is None:
            self.worker, self.conn = self.take_worker()
            if self.failed:  # closed while it was taken (close() sets failed, then reads worker)
                self.worker.kill()
            start = (self.env, self.task_id, self.timeout, self.experiment, dict(os.environ))
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
                self.error = f"{self.env.__name__}.evaluate() returned None: the world failed"
        return result

    def close(self):
        """Kill the world's worker now: the rollout was interrupted, nothing may wait for it."""
        self.failed = self.done = True
        if self.worker is not None:
            self.worker.kill()
