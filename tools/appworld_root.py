"""A small offline AppWorld data root, built from the appworld package's own models and APIs
(no download): the tests' AppWorld, and tools/appworld_startup.py's and appworld_memory.py's.

    python tools/appworld_root.py /tmp/awroot    # then APPWORLD_ROOT=/tmp/awroot ... --split fixture

Supervisor Joyce Weaver with simple_note and todoist accounts; scenario 5a0f1c2 (two tasks: create
a tagged note) and scenario 9d3e7b4 (copy the chores of a note into a new todoist project, answer
their count). Run it in a fresh process: AppWorld keeps global state.
"""
import json
import os
import sys

AW_SUPERVISOR = dict(first_name="Joyce", last_name="Weaver", email="joyce-weav@gmail.com", phone_number="3155673041")
AW_PASSWORDS = {"simple_note": "qwerty-note-17", "todoist": "todo&pass-42"}
AW_CHORES = ["Mow the lawn", "Clean the garage", "Water the plants"]
AW_EVAL_NOTE = '''
import json
def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
    added, updated, removed = models.changed_records("simple_note.Note")
    with test("""assert exactly one simple_note.Note was added and no existing note changed."""):
        test.case(len(added), "==", 1)
        test.case(len(updated) + len(removed), "==", 0)
    with test("""assert the new note has the requested title and content."""):
        test.case(added[0].title.strip().lower(), "==", public_data.title.lower())
        test.case(added[0].content.strip().lower(), "==", public_data.content.lower())
    with test("""assert the new note has exactly the requested tag."""):
        test.case([t.strip().lower() for t in added[0].tags], "==", [public_data.tag.lower()])
    with test("""assert answers match."""):
        test.answer(json.loads(models.end.supervisor.Task.first().answer), ground_truth_answer)
'''
AW_EVAL_PROJECT = '''
import json
def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
    added, _, _ = models.changed_records("todoist.Project")
    with test("""assert exactly one todoist.Project with the requested name was added."""):
        test.case(len(added), "==", 1)
        test.case(added[0].name.strip().lower(), "==", public_data.project_name.lower())
    with test("""assert the new project's tasks are exactly the chores of the note, in any order."""):
        titles = [t.title.strip().lower() for t in models.end.todoist.Task.find_all(project_id=added[0].id)]
        test.case(sorted(titles), "==", sorted(c.lower() for c in private_data.chores))
    with test("""assert no simple_note data was changed."""):
        test.case({n for n in models.changed_model_names() if n.startswith("simple_note.")}, "==", set())
    with test("""assert answers match."""):
        test.answer(json.loads(models.end.supervisor.Task.first().answer), ground_truth_answer)
'''


def _aw_note(title, content, tag):
    return dict(instruction=f'Create a note in Simple Note titled "{title}" with the content "{content}" and tag it "{tag}".',
                public=dict(title=title, content=content, tag=tag), private={}, answer=None, eval=AW_EVAL_NOTE,
                labels=["no_op_fail"] * 4, apps=["simple_note"])


AW_TASKS = {
    "5a0f1c2_1": _aw_note("Book club", "Read chapters 3-5 by Friday", "reading"),
    "5a0f1c2_2": _aw_note("Gym plan", "Legs on Monday, arms on Thursday", "fitness"),
    "9d3e7b4_1": dict(
        instruction='My Simple Note note titled "Weekend chores" lists one chore per line. Create a Todoist project '
                    'named "Weekend" with one task per chore (task title = the chore), then tell me how many tasks you created.',
        public=dict(project_name="Weekend"), private=dict(chores=AW_CHORES), answer=len(AW_CHORES), eval=AW_EVAL_PROJECT,
        labels=["no_op_fail", "no_op_fail", "no_op_pass", "no_op_fail"], apps=["simple_note", "todoist"],
        note=dict(title="Weekend chores", content="\n".join(AW_CHORES), tags=["home"])),
}


def build_appworld_root(root, split="fixture"):
    """Write <root>/data for AW_TASKS, and the split file <root>/data/datasets/<split>.txt."""
    import textwrap
    from appworld.install import install_package
    import appworld
    if not os.path.isdir(os.path.join(os.path.dirname(appworld.__file__), "apps", "supervisor")):
        install_package()
    root = os.path.abspath(root)
    os.environ["APPWORLD_ROOT"] = root
    from appworld.api_docs import prepare_api_docs
    from appworld.apps import get_all_apps
    from appworld.apps.api_lib import save_local_dbs, set_local_date_and_time, unset_local_date_and_time
    from appworld.apps.model_lib import CachedDBHandler
    from appworld.collections.apis import ApiCollection
    from appworld.collections.models import ModelCollection
    from appworld.common.constants import CANARY_STRING, DB_VERSION
    from appworld.common.datetime import DateTime
    from appworld.common.utils import import_models_module as models

    def dump(obj, *path):
        os.makedirs(os.path.dirname(os.path.join(*path)), exist_ok=True)
        with open(os.path.join(*path), "w") as fh:
            fh.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2))

    data, apps, when = os.path.join(root, "data"), list(get_all_apps()), "2023-05-18T12:00:00"
    freezer = set_local_date_and_time(DateTime.fromisoformat(when))
    try:
        docs = {app: prepare_api_docs(app) for app in get_all_apps(skip_admin=True)}
        for app, ds in docs.items():
            dump({d["api_name"]: {**d, "canary_string": CANARY_STRING} for d in ds}, data, "api_docs", "standard", f"{app}.json")
        base_mem = ":memory:fixture_base"
        apis, _ = ApiCollection.load(to_db_home_path=base_mem, from_db_home_path=base_mem, load_apps=apps,
                                     ignore_private_apis=False, create_db=True, max_num_requests=None)
        models("api_docs").ApiDoc.save_all([models("api_docs").ApiDoc.create(app_name_=d["app_name"], **{
            k: d[k] for k in ("api_name", "path", "method", "description", "parameters", "response_schemas")})
            for ds in docs.values() for d in ds])
        person = dict(**AW_SUPERVISOR, birthday="1990-06-09", sex="female")
        main_user, supervisor = models("admin").MainUser.create(**person), models("supervisor").Supervisor.create(**person)
        main_user.save()
        supervisor.save()
        for app, pw in AW_PASSWORDS.items():
            models("admin").AccountPassword.create(main_user_id=main_user.id, account_name=app, password=pw).save()
            models("supervisor").AccountPassword.create(supervisor_id=supervisor.id, account_name=app, password=pw).save()
            models(app).User.create(first_name=AW_SUPERVISOR["first_name"], last_name=AW_SUPERVISOR["last_name"],
                                    email=AW_SUPERVISOR["email"], password=pw, verified=True).save()
        token = apis.simple_note.login(username=AW_SUPERVISOR["email"], password=AW_PASSWORDS["simple_note"])["access_token"]
        apis.simple_note.create_note(title="Grocery list", content="eggs\nmilk", tags=["shopping"], access_token=token)
        token = apis.todoist.login(username=AW_SUPERVISOR["email"], password=AW_PASSWORDS["todoist"])["access_token"]
        apis.todoist.create_project(name="Work", access_token=token)
        base = os.path.join(data, "base_dbs")
        save_local_dbs(base_mem, base, format="full", app_names=apps, delete_if_exists=True, save_model_hashes=True)
        ApiCollection.close_all()
        CachedDBHandler.reset()
        for tid, spec in AW_TASKS.items():  # each task: base + its supervisor.Task row, saved as changes
            mem = f":memory:fixture_task-{tid}"
            mc = ModelCollection.load(to_db_home_path=mem, from_db_home_path=base, load_apps=apps)
            mc.supervisor.Task.create(supervisor_id=mc.supervisor.Supervisor.first().id, instruction=spec["instruction"]).save()
            if "note" in spec:
                mc.simple_note.Note.create(user_id=mc.simple_note.User.find_one(email=AW_SUPERVISOR["email"]).id, **spec["note"]).save()
            task_dir = os.path.join(data, "tasks", tid)
            save_local_dbs(mem, os.path.join(task_dir, "dbs"), format="changes", app_names=apps,
                           delete_if_exists=True, save_model_hashes=True)
            mc.close()
            dump(dict(instruction=spec["instruction"], supervisor=AW_SUPERVISOR, datetime=when, db_version=DB_VERSION,
                      canary_string=CANARY_STRING), task_dir, "specs.json")
            gt, code = os.path.join(task_dir, "ground_truth"), textwrap.dedent(spec["eval"]).strip() + "\n"
            requirements = [r.split('"""')[0] for r in code.split('with test("""')[1:]]
            dump([dict(requirement=r, label=label) for r, label in zip(requirements, spec["labels"], strict=True)], gt, "test_data.json")
            dump(code, gt, "evaluation.py")
            dump(spec["public"], gt, "public_data.json")
            dump(spec["private"], gt, "private_data.json")
            dump(json.dumps(spec["answer"]), gt, "answer.json")
            dump(dict(mode="minimal", difficulty=1, num_apps=len(spec["apps"]), num_apis=4, num_solution_code_lines=8), gt, "metadata.json")
    finally:
        ApiCollection.close_all()
        CachedDBHandler.reset()
        unset_local_date_and_time(freezer)
    dump("\n".join(AW_TASKS) + "\n", data, "datasets", f"{split}.txt")


if __name__ == "__main__":
    build_appworld_root(sys.argv[1], *sys.argv[2:3])
