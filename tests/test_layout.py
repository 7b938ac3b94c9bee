"""The project's layout: the paper's files and the scripts at the root, the plumbing in one package
(infra/); every file is a library or a script, and no script imports another script.

A script is a file with a command line (it parses arguments); a library is imported and has none
(at most a self-check). The imports are read from the source, not executed."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "infra"
FILES = sorted(p for folder in (ROOT, PACKAGE, ROOT / "data", ROOT / "bench") for p in folder.glob("*.py")
               if p.name != "__init__.py")


def is_script(path: Path) -> bool:
    return "parse_args(" in path.read_text()


def project_imports(path: Path) -> set[Path]:
    """The project files a file imports (by module name, as `python file.py` would find them)."""
    by_name = {}
    for folder in (path.parent, ROOT):  # the scripts in data/ and bench/ put the root first on sys.path
        by_name.update({p.stem: p for p in folder.glob("*.py") if p.name != "__init__.py"})
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] in by_name and by_name[parts[0]] != path:
                found.add(by_name[parts[0]])
            if len(parts) > 1 and (ROOT / parts[0] / f"{parts[1]}.py").exists():  # infra.update, data.x
                found.add(ROOT / parts[0] / f"{parts[1]}.py")
    return found - {path}


def test_the_layout_has_both_kinds():
    names = {p.name for p in FILES}
    assert {"train.py", "sft.py", "eval.py", "demo.py"} <= names and is_script(ROOT / "train.py")
    assert not is_script(PACKAGE / "training.py") and not is_script(ROOT / "rollout.py")


def test_the_root_holds_the_paper_and_the_scripts_and_the_package_the_plumbing():
    """A reader of the paper opens the root; the plumbing waits in one package. The package is all
    libraries, and it never reads a script (it may read the paper's records, such as the trajectory)."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= 12, f"{len(root)} files at the root: {root}\n---> HINT: the plumbing goes in infra/"
    package = [p for p in FILES if p.parent == PACKAGE]
    assert package and not [p.name for p in package if is_script(p)], "infra/ holds libraries only"
    assert (PACKAGE / "__init__.py").read_text().count("\n") < 20, "infra/__init__.py is a docstring, no code"
    assert "import" not in (PACKAGE / "__init__.py").read_text(), "no facade: infra/__init__.py forwards none"


def test_train_py_reads_few_of_the_projects_modules():
    """train.py's imports are a reader's map of one RL step: at most 10 of the project's modules."""
    imported = sorted(str(p.relative_to(ROOT)) for p in project_imports(ROOT / "train.py"))
    assert len(imported) <= 10, f"train.py imports {len(imported)} project modules: {imported}"


def test_no_file_imports_a_script():
    bad = [f"{path.relative_to(ROOT)} imports {imported.relative_to(ROOT)}"
           for path in FILES for imported in project_imports(path) if is_script(imported)]
    assert not bad, "a script must import libraries only; move what they share into a library: " + "; ".join(bad)


def import_circles(imports: dict) -> list[list]:
    """Each circle of imports (a -> b -> ... -> a) in {file: the files it imports}, once per circle."""
    circles = []

    def walk(path, trail):
        for imported in sorted(imports.get(path, ())):
            if imported == trail[0]:
                circles.append(trail + [imported])
            elif imported > trail[0] and imported not in trail:  # each circle from its smallest file only
                walk(imported, trail + [imported])
    for start in sorted(imports):
        walk(start, [start])
    return circles


def test_no_library_imports_its_importer_back():
    """A circle, even through an import inside a function, means two files share a job: the order they
    load in decides what works, and a reader cannot read one before the other."""
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []
    imports = {path: project_imports(path) for path in FILES}
    circles = [" -> ".join(str(p.relative_to(ROOT)) for p in c) for c in import_circles(imports)]
    assert not circles, f"import circles: {circles}\n---> HINT: move what both need into one of them"


def test_no_two_files_share_a_name():
    """`import sandbox` must name one file: a script in bench/ or data/ named like a library makes a
    reader (and `python bench/x.py`, whose own folder comes first on sys.path) take one for the other."""
    by_name = {}
    for path in FILES:
        by_name.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"files sharing a module name: {shared}; rename the script"


def test_every_document_the_code_cites_is_in_the_repository():
    """A citation a reader cannot follow is worse than none: every `.md` a .py file names must exist
    (relative to the repository's root)."""
    import re
    sources = FILES + sorted((ROOT / "tests").glob("*.py"))
    missing = [f"{path.relative_to(ROOT)} cites {cited}" for path in sources
               for cited in re.findall(r"[\w./-]+\.md\b", path.read_text()) if not (ROOT / cited).exists()]
    assert not missing, "cited documents that the repository does not have: " + "; ".join(missing)


def test_every_torchrun_of_the_tests_takes_a_free_port():
    """pytest.ini runs two test workers side by side: two launches on torchrun's default port (29500)
    would meet in one rendezvous, or fail to bind it. conftest.torchrun picks a free port each time."""
    import re
    launch = re.compile(r'"-m",\s*"torch\.distributed\.run"')
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    raw = [path.name for path in tests if launch.search(path.read_text())]
    assert not raw, f"{raw} start torch.distributed.run themselves\n---> HINT: use conftest.torchrun(n)"


def test_every_requirements_file_installs_what_the_code_imports_beside_torch_and_vllm():
    """A GPU machine of either kind must run every option: the packages the code imports that neither
    torch nor vLLM brings are in each requirements file (ROCm's lacked peft, which --lora-rank needs)."""
    needed = {"peft": "peft", "math_verify": "math-verify", "datasets": "datasets", "numpy": "numpy",
              "tqdm": "tqdm", "matplotlib": "matplotlib"}
    nodes = [node for path in FILES for node in ast.walk(ast.parse(path.read_text()))]
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom)}
    unused = sorted(set(needed) - imported)
    assert not unused, f"the code no longer imports {unused}: update this test"
    for requirements in sorted(ROOT.glob("requirements*.txt")):
        names = {line.split("#")[0].split("==")[0].strip() for line in requirements.read_text().splitlines()}
        missing = sorted(package for package in needed.values() if package not in names)
        assert not missing, f"{requirements.name} lacks {missing}\n---> HINT: add them, pinned as the others"
