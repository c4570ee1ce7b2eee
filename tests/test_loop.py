"""The loop says what, its components decide when and how (issue 38): the checkpoint manager's
decision of when to save, and the trainer reaching programs only through their common interface.
The checkpoints' contents and the resume are tests/test_resume.py's and the layouts' e2e tests'."""

from __future__ import annotations

import ast
import os

import pytest

from spmdsplit.checkpoint_manager import save_due
from spmdsplit.programs import Program

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("save_freq, total_steps, saved", [
    (2, 5, [2, 4, 5]),  # every save_freq steps, and the last one
    (3, 6, [3, 6]),  # the last step is one of them: once
    (0, 5, []),  # save_freq=0: never on schedule
    (7, 5, [5]),  # longer than the run: the last step only
])
def test_a_checkpoint_is_due_every_save_freq_steps_and_after_the_last(save_freq, total_steps, saved):
    assert [s for s in range(1, total_steps + 1) if save_due(s, False, save_freq, s == total_steps)] == saved


@pytest.mark.parametrize("save_freq", [0, 3])
def test_a_stop_vote_always_checkpoints(save_freq):
    assert save_due(1, True, save_freq, last=False)


def test_the_step_a_run_ends_at_for_its_target_score_is_its_last():
    # trainer.stop_at_score: step 7 of 10 ends the run, so save_freq's "after the last" is step 7
    assert save_due(7, False, 3, last=True) and not save_due(7, False, -1, last=True)


def program_attributes(path: str) -> set[str]:
    """Every attribute the module takes of a program: `programs[...].x`, `program.x` and
    `self.programs[...].x`, by its syntax tree."""
    def is_program(node) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "program"
        if isinstance(node, ast.Subscript):
            target = node.value
            return (isinstance(target, ast.Name) and target.id == "programs") or (
                isinstance(target, ast.Attribute) and target.attr == "programs")
        return False

    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_program(node.value)}


@pytest.mark.parametrize("path", ["spmdsplit/trainer.py", "spmdsplit/checkpoint_manager.py"])
def test_the_loop_calls_programs_only_through_their_common_interface(path):
    """A new feature that needs every program to do something at a point of the loop adds it to
    Program (spmdsplit/programs/__init__.py), not a reach into one program's insides."""
    interface = {name for name in vars(Program) if not name.startswith("_")}
    assert interface == {"engine", "checkpointed", "start", "state", "load_state", "validate", "score_validation",
                         "export", "close"}
    used = program_attributes(path)
    assert used and used <= interface, f"{path} reaches into programs: {sorted(used - interface)}"


def test_the_step_calls_each_programs_own_phases():
    """train_step's `<group>.<method>(step, ...)` calls (group: rollout, actor, critic, reward) are
    methods the group's program defines itself: a phase renamed or moved fails here, not in a job."""
    from spmdsplit.builder import Programs

    with open(os.path.join(ROOT, "spmdsplit/trainer.py")) as f:
        tree = ast.parse(f.read())
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    classes = {f.name: f.type for f in Programs.__dataclass_fields__.values()}
    calls = [(n.func.value.id, n.func.attr) for n in ast.walk(step) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id in classes]
    assert {group for group, _ in calls} == set(classes)
    import spmdsplit.builder as builder

    for group, method in calls:
        program = getattr(builder, classes[group].split(" | ")[0])
        assert method in vars(program), f"train_step calls {group}.{method}, which {program.__name__} does not define"


def spmdsplit_imports(path: str) -> set[str]:
    """The spmdsplit modules a file imports (`from spmdsplit.x import y` gives x and x.y), by its syntax tree."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("spmdsplit"):
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("spmdsplit")}
    return found


PROGRAMS = sorted(f for f in os.listdir(os.path.join(ROOT, "spmdsplit", "programs")) if f != "__init__.py")


@pytest.mark.parametrize("name", PROGRAMS)
def test_no_program_imports_another_and_only_the_rollout_program_generates(name):
    imported = spmdsplit_imports(f"spmdsplit/programs/{name}")
    others = {f"spmdsplit.programs.{other[:-3]}" for other in PROGRAMS if other != name}
    assert not imported & others, f"{name} imports {sorted(imported & others)}"
    generation = {m for m in imported if m.startswith(("spmdsplit.generation", "spmdsplit.inference"))}
    assert not generation or name == "rollout.py", f"{name} imports generation: {sorted(generation)}"
