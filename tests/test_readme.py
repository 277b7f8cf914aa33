"""The README, verbatim: every fenced command block and Python snippet runs.

A fresh copy of the project (the files git tracks or would track, nothing ignored: no
runs/) gets this environment as its `.venv` (a link: what `make lab` would have
built) and a sibling `shared/` pointing at the reference data, as in the workplace.
Shell blocks run in it as one bash script, in README order, so the README's own
`source .venv/bin/activate` is what puts `labkit` on PATH (PATH entries that already
hold a `labkit` are removed first). Python snippets run in README order in one
namespace, in a fresh interpreter of this environment, in the same copy.

An HTML comment on the line before a block says how to treat it:
`<!-- readme-test: skip (why) -->` (not run: `make lab` serves until stopped) or
`<!-- readme-test: slow -->` (run by the slow test: the planner, the Mooncake replay).
A block that reads `../shared` is skipped, with a reason, where that data is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import SHARED_DATA

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"<!--\s*readme-test:\s*(skip|slow)\b(.*?)-->")


@dataclass(slots=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str | None  # "skip", "slow" or None

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, with the mark on the line before each."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        mark = MARK.search(lines[i - 1]) if i else None
        blocks.append(Block(i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                            mark.group(1) if mark else None))
        i = end + 1
    return blocks


BLOCKS = readme_blocks((REPO / "README.md").read_text())
SHELL = [b for b in BLOCKS if b.lang in ("", "bash", "sh", "shell") and b.mark != "skip"]
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.mark != "skip"]


def test_the_readme_has_what_this_test_runs():
    assert len(SHELL) >= 6 and len(PYTHON) >= 4
    assert any("labkit replay" in b.text for b in SHELL if b.mark is None)
    assert all(b.lang in ("", "bash", "sh", "shell", "python") for b in BLOCKS), \
        "a README block in a language this test does not run"


def fresh_copy(tmp: Path) -> Path:
    """The working tree's files that git tracks or would track, in tmp/labkit."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    root = tmp / "labkit"
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    (root / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    if SHARED_DATA.is_dir():
        (tmp / "shared").symlink_to(SHARED_DATA.parent, target_is_directory=True)
    return root


def plain_env() -> dict:
    """The environment without labkit on PATH (the README must put it there)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not (Path(p) / "labkit").exists())
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def run_shell(blocks: list[Block], root: Path) -> None:
    """One bash script of the blocks; a failure names the block it stopped in."""
    script = []
    for block in blocks:
        if "../shared" in block.text and not (root.parent / "shared").exists():
            print(f"{block.where}: skipped, ../shared/data is absent here")
            continue
        script += [f"echo '>>> {block.where}' >&2", block.text]
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(script)], cwd=root,
                          env=plain_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode:
        where = re.findall(r"^>>> (README\.md:\d+)$", done.stderr, re.M)
        block = next(b for b in blocks if b.where == where[-1])
        raise AssertionError(
            f"{block.where} failed (exit {done.returncode}):\n{block.text}\n"
            f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


def setup_blocks() -> list[Block]:
    """The README's set-up (activating the environment), which later blocks assume."""
    return [b for b in SHELL if b.mark is None and "activate" in b.text]


def test_readme_commands_run(tmp_path):
    run_shell([b for b in SHELL if b.mark is None], fresh_copy(tmp_path))


@pytest.mark.slow
def test_readme_long_commands_run(tmp_path):
    run_shell(setup_blocks() + [b for b in SHELL if b.mark == "slow"], fresh_copy(tmp_path))


def test_readme_python_snippets_run(tmp_path):
    """In order, in one namespace; a failure names the snippet's README line."""
    root = fresh_copy(tmp_path)
    runner = textwrap.dedent("""\
        import sys
        namespace = {"__name__": "__main__"}
        for where, code in SNIPPETS:
            try:
                exec(compile(code, where, "exec"), namespace)
            except BaseException:
                print(f"snippet at {where} failed", file=sys.stderr)
                raise
        """).replace("SNIPPETS", repr([(b.where, b.text) for b in PYTHON]))
    done = subprocess.run([sys.executable, "-c", runner], cwd=root, env=plain_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"--- stderr\n{done.stderr[-4000:]}"


def test_a_broken_block_fails_and_is_named():
    """The parser sees what a reader sees, and a failing block stops the script."""
    text = ("intro\n\n```\ntrue\n```\n<!-- readme-test: slow -->\n```\nfalse\n```\n\n"
            "```python\n1/0\n```\n")
    ok, broken, python = readme_blocks(text)
    assert (broken.mark, broken.text, broken.line) == ("slow", "false\n", 7)
    assert (python.lang, python.mark, python.text) == ("python", None, "1/0\n")
    with pytest.raises(AssertionError, match="README.md:7 failed"):
        run_shell([ok, broken], REPO)
