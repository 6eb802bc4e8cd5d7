"""The real AppWorld (appworld.dev): the interface of tiny_world.py's docstring, second example.
An episode is a task of an AppWorld split: our ReAct-style prompt (assets/appworld_prompt.txt), the
task with its date and supervisor, the agent's code run by `world.execute`, reward and success
from `world.evaluate()`'s unit tests; each world in a worker process of its own (infra.Hosted).
"""
import os
import pathlib
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


class AppWorldEnv:
    PROMPT = pathlib.Path(HERE, "assets", "appworld_prompt.txt").read_text().strip()  # ReAct-style
    DOCS_CALL, ERROR_PREFIX = "apis.api_docs.", "Execution failed"  # for the behaviour shares

    @staticmethod
    def tasks(split):
        """Task ids of an AppWorld split, or train_paper: the paper's training set."""
        try:
            import appworld
        except ImportError:
            raise ValueError("the appworld package is missing: pip install -r requirements.txt")
        apps = os.path.join(os.path.dirname(appworld.__file__), "apps", "supervisor")
        if not os.path.isdir(apps):
            from appworld.install import install_package
            install_package()  # `appworld install`: unpacks the apps shipped in the wheel, offline
        root = os.environ.get("APPWORLD_ROOT", os.getcwd())
        name = "train" if split == "train_paper" else split
        if not os.path.exists(os.path.join(root, "data", "datasets", f"{name}.txt")):
            raise ValueError(f"no AppWorld data for split {name!r} under {root}/data: run "
                             "`appworld download data` once (it needs the internet), or set "
                             "APPWORLD_ROOT to the folder with data/")
        from appworld import load_task_ids
        if split == "train_paper":  # the paper's training set: train tasks of difficulty 1 and 2
            return load_task_ids("train", difficulty=1) + load_task_ids("train", difficulty=2)
        return load_task_ids(split)

    @staticmethod
    def preload():
        """The package and its 12 apps (3-4 s to import), imported once for every worker."""
        from appworld.apps import get_all_apps
        return ["appworld", *(f"appworld.apps.{app}.apis" for app in get_all_apps())]

    def __init__(self, task_id, timeout=5.0, experiment="loop"):
        warnings.filterwarnings("ignore")  # the package's deprecation notes, in every worker
        from appworld import AppWorld
        self.world = AppWorld(task_id=task_id, experiment_name=experiment,
                              timeout_seconds=int(max(1, timeout)))

    def messages(self):
        task = self.world.task
        s = task.supervisor
        me = f"My name is {s.first_name} {s.last_name}, email {s.email}, phone {s.phone_number}"
        opening = f"Date: {task.datetime}\n{me}.\nTask: {task.instruction}"
        return [{"role": "system", "content": self.PROMPT}, {"role": "user", "content": opening}]

    def step(self, code):
        return self.world.execute(code)

    done = property(lambda self: self.world.task_completed())  # the interface's env.done

    def evaluate(self):
        tracker = self.world.evaluate()
        return tracker.pass_count, tracker.num_tests

    def close(self):
        self.world.close()
