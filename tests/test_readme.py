import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_usage_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example saves an index file
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    scope: dict = {}
    exec(compile(block, str(README), "exec"), scope)
    assert scope["index"].ntotal == 10_000
    assert scope["I"][:, 0].tolist() == [0, 1, 2, 3, 4]  # each vector finds itself first
    assert scope["enc"].code_size == 34
