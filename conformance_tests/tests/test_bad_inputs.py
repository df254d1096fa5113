"""Bad arguments and inputs (``conformance_tests/bad_inputs.py``): each row raises the same clear
error in both packages, and ``docs/errors.md`` lists every message a row raises (and nothing
else)."""

from __future__ import annotations

import re

import pytest

from conformance_tests.bad_inputs import BAD_INPUTS, BadInput, messages, raised
from conformance_tests.tests.helpers import error_templates


def _error(row: BadInput, package: str) -> Exception:
    error = raised(row, package)
    if error is None:
        pytest.fail(f"{row.id} ({package}): raised nothing, expected {row.error.__name__}")
    return error


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[row.id for row in BAD_INPUTS])
def test_bad_input_raises_the_same_clear_error_in_both_packages(row):
    found = {}
    for package, run in (("torch_reference", row.torch), ("flax_attention", row.flax)):
        if run is None:
            continue
        error = _error(row, package)
        assert type(error) is row.error, (
            f"{row.id} ({package}): {type(error).__name__}: {error} (expected {row.error.__name__})"
        )
        assert re.search(row.match, str(error)), (
            f"{row.id} ({package}): message {str(error)!r} does not match {row.match!r}"
        )
        found[package] = str(error)
    assert found, f"{row.id}: runs in neither package"
    if row.same_message and len(found) == 2:
        assert found["torch_reference"] == found["flax_attention"], (
            f"{row.id}: the packages disagree: {found}"
        )


@pytest.mark.quick
def test_the_matrix_is_one_table_of_unique_rows():
    ids = [row.id for row in BAD_INPUTS]
    assert len(ids) == len(set(ids)), (
        f"duplicate ids: {sorted({i for i in ids if ids.count(i) > 1})}"
    )
    assert len(BAD_INPUTS) >= 20, f"{len(BAD_INPUTS)} rows"
    assert {row.error for row in BAD_INPUTS} == {ValueError, TypeError}


@pytest.mark.quick
def test_docs_errors_lists_every_message_of_the_matrix():
    listed = error_templates("Arguments and inputs")
    found = messages()
    for where, message in found:
        assert any(t.match(message) for t in listed), (
            f"{where}: {message!r} is not in docs/errors.md's 'Arguments and inputs' table"
        )
    for template in listed:
        assert any(template.match(m) for _, m in found), (
            f"docs/errors.md lists {template.pattern!r}, which no row of BAD_INPUTS raises"
        )
