"""The configuration tables of the README and of docs/configuration.md name exactly the keys
acache/config.py has: the fields of Settings (the [s3] table's keys as ``s3.KEY``, from
S3_KEYS). A key added to config.py without a row, a row left behind by a removed key, or a
misspelt one fails here, naming it."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from acache import config

ROOT = Path(__file__).resolve().parents[2]
KEY_CELL = re.compile(r"`([a-z0-9_]+(?:\.[a-z0-9_]+)?)`")


def config_keys() -> set[str]:
    """Every key a user can set: Settings' fields but the bookkeeping one, s3 as its keys."""
    names = {f.name for f in fields(config.Settings)} - {"sources"}
    assert "s3" in names, "Settings has no s3 table any more: update this test"
    return (names - {"s3"}) | {f"s3.{k}" for k in config.S3_KEYS}


def section(text: str, heading: str) -> str:
    """The body of the section whose heading line is ``heading``, up to the next heading of
    the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        raise AssertionError(f"no section {heading!r}") from None
    out = []
    for line in lines[start + 1:]:
        m = re.match(r"(#+)\s", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return "\n".join(out)


def table(body: str) -> list[list[str]]:
    """The first table in body: its header, then its data rows, each a list of cells."""
    rows, started = [], False
    for line in body.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            rows.append(cells)
        elif started:
            break
    assert len(rows) >= 3, "no table (a header, a separator and rows) in the section"
    assert set(rows[1][0]) <= set("-: "), f"the second line is not a separator: {rows[1]}"
    return [rows[0], *rows[2:]]


def keys_of(rows: list[list[str]], where: str) -> list[str]:
    keys = []
    for cells in rows:
        m = KEY_CELL.fullmatch(cells[0])
        assert m, f"{where}: a row whose first cell is not one `key`: {cells[0]!r}"
        keys.append(m.group(1))
    dups = sorted({k for k in keys if keys.count(k) > 1})
    assert not dups, f"{where}: keys listed twice: {dups}"
    return keys


def compare(listed: list[str], where: str) -> None:
    have = config_keys()
    unknown = sorted(set(listed) - have)
    missing = sorted(have - set(listed))
    assert not unknown and not missing, (
        f"{where} and acache/config.py disagree: "
        f"not in config.py: {unknown or 'none'}; not in the table: {missing or 'none'}")


def readme_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    return table(section(text, "## Configuration"))[1:]


def docs_table() -> list[list[str]]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    return table(section(text, "## Keys"))


def test_readme_table_names_every_key_and_no_other():
    compare(keys_of(readme_rows(), "README.md, ## Configuration"), "README.md's configuration table")


def test_docs_table_names_every_key_and_no_other():
    compare(keys_of(docs_table()[1:], "docs/configuration.md, ## Keys"), "docs/configuration.md's table")


def test_docs_table_names_each_keys_environment_variable():
    """config.load reads ACACHE_<KEY> for every top-level key, ACACHE_S3_<KEY> for s3's."""
    header, *rows = docs_table()
    env_col = [c.lower() for c in header].index("env")
    for cells in rows:
        key = KEY_CELL.fullmatch(cells[0]).group(1)  # type: ignore[union-attr]
        var = "ACACHE_" + key.replace(".", "_").upper()
        assert f"`{var}`" in cells[env_col], f"docs/configuration.md: {key}: env column lacks {var}"


def test_every_key_is_settable():
    """The keys the tables document are the keys config.py casts (file and env), so a
    documented key is one a user can actually set."""
    casts = set(config._CASTS) | {f"s3.{k}" for k in config.S3_KEYS}
    assert casts == config_keys()


# -- the checker itself must be able to fail ------------------------------------------------
def test_a_missing_row_and_an_unknown_row_fail():
    rows = readme_rows()
    with pytest.raises(AssertionError, match=r"not in the table: \['chunk_size'\]"):
        compare(keys_of([r for r in rows if r[0] != "`chunk_size`"], "t"), "t")
    with pytest.raises(AssertionError, match=r"not in config.py: \['chunk_sizes'\]"):
        compare(keys_of([*rows, ["`chunk_sizes`", "", ""]], "t"), "t")
    with pytest.raises(AssertionError, match="listed twice"):
        keys_of([*rows, rows[0]], "t")
    with pytest.raises(AssertionError, match="not one `key`"):
        keys_of([*rows, ["chunk_size", "", ""]], "t")
