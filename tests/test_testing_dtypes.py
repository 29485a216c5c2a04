"""The dtype the test engines run in (ucm_testing.dtypes)."""

from __future__ import annotations

import pytest

from ucm_testing import dtypes


def test_the_default_follows_whether_the_cpu_multiplies_bf16(monkeypatch):
    monkeypatch.delenv(dtypes.ENV, raising=False)
    want = "bfloat16" if dtypes.cpu_multiplies_bf16() else "float32"
    assert dtypes.engine_dtype() == want
    assert dtypes.other_dtype() != want and dtypes.other_dtype() in dtypes.DTYPES


@pytest.mark.parametrize("forced, other", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_the_variable_forces_a_dtype(monkeypatch, forced, other):
    monkeypatch.setenv(dtypes.ENV, forced)
    assert (dtypes.engine_dtype(), dtypes.other_dtype()) == (forced, other)


def test_an_unknown_dtype_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(dtypes.ENV, "fp8")
    with pytest.raises(ValueError, match="UCM_TEST_DTYPE='fp8'"):
        dtypes.engine_dtype()
