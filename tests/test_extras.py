"""The ``lightning`` extra: ``InSituDataModule`` is a name of the package, imported only when
asked for, and a missing Lightning is an error that says how to install it."""

from __future__ import annotations

import importlib
import sys

import pytest

import insitubatch_nodes


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_data_module_is_a_name_of_the_package_the_lightning_modules_class() -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes import InSituDataModule
    from insitubatch_nodes.lightning import InSituDataModule as same

    assert InSituDataModule is same
    with pytest.raises(AttributeError, match="no attribute 'InSituDatamodule'"):
        insitubatch_nodes.InSituDatamodule  # noqa: B018


def test_without_lightning_the_data_module_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Lightning as if not installed (None in sys.modules: ``import`` raises ImportError), and
    # the package's module not imported yet
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.delitem(sys.modules, "insitubatch_nodes.lightning", raising=False)
    monkeypatch.delattr(insitubatch_nodes, "lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'insitubatch_nodes\[lightning\]'"):
        importlib.import_module("insitubatch_nodes.lightning")
    with pytest.raises(ImportError, match="the package's `lightning` extra"):
        from insitubatch_nodes import InSituDataModule  # noqa: F401
