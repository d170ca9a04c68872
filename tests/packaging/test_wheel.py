"""The built wheel holds the whole library: every file git tracks under hf_linear_attn/ (modules, model-card
templates, the offline `evaluate` metric scripts that fine-tuning loads by path), and nothing from beside it."""

import shutil
import subprocess
import sys
import zipfile

import pytest
from helpers import REPO_ROOT


@pytest.mark.slow
def test_the_wheel_ships_every_library_file_and_nothing_else(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "hf_linear_attn"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    # from a clean copy of the tracked files: a build/ folder left in the checkout would hand stale files to the wheel
    source = tmp_path / "source"
    files = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    for name in files.split():
        if (REPO_ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if not name.endswith("/")}
    missing = sorted(set(tracked) - shipped)
    assert not missing, f"tracked library files missing from the wheel (add them to package-data): {missing}"
    outside = sorted(n for n in shipped if not n.startswith(("hf_linear_attn/", "hf_linear_attn-")))
    assert not outside, outside
