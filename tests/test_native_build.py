"""Where the native op is built, and that a build killed mid-way (its torch `lock` file left behind) cannot make later
builds wait for ever: the failure that stopped a CI run at `make install` after a session's end killed a build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lab.engine import native_forward

_TRY_LOCK = """
import fcntl, sys
with open(sys.argv[1], "w") as guard:
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(3)
"""


def _other_process_gets_the_lock(directory: Path) -> bool:
    done = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(directory / "lab-build.flock")], timeout=60)
    assert done.returncode in (0, 3)
    return done.returncode == 0


def test_the_build_directory_follows_torch_extensions_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native_forward.build_directory() == tmp_path / native_forward.EXTENSION
    assert (tmp_path / native_forward.EXTENSION).is_dir()


def test_by_default_each_environment_builds_its_own(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    directory = native_forward.build_directory()
    assert directory.name == native_forward.EXTENSION
    assert directory.parent in (Path(sys.prefix) / "torch_extensions", Path.home() / ".cache" / "torch_extensions")


def test_a_killed_builds_lock_file_is_cleared_and_other_processes_wait(tmp_path) -> None:
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its process is killed mid-build
    assert _other_process_gets_the_lock(tmp_path)
    with native_forward.exclusive(tmp_path) as directory:
        assert directory == tmp_path
        assert not (tmp_path / "lock").exists()
        assert not _other_process_gets_the_lock(tmp_path)
    assert _other_process_gets_the_lock(tmp_path)


def test_a_process_killed_while_holding_the_directory_releases_it(tmp_path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from lab.engine import native_forward as n\n"
            "with n.exclusive(Path(sys.argv[1])):\n"
            "    (Path(sys.argv[1]) / 'lock').write_text(''); print('held', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not _other_process_gets_the_lock(tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert (tmp_path / "lock").exists()  # the killed "build" left torch's lock behind
    with native_forward.exclusive(tmp_path):
        assert not (tmp_path / "lock").exists()
