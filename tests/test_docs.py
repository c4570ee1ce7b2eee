"""The README and docs/ point at things that exist: links, headings, modules, files, commands.

Text only: no process is started, nothing is imported from the project.
"""

import importlib.util
import pathlib
import re
import shlex
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Folders of this repository whose files the pages name in prose and commands.
REPO_DIRS = ("spmdsplit", "launch", "tools", "tests", "configs", "docs", ".ci")
FILE_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".sbatch", ".md", ".json", ".jsonl")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.M | re.S)
MODULE = re.compile(r"(?:^|\s)-m\s+([A-Za-z_][\w.]*)")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./+-]*[\w+-])" % "|".join(re.escape(d) for d in REPO_DIRS))


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = FENCE.sub("", path.read_text())  # a `# comment` in a code block is no heading
    seen: dict[str, int] = {}
    out = set()
    for line in text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(page: pathlib.Path) -> list[str]:
    problems = []
    text = FENCE.sub("", page.read_text())
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, chrome:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{_rel(page)}: link to {target}: {path_part} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{_rel(page)}: link to {target}: no heading #{anchor} in {_rel(dest)}")
    return problems


def module_problem(name: str) -> str | None:
    """A module run with `-m`: this repository's must be a file here; any other must be installed."""
    top = name.split(".")[0]
    if (ROOT / top).is_dir():
        base = ROOT.joinpath(*name.split("."))
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or (base / "__main__.py").is_file():
            return None
        return f"-m {name}: no {base.relative_to(ROOT)}.py, {base.relative_to(ROOT)}/__init__.py or __main__.py"
    if importlib.util.find_spec(top) is None:
        return f"-m {name}: {top} is neither in this repository nor installed"
    return None


def commands(block: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments dropped."""
    out, current = [], ""
    for line in block.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        out.append(current + stripped)
        current = ""
    if current:
        out.append(current)
    return out


def command_problems(page: pathlib.Path) -> list[str]:
    problems = []
    for lang, block in FENCE.findall(page.read_text()):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        for command in commands(block):
            try:
                words = shlex.split(command, comments=True)
            except ValueError as e:
                problems.append(f"{_rel(page)}: cannot parse {command!r}: {e}")
                continue
            line = " ".join(words)
            problems += [f"{_rel(page)}: {command!r}: {p}" for p in map(module_problem, MODULE.findall(line)) if p]
            for word in words:
                value = word.split("=", 1)[1] if re.match(r"^[\w.-]+=", word) else word
                if value.startswith(("/", "~", "$", "-")) or "://" in value:
                    continue
                if value.endswith(FILE_SUFFIXES) and not (ROOT / value).exists():
                    problems.append(f"{_rel(page)}: {command!r}: {value} does not exist")
    return problems


def prose_problems(page: pathlib.Path) -> list[str]:
    """`python -m spmdsplit.x` / `launch.x` / `tools.x` and repository paths named anywhere on the page."""
    problems = []
    text = page.read_text()
    for name in set(re.findall(r"python -m ((?:spmdsplit|launch|tools)\.[\w.]*\w)", text)):
        problem = module_problem(name)
        if problem:
            problems.append(f"{_rel(page)}: {problem}")
    for path in set(REPO_PATH.findall(text)):
        path = path.split("::")[0]
        if "*" in path or "<" in path:
            continue
        if not (ROOT / path).exists():
            problems.append(f"{_rel(page)}: names {path}, which does not exist")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_point_at_existing_files_and_headings(page):
    assert link_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_commands_name_existing_modules_and_files(page):
    assert command_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_modules_and_repository_paths_exist(page):
    assert prose_problems(page) == []


def test_readme_keeps_its_two_commands_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert "bash tools/setup/setup_cpu.sh && .venv/bin/torchrun --nproc-per-node 4 -m spmdsplit.train\n" in readme
    assert "bash tools/setup/setup_cpu.sh && .venv/bin/python -m pytest -q\n" in readme
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    missing = [_rel(p) for p in PAGES[1:] if p.resolve() not in linked]
    assert missing == [], f"docs pages the README's table of contents does not link: {missing}"
    assert len(readme.splitlines()) <= 150


def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch):
    """A broken link, a missing heading, a missing module and a missing file are each reported."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "spmdsplit").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "spmdsplit" / "train.py").write_text("")
    (docs / "a.md").write_text("# A\n\n## Real heading\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#real-heading) [bad](docs/nope.md) [bad anchor](docs/a.md#nope)\n\n"
        "```bash\n"
        "python -m spmdsplit.train --config configs/missing.yaml\n"
        "python -m spmdsplit.nothere \\\n    trainer.x=1\n"
        "```\n\n"
        "See `spmdsplit/gone.py` and `python -m tools.absent`.\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    links = link_problems(page)
    assert len(links) == 2 and "docs/nope.md" in links[0] and "#nope" in links[1], links
    cmds = command_problems(page)
    assert any("configs/missing.yaml" in p for p in cmds), cmds
    assert any("spmdsplit.nothere" in p for p in cmds), cmds
    assert not any("spmdsplit.train'" in p and "-m spmdsplit.train:" in p for p in cmds), cmds
    prose = prose_problems(page)
    assert any("spmdsplit/gone.py" in p for p in prose) and any("tools.absent" in p for p in prose), prose
