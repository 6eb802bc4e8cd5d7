"""The tiny world: an offline miniature of AppWorld, and the template for a new environment.

Copy TinyWorld (and run_code) to train in your own environment. loop.py makes one world per
episode, each in a worker process of its own (infra.Hosted), and calls:

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

A world that raises, dies, does not answer in time (its step: `timeout` + 5 s) or returns what
this interface does not allow (its worker checks) fails its episode: no reward, and the run goes
on; a run whose every world fails stops. Define the class at a module's top level (a worker
process imports it); name it --env my_module:MyWorld, or register it from a script:

    import loop, my_world
    loop.ENVS["mine"] = my_world.MyWorld
    if __name__ == "__main__":      # a world's worker imports this script again as it starts
        loop.main()                 # python my_script.py --env mine --model ...
"""
import builtins
import random
import re
import sys
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
# names and product titles: two syllables each (kofi, lena)
WORDS = random.Random(0).sample([a + b for a in SYLLABLES for b in SYLLABLES], 560)
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
    hold other scenarios. The long families (splits long-train, long-test) chain look-ups across
    three apps, each app's docs read before its call: 7 turns, done carefully."""

    FAMILIES = {"order": "Order the item at the top of my wishlist.",
                "payback": "Pay back the last person who paid me, the same amount.",
                "phone": "What is the phone extension of the last person who paid me?",
                "gift": "Order the top item of the wishlist of the person I meet next.",
                "repay": "Pay back the person I meet next what they last paid me."}
    APPS = {"order": "shop", "payback": "bank", "phone": "contacts"}
    CHAINS = {"gift": ["calendar", "gifts", "shop"], "repay": ["calendar", "ledger", "bank"]}
    DOCS = {"shop": "(item): orders an item", "bank": "(name, amount): sends money",
            "contacts": "(name): a phone extension", "calendar": "(): whom I meet, the next first",
            "gifts": "(name): a person's wishlist, top first",
            "ledger": "(name): what a person last paid me"}
    SYSTEM = ("Apps: shop, bank, contacts; see apis.api_docs.show(app). Mine: "
              "apis.supervisor.wishlist(), apis.supervisor.payments() (latest first), "
              "apis.supervisor.complete_task(answer=None)")
    LONG_SYSTEM = ("Apps: calendar, gifts, ledger, shop, bank, contacts; see "
                   "apis.api_docs.show(app). Mine: apis.supervisor.complete_task(answer=None)")
    DOCS_CALL, ERROR_PREFIX = "apis.api_docs.", "Execution failed"  # for the behaviour shares

    @staticmethod
    def tasks(split):
        """Per family 12 scenarios of 3 tasks: 9 scenarios train, 3 test; long-: the long ones."""
        if split not in ("train", "test", "long-train", "long-test"):
            raise ValueError("the tiny world's splits are train, test, long-train and long-test, "
                             f"not {split!r}")
        families = [f for f in TinyWorld.FAMILIES if (f in TinyWorld.CHAINS) == ("long" in split)]
        scenarios = range(3) if split.endswith("test") else range(3, 12)
        return [f"{family}{i:02d}_{n}" for family in families for i in scenarios
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
        amounts = list(map(int, rng.sample(values["numbers"], 2)))
        self.payments = list(zip(people[:2], amounts))  # latest first
        self.apps = list(self.APPS.values())
        if self.family in self.CHAINS:  # the long families' apps and state, drawn after the rest
            more = rng.sample([word for word in values["words"] if word not in words], 15)
            self.apps = ["calendar", "gifts", "ledger", *self.apps]
            self.api |= dict(zip(self.apps[:3], more))
            first = rng.choice(people[2:])  # the next, never a payer: payments() cannot tell
            self.meetings = [first, *rng.sample([who for who in people if who != first], 2)]
            self.gifts = {who: more[3 + 3 * i:6 + 3 * i] for i, who in enumerate(people)}
            paid = rng.sample([n for n in map(int, values["numbers"]) if n not in amounts], 4)
            self.ledger = dict(zip(people, paid)) | dict(self.payments)  # the last, as payments()
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

        def meetings():
            return list(self.meetings)

        def wishlist_of(name):
            phone(name)  # a contact of that name
            return list(self.gifts[name])

        def paid(name):
            phone(name)
            return self.ledger[name]

        def complete_task(answer=None):
            self.answer = answer
            self.done = True
            return "task completed"

        def show(app):
            return self.docs(app)

        supervisor = App("supervisor", wishlist=wishlist, payments=payments,
                         complete_task=complete_task)
        work = {"shop": buy, "bank": send, "contacts": phone, "calendar": meetings,
                "gifts": wishlist_of, "ledger": paid}
        return App("apis", api_docs=App("api_docs", show=show), supervisor=supervisor,
                   **{app: App(app, **{self.api[app]: work[app]}) for app in self.apps})

    def docs(self, app):
        if app not in self.apps:
            raise KeyError(f"no app named {app!r}; the apps are {', '.join(self.apps)}")
        return f"apis.{app}.{self.api[app]}{self.DOCS[app]}"

    def messages(self):
        system = self.LONG_SYSTEM if self.family in self.CHAINS else self.SYSTEM
        return [{"role": "system", "content": system},
                {"role": "user", "content": self.instruction}]

    def step(self, code):
        return run_code(code, self.namespace, self.timeout)

    def evaluate(self):
        """Checks on the end state; partial credit always points at the full solution."""
        last, amount = self.payments[0]
        if self.family in self.CHAINS:  # the person I meet next, and what they last paid me
            last, amount = self.meetings[0], self.ledger[self.meetings[0]]
        if self.family == "order":
            checks = [len(self.orders) == 1, self.orders == self.wishlist[:1]]
        elif self.family == "gift":  # one order, an item of their wishlist, the top one
            wanted = self.gifts[last]
            checks = [len(self.orders) == 1, any(self.orders == [item] for item in wanted),
                      self.orders == wanted[:1]]
        elif self.family in ("payback", "repay"):
            checks = [len(self.transfers) == 1, [to for to, _ in self.transfers] == [last],
                      [amount for _, amount in self.transfers] == [amount]]
        else:
            checks = [self.answer in self.phones.values(), self.answer == self.phones[last]]
        return sum(checks) + self.done, len(checks) + 1
