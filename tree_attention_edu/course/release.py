"""The student release of the course and its grading, by nbgrader.

The committed notebooks are the lecturer's copy and an nbgrader *source* version at once:
each coding exercise's solution cell (tagged `solution`, which the site folds) carries
nbgrader's metadata for an answer cell (`"solution": true`, grade_id the function's name),
and the exercise's test cell, the code cell after it, that of a graded, locked test
(`"grade": true`, grade_id `test_` + the name, 1 point). A later cell that uses the
student's function is a further test (`test_<name>_2`, ...): with a wrong answer, only
graded cells fail. A `solution` cell that answers a written question (a hidden check, not
a coding exercise) is an answer cell too (`answer_1`, `answer_2`, ... in each notebook),
with no test.

`release` runs `nbgrader generate_assignment` in a temporary course folder: the answer cells
become `CODE_STUB`, outputs are cleared, stubs and tests stay. `grade` runs
`nbgrader autograde` on submitted notebooks and reads each test's score back from the
gradebook. `check_release` autogrades the release as it is (exactly the exercises' tests
fail) and with the solutions put back (full marks).

nbgrader is a developer dependency (`pip install -e ".[dev]"`); it is imported here only
when a release is made or graded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ASSIGNMENT = "tree_attention_edu"
"""nbgrader's name for the assignment that holds the nine notebooks."""
CODE_STUB = (
    "# The student release empties this cell. In the lecturer's copy it holds the answer\n"
    "# or the check that the text around it mentions: write your own here, or skip it.\n"
    "# YOUR CODE HERE"
)
"""What an answer cell holds in the release: a banner, so that prose pointing to "the
hidden cell" or "the cell below" (true of the lecturer's copy) is not taken to mean an
empty cell, then nbgrader's marker. It does not raise: each exercise's stub, in the cell
above it, already fails the exercise's test, and nothing else is left to fail."""
SOLUTION_TAG = "solution"
NOTEBOOK_NAME = re.compile(r"^\d\d_\w+\.ipynb$")


def nbgrader_marks(cell: Any) -> dict[str, Any]:
    """A cell's nbgrader metadata ({} for a plain cell)."""
    return dict(cell.get("metadata", {}).get("nbgrader", {}))


def is_answer(cell: Any) -> bool:
    """An nbgrader answer cell: a solution, cleared in the release."""
    return bool(nbgrader_marks(cell).get("solution"))


def is_test(cell: Any) -> bool:
    """An nbgrader graded test cell (autograded: full points unless it raises)."""
    marks = nbgrader_marks(cell)
    return bool(marks.get("grade")) and not marks.get("solution")


def grade_id(cell: Any) -> str | None:
    return nbgrader_marks(cell).get("grade_id")


@dataclass(frozen=True)
class Exercise:
    """A coding exercise: its answer cell's grade_id and its tests' (`test_X`, the cell
    after the answer cell `X`, then `test_X_2`, ... for later cells that use `X`)."""

    notebook: str
    solution: str
    tests: tuple[str, ...]


def tested(test_id: str, answers: Iterable[str]) -> str:
    """The answer cell (among the grade_ids `answers`) a test's grade_id names: `test_X`
    and `test_X_2` test `X` (`test_q8_0` tests `q8_0` where that is an answer cell)."""
    name = test_id.removeprefix("test_")
    return name if name in set(answers) else re.sub(r"_\d+$", "", name)


def answer_ids(nb: Any) -> list[str]:
    return [str(grade_id(c)) for c in nb["cells"] if is_answer(c)]


def exercises(nb: Any, name: str) -> list[Exercise]:
    """The coding exercises of one notebook, in order: answer cells with tests."""
    tests: dict[str, list[str]] = {}
    for cell in nb["cells"]:
        if is_test(cell):
            gid = str(grade_id(cell))
            tests.setdefault(tested(gid, answer_ids(nb)), []).append(gid)
    return [
        Exercise(name, str(grade_id(c)), tuple(tests[str(grade_id(c))]))
        for c in nb["cells"]
        if is_answer(c) and str(grade_id(c)) in tests
    ]


def mark_problems(nb: Any) -> list[str]:
    """What is wrong with a lecturer's notebook's nbgrader marks ([] when nothing): every
    `solution`-tagged cell is an answer cell and the other way round; grade_ids are
    unique; every test is locked and worth points; an exercise's first test `test_X` is
    the code cell right after its answer cell `X`, and its later tests (`test_X_2`, ...)
    come after that."""
    problems, seen = [], set()
    cells = nb["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    for i, cell in enumerate(cells):
        marks, where = nbgrader_marks(cell), f"cell {i}"
        tagged = SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])
        if tagged and not is_answer(cell):
            problems.append(f"{where}: tagged {SOLUTION_TAG!r} but no nbgrader answer cell")
        if is_answer(cell) and not tagged:
            problems.append(f"{where}: an nbgrader answer cell not tagged {SOLUTION_TAG!r}")
        if not marks:
            continue
        gid = marks.get("grade_id")
        if not gid or gid in seen:
            problems.append(f"{where}: grade_id {gid!r} missing or repeated")
        seen.add(gid)
        if is_test(cell):
            if not (marks.get("locked") and marks.get("points", 0) > 0):
                problems.append(f"{where}: test {gid!r} is not locked or is worth no points")
            first = f"test_{tested(str(gid), answer_ids(nb))}"
            if first not in seen:
                problems.append(f"{where}: test {gid!r} comes before {first!r}")
            if gid == first:
                answer = code[code.index(cell) - 1] if code.index(cell) else None
                if answer is None or not is_answer(answer) or f"test_{grade_id(answer)}" != gid:
                    problems.append(f"{where}: test {gid!r} does not follow its answer cell")
    return problems + unbound_in_release(nb)


def _python(source: str) -> str:
    """A cell's code as Python: IPython's own transform turns magics (`%timeit`, `!ls`) into
    calls, where IPython is installed (it is wherever the notebooks run)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:  # pragma: no cover - IPython comes with the notebook extra
        return source
    return TransformerManager().transform_cell(source)


def _free_names(code: str) -> set[str]:
    """The global names a piece of code reads and does not bind itself (anywhere in it: the
    order inside a cell is not checked), by `symtable`, so that a parameter or a
    comprehension's variable in a nested scope is not taken for a global. `x += 1` and
    `del x` read `x` (and neither binds it for a later reader)."""
    import ast
    import symtable

    top = symtable.symtable(code, "<cell>", "exec")
    read: set[str] = set()
    bound: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables += table.get_children()
        for sym in table.get_symbols():
            if table is top and (sym.is_assigned() or sym.is_imported()):
                bound.add(sym.get_name())
            if sym.is_referenced() and (table is top or sym.is_global()):
                read.add(sym.get_name())
    return (read - bound) | _updated(ast.parse(code))


def _updated(tree: Any) -> set[str]:
    """Names that `x += ...` or `del x` needs bound already (anywhere in the code, nested
    functions included: a conservative reading, rare in notebooks)."""
    import ast

    names = set()
    for node in ast.walk(tree):
        targets = (
            [node.target]
            if isinstance(node, ast.AugAssign)
            else node.targets
            if isinstance(node, ast.Delete)
            else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _statements(code: str) -> list[tuple[set[str], set[str], bool]]:
    """Per top-level statement of a cell's code: (the names it binds, the global names it
    reads and does not bind, whether it only defines a function or class, or gives a
    name another name: `stub_f = f`)."""
    import ast
    import symtable

    rows = []
    for stmt in ast.parse(code).body:
        text = ast.unparse(stmt)
        top = symtable.symtable(text, "<statement>", "exec")
        binds = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
        if isinstance(stmt, ast.Delete):
            binds = set()
        defines = isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) or (
            isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name)
        )
        rows.append((binds, _free_names(text), defines))
    return rows


def _guarded(code: str) -> set[str]:
    """The names a cell tests for with `"name" in globals()`: it reads them only if bound."""
    import ast

    return {
        node.left.value
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Constant)
        and isinstance(node.left.value, str)
        and isinstance(node.ops[0], ast.In)
        and isinstance(node.comparators[0], ast.Call)
        and isinstance(node.comparators[0].func, ast.Name)
        and node.comparators[0].func.id == "globals"
    }


def unbound_in_release(nb: Any) -> list[str]:
    """What an ordinary cell (neither answer nor test) reads that the release does not give
    it ([] when nothing). In the release an answer cell is empty, and a test cell stops at
    its first statement that uses a student's answer with the stub's wrong result. So:

    * a name that only an answer cell binds, or only a test cell from that statement on,
      is missing for a later cell (a name bound before by another cell is still there);
    * an exercise's function (an answer cell's grade_id) is the stub in the release, and
      so is anything defined from it: a cell that uses either is meant to be one of the
      exercise's tests (only tests may fail in the release, `check_release`).

    Such a cell raises in the release, which CI grades and `make test` does not. A later
    ordinary cell that binds a name again makes it safe, and one that reads it only under
    `"name" in globals()` is safe. Limits: the order of statements inside one cell is not
    checked (a cell that binds a name anywhere is taken to bind it before it reads it),
    and a `"name" in globals()` anywhere in a cell covers every read of that name there."""
    problems: list[str] = []
    bound: set[str] = set()  # bound in the release so far
    missing: dict[str, str] = {}  # name -> the graded cell that alone binds it
    # exercise function, or one defined from it -> its exercise: the stub in the release
    exercise = {str(grade_id(c)) for c in nb["cells"] if is_answer(c)}
    stub: dict[str, str] = {n: n for n in exercise}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        code = _python("".join(cell["source"]))
        try:
            statements = _statements(code)
            free = _free_names(code) - _guarded(code)
        except SyntaxError as err:
            where = "" if err.lineno is None else f", line {err.lineno}"
            problems.append(f"cell {i}: not Python ({err.msg}{where})")
            continue
        gid = str(grade_id(cell))
        if is_answer(cell):
            for binds, _, _ in statements:
                missing.update({n: gid for n in binds - bound - exercise})
        elif is_test(cell):
            stopped = False
            for binds, reads, _ in statements:
                stopped = stopped or bool(reads & (missing.keys() | stub.keys()))
                if stopped:
                    missing.update({n: gid for n in binds - bound})
                else:
                    bound |= binds
                    for name in binds:
                        missing.pop(name, None)
        else:
            problems += [
                f"cell {i}: reads {name!r}, which the release lacks: {missing[name]!r} binds "
                "it (an answer cell, or a test after its first use of the answer); bind it "
                "before that, or compute it here from the package"
                for name in sorted(free & missing.keys())
            ]
            for binds, reads, defines in statements:
                uses = reads & stub.keys()
                if uses and defines:  # defined from the answer: the stub in the release
                    stub.update(dict.fromkeys(binds - exercise, stub[min(uses)]))
                    bound |= binds
                    continue
                problems += [
                    f"cell {i}: uses {name!r}, which is exercise {stub[name]!r}'s stub in the "
                    f"release: make the cell a test of it (test_{stub[name]}_N)"
                    for name in sorted(uses)
                ]
                bound |= binds
                for name in binds:
                    missing.pop(name, None)
                    if name not in exercise:  # the stub's own cell binds the stub
                        stub.pop(name, None)
    return problems


# ---------------------------------------------------------------------------------------
# nbgrader in a temporary course folder


def _nbgrader() -> Any:
    try:
        from nbgrader.apps import NbGraderAPI
    except ImportError as err:
        raise RuntimeError(
            'nbgrader is not installed: pip install -c requirements-lock.txt -e ".[dev]"'
        ) from err
    return NbGraderAPI


def _course(root: Path, timeout_s: float) -> Any:
    """nbgrader's API on a course folder `root` with its own gradebook."""
    from traitlets.config import Config

    # nbgrader runs `alembic` (its gradebook's migrations) from PATH: this environment's
    # (and the notebooks' `python3` kernel is this environment's python, found there too)
    here = str(Path(sys.executable).parent)
    if here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([here, os.environ.get("PATH", "")])
    config = Config()
    config.CourseDirectory.root = str(root)
    config.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
    config.ClearSolutions.code_stub = {"python": CODE_STUB}
    config.Execute.timeout = int(timeout_s)  # per cell; nbgrader's default is 30 s
    config.Execute.allow_errors = True
    return _nbgrader()(config=config)


def _run(result: dict[str, Any], what: str) -> None:
    """Raise with the first error nbgrader logged (its own summary says only "see above")."""
    if not result.get("success"):
        text = f"{result.get('log') or ''}\n{result.get('error') or ''}"
        causes = [
            m.group(1)
            for m in re.finditer(r"^\s*((?:\w+\.)*\w+(?:Error|Exception): .*)$", text, re.M)
            if "NbGraderException" not in m.group(1)
        ]
        raise RuntimeError(f"nbgrader {what} failed: {causes[0] if causes else text.strip()}")


def _generate(course: Path, notebooks: Sequence[Path], timeout_s: float) -> Any:
    """Copy the lecturer's notebooks into `course/source/` and generate the assignment
    (which also records its cells in the course's gradebook, as autograde needs)."""
    source = course / "source" / ASSIGNMENT
    source.mkdir(parents=True)
    for path in notebooks:
        shutil.copy(path, source / path.name)
    api = _course(course, timeout_s)
    _run(api.generate_assignment(ASSIGNMENT), "generate_assignment")
    return api


def lecturer_notebooks(folder: Path) -> list[Path]:
    """The course's notebooks in `folder` (NN_name.ipynb), in reading order."""
    found = sorted(p for p in Path(folder).glob("*.ipynb") if NOTEBOOK_NAME.match(p.name))
    if not found:
        raise ValueError(f"{folder}: no course notebooks (NN_name.ipynb)")
    return found


def read(path: Path) -> Any:
    import nbformat

    return nbformat.read(path, as_version=4)


def tidy(nb: Any) -> Any:
    """The release's answer cells are shown (the lecturer's copy folds them with JupyterLab's
    `source_hidden`; a student writes there), without the lecturer's run's timestamps or
    jupytext pairing (which would write a `.py` beside a student's notebook)."""
    nb["metadata"].pop("jupytext", None)
    for cell in nb["cells"]:
        cell["metadata"].pop("execution", None)
        if is_answer(cell):
            cell["metadata"].get("jupyter", {}).pop("source_hidden", None)
            if cell["metadata"].get("jupyter") == {}:
                del cell["metadata"]["jupyter"]
    return nb


def release(notebooks: Sequence[Path], out: Path, timeout_s: float = 600) -> list[Path]:
    """Write the student release of `notebooks` (the lecturer's copies) into `out`, by
    `nbgrader generate_assignment`: answer cells cleared to `CODE_STUB`, outputs cleared,
    stubs and tests kept. Returns the written notebooks."""
    import nbformat

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="tae-course-") as tmp:
        course = Path(tmp)
        _generate(course, notebooks, timeout_s)
        for path in notebooks:
            nb = tidy(read(course / "release" / ASSIGNMENT / path.name))
            nbformat.write(nb, out / path.name)
            written.append(out / path.name)
    return written


def put_back(released: Any, lecturer: Any) -> Any:
    """The release with the lecturer's solutions written back into its answer cells (matched
    by grade_id): a submission whose every answer is the lecturer's."""
    import copy

    solutions = {grade_id(c): c["source"] for c in lecturer["cells"] if is_answer(c)}
    nb = copy.deepcopy(released)
    for cell in nb["cells"]:
        if is_answer(cell):
            cell["source"] = solutions[grade_id(cell)]
    return nb


# ---------------------------------------------------------------------------------------
# Grading


@dataclass
class Graded:
    """One submitted notebook, autograded: each test's score, and the cells that raised
    (by grade_id, or "cell N" for a cell without one)."""

    notebook: str
    scores: dict[str, tuple[float, float]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(s for s, _ in self.scores.values())

    @property
    def max_score(self) -> float:
        return sum(m for _, m in self.scores.values())


def submissions(folder: Path) -> dict[str, list[Path]]:
    """Submitted notebooks by student: a folder of notebooks is one student's ("student");
    a folder of folders, one student per folder. Raises ValueError on anything else."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder")
    direct = sorted(folder.glob("*.ipynb"))
    if direct:
        found = {"student": direct}
    else:
        found = {d.name: sorted(d.glob("*.ipynb")) for d in sorted(folder.iterdir()) if d.is_dir()}
        found = {k: v for k, v in found.items() if v}
    if not found:
        raise ValueError(f"{folder}: no notebooks (*.ipynb), nor folders of them")
    for paths in found.values():
        for path in paths:
            _check_notebook(path)
    return found


def _check_notebook(path: Path) -> None:
    if not NOTEBOOK_NAME.match(path.name):
        raise ValueError(f"{path}: not one of the course's notebooks (NN_name.ipynb)")
    try:
        nb = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a notebook ({err.__class__.__name__})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path}: not a notebook (no cells)")


def failed_cells(nb: Any) -> list[str]:
    """The code cells of an executed notebook that raised: grade_id, or "cell N"."""
    return [
        grade_id(c) or f"cell {i}"
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and any(o.get("output_type") == "error" for o in c["outputs"])
    ]


def grade(
    by_student: dict[str, Sequence[Path]],
    notebooks: Sequence[Path],
    timeout_s: float = 600,
) -> dict[str, list[Graded]]:
    """Autograde submitted notebooks against the lecturer's `notebooks` (by
    `nbgrader autograde`: each notebook executed, the tests restored from the lecturer's
    copy first). Returns, per student, each submitted notebook's test scores. The
    temporary course folder lies in `out/` beside the lecturer's folder (the checkout), so
    that the notebooks run inside the repository, whose files they read."""
    from nbgrader.api import Gradebook

    known = {p.name for p in notebooks}
    for paths in by_student.values():
        for path in paths:
            if path.name not in known:
                raise ValueError(f"{path}: the course has no notebook {path.name}")
    order = {p.name: [str(grade_id(c)) for c in read(p)["cells"] if is_test(c)] for p in notebooks}
    results: dict[str, list[Graded]] = {}
    # The course folder lies in the checkout (its git-ignored out/), as the release does:
    # a notebook run there finds the repository's files from its working folder, as
    # notebook 9 finds results/cluster/.
    scratch = Path(notebooks[0]).resolve().parent.parent / "out"
    scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".nbgrader-", dir=scratch) as tmp:
        course = Path(tmp)
        api = _generate(course, notebooks, timeout_s)
        for student, paths in by_student.items():
            folder = course / "submitted" / student / ASSIGNMENT
            folder.mkdir(parents=True)
            for path in paths:
                shutil.copy(path, folder / path.name)
            _run(api.autograde(ASSIGNMENT, student), f"autograde ({student})")
            results[student] = []
            with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
                for path in paths:
                    name = path.stem
                    sub = gradebook.find_submission_notebook(name, ASSIGNMENT, student)
                    by_name = {g.name: g for g in sub.grades}
                    graded = Graded(path.name)
                    for gid in order[path.name]:  # the tests, in the notebook's order
                        g = by_name[gid]
                        graded.scores[gid] = (float(g.score), float(g.max_score))
                    done = read(course / "autograded" / student / ASSIGNMENT / path.name)
                    graded.failed = failed_cells(done)
                    results[student].append(graded)
    return results


def score_table(results: dict[str, list[Graded]]) -> str:
    """One line per test (notebook, grade_id, score / points), a total per notebook and
    per student."""
    lines = []
    for student, graded in results.items():
        lines.append(f"{student}:")
        for g in graded:
            lines.append(f"  {g.notebook}: {g.score:g} / {g.max_score:g}")
            lines += [f"    {gid:<28} {s:g} / {m:g}" for gid, (s, m) in g.scores.items()]
        total = sum(g.score for g in graded), sum(g.max_score for g in graded)
        lines.append(f"  total: {total[0]:g} / {total[1]:g}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The release checks itself


def check_release(
    released: Iterable[Path], notebooks: Sequence[Path], timeout_s: float = 600
) -> list[str]:
    """Autograde the release as it is and with the lecturer's solutions put back; [] when
    as it is exactly the exercises' tests fail, each scoring 0, and nothing else raises,
    and with the solutions put back nothing raises and every test scores full marks."""
    import nbformat

    released = list(released)
    lecturer = {p.name: p for p in notebooks}
    with tempfile.TemporaryDirectory(prefix="tae-filled-") as tmp:
        filled = []
        for path in released:
            nb = put_back(read(path), read(lecturer[path.name]))
            nbformat.write(nb, Path(tmp) / path.name)
            filled.append(Path(tmp) / path.name)
        results = grade({"unfilled": released, "filled": filled}, notebooks, timeout_s)
    problems = []
    for as_is, full in zip(results["unfilled"], results["filled"], strict=True):
        tests = [str(grade_id(c)) for c in read(lecturer[as_is.notebook])["cells"] if is_test(c)]
        problems += judge(as_is, full, tests)
    return problems


def judge(as_is: Graded, solved: Graded, tests: Sequence[str]) -> list[str]:
    """What is wrong with one notebook's two gradings ([] when nothing): as released,
    exactly the exercises' `tests` raise, and it scores 0; solved, nothing raises and every
    one of the tests scores full marks."""
    problems = []
    if as_is.failed != list(tests):
        problems.append(f"{as_is.notebook} as released: raised {as_is.failed}, not {tests}")
    if as_is.score != 0:
        problems.append(f"{as_is.notebook} as released scores {as_is.score:g}, not 0")
    if solved.failed or solved.score != solved.max_score or len(solved.scores) != len(tests):
        problems.append(
            f"{solved.notebook} with its solutions: raised {solved.failed}, scores "
            f"{solved.score:g} / {solved.max_score:g} ({len(tests)} tests)"
        )
    return problems
