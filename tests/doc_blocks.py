"""The code of a Markdown page (the README, a page of docs/) as the tests run it.

A page's Python blocks run in order, as one program, under JAX's default promotion
(optax's Adam is not strict-promotion clean, and users run it as it is). Two HTML
comments, which neither the site nor PyPI shows, adjust that:

- a hidden set-up block runs where it stands, before the blocks after it:

      <!-- setup
      model = eqx.nn.MLP(64, 10, 128, 2, key=jr.key(0))
      -->

- `<!-- no-run: the reason -->` on the line before a block leaves out a block that is
  deliberately a fragment.

Comments inside a fenced block are the block's text, not instructions.
"""

import dataclasses
import pathlib
import re

import jax


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
_NO_RUN = re.compile(r"<!-- no-run\b.*-->")


@dataclasses.dataclass(frozen=True)
class Block:
    source: str
    line: int  # the page's line of the block's first line of code
    runs: bool
    hidden: bool  # a set-up comment, not a fenced block


def blocks(text: str) -> list[Block]:
    """The Python blocks and hidden set-up blocks of a page, in order."""
    lines = text.splitlines()
    found = []
    no_run = False
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            info = stripped[3:].split()
            indent = len(lines[i]) - len(lines[i].lstrip())
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith("```"):
                end += 1
            if info and info[0] == "python":
                body = "\n".join(line[indent:] for line in lines[i + 1 : end])
                found.append(Block(body + "\n", i + 2, not no_run, False))
            no_run = False
            i = end + 1
            continue
        if stripped == "<!-- setup":
            end = i + 1
            while end < len(lines) and lines[end].strip() != "-->":
                end += 1
            assert end < len(lines), f"the set-up comment at line {i + 1} is not closed"
            body = "\n".join(lines[i + 1 : end])
            found.append(Block(body + "\n", i + 2, True, True))
            i = end + 1
            continue
        if _NO_RUN.fullmatch(stripped):
            no_run = True
        elif stripped and not stripped.startswith("<!--"):
            no_run = False
        i += 1
    return found


def section(text: str, heading: str) -> str:
    """The text under `heading` (a whole line, such as `## Data parallelism`), up to
    the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == heading]
    assert len(starts) == 1, f"{len(starts)} headings {heading!r}"
    # The section's line numbers stay the page's: blank lines stand for the text
    # before it.
    kept = ["\n"] * (starts[0] + 1)
    in_fence = False
    for line in lines[starts[0] + 1 :]:
        if line.strip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and re.match(rf"#{{1,{level}}} ", line):
            break
        kept.append(line)
    return "".join(kept)


def run(code: list[Block], filename: str, namespace: dict | None = None) -> dict:
    """Runs the blocks that run, in one namespace; a traceback names the page's own
    lines."""
    namespace = {} if namespace is None else namespace
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        for block in code:
            if block.runs:
                source = "\n" * (block.line - 1) + block.source
                exec(compile(source, filename, "exec"), namespace)
    return namespace


def run_page(path: str, namespace: dict | None = None) -> dict:
    """Every block of the page at `path` (relative to the repository root)."""
    return run(blocks((REPO_ROOT / path).read_text()), path, namespace)
