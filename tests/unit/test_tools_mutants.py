"""tools/mutants.py (`make mutants`) refuses a list that no longer matches the code, by name,
instead of counting a mutant that was never applied as caught; and the list matches the code
today, checked here in `make test` (no test run, milliseconds), so it cannot rot unseen again
(issue 37: six mutants named text a restructuring had removed, and nothing noticed)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mutants() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "tools" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_a_mutant_whose_text_moved_fails_the_run_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    tool = _mutants()
    (tmp_path / "core.py").write_text("x = 1\ny = 2\ny = 2\n")
    (tmp_path / "t.py").write_text("")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    moved = tool.Mutant("moved", "core.py", "z = 3", "z = 4", ("t.py",))
    twice = tool.Mutant("twice", "core.py", "y = 2", "y = 3", ("t.py",))
    gone = tool.Mutant("gone", "gone.py", "x", "y", ("t.py",))
    broken = tool.Mutant("broken", "core.py", "x = 1", "x = (", ("t.py",))
    untested = tool.Mutant("untested", "core.py", "x = 1", "x = 3", ("t_gone.py::test_x",))
    fine = tool.Mutant("fine", "core.py", "x = 1", "x = 2", ("t.py",))
    with pytest.raises(tool.ListError) as info:
        tool.check_list((fine, moved, twice, gone, broken, untested))
    message = str(info.value)
    assert "moved: the text to mutate is no longer found in core.py: 'z = 3'" in message
    assert "twice: the text to mutate occurs 2 times in core.py" in message
    assert "gone: gone.py does not exist" in message
    assert "broken: the mutated core.py does not parse" in message
    assert "untested: t_gone.py does not exist" in message
    assert "fine" not in message.replace("fine:", "")
    tool.check_list((fine,))  # a list that matches passes
    # Through main: one clear line per problem, exit 2, nothing run.
    monkeypatch.setattr(tool, "MUTANTS", (fine, moved))
    assert tool.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mutants: the mutant list does not match the code") and "moved:" in err


def test_the_list_names_the_bugs_issue_22_planted() -> None:
    names = {m.name for m in _mutants().MUTANTS}
    assert {
        "surplus-ready-before-starting",
        "register-node-id-unchecked",
        "register-certificate-name-unchecked",
        "gateway-outcome-always-success",
        "http1-content-length-with-transfer-encoding",
        "tls-unreadable-key-not-explained",
    } <= names


def test_every_mutant_of_the_list_still_applies_to_the_code() -> None:
    """The real list against the real tree: each text found exactly once, each mutated file still
    parses, each test file named exists. A refactoring that moves a mutant's text fails here."""
    tool = _mutants()
    tool.check_list(tool.MUTANTS)


def test_most_mutants_are_in_the_code_of_the_fabric_wave_and_later() -> None:
    """Issue 37: the 27 mutants were all in code from before the fabric wave; more than half now
    plant bugs in code landed since 1 Dec, each rule's mutant run against its unit tests."""
    tool = _mutants()
    newer = [m for m in tool.MUTANTS if m not in tool.CORE]
    assert len(newer) * 2 > len(tool.MUTANTS), (len(newer), len(tool.MUTANTS))
    assert all(m.unit or m.e2e for m in tool.MUTANTS)


def test_unit_tests_first_then_e2e_and_a_summary_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """On a tree of its own (a two-function `llmgw`): a bug the unit tests catch, one only the
    e2e tests catch, one nothing catches; each said per mutant, and counted in the summary."""
    tool = _mutants()
    (tmp_path / "src" / "llmgw").mkdir(parents=True)
    (tmp_path / "src" / "llmgw" / "__init__.py").write_text("")
    (tmp_path / "src" / "llmgw" / "core.py").write_text("def f():\n    return 1\n\n\ndef g():\n    return 2  # g\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_u.py").write_text("from llmgw.core import f\n\n\ndef test_f():\n    assert f() == 1\n")
    (tmp_path / "tests" / "test_e.py").write_text("from llmgw.core import g\n\n\ndef test_g():\n    assert g() == 2\n")
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    core, unit, e2e = "src/llmgw/core.py", ("tests/test_u.py",), ("tests/test_e.py",)
    mutants = (
        tool.Mutant("f-off", core, "return 1", "return 0", unit, e2e),
        tool.Mutant("g-off", core, "return 2  # g", "return 3  # g", unit, e2e),
        tool.Mutant("comment", core, "# g", "# h", unit, e2e),
    )
    monkeypatch.setattr(tool, "CORE", mutants[:1])
    assert tool.run(mutants, limit=60) == 1
    out = capsys.readouterr().out
    for pattern in (r"^caught +f-off .*tests/test_u\.py$", r"^e2e only +g-off .*tests/test_e\.py$",
                    r"^NOT CAUGHT +comment "):
        assert re.search(pattern, out, re.MULTILINE), (pattern, out)
    assert ("3 mutants (2 in code since 1 Dec, 1 before): 1 caught by unit tests, 1 caught by e2e only, "
            "1 survived, in ") in out
    assert "NOT CAUGHT: comment" in out
