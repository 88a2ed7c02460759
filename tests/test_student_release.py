"""The student release (`course.release`, nbgrader): how the lecturer's notebooks are
marked, what the release carries, and how it grades.

Static checks cover all nine notebooks: the marks, no solution text and no outputs in the
release, and the release with its solutions put back giving the lecturer's cells (so that
nbval of the committed notebooks proves the release, solved, passes everything). The
grading pipeline runs end to end on a miniature course in the same conventions: as
released exactly its exercises' tests fail, and with its solutions, full marks.
`make student-check` (run by CI) does that for the nine notebooks.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import nbformat
import pytest

from tree_attention_edu import cli
from tree_attention_edu.course import release

pytest.importorskip("nbgrader")  # a developer dependency (the dev extra)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = release.lecturer_notebooks(ROOT / "notebooks")
LECTURER = {p.name: release.read(p) for p in NOTEBOOKS}
# The notebook the static checks' rule tests plant their bugs in.
CHEAPEST = "03_associativity_and_trees.ipynb"


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """The release of all nine notebooks (nbgrader generate_assignment, about 15 s)."""
    out = tmp_path_factory.mktemp("student")
    paths = release.release(NOTEBOOKS, out)
    return {p.name: release.read(p) for p in paths}


# --- the lecturer's marks -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LECTURER))
def test_the_lecturers_notebooks_are_marked(name):
    """Every `solution` cell is an nbgrader answer cell and the other way round; every test
    is locked, worth points and follows its exercise's answer cell."""
    assert release.mark_problems(LECTURER[name]) == []


def test_every_notebook_has_exercises():
    counts = {n: len(release.exercises(nb, n)) for n, nb in LECTURER.items()}
    assert all(counts.values()), counts
    assert sum(counts.values()) == 21, counts


def test_the_mark_check_can_fail():
    nb = copy.deepcopy(LECTURER[CHEAPEST])
    test = next(c for c in nb.cells if release.is_test(c))
    test.metadata.nbgrader["locked"] = False
    answer = next(c for c in nb.cells if release.is_answer(c))
    answer.metadata.tags = []  # an answer cell the site would not fold
    later = [c for c in nb.cells if release.is_test(c)][1]
    later.metadata.nbgrader["grade_id"] = "test_nothing_2"  # a test of no exercise
    problems = release.mark_problems(nb)
    assert any("not locked" in p for p in problems) and any("tagged" in p for p in problems)
    assert any("'test_nothing_2' comes before 'test_nothing'" in p for p in problems)


def test_a_cell_that_reads_what_the_release_lacks_is_found():
    """notebook 9 at 269f42b: an ordinary cell read `source_count`, which a test binds from
    the student's function, so the release raised there and CI's grading failed."""
    marks = {"schema_version": 3, "locked": True, "points": 1, "task": False}
    test_f = "before = 1\nafter = f(3)\nassert after == 3\nalso = 4"

    def problems(later: str, pre: str = "import math", test: str = test_f) -> list[str]:
        cells = [
            nbformat.v4.new_code_cell("import math\n\ndef f(x):\n    return 0  # the stub"),
            nbformat.v4.new_code_cell(pre),
            nbformat.v4.new_code_cell(
                "import math\n\ndef f(x):\n    return x\nhelper = 2",
                metadata={
                    "tags": ["solution"],
                    "nbgrader": {"grade": False, "grade_id": "f", "solution": True, **marks},
                },
            ),
            nbformat.v4.new_code_cell(
                test,
                metadata={
                    "nbgrader": {"grade": True, "grade_id": "test_f", "solution": False, **marks}
                },
            ),
            nbformat.v4.new_code_cell(later),
        ]
        nb = nbformat.v4.new_notebook(cells=cells)
        found = release.unbound_in_release(nb)
        assert release.mark_problems(nb) == found  # the marks are right, and it runs there
        return found

    found = problems("print(after + also + helper + before)")
    assert [re.search(r"reads '(\w+)'", p)[1] for p in found] == ["after", "also", "helper"]
    assert "'test_f' binds it" in found[0] and "'f' binds it" in found[2]
    assert problems("print(before, [after for after in range(3)], (lambda also: also)(1))") == []
    assert problems("after = 5\nprint(after)") == []  # bound again in the cell
    assert problems('print(also if "also" in globals() else None)') == []
    assert problems("print(math.pi)") == []  # the answer rebinds it; the earlier one stays
    assert problems("also += 1") != [] and problems("del helper") != []  # need it bound
    assert problems("%timeit math.pi") == []  # a magic is IPython's, not a syntax error
    # The exercise's function is the stub in the release, and so is what is made from it.
    assert "uses 'f'" in problems("print(f(2))")[0]
    assert "uses 'g'" in problems("g = f\nprint(g(2))")[0]
    wrapped = "def g(x):\n    return f(x)"
    assert "uses 'g'" in problems("print(g(2))", pre=wrapped)[0]
    # a test that reaches the answer through such a function stops there too
    test_g = "before = 1\nr = g(3)\nassert r == 3\nalso = 4"
    assert "reads 'also'" in problems("print(also)", pre=wrapped, test=test_g)[0]
    assert problems("print(before)", pre=wrapped, test=test_g) == []


# --- what the release carries (static, all nine) ------------------------------------------


def solution_lines(lecturer) -> set[str]:
    """Lines of the answer cells that no other cell of the lecturer's notebook has (a stub's
    `def` line or docstring, repeated in its solution, is no solution text)."""
    answers = [c for c in lecturer.cells if release.is_answer(c)]
    others = {
        line.strip()
        for c in lecturer.cells
        if not release.is_answer(c)
        for line in c.source.splitlines()
    }
    return {
        line.strip() for c in answers for line in c.source.splitlines() if line.strip()
    } - others


def leaks(released_nb, lecturer) -> list[str]:
    """Solution lines found anywhere in a released notebook's cells."""
    text = {line.strip() for c in released_nb.cells for line in c.source.splitlines()}
    return sorted(solution_lines(lecturer) & text)


@pytest.mark.parametrize("name", sorted(LECTURER))
def test_the_release_carries_no_solution_and_no_output(released, name):
    nb = released[name]
    assert leaks(nb, LECTURER[name]) == []
    assert len(solution_lines(LECTURER[name])) > 5  # the check has something to look for
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    for cell in nb.cells:
        if release.is_answer(cell):
            assert cell.source == release.CODE_STUB
            assert cell.source.startswith("# The student release empties this cell.")
            assert cell.source.endswith("# YOUR CODE HERE")  # nbgrader's marker, last
            assert not cell.metadata.get("jupyter", {}).get("source_hidden")  # shown
    assert "jupytext" not in nb.metadata  # no .py paired beside a student's notebook


def test_a_planted_solution_line_is_found(released):
    nb = copy.deepcopy(released[CHEAPEST])
    lecturer = LECTURER[CHEAPEST]
    planted = next(iter(sorted(solution_lines(lecturer))))
    stub = next(c for c in nb.cells if release.is_answer(c))
    stub.source += "\n    " + planted
    assert leaks(nb, lecturer) == [planted]


def lecturer_cells(nb):
    return [(c.cell_type, c.source) for c in nb.cells]


@pytest.mark.parametrize("name", sorted(LECTURER))
def test_solutions_put_back_give_the_lecturers_cells(released, name):
    """The release differs from the lecturer's copy in its answer cells only: with them
    filled back in, every cell is the lecturer's (which nbval checks, outputs and all)."""
    filled = release.put_back(released[name], LECTURER[name])
    assert lecturer_cells(filled) == lecturer_cells(LECTURER[name])


def test_putting_back_finds_any_other_change(released):
    nb = copy.deepcopy(released[CHEAPEST])
    test = next(c for c in nb.cells if release.is_test(c))
    test.source = test.source.replace("assert", "pass  #", 1)  # a weakened test
    filled = release.put_back(nb, LECTURER[CHEAPEST])
    assert lecturer_cells(filled) != lecturer_cells(LECTURER[CHEAPEST])


# --- grading -----------------------------------------------------------------------------


def mini_course(folder: Path) -> list[Path]:
    """Two lecturer's notebooks in the course's conventions (a stub, its hidden answer cell,
    the graded test right after it and a later test; a written question's hidden check),
    small enough to execute in seconds: 01 is right, 02's stub already passes its test."""
    folder.mkdir()

    def marks(gid, test):
        return {
            "nbgrader": {
                "grade": test,
                "grade_id": gid,
                "locked": test,
                "schema_version": 3,
                "solution": not test,
                "task": False,
                **({"points": 1} if test else {}),
            }
        }

    def answer(gid, source):
        cell = nbformat.v4.new_code_cell(source, metadata=marks(gid, False))
        cell.metadata["tags"] = [release.SOLUTION_TAG]
        return cell

    def test(gid, source):
        return nbformat.v4.new_code_cell(source, metadata=marks(gid, True))

    def notebook(name, stub):
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3",
            "language": "python",
        }
        nb.cells = [
            nbformat.v4.new_markdown_cell("Write `double(x)`, twice `x`."),
            nbformat.v4.new_code_cell(f"def double(x):\n    {stub}"),
            answer("double", "def double(x):\n    return 2 * x"),
            test("test_double", "assert double(3) == 6"),
            nbformat.v4.new_markdown_cell("Why is `double(0)` zero? (a written question)"),
            answer("answer_1", "assert double(0) == 0  # the hidden check"),
            test("test_double_2", "assert double(-1.5) == -3.0"),
        ]
        assert release.mark_problems(nb) == []
        nbformat.write(nb, folder / name)
        return folder / name

    return [
        notebook("01_right.ipynb", "return x  # placeholder: the test rejects it"),
        notebook("02_passes_unfilled.ipynb", "return x + x  # a stub that is the answer"),
    ]


@pytest.mark.slow
def test_a_release_graded_by_nbgrader_fails_exactly_its_tests_and_solved_scores_full(tmp_path):
    """The whole pipeline on a miniature course (nbgrader generate_assignment, then
    autograde as released and with the solutions put back: four executed notebooks, seconds
    not minutes). 01 passes the check; 02, whose stub already answers, is reported: its
    tests pass unfilled. `make student-check` (run by CI) does this for the nine notebooks
    of the course, which execute for about 20 minutes."""
    lecturer = mini_course(tmp_path / "notebooks")
    written = release.release(lecturer, tmp_path / "student")
    assert [p.name for p in written] == ["01_right.ipynb", "02_passes_unfilled.ipynb"]
    assert release.CODE_STUB in "".join(release.read(written[0])["cells"][2]["source"])
    problems = release.check_release(written, lecturer)
    assert len(problems) == 2 and all(p.startswith("02_passes_unfilled") for p in problems), (
        problems
    )
    assert "raised [], " in problems[0] and "scores 2, not 0" in problems[1], problems


def test_the_release_check_can_fail():
    """The verdict on two gradings: a test that passes unfilled, a cell that raises which
    is no test, and a solved notebook short of full marks are each reported."""
    tests = ["test_a", "test_b"]
    right = release.judge(
        release.Graded("x.ipynb", {"test_a": (0, 1), "test_b": (0, 1)}, tests),
        release.Graded("x.ipynb", {"test_a": (1, 1), "test_b": (1, 1)}, []),
        tests,
    )
    assert right == []
    wrong = release.judge(
        release.Graded("x.ipynb", {"test_a": (0, 1), "test_b": (1, 1)}, ["test_a", "cell 7"]),
        release.Graded("x.ipynb", {"test_a": (1, 1), "test_b": (0, 1)}, ["test_b"]),
        tests,
    )
    assert len(wrong) == 3 and "cell 7" in wrong[0] and "scores 1" in wrong[1], wrong


# --- the command line: bad input is one line and exit status 2 ----------------------------


def call(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    (tmp_path / "not_json").mkdir()
    (tmp_path / "not_json" / "01_energy_function.ipynb").write_text("not json")
    (tmp_path / "stranger").mkdir()
    (tmp_path / "stranger" / "99_unknown.ipynb").write_text(json.dumps({"cells": []}))
    (tmp_path / "empty").mkdir()
    cases = [
        (["grade", str(tmp_path / "missing")], "no such folder"),
        (["grade", str(tmp_path / "empty")], "no notebooks"),
        (["grade", str(tmp_path / "not_json")], "not a notebook"),
        (["grade", str(tmp_path / "stranger")], "no notebook 99_unknown.ipynb"),
        (["student", "--notebooks", str(tmp_path / "missing")], "no such folder"),
        (["student", "--notebooks", str(tmp_path / "empty")], "no course notebooks"),
        (["student", "--only", "42"], "no notebook numbered 42"),
    ]
    for argv, expected in cases:
        code, err = call(argv, capsys)
        assert code == 2 and len(err) == 1 and expected in err[0], (argv, err)


def test_grade_prints_a_score_per_test_and_writes_json(tmp_path, monkeypatch, capsys):
    """`grade`'s report, with nbgrader's run replaced by a fixed result (no execution)."""
    (tmp_path / "ada").mkdir()
    nbformat.write(LECTURER[CHEAPEST], tmp_path / "ada" / CHEAPEST)
    scores = {"test_combine_np": (1.0, 1.0), "test_two_sum": (0.0, 1.0)}

    def fake(by_student, notebooks, timeout_s):
        assert [p.name for p in by_student["ada"]] == [CHEAPEST] and len(notebooks) == 9
        return {"ada": [release.Graded(CHEAPEST, scores, ["test_two_sum"])]}

    monkeypatch.setattr(release, "grade", fake)
    out = tmp_path / "grades.json"
    assert (
        cli.main(
            ["grade", str(tmp_path), "--notebooks", str(ROOT / "notebooks"), "--json", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert f"{CHEAPEST}: 1 / 2" in text and "test_two_sum" in text and "total: 1 / 2" in text
    assert json.loads(out.read_text())["ada"][CHEAPEST]["failed"] == ["test_two_sum"]


def test_grading_reads_a_folder_per_student(tmp_path):
    for student in ("ada", "bob"):
        (tmp_path / student).mkdir()
        nbformat.write(LECTURER[CHEAPEST], tmp_path / student / CHEAPEST)
    found = release.submissions(tmp_path)
    assert list(found) == ["ada", "bob"] and all(len(v) == 1 for v in found.values())


# --- the lecturer's guide ------------------------------------------------------------------


GUIDE = ROOT / "docs" / "lecturers-guide.md"
ANSWERS = ROOT / "docs" / "lecturers-answers.md"


NO_SITE = pytest.mark.skipif(
    not ANSWERS.exists(), reason="the site's sources (docs/, mkdocs.yml) are not in the sdist"
)


@NO_SITE
def test_the_guide_is_on_the_site_and_the_answers_are_not():
    """The guide is a page of the site (in the nav); the exam answers are excluded from
    it (`exclude_docs`), and no page of the site carries an answer's text."""
    from mkdocs.config import load_config
    from mkdocs.structure.files import get_files

    config = load_config(str(ROOT / "mkdocs.yml"))
    files = {f.src_uri: f for f in get_files(config)}
    assert not files["lecturers-answers.md"].inclusion.is_included()
    assert files["lecturers-guide.md"].inclusion.is_included()
    assert "lecturers-guide.md" in (ROOT / "mkdocs.yml").read_text()
    answers = answer_texts(ANSWERS.read_text())
    assert len(answers) == 27, len(answers)  # three questions for each of nine notebooks
    published = [
        Path(f.abs_src_path)
        for f in files.values()
        if f.inclusion.is_included() and f.src_uri.endswith((".md", ".ipynb"))
    ]
    assert len(published) > 40
    assert shown(published, answers) == []


def page_text(path: Path) -> str:
    """A page's text, whitespace collapsed (a notebook's: its cells' sources)."""
    if path.suffix == ".ipynb":
        text = "\n".join(c.source for c in release.read(path).cells)
    else:
        text = path.read_text()
    return " ".join(text.split())


def shown(pages: list[Path], answers: list[str]) -> list[tuple[str, str]]:
    """(page, answer) for each answer whose text a page carries."""
    texts = {p.name: page_text(p) for p in pages}
    return [(name, a) for name, text in texts.items() for a in answers if a in text]


def answer_texts(text: str) -> list[str]:
    """The first 80 characters of each answer (after "**Answer.**"), whitespace collapsed."""
    return [" ".join(part.split("\n\n")[0].split())[:80] for part in text.split("**Answer.**")[1:]]


@NO_SITE
def test_the_answer_check_can_fail(tmp_path):
    answers = answer_texts(ANSWERS.read_text())
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\nIn short:\n{ANSWERS.read_text().split('**Answer.**')[5]}")
    assert shown([page], answers) == [("page.md", answers[4])]


# --- time estimates: one figure per notebook, the same everywhere ---------------------------


def session_minutes(guide: str) -> dict[str, tuple[int, int | None]]:
    """{"01": (minutes, minutes with the optional part or None), ...} from each notebook's
    "**Session (about N minutes[, M with ...])**" in the lecturer's guide."""
    found = {}
    for number, body in re.findall(r"^## (\d)\. [^\n]*\n(.*?)(?=^## |\Z)", guide, re.M | re.S):
        m = re.search(r"\*\*Session \(about (\d+) minutes(?:, (\d+) with [^)]*)?\)", body)
        assert m, f"section {number} of the guide gives no session length"
        found[number.zfill(2)] = (int(m[1]), int(m[2]) if m[2] else None)
    return found


def stated_minutes(first_cell: str) -> tuple[int, int | None]:
    """(minutes, minutes with the optional part or None) from a notebook's "**Time.** About N
    minutes ...; ... takes another M"."""
    m = re.search(r"\*\*Time[.:]\*\*\s+[Aa]bout (\d+)\s+minutes", first_cell)
    assert m, first_cell[:200]
    extra = re.search(r"takes another (\d+)", first_cell)
    return int(m[1]), int(m[1]) + int(extra[1]) if extra else None


RUN_PHRASES = {  # what a notebook's first cell says of its run time: the README's seconds
    "runs in seconds": (0, 20),
    "under a minute": (0, 60),
    "about a minute": (40, 90),
}


@NO_SITE
def test_the_guide_and_the_notebooks_give_the_same_session_lengths():
    guide = session_minutes(GUIDE.read_text())
    stated = {name[:2]: stated_minutes(nb.cells[0].source) for name, nb in LECTURER.items()}
    assert len(guide) == 9 and guide == stated


def test_the_notebooks_run_times_agree_with_the_readme():
    """The README's table (measured by scripts/notebook_costs.py) is the one source of the run
    times; each notebook's first cell says the same in words."""
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("no README")
    seconds = {
        n.zfill(2): int(s)
        for n, s in re.findall(r"^\| (\d)\. [^|]*\| about (\d+) s \|", readme.read_text(), re.M)
    }
    assert len(seconds) == 9, seconds
    for name, nb in LECTURER.items():
        text = " ".join(nb.cells[0].source.split())
        said = [phrase for phrase in RUN_PHRASES if phrase in text]
        assert len(said) == 1, (name, said)
        low, high = RUN_PHRASES[said[0]]
        assert low <= seconds[name[:2]] < high, (name, said[0], seconds[name[:2]])
