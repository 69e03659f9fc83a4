"""Every entry point answers --version and --help."""

from __future__ import annotations

import importlib

import pytest

from dptune import __version__


@pytest.mark.parametrize("module", ["dptune.__main__", "dptune.plan", "dptune.search", "dptune.report"])
def test_version_and_help(module: str, capsys: pytest.CaptureFixture) -> None:
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"dptune {__version__}"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "usage: python -m " in capsys.readouterr().out
