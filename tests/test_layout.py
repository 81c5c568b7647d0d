"""ckptstore.layout: entry names, parsing, numeric order, garbage detection."""

from __future__ import annotations

import re

import pytest

from ckptstore import layout
from ckptstore.layout import (
    MAX_STEP,
    is_garbage_name,
    parse_step_dirname,
    step_dirname,
    tmp_dirname,
    trash_dirname,
)


def test_constants() -> None:
    assert layout.MANIFEST_NAME == "manifest.json"
    assert layout.STATE_NAME == "state.json"
    assert layout.LOCK_NAME == ".ckptstore.lock"
    assert layout.PIN_NAME == "pinned"


@pytest.mark.parametrize(
    ("step", "name"),
    [
        (0, "step-000000000000"),
        (7, "step-000000000007"),
        (1000, "step-000000001000"),
        (999_999_999_999, "step-999999999999"),
        (10**12, "step-1000000000000"),
        (MAX_STEP, "step-" + "9" * 30),
    ],
)
def test_step_names_roundtrip(step: int, name: str) -> None:
    assert step_dirname(step) == name
    assert parse_step_dirname(name) == step


@pytest.mark.parametrize(
    ("step", "error", "message"),
    [
        (-1, ValueError, f"step must be between 0 and {MAX_STEP}, got -1"),
        (MAX_STEP + 1, ValueError, f"step must be between 0 and {MAX_STEP}, got {MAX_STEP + 1}"),
        (True, TypeError, "step must be an int, got bool"),
        (1.0, TypeError, "step must be an int, got float"),
        ("1", TypeError, "step must be an int, got str"),
    ],
)
def test_bad_steps(step: object, error: type[Exception], message: str) -> None:
    for make in (step_dirname, tmp_dirname, trash_dirname):
        with pytest.raises(error) as ei:
            make(step)  # type: ignore[arg-type]
        assert str(ei.value) == message


def test_numeric_order_never_text_order() -> None:
    names = [step_dirname(n) for n in (100, 10, 9, 11, 10**12, 999_999_999_999)]
    # Non-canonical spellings are not step directories at all (see test below).
    assert parse_step_dirname("step-9") is None
    assert parse_step_dirname("step-0000000000009") is None
    assert sorted(names) != sorted(names, key=parse_step_dirname)
    ordered = sorted(names, key=parse_step_dirname)  # type: ignore[arg-type]
    assert [parse_step_dirname(n) for n in ordered] == [
        9,
        10,
        11,
        100,
        999_999_999_999,
        10**12,
    ]
    # Padding makes text order agree up to 12 digits; past that only the number is right.
    assert sorted([step_dirname(10**12), step_dirname(9)]) == [
        "step-000000000009",
        "step-1000000000000",
    ]
    assert sorted([step_dirname(10**12), step_dirname(10**12 - 1)]) == [
        "step-1000000000000",
        "step-999999999999",
    ]


@pytest.mark.parametrize(
    "name",
    [
        "step-",
        "step-abc",
        "step--1",
        "step-+1",
        "step-1.0",
        "step-1 ",
        " step-1",
        "step-1\n",
        "xstep-1",
        "Step-1",
        "step_1",
        "step-1e3",
        "step-" + "1" * 31,
        "step-\u0661\u0662",  # Arabic-Indic digits: int() would accept them
        "step-\uff11",  # a fullwidth digit
        ".tmp-step-000000000001-" + "0" * 32,
        "manifest.json",
        "",
    ],
)
def test_not_step_names(name: str) -> None:
    assert parse_step_dirname(name) is None


def test_tmp_and_trash_names() -> None:
    tmp = tmp_dirname(42)
    trash = trash_dirname(42)
    assert re.fullmatch(r"\.tmp-step-000000000042-[0-9a-f]{32}", tmp)
    assert re.fullmatch(r"\.trash-step-000000000042-[0-9a-f]{32}", trash)
    assert tmp_dirname(42) != tmp  # unique every time
    assert trash_dirname(42) != trash
    for name in (tmp, trash, tmp + "-r3", tmp + "-r12"):
        assert is_garbage_name(name), name
        assert parse_step_dirname(name) is None, name
    assert layout.is_tmp_name(tmp)
    assert not layout.is_tmp_name(trash)
    assert layout.is_trash_name(trash)
    assert not layout.is_trash_name(tmp)


@pytest.mark.parametrize(
    "name",
    [
        "step-000000000042",
        ".ckptstore.lock",
        ".tmp-step-000000000042",
        ".tmp-step-000000000042-" + "0" * 31,
        ".tmp-step-000000000042-" + "A" * 32,
        ".tmp-step-000000000042-" + "0" * 32 + "-r",
        ".tmp-step-000000000042-" + "0" * 32 + "/x",
        ".tmp-step-\u0661-" + "0" * 32,
        ".trash-step-000000000042-" + "0" * 32 + "-r1",
        "tmp-step-000000000042-" + "0" * 32,
        "notes.txt",
        "",
    ],
)
def test_not_garbage(name: str) -> None:
    assert not is_garbage_name(name)
