"""The README's "Using it" snippet runs as written, on CPU ranks (a new user's first try)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_using_it_snippet_runs_on_cpu_ranks(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Using it"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "run_distributed(main, 4)" in code and "init_cp_mesh" in code
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = sorted(re.findall(r"rank (\d): loss (\d+\.\d+)", result.stdout))
    assert [r for r, _ in losses] == ["0", "1", "2", "3"], result.stdout
    assert len({value for _, value in losses}) == 1, result.stdout  # the global mean on every rank
