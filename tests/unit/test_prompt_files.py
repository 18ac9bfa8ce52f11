"""Users' prompt files for bench and trace: plain text or JSONL, told apart per file; every bad file is one
SpecterError naming it (the CLI prints one line and exits 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pyspecter.errors import SpecterError
from pyspecter.prompts import load_prompts


def _users(items: list[dict]) -> list[str]:
    return [p["messages"][-1]["content"] for p in items]


def test_plain_text_is_one_prompt_a_line(tmp_path: Path) -> None:
    f = tmp_path / "prompts.txt"
    f.write_text("Why is the sky blue?\n\n  # a heading is text here  \r\n{not json\nExplain \"quotes\".\n")
    items = load_prompts(f)
    assert _users(items) == ["Why is the sky blue?", "# a heading is text here", "{not json", 'Explain "quotes".']
    assert all(p["split"] == "eval" and p["messages"][0]["role"] == "user" for p in items)
    assert [p["id"] for p in items] == ["line1", "line3", "line4", "line5"]  # ids say where each came from


def test_jsonl_objects_strings_and_messages(tmp_path: Path) -> None:
    f = tmp_path / "prompts.data"  # no telling suffix: the first line decides
    f.write_text('# comments are skipped in JSONL\n{"prompt": "one"}\n\n"two"\n{"text": "three", "id": "t"}\n'
                 '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "four"}]}\n')
    items = load_prompts(f)
    assert _users(items) == ["one", "two", "three", "four"]
    assert items[2]["id"] == "t" and items[3]["messages"][0]["role"] == "system"


def test_a_jsonl_suffix_means_jsonl_even_when_the_first_line_is_broken(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a",}\n{"prompt": "b"}\n')
    with pytest.raises(SpecterError, match=r"p\.jsonl:1: not JSON"):
        load_prompts(f)


@pytest.mark.parametrize("body, match", [
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', r":2: not JSON"),
    ('{"prompt": "ok"}\n[1, 2]\n', r":2: a prompt must be an object or a string"),
    ('{"prompt": "ok"}\n{"question": "no field"}\n', r":2: a prompt needs a \"prompt\" or \"text\" string"),
    ('"ok"\n{"prompt": "  "}\n', r":2: empty prompt"),
])
def test_a_bad_jsonl_line_is_named(tmp_path: Path, body: str, match: str) -> None:
    f = tmp_path / "p.txt"
    f.write_text(body)
    with pytest.raises(SpecterError, match=match):
        load_prompts(f)


def test_missing_empty_unreadable_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(SpecterError, match="no such prompt file"):
        load_prompts(tmp_path / "nope.txt")
    with pytest.raises(SpecterError, match="no such prompt file"):
        load_prompts(tmp_path)  # a directory
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(SpecterError, match="no prompts"):
        load_prompts(empty)
    comments = tmp_path / "c.jsonl"
    comments.write_text("# only a comment\n")
    with pytest.raises(SpecterError, match="no prompts"):
        load_prompts(comments)
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(SpecterError, match="not UTF-8"):
        load_prompts(binary)
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("hello\n")
        locked.chmod(0)
        with pytest.raises(SpecterError, match="cannot read"):
            load_prompts(locked)


def test_the_packaged_set_still_loads_with_its_splits() -> None:
    ps = load_prompts()
    assert len(load_prompts(split="tune")) + len(load_prompts(split="eval")) == len(ps) > 0
