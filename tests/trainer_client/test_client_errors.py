"""The trainer client's errors against the code and the docs: every exception the client raises on
purpose is a `PlannerClientError` (tests scan trainer_client/'s source for builtin exceptions raised
or built to be raised), the error tree of docs/trainer-client.md ("Errors") is the hierarchy of
trainer_client/errors.py, every class is exported, and every one travels between ranks (pickle)."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pickle
import re
from pathlib import Path

import pytest

import trainer_client
from trainer_client import errors
from trainer_client.errors import PlannerClientError

# The repository root, wherever this file sits under tests/.
ROOT = Path(trainer_client.__file__).resolve().parents[1]
PACKAGE = ROOT / "trainer_client"
SOURCES = sorted(PACKAGE.rglob("*.py"))

# Exceptions of other classes that the client raises on purpose, by (file, class): each with why.
ALLOWED = {
    ("trainer_client/service/config.py", "PydanticCustomError"): (
        "raised inside a pydantic validator (`_refuse`), which is pydantic's protocol for a refusal: pydantic "
        "turns it into a ValidationError and PlannerClientConfig turns that into a ConfigError; no caller sees it"
    ),
}
# Builtins raised on purpose anywhere: protocol, not an error.
ALLOWED_ANYWHERE = {
    "StopIteration": "the iterator protocol's end of iteration (`__next__` of the drop-ins' iterators), not an error",
}


def _imports(tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """Every name a module binds by an import (at any level): name -> (module, attribute or None)."""
    bound: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                bound[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = (alias.name, None)
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = (top, None)
    return bound


def _defined(tree: ast.Module) -> set[str]:
    """Names a module binds other than by import: classes, functions, assignments, parameters."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _resolve(expr: ast.expr, imported: dict[str, tuple[str, str | None]], defined: set[str]) -> object | None:
    """The object a raised name (`X`, `module.X`) stands for, or None for anything else (a variable,
    a call's result, an attribute of an object)."""
    if isinstance(expr, ast.Name):
        if expr.id in imported:
            module, attribute = imported[expr.id]
            found = importlib.import_module(module)
            return getattr(found, attribute) if attribute else found
        if expr.id in defined:
            return None  # a variable (`raise error`) or a class of the module, checked below
        return getattr(builtins, expr.id, None)
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, (ast.Name, ast.Attribute)):
        owner = _resolve(expr.value, imported, defined)
        return getattr(owner, expr.attr, None) if inspect.ismodule(owner) else None
    return None


def _raised_classes(path: Path) -> list[tuple[int, type[BaseException]]]:
    """(line, class) of every exception class a module raises (`raise X(...)`, `raise X`) or builds
    to raise later (`return X(...)`, `problem = X(...)`, handed to the group's collective)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported, defined = _imports(tree), _defined(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            expr = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        elif isinstance(node, ast.Call):
            expr = node.func
        else:
            continue
        last = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else ""
        if not last[:1].isupper():
            continue  # a function or method: not a class
        try:
            obj = _resolve(expr, imported, defined)
        except ImportError:
            if isinstance(node, ast.Raise):
                raise  # a raised class must resolve
            continue  # a call of another library's class this environment lacks: not an exception of ours
        if isinstance(obj, type) and issubclass(obj, BaseException):
            found.append((node.lineno, obj))
    return sorted(set(found), key=lambda item: (item[0], item[1].__name__))


def _offenders(path: Path) -> list[str]:
    relative = path.relative_to(ROOT).as_posix()
    offenders = []
    for line, cls in _raised_classes(path):
        if issubclass(cls, PlannerClientError):
            continue
        if cls.__name__ in ALLOWED_ANYWHERE and cls is getattr(builtins, cls.__name__, None):
            continue
        if (relative, cls.__name__) in ALLOWED:
            continue
        offenders.append(f"{relative}:{line}: {cls.__module__}.{cls.__name__}")
    return offenders


@pytest.mark.parametrize("path", SOURCES, ids=[path.relative_to(ROOT).as_posix() for path in SOURCES])
def test_every_error_the_module_raises_is_a_planner_client_error(path: Path):
    """A builtin (ValueError, TypeError, RuntimeError, KeyError, ...) or another library's exception
    raised on purpose is an offender: raise the PlannerClientError subclass that is also that builtin
    (InvalidArgumentError, ArgumentTypeError, ProcessGroupError, UsageError, ...). A re-raise of a
    caught error (`raise error`) and an `assert` are not raises of a class, and pass."""
    offenders = _offenders(path)
    assert offenders == [], "raised on purpose but not a PlannerClientError (trainer_client/errors.py):\n" + "\n".join(offenders)


@pytest.mark.parametrize("path", SOURCES, ids=[path.relative_to(ROOT).as_posix() for path in SOURCES])
def test_no_assert_guards_the_client_at_run_time(path: Path):
    """`python -O` drops every `assert`: a guard of the client's is an explicit check that raises a
    PlannerClientError (or code shaped so that the case cannot arise)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert lines == [], f"{path.relative_to(ROOT).as_posix()}: assert at lines {lines}"


def test_the_allowed_raises_are_still_there():
    """An entry of the allow-lists that matches no raise any more is dropped, not kept."""
    raised = {(path.relative_to(ROOT).as_posix(), cls.__name__) for path in SOURCES for _, cls in _raised_classes(path)}
    assert sorted(set(ALLOWED) - raised) == []
    assert sorted(set(ALLOWED_ANYWHERE) - {name for _, name in raised}) == []


def test_every_error_class_raised_from_errors_py_is_a_planner_client_error():
    named = {cls for path in SOURCES for _, cls in _raised_classes(path) if cls.__module__ == errors.__name__}
    assert named, "the scan found no raise of trainer_client.errors' classes: it resolves nothing"
    assert sorted(cls.__name__ for cls in named if not issubclass(cls, PlannerClientError)) == []


def test_the_scan_finds_builtin_raises(tmp_path: Path):
    """The scan itself: a raise, a bare raise of a class, an error built to be returned; a re-raise of
    a variable and a PlannerClientError pass."""
    source = tmp_path / "sample.py"
    source.write_text(
        "from trainer_client.errors import UsageError\n"
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('no')\n"
        "    if x is None:\n"
        "        raise KeyError\n"
        "    try:\n"
        "        return RuntimeError('built')\n"
        "    except OSError as error:\n"
        "        raise error\n"
        "    raise UsageError('first plan')\n"
    )
    assert [(line, cls) for line, cls in _raised_classes(source)] == [
        (4, ValueError), (6, KeyError), (8, RuntimeError), (11, errors.UsageError)
    ]


# The error tree of docs/trainer-client.md, "### Errors".
TREE_LINE = re.compile(r"^(?P<indent>(?:│   |    )*)(?P<branch>├── |└── )?(?P<name>[A-Za-z]+)(?: \((?P<builtin>[A-Za-z]+)\))?(?P<gap> {2,}(?P<phrase>\S.*))?$")


def documented_tree() -> list[dict]:
    page = (ROOT / "docs" / "trainer-client.md").read_text()
    section = page[page.index("\n### Errors\n"):]
    block = re.search(r"\n```\n(.*?)\n```\n", section, re.S)
    assert block, 'docs/trainer-client.md, "Errors", has no fenced error tree'
    entries: list[dict] = []
    parents: list[str] = []
    for text in block.group(1).splitlines():
        match = TREE_LINE.match(text)
        assert match, f"not a line of the error tree: {text!r}"
        depth = len(match["indent"]) // 4 + (1 if match["branch"] else 0)
        assert depth <= len(parents), f"nested deeper than its parent: {text!r}"
        del parents[depth:]
        entries.append(dict(
            name=match["name"], parent=parents[-1] if parents else None, builtin=match["builtin"],
            branch=match["branch"], phrase=match["phrase"], phrase_at=match.start("phrase") if match["phrase"] else None,
        ))
        parents.append(match["name"])
    return entries


def code_tree() -> dict[str, tuple[str | None, str | None]]:
    """Every PlannerClientError class of trainer_client.errors: name -> (parent, the builtin it adds directly)."""
    tree = {}
    for name, cls in vars(errors).items():
        if not (inspect.isclass(cls) and issubclass(cls, PlannerClientError) and cls.__module__ == errors.__name__):
            continue
        if cls is PlannerClientError:
            tree[name] = (None, None)
            continue
        ours = [base for base in cls.__bases__ if issubclass(base, PlannerClientError)]
        builtin = [base.__name__ for base in cls.__bases__ if base.__module__ == "builtins"]
        others = [base for base in cls.__bases__ if base not in ours and base.__module__ != "builtins"]
        assert len(ours) == 1 and len(builtin) <= 1 and not others, f"{name}: bases {cls.__bases__}"
        tree[name] = (ours[0].__name__, builtin[0] if builtin else None)
    return tree


def test_the_docs_error_tree_is_the_hierarchy_of_errors_py():
    documented = documented_tree()
    names = [entry["name"] for entry in documented]
    assert len(names) == len(set(names)), "a class listed twice"
    assert {e["name"]: (e["parent"], e["builtin"]) for e in documented} == code_tree()


def test_the_docs_error_tree_is_drawn_alike():
    """A phrase for every class but the root, all in one column; `└──` for the last child alone."""
    documented = documented_tree()
    assert documented[0]["name"] == "PlannerClientError" and documented[0]["branch"] is None
    children = documented[1:]
    assert [e["name"] for e in children if not e["phrase"]] == []
    assert len({e["phrase_at"] for e in children}) == 1, "phrases start in different columns"
    for index, entry in enumerate(children):
        later = [e for e in children[index + 1:] if e["parent"] == entry["parent"]]
        assert entry["branch"] == ("├── " if later else "└── "), entry["name"]


def test_every_error_class_is_exported():
    assert sorted(set(code_tree()) - set(trainer_client.__all__)) == []
    assert all(getattr(trainer_client, name) is getattr(errors, name) for name in code_tree())


# Sample arguments for the classes whose constructor takes others than a message.
SAMPLE_ARGS = {
    "UnsupportedCombinationError": ("moe_token_dispatcher_type", "alltoall_seq", "use 'alltoall'"),
    "UnrunnablePlanError": ("micro_batches", "micro-batch 0: DPxCP ranks [1] have no sample", "plan with dynamic_cp"),
    "PlanRejectedError": ("INVALID_ARGUMENT", "sequence_lengths: sample 0 has length -3"),
    "ServiceFailedError": ("deadline", "no answer in 5 s", False),
    "MissingUpstreamError": ("trainer_client.x: wrap calls X's m:_f, which the installed build lacks", ["m:_f"]),
}


def error_classes() -> list[type[PlannerClientError]]:
    return [getattr(errors, name) for name in code_tree()]


@pytest.mark.parametrize("cls", error_classes(), ids=lambda cls: cls.__name__)
def test_every_error_pickles_to_the_same_class_message_and_attributes(cls):
    """Errors travel between ranks pickled (trainer_client.plans.together): each comes back as itself."""
    own_init = "__init__" in vars(cls) or any("__init__" in vars(base) for base in cls.__mro__[1:] if issubclass(base, PlannerClientError))
    assert (cls.__name__ in SAMPLE_ARGS) == own_init, f"{cls.__name__}: give its constructor's sample arguments in SAMPLE_ARGS"
    error = cls(*SAMPLE_ARGS.get(cls.__name__, ("rank 3: something the client refused",)))
    copy = pickle.loads(pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(copy) is cls
    assert str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)


def test_an_error_travels_between_ranks_as_itself():
    from trainer_client.plans.together import _copy, _pickled_error

    for cls in error_classes():
        error = cls(*SAMPLE_ARGS.get(cls.__name__, ("something the client refused",)))
        copy = _copy(_pickled_error(error), 2, "rank {rank}: {message}")
        assert type(copy) is cls and str(copy) == f"rank 2: {error}"


def test_an_unpicklable_rule_is_left_behind_and_the_rest_travels():
    error = errors.UnsupportedCombinationError("fp8", True, "turn it off", rule=lambda config: config.fp8)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is errors.UnsupportedCombinationError and str(copy) == str(error)
    assert (copy.option, copy.value, copy.fix) == ("fp8", True, "turn it off") and "rule" not in vars(copy)


def test_converted_errors_are_still_their_builtins():
    """Some of the raises that were builtins: the new class, still caught as the old builtin."""
    from trainer_client.service.ahead import PlanAhead
    from trainer_client.service.client import _check_record_step, _require_int
    from trainer_client.plans.outputs import restore_outputs
    from trainer_client.plans.token_outputs import restore_token_outputs

    with pytest.raises(errors.ArgumentTypeError, match=r"step: got 1\.5 \(float\)") as caught:
        _require_int("step", 1.5, 0, what="the training step")
    assert isinstance(caught.value, TypeError)
    with pytest.raises(errors.InvalidArgumentError, match="step: -1 is not allowed") as caught:
        _require_int("step", -1, 0, what="the training step")
    assert isinstance(caught.value, ValueError)
    with pytest.raises(ValueError, match="seconds: nan is not allowed"):
        _check_record_step([], float("nan"))
    with pytest.raises(errors.InvalidArgumentError, match="plan-ahead depth must be >= 1"):
        PlanAhead(lambda request: None, depth=0)
    with pytest.raises(TypeError, match="local_outputs: got a list") as caught:
        restore_outputs([], 1)
    assert type(caught.value) is errors.ArgumentTypeError
    with pytest.raises(errors.InvalidArgumentError, match="^lengths"):
        restore_token_outputs([], [0])
