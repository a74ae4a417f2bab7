"""Test files say what they test: tests/test_<module>.py is about lib/eaglekit/<module>.py, so a renamed
module (server.py -> embedded_server.py) leaves no test named after a module that is gone."""

from pathlib import Path

TESTS = Path(__file__).parent
LIBRARY = TESTS.parent / "lib" / "eaglekit"
# Tests of a behaviour across modules rather than of one module.
TOPICS = {
    "chaos": "stage 03 under kill -9 of runner, kernel and endpoint",
    "layout": "this file",
    "notebooks": "committed notebooks: stripped, parameters cell, thin",
    "pipeline": "the six notebooks through the runner on params/smoke.yaml",
    "recipe_levers": "distillation target and feature noise through training",
    "templates": "published chat templates through eaglekit.chat",
}


def test_every_test_file_is_named_after_a_module_or_a_topic():
    names = sorted(path.stem.removeprefix("test_") for path in TESTS.glob("test_*.py"))
    stale = [name for name in names if not (LIBRARY / f"{name}.py").is_file() and name not in TOPICS]
    assert not stale, (f"tests {['test_' + name + '.py' for name in stale]} are named after no module in {LIBRARY}: "
                       "`git mv` them after the module they test, or name the topic in TOPICS")
