"""docs/settings.md is generated from the settings classes and must match them."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr

from astraflow.settings_doc import main, render

ROOT = Path(__file__).resolve().parents[2]


def test_settings_reference_is_up_to_date() -> None:
    stale = render() != (ROOT / "docs" / "settings.md").read_text()
    assert not stale, "docs/settings.md is stale: run `python -m astraflow.settings_doc`"


class _Inner(BaseModel):
    token: SecretStr = SecretStr("hunter2")
    """Bearer token; never printed."""
    limits: dict[str, int] = Field(default_factory=lambda: {"a": 1})


class _Section(BaseModel):
    port: int = 6379
    """Port of the | server."""
    inner: _Inner = Field(default_factory=_Inner)


class _Root(BaseModel):
    net: _Section = Field(default_factory=_Section)
    """The network."""


def test_each_field_gets_a_row_with_its_docstring_and_no_secret() -> None:
    text = render(_Root)
    assert "## `net`\n\nThe network.\n" in text
    assert "| `net.port` | `int` | `6379` | Port of the \\| server. |" in text
    assert "| `net.inner.token` | `SecretStr` | `(secret)` | Bearer token; never printed. |" in text
    assert '| `net.inner.limits` | `dict[str, int]` | `{"a": 1}` |  |' in text
    assert "hunter2" not in text


def test_check_fails_on_a_stale_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    assert main([]) == 0
    assert main(["--check"]) == 0
    (tmp_path / "docs" / "settings.md").write_text("old\n")
    assert main(["--check"]) == 1
