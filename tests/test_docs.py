"""The README and docs/*.md cite code as `file.name` (a module's function, class or constant) or
`file.Class.method`; each such name must exist in that file, so a rename or a move shows up here.
The code's comments and docstrings cite it the same way, without the backticks."""
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for folder in (ROOT, ROOT / "infra") for p in folder.glob("*.py") if p.stem != "__init__"}
CITATION = re.compile(r"`(\w+)\.(\w+)(?:\.(\w+))?")
PLAIN_CITATION = re.compile(r"(?<![\w.`])(\w+)\.(\w+)(?:\.(\w+))?")  # in code's prose: no backticks
FOLDERS = (ROOT, ROOT / "infra", ROOT / "data", ROOT / "bench", ROOT / "tests")
CODE = sorted(p for folder in FOLDERS for p in folder.glob("*.py"))
FILE_TYPES = {"py", "jsonl", "json", "md", "txt", "csv", "png", "sh"}  # `train.jsonl` names a file, not code


def defined_names(body: list) -> set[str]:
    """The names a module's or a class's body defines: defs, classes, assignments and imports."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def top_level_names(path: Path) -> dict[str, set[str]]:
    """name -> what it defines in turn (a class's methods and fields; empty otherwise), for a module."""
    body = ast.parse(path.read_text()).body
    classes = {node.name: defined_names(node.body) for node in body if isinstance(node, ast.ClassDef)}
    return {name: classes.get(name, set()) for name in defined_names(body)}


def citations(text: str, pattern=CITATION, local_names=()):
    """(module, name, method or None) for each backticked `module.name` whose module is one of ours;
    a module name the file also binds itself (a variable `engine`, say) cites that variable."""
    for module, name, method in pattern.findall(text):
        if module in MODULES and name not in FILE_TYPES and module not in local_names:
            yield module, name, method or None


def missing_citations(text: str, pattern=CITATION, local_names=()) -> list[str]:
    missing = []
    for module, name, method in citations(text, pattern, local_names):
        names = top_level_names(MODULES[module])
        if name not in names:
            missing.append(f"{module}.{name}")
        elif method and names[name] and method not in names[name]:
            missing.append(f"{module}.{name}.{method}")
    return missing


def prose_and_names(source: str) -> list[tuple[str, set[str]]]:
    """A Python file's comments and docstrings, each with the names bound where it stands (a function's
    or a class's arguments and assignments, and the module's): there `engine.step` is a variable's."""
    tree = ast.parse(source)
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    scopes = [n for n in ast.walk(tree) if isinstance(n, kinds)]

    def scope(line):  # the functions and classes around a line, innermost last
        return [f for f in scopes if f.lineno <= line <= f.end_lineno]

    bound = {}  # a function or class (None: the module) -> the names bound in it
    for node in ast.walk(tree):
        name = node.arg if isinstance(node, ast.arg) else node.id if isinstance(node, ast.Name) and \
            isinstance(node.ctx, ast.Store) else None
        if name:
            inner = scope(node.lineno)
            bound.setdefault(inner[-1] if inner else None, set()).add(name)

    def names_at(line):
        return set().union(bound.get(None, set()), *(bound.get(f, set()) for f in scope(line)))
    texts = [(t.string, names_at(t.start[0])) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            texts.append((ast.get_docstring(node, clean=False) or "", names_at(getattr(node, "lineno", 0))))
    return texts


def test_the_checker_catches_a_name_that_moved():
    assert missing_citations("`logprobs.token_logprobs` and `update.MiniBatch`") == []
    # File names (grpo_roc.py, train.jsonl) and another package's names (numpy.zeros) are not citations
    # of our code.
    moved = "`training.token_logprobs`, `grpo_roc.py`, `train.jsonl`, `numpy.zeros`"
    assert missing_citations(moved) == ["training.token_logprobs"]
    assert missing_citations("`update.MiniBatch.record`, `update.MiniBatch.kl`") == \
        ["update.MiniBatch.kl"]


def test_every_code_name_the_readme_and_docs_cite_exists():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        missing = missing_citations(doc.read_text())
        assert not missing, f"{doc.relative_to(ROOT)} cites names its files do not have: {missing}\n" \
                            "---> HINT: cite the file where the name lives today"


def test_the_code_checker_reads_comments_and_docstrings_and_knows_a_variable():
    source = ('"""Runs grpo_roc.policy_loss and training.load_sharded_model."""\n'
              "# training._chunk_logprobs\n"
              "class Plan:\n"
              "    training: str = ''  # a field\n"
              "def f(engine):  # engine.step() is the argument's\n"
              "    training = 1  # update.MiniBatch.kl\n"
              "    return engine.step()\n")
    missing = [name for prose, bound in prose_and_names(source)
               for name in missing_citations(prose, PLAIN_CITATION, bound)]
    assert missing == ["training._chunk_logprobs", "update.MiniBatch.kl"], \
        "a module-level comment cites the module even where a function names a variable like it"


def test_every_code_name_the_code_comments_cite_exists():
    for path in CODE:
        missing = [name for prose, bound in prose_and_names(path.read_text())
                   for name in missing_citations(prose, PLAIN_CITATION, bound)]
        assert not missing, f"{path.relative_to(ROOT)}'s comments cite names their files do not have: " \
                            f"{missing}\n---> HINT: cite the file where the name lives today"
