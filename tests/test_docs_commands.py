"""The docs' commands run as written: every block a page marks as running offline on the CPU is run with bash
from a folder beside shared/data (as the checkout is beside ../shared/data). Where the page shows what it prints (a
plain ``` block after it, maybe after a line such as "It prints:"), the last command prints that, or ends with it,
to fp32's precision (tests/fixtures/printed.py). Blocks that need the network, a GPU or minutes are not marked."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.printed import assert_prints_like

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- runs offline on the CPU: tests/test_docs_commands.py -->"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMINGS = ("speed",)   # lines of wall time and tokens/s: only their first word is compared


def _code_block(lines: list[str], i: int) -> tuple[list[str], int]:
    """The code block starting at lines[i] (fenced, or indented by 4 spaces), and the index after it."""
    if lines[i].startswith("```"):
        end = lines.index("```", i + 1)
        return lines[i + 1:end], end + 1
    block = []
    while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
        block.append(lines[i][4:])
        i += 1
    while block and not block[-1].strip():
        block.pop()
    return block, i


def _next_text(lines: list[str], i: int) -> int:
    while i < len(lines) and not lines[i].strip():
        i += 1
    return i


def marked_blocks(page: Path) -> list[tuple[str, str, str]]:
    """(the block's commands, the last command, what the page shows it prints or "") of each marked block."""
    lines, found = page.read_text(encoding="utf-8").splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        code, after = _code_block(lines, _next_text(lines, i + 1))
        after = _next_text(lines, after)
        if after < len(lines) and lines[after].endswith(":"):   # "It prints:"
            after = _next_text(lines, after + 1)
        shown = "\n".join(_code_block(lines, after)[0]) if after < len(lines) and lines[after] == "```" else ""
        commands = "\n".join(code).replace("\\\n", " ").splitlines()
        commands = [c for c in commands if c.strip() and not c.lstrip().startswith("#")]
        found.append(("\n".join(commands[:-1]), commands[-1], shown))
    return found


BLOCKS = [pytest.param(*block, id=f"{page.name}:{n}") for page in PAGES for n, block in enumerate(marked_blocks(page))]


def test_the_pages_mark_the_commands_that_run_here():
    assert len(BLOCKS) >= 4 and sum(bool(block.values[2]) for block in BLOCKS) >= 2


@pytest.fixture(scope="module")
def checkout(tmp_path_factory, tokenizer_dir):
    """A folder beside shared/data (as the checkout is beside ../shared/data), and a `fastppl` command."""
    top = tmp_path_factory.mktemp("docs")
    (top / "shared").mkdir()
    (top / "shared" / "data").symlink_to(tokenizer_dir.parent)
    fastppl = top / "bin" / "fastppl"
    fastppl.parent.mkdir()
    fastppl.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fastppl "$@"\n')
    fastppl.chmod(fastppl.stat().st_mode | stat.S_IEXEC)
    return top


def _bash(command: str, cwd: Path, env: dict) -> str:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("before, last, shown", BLOCKS)
def test_a_marked_command_runs_and_prints_what_its_page_shows(checkout, before, last, shown, tmp_path):
    env = dict(os.environ, PATH=f"{checkout / 'bin'}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    cwd = checkout / tmp_path.name   # each block in a folder of its own, beside shared/data
    cwd.mkdir()
    printed = _bash(f"{{\n{before}\n}} >/dev/null\n{last}" if before else last, cwd, env)   # what the last prints
    if shown:
        assert_prints_like(printed, shown, words_only=TIMINGS, tail=True)   # a page may show the end alone
