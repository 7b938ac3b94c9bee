"""The README and docs/*.md cite code as `file.name` (a module's function, class or constant) or
`file.Class.method`; each such name must exist in that file, so a rename or a move shows up here."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")}
CITATION = re.compile(r"`(\w+)\.(\w+)(?:\.(\w+))?")
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


def citations(text: str):
    """(module, name, method or None) for each backticked `module.name` whose module is one of ours."""
    for module, name, method in CITATION.findall(text):
        if module in MODULES and name not in FILE_TYPES:
            yield module, name, method or None


def missing_citations(text: str) -> list[str]:
    missing = []
    for module, name, method in citations(text):
        names = top_level_names(MODULES[module])
        if name not in names:
            missing.append(f"{module}.{name}")
        elif method and names[name] and method not in names[name]:
            missing.append(f"{module}.{name}.{method}")
    return missing


def test_the_checker_catches_a_name_that_moved():
    assert missing_citations("`logprobs.token_logprobs` and `update.UpdateSettings`") == []
    # File names (grpo_roc.py, train.jsonl) and another package's names (numpy.zeros) are not citations
    # of our code.
    moved = "`training.token_logprobs`, `grpo_roc.py`, `train.jsonl`, `numpy.zeros`"
    assert missing_citations(moved) == ["training.token_logprobs"]
    assert missing_citations("`update.UpdateSettings.kl_coef`, `update.UpdateSettings.kl`") == \
        ["update.UpdateSettings.kl"]


def test_every_code_name_the_readme_and_docs_cite_exists():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        missing = missing_citations(doc.read_text())
        assert not missing, f"{doc.relative_to(ROOT)} cites names its files do not have: {missing}\n" \
                            "---> HINT: cite the file where the name lives today"
