"""The repository's scripts (train.py, eval.py, bench/*.py) as modules: they are not an installed
package, so tests load them from their files."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: str, name: str):
    """The script at `path` (from the repository root) loaded as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
